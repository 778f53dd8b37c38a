"""FSDP2, the second strategy (``train/strategy.py``): each rank holds 1/world of every parameter, of its
gradient and of its optimizer state (torch's ``fully_shard``: parameters become DTensors sharded on dim 0),
and gathers a unit's whole parameters only for its forward and backward.

    strategy = FSDP2Strategy()
    model = strategy.wrap(raw, ctx)                     # fully_shard on the units, then on the root
    opt = torch.optim.AdamW(model.parameters())         # after the wrap: over the shards
    strategy.snapshot_model(model)                      # each rank's shards, for a snapshot (run/shards.py)
    strategy.model_state(model)                         # the whole state_dict on rank 0: best.pt, model.pt

What DDP gives, this gives as well, computed alike: gradients averaged over ranks (reduce-scatter of the
mean), rank 0's buffers broadcast when DDP broadcasts them (:class:`BufferSync`), clipping by the global
norm, and an evaluation whose ranks may run different numbers of batches (:meth:`FSDP2Strategy.evaluating`).
Autocast stays ``--amp``'s, as under DDP, so a run computes what the DDP run computes
(``MixedPrecisionPolicy`` is not used: it would cast the parameters themselves, a change of numerics
nobody asked for).

A snapshot holds each rank's shards of the model and the optimizer, written by every rank itself with
``torch.distributed.checkpoint`` beside the snapshot file, and resharded on load to the world that resumes
(``run/shards.py``): no rank holds the whole state. A DDP run's snapshot (whole tensors) loads here, cut
into the shards, and a DDP run reads this one's shards whole.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Any, Callable, Iterator

import torch
from torch import nn

from ..config import FSDP2_REFUSED
from ..errors import ConfigError
from ..ranks.context import DistContext
from ..run import shards

# What a sharding unit holds at least, by default (parameters not in a smaller unit already): a
# transformer block of a 100M-parameter GPT (7M) is one, a LayerNorm is not. Below it, the root's unit.
MIN_UNIT_PARAMS = 1_000_000
# torch's public fully_shard came in 2.6; FSDPModule.set_reshard_after_forward, which an evaluation uses,
# in 2.7 (pytorch PR 149103). Detected, not compared by version number.
NEEDS = "FSDP2 needs torch >= 2.7 (torch.distributed.fsdp.fully_shard with FSDPModule.set_reshard_after_forward)"


def available() -> str:
    """ "" when this torch has what FSDP2 here uses; else why not, in one line."""
    try:
        from torch.distributed.fsdp import FSDPModule, fully_shard  # noqa: F401
    except ImportError:
        FSDPModule = None
    if FSDPModule is None or not hasattr(FSDPModule, "set_reshard_after_forward"):
        return f"{NEEDS}; this is torch {torch.__version__}: upgrade torch, or use --strategy ddp"
    return ""


def is_sharded(model: Any) -> bool:
    from torch.distributed.fsdp import FSDPModule

    return isinstance(model, FSDPModule)


def sharded_params(optimizer: torch.optim.Optimizer) -> bool:
    from torch.distributed.tensor import DTensor

    return all(isinstance(p, DTensor) for group in optimizer.param_groups for p in group["params"])


def units(raw: nn.Module, min_params: int = MIN_UNIT_PARAMS) -> list[nn.Module]:
    """The default policy: submodules, innermost first, each holding at least ``min_params`` parameters not
    in a unit below it (a transformer block, a ResNet stage); the root is a unit of its own after them. A
    module that shares a parameter with one outside it (an embedding tied to the output head) is never a
    unit: the tied weight stays in the unit above both."""
    chosen: list[nn.Module] = []
    taken: set[int] = set()
    shared = shared_outside(raw)

    def visit(module: nn.Module) -> None:
        for child in module.children():
            visit(child)
        if module is raw or id(module) in shared:
            return
        free = [p for p in module.parameters() if id(p) not in taken]
        if sum(p.numel() for p in free) >= min_params:
            chosen.append(module)
            taken.update(id(p) for p in free)

    visit(raw)
    return chosen


def shared_outside(raw: nn.Module) -> set[int]:
    """The ids of the submodules holding a parameter that a module outside them holds too (tied weights):
    ``fully_shard`` refuses such a unit at its first forward ("shared with a parameter already managed by
    another FSDP group")."""
    owners: dict[int, set[int]] = {}
    for module in raw.modules():
        for p in module.parameters(recurse=False):
            owners.setdefault(id(p), set()).add(id(module))
    out = set()
    for module in raw.modules():
        inside = {id(m) for m in module.modules()}
        if any(not owners[id(p)] <= inside for p in module.parameters()):
            out.add(id(module))
    return out


class FSDP2Strategy:
    """Fully sharded data parallel (torch's ``fully_shard``, FSDP2)."""

    name = "fsdp2"

    def __init__(self) -> None:
        self.models: list[nn.Module] = []  # what wrap() sharded: an optimizer's state is found through them
        self._buffers: dict[int, BufferSync] = {}  # by id of a model whose buffers rank 0 broadcasts

    def wrap(
        self,
        raw: nn.Module,
        ctx: DistContext,
        *,
        policy: Callable[[nn.Module], bool] | None = None,
        sync_buffers: bool = True,
        find_unused_parameters: bool = False,
        static_graph: bool = False,
        **_ddp_only: Any,
    ) -> nn.Module:
        """``raw`` sharded in place (its class becomes an ``FSDPModule`` subclass: still the user's module).
        ``policy(module)``: which submodules are units of their own (default :func:`units`).
        ``static_graph`` is DDP's hint and means nothing here."""
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        if find_unused_parameters:
            raise ConfigError(
                "FSDP2 has no find_unused_parameters: every rank must give every sharded parameter a gradient "
                "(or none) in a step; use every parameter in each forward, or use strategy='ddp'"
            )

        chosen = [m for m in raw.modules() if m is not raw and policy(m)] if policy else units(raw)
        shared = shared_outside(raw)  # once: it walks every module's subtree
        tied = [type(m).__name__ for m in chosen if id(m) in shared]
        if tied:
            raise ConfigError(
                f"Loop.wrap(shard=...) chose {', '.join(tied[:3])}, which shares a parameter with a module outside "
                f"it (a tied weight): FSDP2 cannot shard one parameter in two units; leave it to the unit above both"
            )
        # DDP's constructor makes every rank start from rank 0's parameters and buffers; fully_shard does not:
        # a script that seeds each rank apart (or loads weights on rank 0) would train a patchwork of them
        ctx.broadcast_many([*raw.parameters(), *raw.buffers()])
        # The mesh on the run's own device type: left to torch, it is the machine's accelerator, even for a
        # --device cpu run on a GPU machine
        mesh = init_device_mesh(ctx.device.type, (ctx.world_size,))
        # Explicit, so that an evaluation can set them back: the units free their gathered weights after the
        # forward, the root keeps its own for the backward (torch's default for the root)
        for module in reversed(chosen) if policy else chosen:  # innermost first: a unit excludes its sub-units
            fully_shard(module, mesh=mesh, reshard_after_forward=True)
        fully_shard(raw, mesh=mesh, reshard_after_forward=False)
        if sync_buffers and ctx.world_size > 1 and any(True for _ in raw.buffers()):
            self._buffers[id(raw)] = BufferSync(ctx)
            raw.register_forward_pre_hook(self._buffers[id(raw)])
        self.models.append(raw)
        return raw

    @staticmethod
    def unwrap(model: Any) -> Any:
        if isinstance(model, nn.Module) and "_orig_mod" in model._modules:  # torch.compile's wrapper
            return model._modules["_orig_mod"]
        return model  # fully_shard changed the module's class, not its place: it is the user's own

    @contextmanager
    def no_sync(self, model: nn.Module, enabled: bool = True) -> Iterator[None]:
        """The gradients of this backward kept whole on each rank and accumulated; reduce-scattered at the
        first backward outside."""
        model = self.unwrap(model)
        if not (enabled and is_sharded(model)):
            yield
            return
        model.set_requires_gradient_sync(False)
        buffers = self._buffers.get(id(model), BufferSync(None))
        buffers.no_sync = True
        try:
            yield
        finally:
            model.set_requires_gradient_sync(True)
            buffers.no_sync = False

    def local_parameters(self, model: nn.Module) -> list[torch.Tensor]:
        """This rank's shard of each parameter (a check over every rank's covers every weight once)."""
        return [p.to_local() if hasattr(p, "to_local") else p for p in self.unwrap(model).parameters()]

    def weights_to_check(self, model: nn.Module, ctx: DistContext) -> list[torch.Tensor]:
        """This rank's shards: every rank's together are every weight once."""
        return self.local_parameters(model)

    def clip_grad_norm_(self, model: nn.Module, max_norm: float, foreach: bool | None = None) -> torch.Tensor:
        """Each rank holds a shard of each gradient: torch's norm of DTensors is a partial one, completed
        by one all-reduce (``full_tensor``), then every shard scaled by the same factor."""
        from torch.distributed.tensor import DTensor

        params = [p for p in self.unwrap(model).parameters() if p.grad is not None]
        norm = nn.utils.get_total_norm([p.grad for p in params], foreach=foreach)
        if isinstance(norm, DTensor):
            norm = norm.full_tensor()
        nn.utils.clip_grads_with_norm_(params, max_norm, norm, foreach=foreach)
        return norm

    def replicated(self, obj: Any) -> bool:
        """A sharded module's snapshot state, and its optimizer's, is each rank's shards, which every rank
        writes itself: never hashed as a value that may differ by rank."""
        if isinstance(obj, torch.optim.Optimizer):
            return sharded_params(obj)
        return is_sharded(self.unwrap(obj))

    def shares_buffers(self, model: nn.Module) -> bool:
        return id(self.unwrap(model)) in self._buffers  # wrapped with a BufferSync

    def check_optimizer(self, optimizer: torch.optim.Optimizer, where: str) -> None:
        """An optimizer built before the wrap holds the whole parameters that ``fully_shard`` replaced: it
        would step tensors the model no longer uses. Refused, saying to build it after; and one over the
        parameters of several wrapped models, whose sharded state is keyed by one model's names."""
        if self.models and not sharded_params(optimizer):
            raise ConfigError(
                f"{where}: the optimizer was built over the model's parameters before FSDP2 sharded them (the "
                f"model trains new ones, its shards): build it after the wrap, over model.parameters() of the "
                f"model wrap() returned"
            )
        if self.models:
            self._owner(optimizer, where)

    # ------------------------------------------------------------------ a snapshot's state
    def model_state(self, model: nn.Module) -> dict:
        """The whole ``state_dict`` in torch's layout, on the host: a collective; rank 0 holds the values,
        the other ranks an empty dict."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        model = self.unwrap(model)
        if not is_sharded(model):
            return model.state_dict()
        return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))

    def snapshot_model(self, model: nn.Module) -> Any:
        """What a snapshot holds of the model: each rank's shards, which it writes itself (run/shards.py)."""
        from torch.distributed.checkpoint.state_dict import get_model_state_dict

        model = self.unwrap(model)
        return shards.Sharded(get_model_state_dict(model)) if is_sharded(model) else model.state_dict()

    def snapshot_optimizer(self, optimizer: torch.optim.Optimizer, ctx: DistContext) -> Any:
        """As :meth:`snapshot_model`, for an optimizer over sharded parameters (its state keyed by their names)."""
        from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

        if not sharded_params(optimizer) or not optimizer.state:
            # No state yet (no step taken): torch's state-dict API would make some with a step at lr 0
            # (_init_optim_state), setting Adam's step count to 1 under the run's feet; its groups alone
            return optimizer.state_dict()
        return shards.Sharded(get_optimizer_state_dict(self._owner(optimizer), optimizer))

    def load_model_state(self, model: nn.Module, state: dict) -> None:
        """A snapshot's model: its shards (this run's own, resharded by DCP to this world), or a whole
        ``state_dict`` (a DDP run's: every rank holds it, each read the snapshot) cut into the shards."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

        model = self.unwrap(model)
        if shards.is_ref(state):
            shards.load_model(model, state)
            return
        if not is_sharded(model):
            model.load_state_dict(state)
            return
        set_model_state_dict(model, state, options=StateDictOptions(full_state_dict=True))

    def load_optimizer_state(self, optimizer: torch.optim.Optimizer, state: dict, models: list = ()) -> None:
        """What :meth:`snapshot_optimizer` wrote (shards), or a whole state in ``Optimizer.state_dict``'s layout
        (a DDP run's snapshot's: parameters numbered in group order), into this optimizer's shards."""
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions,
            get_optimizer_state_dict,
            set_optimizer_state_dict,
        )

        if shards.is_ref(state):
            owner = self._owner(optimizer) if sharded_params(optimizer) else shards.owner(optimizer, models)
            shards.load_optimizer(owner, optimizer, state)
            return
        if not sharded_params(optimizer) or not state.get("state"):
            optimizer.load_state_dict(state)  # whole tensors, or no state at all: torch's own load
            return
        model = self._owner(optimizer)
        name_of = {id(p): name for name, p in model.named_parameters()}
        names = [name_of[id(p)] for group in optimizer.param_groups for p in group["params"]]
        by_name = {
            "state": {names[i]: value for i, value in state["state"].items()},
            "param_groups": [{**g, "params": [names[i] for i in g["params"]]} for g in state["param_groups"]],
        }
        # torch's load wants a state for every parameter: one the saved run had none for gets a made-up one,
        # removed after the load, so it has none again, as in the run that saved it
        whole = StateDictOptions(full_state_dict=True)
        made = get_optimizer_state_dict(model, optimizer, options=whole)["state"]
        missing = [name for name in made if name not in by_name["state"]]
        by_name["state"].update({name: made[name] for name in missing})
        set_optimizer_state_dict(model, optimizer, by_name, options=whole)
        shards.drop_state(model, optimizer, missing)

    def _owner(self, optimizer: torch.optim.Optimizer, where: str = "an optimizer") -> nn.Module:
        mine = {id(p) for group in optimizer.param_groups for p in group["params"]}
        for model in self.models:
            if mine <= {id(p) for p in model.parameters()}:
                return model
        raise ConfigError(
            f"{where}: under FSDP2 an optimizer steps the parameters of one wrapped model (its sharded state is "
            f"saved by that model's parameter names), and this one's are of several or of none: build one "
            f"optimizer per model, after wrapping it"
        )

    # ------------------------------------------------------------------ evaluation
    @contextmanager
    def evaluating(self, model: nn.Module) -> Iterator[None]:
        """Every unit's whole parameters gathered once (a collective), and kept through the forwards:
        each rank may then evaluate as many batches as its share holds, with no collective per forward.
        Costs the whole parameters on each rank for the evaluation, as DDP holds them always."""
        model = self.unwrap(model)
        if not is_sharded(model):
            yield
            return
        from torch.distributed.fsdp import FSDPModule

        shards = [m for m in model.modules() if isinstance(m, FSDPModule)]
        for m in shards:
            m.unshard()
        model.set_reshard_after_forward(False, recurse=True)
        buffers = self._buffers.get(id(model), BufferSync(None))
        buffers.paused = True  # an evaluation runs the module as DDP's would run unwrapped: no broadcast
        try:
            yield
        finally:
            buffers.paused = False
            model.set_reshard_after_forward(True, recurse=True)  # as wrap() set them: the units free theirs,
            model.set_reshard_after_forward(False, recurse=False)  # the root keeps its own
            for m in shards:
                m.reshard()

    @staticmethod
    def join(model: nn.Module, optimizer: torch.optim.Optimizer):
        raise ConfigError(f"--strategy fsdp2 cannot be combined with --join: {FSDP2_REFUSED['--join']}")

    @staticmethod
    def rejoin(optimizer: torch.optim.Optimizer, ctx: DistContext) -> None:
        return None


class BufferSync:
    """DDP's ``broadcast_buffers``, timed as DDP times it (``DistributedDataParallel._pre_forward``): rank 0's
    buffers (BatchNorm's running statistics) are broadcast before a forward when the forward before it ran
    with gradients and their sync (DDP's ``require_forward_param_sync``; true at the first forward), so under
    accumulation only the first micro-step's forward broadcasts, and each rank's later ones go on from their
    own. An evaluation (:meth:`FSDP2Strategy.evaluating`) neither broadcasts nor moves the flag, as DDP's
    unwrapped module would not."""

    def __init__(self, ctx: DistContext | None):
        self.ctx, self.due, self.no_sync, self.paused = ctx, True, False, False

    def __call__(self, module: nn.Module, args: Any) -> None:
        if self.paused:
            return
        if self.due:
            self.ctx.broadcast_many(list(module.buffers()))
        self.due = torch.is_grad_enabled() and not self.no_sync
