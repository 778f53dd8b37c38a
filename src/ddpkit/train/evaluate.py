"""Exact distributed evaluation, for any task.

Every rank evaluates its own slice of the test set (every world_size-th sample, no
padding), the task turns each batch into (sum, count) per metric, and the sums, counts
and sample count are all-reduced: each test sample is counted exactly once at any
world size, and every mean is the mean over the whole test set.
"""

from __future__ import annotations

import torch
from torch import nn

from ..config import TrainConfig
from ..data.batch import leading_size
from ..data.loader import EvalSource
from ..ranks.context import DistContext
from .metrics import Accumulator
from .optim import autocast
from .task import Task


@torch.no_grad()
def evaluate(
    model: nn.Module, source: EvalSource, task: Task, cfg: TrainConfig, ctx: DistContext, prefix: str = "test_"
) -> tuple[dict, torch.Tensor]:
    """({test_<metric>: mean, test_samples: n} over the whole test set (``prefix`` "val_": the validation
    split), this rank's own [sums..., counts..., samples] on the device). Every rank must call it.

    ``model`` must be the unwrapped module: DDP's forward hooks are for training only.
    """
    was_training = model.training
    model.eval()
    acc = Accumulator(task.names, ctx.device)
    samples = 0
    for b in source.batches():
        with autocast(cfg, ctx.device):
            acc.add(task.evaluate(model, b))
        samples += leading_size(b)
    model.train(was_training)
    local = torch.cat([acc.local(), torch.tensor([float(samples)], dtype=torch.float64, device=ctx.device)])
    totals = ctx.all_reduce(local.clone()).tolist()
    # An empty test set is refused before launch (trainer.preflight); here its means are None.
    return {**acc.means(totals[:-1], prefix), f"{prefix}samples": int(totals[-1])}, local
