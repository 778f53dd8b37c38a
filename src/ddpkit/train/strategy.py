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
and optimizer's state for a snapshot, and what it cannot be combined with. DDP (``train/ddp.py``) is the
first implementation: every rank holds the whole model, so the rank's own state is the global one. A
sharded strategy (FSDP2) is a second file beside it, answering the same questions.
"""

from __future__ import annotations

from contextlib import AbstractContextManager
from typing import Any, Protocol

import torch
from torch import nn

from ..errors import ConfigError
from ..ranks.context import DistContext
from .ddp import DDPStrategy


class Strategy(Protocol):
    name: str

    def wrap(self, raw: nn.Module, ctx: DistContext, **options: Any) -> nn.Module:
        """``raw`` (already on ``ctx.device``) as the loop calls it."""

    def unwrap(self, model: Any) -> Any:
        """The user's module out of the strategy's wrapper (and torch.compile's): its ``state_dict`` is
        what ``model.pt``, ``best.pt`` and a snapshot hold. Anything else comes back as it is."""

    def no_sync(self, model: nn.Module, enabled: bool = True) -> AbstractContextManager:
        """A backward that leaves the gradients unsynchronised (every micro-step of an accumulation but the last)."""

    def clip_grad_norm_(self, model: nn.Module, max_norm: float, foreach: bool | None = None) -> torch.Tensor:
        """Clip by the norm of the whole model's gradient, over every rank; returns that norm."""

    def replicated(self, model: nn.Module) -> bool:
        """Whether ``model``'s state is equal on every rank by construction (not hashed at a snapshot)."""

    def optimizer_state(self, optimizer: torch.optim.Optimizer, ctx: DistContext) -> dict | None:
        """The optimizer's whole state for a snapshot (every rank calls it: it may be a collective)."""

    def join(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> AbstractContextManager:
        """``--join``: uneven inputs, a rank out of batches answering the others' collectives until all are out."""

    def rejoin(self, optimizer: torch.optim.Optimizer, ctx: DistContext) -> None:
        """After an uneven ``--join`` epoch: every rank's optimizer state made alike again (a collective)."""

    def refused_with(self, **flags: Any) -> str:
        """What this strategy cannot be combined with among ``flags`` (name -> value), in one line; ""."""


def strategy_for(name: str) -> Strategy:
    """The strategy named by ``--strategy`` / ``Loop(strategy=...)``; ``auto`` is DDP."""
    if name in ("auto", "ddp"):
        return DDPStrategy()
    raise ConfigError(f"strategy {name!r}: choose auto or ddp")
