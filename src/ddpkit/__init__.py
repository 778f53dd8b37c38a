"""ddpkit: data-parallel training with PyTorch DDP, for image classifiers and your own models.

    from ddpkit import Trainer, TrainConfig
    result = Trainer(TrainConfig(dataset="mnist", epochs=2, nproc="2")).fit()

    from ddpkit import launch               # your own loop: fn(ctx, *args) on every rank
    launch(fn, *args, nproc=2)
"""

__version__ = "0.2.0"

from .config import TrainConfig  # noqa: E402
from .launcher import launch  # noqa: E402
from .trainer import FitResult, Trainer  # noqa: E402

__all__ = ["FitResult", "Trainer", "TrainConfig", "launch", "__version__"]
