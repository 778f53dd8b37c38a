"""User code whose edits the run identity must see (tests/api/test_identity.py edits it in place)."""

from __future__ import annotations

import identity_cfg
import torch
from torch import nn
from torch.utils.data import Dataset

SCALE = 1.0  # a module-level name the model's forward reaches through a helper


class HelperNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 1)

    def scaled(self, x):
        return x * SCALE

    def forward(self, x):
        return self.scaled(self.fc(x))


class Weighted:
    """A callable object used as a loss: its attribute is part of what it computes."""

    def __init__(self, weight: float):
        self.weight = weight

    def __call__(self, model, batch):
        return self.weight * nn.functional.mse_loss(model(batch[0]), batch[1])


class Augmented(Dataset):
    """Stored samples, drawn through a random augmentation on every read (an unseeded script's data)."""

    def __init__(self, n: int, seed: int = 0):
        gen = torch.Generator().manual_seed(seed)
        self.x = torch.randn(n, 4, generator=gen)
        self.y = self.x.sum(1, keepdim=True)

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        return self.x[i] + 0.01 * torch.randn(4), self.y[i]


class Streamed(Dataset):
    """Samples read from a handle ddpkit cannot look into (here a lock stands in for a database client)."""

    def __init__(self, n: int):
        import threading

        self.handle = threading.Lock()
        gen = torch.Generator().manual_seed(1)
        self.x = torch.randn(n, 4, generator=gen)

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        return self.x[i], self.x[i].sum(0, keepdim=True)


def set_literal_loss(model, batch):
    """Compiles to a frozenset constant, whose repr order follows PYTHONHASHSEED."""
    kind = "mse" if "mse" in {"mse", "l2", "squared", "quadratic"} else "l1"
    return nn.functional.mse_loss(model(batch[0]), batch[1]) if kind == "mse" else None


class Unreadable:
    """An object whose repr raises, as some C-extension handles do."""

    __slots__ = ("x",)

    def __repr__(self):
        raise RuntimeError("no repr")


class Block(nn.Module):
    def __init__(self, width: int):
        super().__init__()  # a __class__ closure cell: Block, reached again from Block.__init__
        self.fc = nn.Linear(width, width)

    def forward(self, x):
        return x + self.fc(x)


class Stack(nn.Module):
    """Builds its blocks by the module-level name Block, as a minGPT builds its transformer blocks."""

    def __init__(self, width: int = 4, depth: int = 2):
        super().__init__()
        self.blocks = nn.Sequential(*[Block(width) for _ in range(depth)])
        self.head = nn.Linear(width, 1)

    def forward(self, x):
        return self.head(self.blocks(x))


# ---------------------------------------------------------------- issue 33: what the identity missed
class ConfigNet(nn.Module):
    """Reads a constant of another module of the user's through that module (``import identity_cfg``)."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 1)

    def forward(self, x):
        return self.fc(x) * identity_cfg.SCALE


CE = nn.CrossEntropyLoss()  # a library loss the user's loss holds: its settings are not in its repr


def ce_loss(model, batch):
    return CE(model(batch[0]), batch[1])


class Smoothed:
    """A callable-object loss holding a library loss."""

    def __init__(self, smoothing: float):
        self.ce = nn.CrossEntropyLoss(label_smoothing=smoothing)

    def __call__(self, model, batch):
        return self.ce(model(batch[0]), batch[1])


class Encoder(nn.Module):
    """A library layer whose settings change neither its repr nor its parameters' shapes (nhead, norm_first)."""

    def __init__(self, nhead: int = 2, norm_first: bool = False):
        super().__init__()
        self.layer = nn.TransformerEncoderLayer(16, nhead=nhead, dim_feedforward=32, norm_first=norm_first)
        self.head = nn.Linear(16, 1)

    def forward(self, x):
        return self.head(self.layer(x).mean(0))


class Activated(nn.Module):
    """A class attribute and a private attribute the forward reads."""

    act = staticmethod(torch.relu)

    def __init__(self, scale: float = 1.0):
        super().__init__()
        self.fc = nn.Linear(4, 1)
        self._scale = scale

    def forward(self, x):
        return self.act(self.fc(x)) * self._scale


def pad_collate(batch, pad=0.0):
    """A collate_fn: stacks the samples, adding ``pad`` (edited through functools.partial)."""
    x = torch.stack([s[0] for s in batch]) + pad
    return x, torch.stack([s[1] for s in batch])


class FolderData(Dataset):
    """Keeps only its folder's path and opens each sample's file by name in __getitem__."""

    def __init__(self, root: str, n: int = 16):
        self.root, self.n = root, n

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        with open(f"{self.root}/{i % 4}.txt") as fh:
            x = torch.tensor([float(v) for v in fh.read().split()])
        return x, x.sum(0, keepdim=True)


LOG = __import__("logging").getLogger(__name__)


class Logged(nn.Module):
    """A forward that logs through a module-level logger (whose __dict__ reaches the process's logger registry)."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 2)

    def forward(self, x):
        LOG.debug("forward on %s", tuple(x.shape))
        return self.fc(x)


class Triplets(Dataset):
    """An ImageFolder-like dataset (root and samples) whose samples are (path, target, weight) triples."""

    def __init__(self, root):
        self.root, self.samples = root, [(f"{root}/a.png", 0, 1.0)]

    def __len__(self):
        return 1

    def __getitem__(self, i):
        return torch.zeros(4), 0
