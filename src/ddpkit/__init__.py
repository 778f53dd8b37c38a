"""ddpkit: data-parallel training of image classifiers with PyTorch DDP.

    from ddpkit import Trainer, TrainConfig
    summary = Trainer(TrainConfig(dataset="mnist", epochs=2, nproc="2")).fit()
"""

__version__ = "0.1.0"

from .config import TrainConfig  # noqa: E402
from .trainer import Trainer  # noqa: E402

__all__ = ["Trainer", "TrainConfig", "__version__"]
