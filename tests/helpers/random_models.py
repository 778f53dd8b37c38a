"""Models with each kind of randomness a training step can have, for ``ddpkit check``'s verdicts
(tests/tools/test_check.py). Importable by spawned workers (tests/helpers is on their path)."""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn
from user_code import RegressionMLP


class DropoutMLP(RegressionMLP):
    """nn.Dropout modules: switched off by check."""

    def __init__(self):
        super().__init__()
        self.net.insert(2, nn.Dropout(0.3))


class AttentionDropout(nn.Module):
    """The only randomness is nn.MultiheadAttention's own dropout argument (no nn.Dropout module)."""

    def __init__(self, features: int = 4, width: int = 8):
        super().__init__()
        self.inp = nn.Linear(1, width)
        self.attn = nn.MultiheadAttention(width, num_heads=2, dropout=0.3, batch_first=True)
        self.out = nn.Linear(width * features, 1)

    def forward(self, x):  # x [B, 4]: 4 tokens of 1 feature each
        h = self.inp(x[..., None])
        h, _ = self.attn(h, h, h, need_weights=False)
        return self.out(h.flatten(1))


class Noise(nn.Module):
    def __init__(self, source: str):
        super().__init__()
        self.source = source

    def forward(self, h):
        if not self.training:
            return h
        if self.source == "torch.rand":
            return h + 0.1 * torch.rand_like(h)
        if self.source == "F.dropout":
            return F.dropout(h, 0.2, training=True)
        if self.source == "numpy":
            return h + 0.1 * torch.from_numpy(np.random.randn(*h.shape)).to(h.dtype)
        raise ValueError(self.source)


class NoisyMLP(RegressionMLP):
    """A draw in the forward that no switch reaches: torch.rand, F.dropout with a constant p, numpy."""

    def __init__(self, source: str):
        super().__init__()
        self.net.insert(1, Noise(source))


class LateNoise(RegressionMLP):
    """Draws only from its second forward on: a single probe step cannot see it; the noise run must."""

    def __init__(self):
        super().__init__()
        self.calls = 0

    def forward(self, x):
        self.calls += 1
        out = super().forward(x)
        return out + 0.1 * torch.rand_like(out) if self.training and self.calls > 1 else out


def noisy_net(source: str = "torch.rand") -> nn.Module:
    """An MNIST classifier with a draw in its forward, for the CLI (``--model random_models:noisy_net``)."""
    return nn.Sequential(nn.Flatten(), nn.Linear(784, 16), Noise(source), nn.ReLU(), nn.Linear(16, 10))
