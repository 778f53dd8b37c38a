"""The strategy seam: how a model is spread over the ranks, asked by every loop, assumed by none.

    strategy = strategy_for("ddp")
    model = strategy.wrap(raw, ctx)                     # what the loop calls
    with strategy.no_sync(model, enabled=not last):     # gradient accumulation
        loss.backward()
    norm = strategy.clip_grad_norm_(model, 1.0)         # by the global norm
    strategy.unwrap(model).state_dict()                 # what a snapshot and model.pt hold

A strategy answers what depends on how the weights, gradients and optimizer state are laid out: the
wrap, the skipped gradient sync of a micro-step, the global gradient norm, which modules are equal on
every rank by construction (a snapshot hashes the rest: ``run/checkpoint.split_by_rank``), the model's
and optimizer's state for a snapshot, and an evaluation's forwards. What it cannot be combined with is
refused before launch, by the config (``config.FSDP2_REFUSED``). DDP (``train/ddp.py``) is the
first implementation: every rank holds the whole model, so the rank's own state is the global one. A
sharded strategy (FSDP2) is a second file beside it, answering the same questions.
"""

from __future__ import annotations

from contextlib import AbstractContextManager
from typing import Any, NamedTuple, Protocol

import torch
from torch import nn

from ..config import TrainConfig
from ..errors import ConfigError
from ..models import to_channels_last, uses_conv
from ..ranks.context import DistContext
from .ddp import DDPStrategy
from .fsdp2 import FSDP2Strategy, available, is_sharded
from .syncbn import convert_sync_batchnorm, only_batchnorm_buffers


class Strategy(Protocol):
    name: str

    def wrap(self, raw: nn.Module, ctx: DistContext, **options: Any) -> nn.Module:
        """``raw`` (already on ``ctx.device``) as the loop calls it."""

    def unwrap(self, model: Any) -> Any:
        """The user's module out of the strategy's wrapper (and torch.compile's): its ``state_dict`` is
        what ``model.pt``, ``best.pt`` and a snapshot hold. Anything else comes back as it is."""

    def no_sync(self, model: nn.Module, enabled: bool = True) -> AbstractContextManager:
        """A backward that leaves the gradients unsynchronised (every micro-step of an accumulation but the last)."""

    def local_parameters(self, model: nn.Module) -> list[torch.Tensor]:
        """The parameter tensors this rank holds (its shards under a sharded strategy): what a check of every
        weight reads on each rank before the check's all-reduce."""

    def weights_to_check(self, model: nn.Module, ctx: DistContext) -> list[torch.Tensor]:
        """The weights this rank reads in the check for a NaN or an infinity before a snapshot, whose verdict the
        safe point's all-reduce sums over the ranks: together the ranks read every weight once."""

    def clip_grad_norm_(self, model: nn.Module, max_norm: float, foreach: bool | None = None) -> torch.Tensor:
        """Clip by the norm of the whole model's gradient, over every rank; returns that norm."""

    def replicated(self, obj: Any) -> bool:
        """Whether the snapshot state of ``obj`` (a model, an optimizer) is equal on every rank by construction
        (not hashed at a snapshot)."""

    def shares_buffers(self, model: nn.Module) -> bool:
        """Whether ``model``'s wrapper makes rank 0's buffers every rank's at each training forward (DDP's
        ``broadcast_buffers``): an evaluation then uses rank 0's too (``evaluate.evaluate_split``)."""

    def model_state(self, model: nn.Module) -> dict:
        """The model's whole ``state_dict`` for ``model.pt`` and ``best.pt`` (every rank calls it:
        it may be a collective, after which only global rank 0 holds the values)."""

    def snapshot_model(self, model: nn.Module) -> Any:
        """What a snapshot holds of the model: :meth:`model_state`'s whole state, or each rank's shards
        (``run/shards.Sharded``: every rank writes its own beside the snapshot file)."""

    def load_model_state(self, model: nn.Module, state: dict) -> None:
        """A snapshot's model, under this strategy or another, at any world size: a whole ``state_dict``
        (:meth:`model_state`'s) or a reference to shards (``run/shards.py``)."""

    def snapshot_optimizer(self, optimizer: torch.optim.Optimizer, ctx: DistContext) -> Any:
        """As :meth:`snapshot_model`, for an optimizer."""

    def load_optimizer_state(self, optimizer: torch.optim.Optimizer, state: dict, models: list = ()) -> None:
        """What :meth:`snapshot_optimizer` gave, under this strategy or another; ``models``: the loop's, one of
        which the optimizer steps (sharded state is keyed by parameter names)."""

    def evaluating(self, model: nn.Module) -> AbstractContextManager:
        """Around an evaluation, where each rank may run another number of batches (every rank enters it)."""

    def join(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> AbstractContextManager:
        """``--join``: uneven inputs, a rank out of batches answering the others' collectives until all are out."""

    def rejoin(self, optimizer: torch.optim.Optimizer, ctx: DistContext) -> None:
        """After an uneven ``--join`` epoch: every rank's optimizer state made alike again (a collective)."""

    def check_optimizer(self, optimizer: torch.optim.Optimizer, where: str) -> None:
        """Raise a ConfigError (``where`` names the call) when ``optimizer`` cannot train the wrapped model."""


STRATEGIES = ("auto", "ddp", "fsdp2")


def strategy_for(name: str) -> Strategy:
    """The strategy named by ``--strategy`` / ``Loop(strategy=...)``; ``auto`` is DDP."""
    if name in ("auto", "ddp"):
        return DDPStrategy()
    if name == "fsdp2":
        if available():
            raise ConfigError(available())
        return FSDP2Strategy()
    raise ConfigError(f"strategy {name!r}: choose {', '.join(STRATEGIES)}")


def refuse_wrapped(model: nn.Module, where: str) -> None:
    """Refuse a model a strategy has wrapped already (under torch.compile's wrapper too): DDP's wrapper wrapped
    again trained silently otherwise (the porter's seed 003 kept the tutorial's ``DDP(model)`` line:
    ``loop.wrap(DDP(model))`` trained other weights than the tutorial, its snapshot's keys ``module.``-prefixed),
    and ``loop.wrap(loop.wrap(m))`` failed in DDP's reducer with "please file an issue"."""
    inner = model
    while isinstance(inner, nn.Module) and "_orig_mod" in inner._modules:  # torch.compile's wrapper
        inner = inner._modules["_orig_mod"]
    if DDPStrategy.wrapped(inner):
        what = "wrapped in DistributedDataParallel"
    elif not available() and is_sharded(inner):
        what = "sharded by fully_shard"
    else:
        return
    raise ConfigError(
        f"{where} got a model {what} already: pass your plain module (it does the wrapping: remove your own "
        f"DDP(...)/fully_shard(...) line, or the first wrap)"
    )


class Prepared(NamedTuple):
    """A model as :func:`prepare` made it ready for the engine's step."""

    raw: nn.Module  # the user's module (sharded in place under FSDP2): what model.pt and a snapshot hold
    ddp: Any  # the DDP wrapper, or None
    synced: Any  # what no_sync is given: the DDP wrapper, the FSDP2 root, or None (no gradient sync to skip)
    model: nn.Module  # what the step calls (compiled with --compile)


def prepare(
    model: nn.Module,
    cfg: TrainConfig,
    ctx: DistContext,
    strategy: Strategy,
    static_graph: bool,
    find_unused_parameters: bool = False,
) -> Prepared:
    """The engine's model, as the config asks, in one function. Order matters: dtype, then SyncBatchNorm
    (before the wrap, so DDP sees the final modules), then channels-last, then the strategy's wrap (DDP with
    a communication hook, or FSDP2's sharding), then torch.compile around the whole. ``static_graph``:
    every parameter is used in every step (the registry models), so DDP may record the first iteration's
    graph. ``find_unused_parameters``: as preflight decided it (the user's ask, or its trial step's find)."""
    raw = model.to(ctx.device)
    if cfg.dtype == "float64":  # float32 (the default) leaves a user's own float64 model as it is
        raw = raw.double()
    if cfg.sync_bn:
        raw = convert_sync_batchnorm(raw, ctx.device)  # before the DDP wrap, so DDP sees the final modules
    if cfg.channels_last and uses_conv(raw):
        raw = to_channels_last(raw, ctx.device.type)
    # BatchNorm-only buffers are broadcast by the engine before each evaluation, not before every forward
    sync_buffers = not only_batchnorm_buffers(raw)
    if strategy.name == "fsdp2":  # at any world size: the run the user asked for, sharded over a mesh of 1 too
        raw = strategy.wrap(raw, ctx, sync_buffers=sync_buffers)
        return Prepared(raw, None, raw, raw)
    ddp = None
    # At world size 1 there is nothing to all-reduce, and the wrapper's per-step work (hooks,
    # bucket copies, buffer broadcasts) took 20-37% of the MNIST ConvNet's step on an H100
    # (BENCHMARKS.md), so it is left off there unless --ddp asks for it.
    if cfg.ddp or (cfg.ddp is None and ctx.world_size > 1):
        ddp = strategy.wrap(
            raw,
            ctx,
            static_graph=static_graph,
            find_unused_parameters=find_unused_parameters,
            sync_buffers=sync_buffers,
            comm_hook=cfg.comm_hook,
        )
    wrapped = ddp or raw
    if cfg.compile:
        wrapped = torch.compile(wrapped, mode=cfg.compile_mode)
    return Prepared(raw, ddp, ddp, wrapped)
