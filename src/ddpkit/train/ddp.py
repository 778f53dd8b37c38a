"""DDP, the first strategy (``train/strategy.py``): every rank holds the whole model, and DDP all-reduces
its gradients. :class:`DDPStrategy` answers the strategy's questions; :func:`make_ddp` is the one place a
DDP wrapper is built (for the engine's ``strategy.prepare`` and ``Loop.wrap`` alike).
"""

from __future__ import annotations

import heapq
import inspect
from contextlib import nullcontext
from typing import Any

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from ..ranks.context import DistContext
from ..run import shards
from .optim import optimizer_state
from .syncbn import refuse_torch_syncbn_off_gpu

# DDP's per-forward buffer broadcast: `broadcast_buffers`, renamed `forward_sync_buffers` in torch 2.14.
SYNC_BUFFERS = (
    "forward_sync_buffers" if "forward_sync_buffers" in inspect.signature(DDP).parameters else "broadcast_buffers"
)


class DDPStrategy:
    """Data parallel with a whole replica per rank (torch's ``DistributedDataParallel``)."""

    name = "ddp"

    def wrap(self, raw: nn.Module, ctx: DistContext, **options: Any) -> DDP:
        """:func:`make_ddp`'s wrapper; its options: static_graph, find_unused_parameters, sync_buffers, comm_hook."""
        refuse_torch_syncbn_off_gpu(raw, ctx.device)
        return make_ddp(raw, ctx, **options)

    @staticmethod
    def wrapped(model: Any) -> bool:
        """Whether ``model`` is DDP's wrapper (a model a strategy must not wrap again)."""
        return isinstance(model, DDP)

    @staticmethod
    def unwrap(model: Any) -> Any:
        # A dict lookup, not hasattr: on a plain module that misses, hasattr goes through Module.__getattr__'s
        # raise (about 3 us, at every step of the engine's clipping)
        while True:
            if isinstance(model, DDP):
                model = model.module
            elif isinstance(model, nn.Module) and "_orig_mod" in model._modules:  # torch.compile's wrapper
                model = model._modules["_orig_mod"]
            else:
                return model

    def no_sync(self, model: nn.Module, enabled: bool = True):
        # The DDP wrapper itself: a compiled one is not looked into, as Loop.no_sync never did (its users' runs
        # all-reduce at every micro-step there, and keep doing so bitwise)
        return model.no_sync() if enabled and isinstance(model, DDP) else nullcontext()

    def local_parameters(self, model: nn.Module) -> list[torch.Tensor]:
        return list(self.unwrap(model).parameters())  # every rank's whole copy

    def weights_to_check(self, model: nn.Module, ctx: DistContext) -> list[torch.Tensor]:
        # The trained weights DDP keeps equal on every rank are read once over the ranks, dealt by size (the largest
        # first, each to the rank with the fewest elements so far, a heap; the same deal on every rank): a snapshot's
        # check costs each rank 1/world of a pass over them (ResNet-9 at world 2 on this CPU: 6-11 ms a snapshot
        # before). Every rank reads the rest itself: frozen weights and those DDP was told to ignore, which a rank
        # may hold its own values of.
        raw = self.unwrap(model)
        ignored = set(getattr(raw, "_ddp_params_and_buffers_to_ignore", ()))
        named = list(raw.named_parameters())
        equal = [p for n, p in named if p.requires_grad and n not in ignored]
        own = [p for n, p in named if not (p.requires_grad and n not in ignored)]
        heap, mine = [(0, r) for r in range(ctx.world_size)], []
        for i in sorted(range(len(equal)), key=lambda i: (-equal[i].numel(), i)):
            load, rank = heapq.heappop(heap)
            heapq.heappush(heap, (load + equal[i].numel(), rank))
            if rank == ctx.rank:
                mine.append(equal[i])
        return mine + own

    def clip_grad_norm_(self, model: nn.Module, max_norm: float, foreach: bool | None = None) -> torch.Tensor:
        # After DDP's all-reduce every rank holds the same whole gradient: its own norm is the global one.
        return nn.utils.clip_grad_norm_(self.unwrap(model).parameters(), max_norm, foreach=foreach)

    def replicated(self, obj: Any) -> bool:
        # Gradients all-reduced from the same start, and buffers broadcast from rank 0 at every forward.
        # An optimizer's state is hashed: a user may step a rank's own one.
        return self.shares_buffers(obj)

    @staticmethod
    def shares_buffers(model: Any) -> bool:
        return isinstance(model, DDP) and bool(model.broadcast_buffers)

    def model_state(self, model: nn.Module) -> dict:
        return self.unwrap(model).state_dict()  # every rank holds the whole model

    def snapshot_model(self, model: nn.Module) -> dict:
        return self.model_state(model)  # the whole, in the snapshot file

    def load_model_state(self, model: nn.Module, state: dict) -> None:
        if shards.is_ref(state):  # an FSDP2 run's snapshot: its shards read whole
            shards.load_model(self.unwrap(model), state)
            return
        self.unwrap(model).load_state_dict(state)

    def snapshot_optimizer(self, optimizer: torch.optim.Optimizer, ctx: DistContext) -> dict | None:
        return optimizer_state(optimizer, ctx)  # ZeRO: its shards gathered to rank 0 (a collective)

    def load_optimizer_state(self, optimizer: torch.optim.Optimizer, state: dict, models: list = ()) -> None:
        if shards.is_ref(state):  # an FSDP2 run's snapshot: keyed by parameter names, found through the model
            shards.load_optimizer(shards.owner(optimizer, [self.unwrap(m) for m in models]), optimizer, state)
            return
        optimizer.load_state_dict(state)

    @staticmethod
    def evaluating(model: nn.Module):
        return nullcontext()  # each rank's forwards are its own: no collective in an evaluation

    @staticmethod
    def check_optimizer(optimizer: torch.optim.Optimizer, where: str) -> None:
        return None  # any optimizer over the whole model's parameters

    @staticmethod
    def join(model: DDP, optimizer: torch.optim.Optimizer):
        """``--join``: DDP's (and ZeRO's) Join, under which a rank out of batches keeps answering the others'
        gradient all-reduces with zeros until every rank is out."""
        from torch.distributed.algorithms.join import Join
        from torch.distributed.optim import ZeroRedundancyOptimizer

        return Join([model, *([optimizer] if isinstance(optimizer, ZeroRedundancyOptimizer) else [])])

    @staticmethod
    def rejoin(optimizer: torch.optim.Optimizer, ctx: DistContext) -> None:
        """Every rank's optimizer state made global rank 0's (after an uneven ``--join`` epoch, where a rank
        that ran fewer steps skipped their updates); ZeRO's own join hook keeps its shards. (state tensor, its
        device copy) pairs: NCCL broadcasts device tensors only, and some state lives on the CPU (Adam's step
        count); a tensor already on the device is its own copy."""
        from torch.distributed.optim import ZeroRedundancyOptimizer

        if isinstance(optimizer, ZeroRedundancyOptimizer):
            return
        pairs = []
        for group in optimizer.param_groups:
            for p in group["params"]:
                state = optimizer.state.get(p, {})
                for key in sorted(state):
                    if torch.is_tensor(state[key]):
                        pairs.append((state[key], state[key].to(ctx.device)))
        ctx.broadcast_many([on_device for _, on_device in pairs])
        for kept, on_device in pairs:
            kept.copy_(on_device)


def make_ddp(
    raw: nn.Module,
    ctx: DistContext,
    *,
    static_graph: bool = False,
    find_unused_parameters: bool = False,
    sync_buffers: bool = True,
    comm_hook: str = "none",
) -> DDP:
    """The DDP wrapper around ``raw`` (already on ``ctx.device``): the one place ddpkit builds one, for
    ``Trainer`` (through :func:`wrap`) and for ``Loop.wrap`` alike. ``sync_buffers``: DDP's per-forward
    broadcast of rank 0's buffers (its default); off, the buffers are broadcast once here instead."""
    ddp = DDP(
        raw,
        device_ids=[ctx.device] if ctx.device.type == "cuda" else None,
        gradient_as_bucket_view=True,  # grads are views into the all-reduce buckets: no copy, the same values
        **{SYNC_BUFFERS: sync_buffers},
        static_graph=static_graph,
        find_unused_parameters=find_unused_parameters,
    )
    if not sync_buffers:  # before torch 2.14 this also skipped DDP's start-up sync of buffers
        ctx.broadcast_many(list(raw.buffers()))
    register_comm_hook(ddp, comm_hook)
    return ddp


def register_comm_hook(ddp: DDP, name: str) -> None:
    """``--comm-hook``: all-reduce gradients as bf16/fp16 (cast back after), or PowerSGD rank-1.

    PowerSGD all-reduces plainly for its first 10 steps, then compresses each gradient matrix
    to rank 1 with error feedback. That feedback (and its warm-start factors) is kept per DDP
    gradient bucket, as flat buffers in the bucket's layout; a new DDP wrapper starts with another
    layout (DDP rebuilds its buckets in gradient-ready order after the first step), so saved
    feedback would land on other parameters. A PowerSGD run therefore never resumes: see
    :data:`ddpkit.config.POWERSGD_NO_RESUME`, said before launch and by a worker that finds a snapshot.
    """
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook

    if name == "none":
        return
    if name == "powersgd":
        state = powerSGD_hook.PowerSGDState(process_group=None, matrix_approximation_rank=1, start_powerSGD_iter=10)
        ddp.register_comm_hook(state, powerSGD_hook.powerSGD_hook)
        return
    ddp.register_comm_hook(
        None, {"bf16": default_hooks.bf16_compress_hook, "fp16": default_hooks.fp16_compress_hook}[name]
    )


def ddp_timers(ddp: DDP | None) -> dict | None:
    """DDP's own averages (ns) of forward, backward compute, backward comm and their overlap, where the
    installed torch exposes them (``_get_ddp_logging_data``, a private API; sampled every 100 iterations)."""
    try:
        data = ddp._get_ddp_logging_data() if ddp is not None else {}
    except Exception:  # a private API: gone or changed in this torch
        return None
    timers = {k: int(v) for k, v in data.items() if k.startswith("avg_") and str(v).lstrip("-").isdigit()}
    return timers or None
