"""Models and losses that couple the samples of a batch, so N processes (each on B/N samples) truly
compute something else than 1 process on B: ``ddpkit check`` must say FAILED on each (issue 33,
case 10; tests/tools/test_check.py). Importable by spawned workers (tests/helpers is on their path)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from user_code import RegressionMLP


class BatchCentred(RegressionMLP):
    """Subtracts the batch's mean from the hidden features: each rank subtracts its own share's."""

    def forward(self, x):
        h = self.net[0](x)
        return self.net[2](self.net[1](h - h.mean(0, keepdim=True)))


class FunctionalBatchNorm(RegressionMLP):
    """``F.batch_norm`` with no module and no running statistics: no BatchNorm module for SyncBN to replace."""

    def forward(self, x):
        h = F.batch_norm(self.net[0](x), None, None, training=True)
        return self.net[2](self.net[1](h))


class RunningBuffer(RegressionMLP):
    """A buffer of its own, a running mean of the hidden features updated from each training batch
    (a user's own normaliser): DDP broadcasts rank 0's, computed from rank 0's share alone."""

    def __init__(self):
        super().__init__()
        self.register_buffer("running", torch.zeros(self.net[0].out_features))

    def forward(self, x):
        h = self.net[0](x)
        if self.training:
            with torch.no_grad():
                self.running.mul_(0.9).add_(0.1 * h.mean(0))
        return self.net[2](self.net[1](h - self.running))


def summed_mse(model, batch):
    """A summed loss: each rank's sum over B/N samples, averaged by DDP, is 1/N of the sum over B."""
    x, y = batch
    out = model(x)
    return F.mse_loss(out, y, reduction="sum"), out


def max_error(model, batch):
    """The batch's largest squared error: the mean of the ranks' maxima is not the batch's maximum."""
    x, y = batch
    out = model(x)
    return F.mse_loss(out, y, reduction="none").max(), out


def centred_net() -> nn.Module:
    """An MNIST classifier that subtracts the batch's mean from its hidden features, for the CLI
    (``--model batch_coupled:centred_net``)."""
    return nn.Sequential(nn.Flatten(), nn.Linear(784, 16), BatchMean(), nn.ReLU(), nn.Linear(16, 10))


class BatchMean(nn.Module):
    def forward(self, h):
        return h - h.mean(0, keepdim=True)
