"""Exact distributed evaluation: one function for every face (the engine's tasks, ``Loop.evaluate``).

Every rank evaluates its own slice of a split (every world_size-th sample, no padding), ``measure`` turns
each batch into (sum, count) per metric, and the sums, counts and the sample count are added over the
ranks in one all-reduce (``metrics.framed_sums``, which also refuses ranks that measured other names, or
that are in another collective): each sample is counted exactly once at any world size, and every mean
is the mean over the whole split.
"""

from __future__ import annotations

from typing import Any, Callable, Iterable

import torch
from torch import nn

from ..config import TrainConfig
from ..data.batch import leading_size
from ..data.loader import EvalSource
from ..errors import ConfigError
from ..ranks.context import DistContext
from .metrics import Accumulator, framed_sums, means
from .session import Amp
from .task import Task


@torch.no_grad()
def evaluate_split(
    model: nn.Module,
    batches: Iterable[Any],
    measure: Callable[[nn.Module, Any], dict],
    ctx: DistContext,
    amp: Amp,
    names: tuple[str, ...] | None = None,
    rank0_buffers: bool = True,
) -> tuple[tuple[str, ...], list[float], torch.Tensor]:
    """``(names, totals, local)``: ``totals`` [sums..., counts..., samples] over every rank, ``local`` this
    rank's own on the device. ``measure(model, batch)`` gives {name: (sum, count)} under ``amp``'s
    autocast, with ``names`` (or the first batch's, sorted) at every batch. ``model`` runs in eval mode
    and unwrapped (DDP's forward hooks are for training only). Every rank.

    ``rank0_buffers``: every rank evaluates with rank 0's buffers (BatchNorm's running statistics), broadcast
    into the model first: the model a snapshot, ``model.pt`` and ``best.pt`` hold. DDP broadcasts them before
    each training forward, and each rank's forward then moves its own, so after the last step they differ by
    rank; DDP's next synced forward broadcasts rank 0's again (one after a ``no_sync`` micro-step does not: an
    evaluation in the middle of an accumulation leaves rank 0's where the rank's own would have gone on). The
    buffers DDP was told to ignore (``_ddp_params_and_buffers_to_ignore``) stay each rank's own. False: a model
    whose ranks keep their own buffers by choice (``Loop.wrap(broadcast_buffers=False)``) is evaluated as each
    has it."""
    if rank0_buffers:
        ignored = set(getattr(model, "_ddp_params_and_buffers_to_ignore", ()))
        ctx.broadcast_many([b for name, b in model.named_buffers() if name not in ignored])
    was_training = model.training
    model.eval()
    acc = Accumulator(names, ctx.device) if names is not None else None
    samples = 0
    try:
        for batch in batches:
            with amp.autocast():
                pairs = measure(model, batch)
            if acc is None:
                acc = Accumulator(tuple(sorted(pairs)), ctx.device)
            if set(pairs) != set(acc.names):
                raise ConfigError(
                    f"the evaluation measured {sorted(pairs)} for one batch and {list(acc.names)} for the first: "
                    f"return the same names for every batch"
                )
            acc.add([pairs[name] for name in acc.names])
            samples += leading_size(batch)
    finally:
        model.train(was_training)
    names = acc.names if acc is not None else ()
    sums = acc.local() if acc is not None else torch.zeros(0, dtype=torch.float64, device=ctx.device)
    count = torch.tensor([float(samples)], dtype=torch.float64, device=ctx.device)
    local = torch.cat([sums, count])  # before the all-reduce: past FRAME names it sums ``sums`` in place
    totals, (total_samples,) = framed_sums(ctx, "evaluate", names, sums, count)  # the count travels as a flag
    if totals is None:
        raise ConfigError(
            f"the ranks' evaluations measured different names (this rank: {', '.join(names) or 'none'}): "
            f"measure the same names on every rank"
        )
    totals = [*totals, total_samples]
    return names, totals, local


def evaluate(
    model: nn.Module, source: EvalSource, task: Task, cfg: TrainConfig, ctx: DistContext, prefix: str = "test_"
) -> tuple[dict, torch.Tensor]:
    """A task's evaluation of a built-in source: ({<prefix><metric>: mean, <prefix>samples: n} over the whole
    split (``prefix`` "val_": the validation split), this rank's [sums..., counts..., samples] on the device).
    An empty test set is refused before launch (trainer.preflight); here its means are None."""
    names, totals, local = evaluate_split(
        model,
        source.batches(),
        lambda m, b: dict(zip(task.names, task.evaluate(m, b))),
        ctx,
        Amp(cfg.amp, ctx.device),
        task.names,
    )
    return {**means(names, totals[:-1], prefix), f"{prefix}samples": int(totals[-1])}, local
