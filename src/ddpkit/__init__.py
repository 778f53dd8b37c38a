"""ddpkit: data-parallel training with PyTorch DDP, for image classifiers and your own models.

from ddpkit import Trainer, TrainConfig
result = Trainer(TrainConfig(dataset="mnist", epochs=2, nproc="2")).fit()

from ddpkit import Loop                 # your own loop, with snapshots, exact metrics, resume
with Loop("runs/mine") as loop: ...     # under torchrun, ddpkit.launch or plain python

from ddpkit import launch               # fn(ctx, *args) on every rank
launch(fn, *args, nproc=2)
"""

from .config import TrainConfig
from .version import __version__

_LAZY = {
    "Trainer": ".trainer",
    "FitResult": ".trainer",
    "launch": ".ranks.launcher",
    "Loop": ".loop",
    "LoopConfig": ".loop",
}  # these import torch


def __getattr__(name: str):
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name], __name__), name)
    raise AttributeError(f"module 'ddpkit' has no attribute {name!r}")


__all__ = ["FitResult", "Loop", "LoopConfig", "Trainer", "TrainConfig", "launch", "__version__"]
