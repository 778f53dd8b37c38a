"""ddpkit: data-parallel training with PyTorch DDP, for image classifiers and your own models.

from ddpkit import Trainer, TrainConfig
result = Trainer(TrainConfig(dataset="mnist", epochs=2, nproc="2")).fit()

from ddpkit import Loop                 # your own loop, with snapshots, exact metrics, resume
with Loop("runs/mine") as loop: ...     # under torchrun, ddpkit.launch or plain python

from ddpkit import launch               # fn(ctx, *args) on every rank
launch(fn, *args, nproc=2)
"""

from .config import TrainConfig
from .ranks.failures import stop_exits_with_its_status
from .version import __version__

# From here on, a ddpkit error a script leaves uncaught ends it as the CLI does: one line, once, and its exit status
# (2 for bad input, 143 for a stop), not a traceback per rank. Installed at import, not by the first ddpkit call that
# needs it: a misspelt TrainConfig(epoch=2) comes before any (the porter's seed 003, and the review of it)
stop_exits_with_its_status()

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
