"""Exact distributed evaluation.

Every rank evaluates its own slice of the test set (every world_size-th sample, no
padding), and the loss sum, correct count and sample count are all-reduced, so each
test sample is counted exactly once at any world size.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .data.loader import Preprocess, eval_batches
from .dist import DistContext
from .optim import autocast


@torch.no_grad()
def evaluate(model: nn.Module, data, pre: Preprocess, cfg, ctx: DistContext, batch: int) -> dict:
    """Test loss, accuracy and sample count over the whole test set. Every rank must call it.

    ``model`` must be the unwrapped module: DDP's forward hooks are for training only.
    """
    was_training = model.training
    model.eval()
    sums = torch.zeros(3, dtype=torch.float64, device=ctx.device)  # loss sum, correct, samples
    for x, y in eval_batches(data, pre, cfg, ctx, batch):
        with autocast(cfg, ctx.device):
            logits = model(x)
            if cfg.tta:  # average over the image and its mirror
                logits = (logits.float() + model(x.flip(3)).float()) / 2
        loss = F.cross_entropy(logits.float(), y, reduction="sum")
        sums += torch.stack([loss.double(), (logits.argmax(1) == y).sum().double(),
                             torch.tensor(float(len(y)), dtype=torch.float64, device=ctx.device)])
    loss_sum, correct, n = ctx.all_reduce(sums).tolist()
    model.train(was_training)
    n = int(n)
    return {"test_loss": loss_sum / max(1, n), "test_accuracy": correct / max(1, n), "test_samples": n}
