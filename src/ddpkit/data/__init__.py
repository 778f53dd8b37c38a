"""Datasets: the shared types, the built-in datasets, and the paths that feed batches to the model.

    splits = load_dataset(cfg)          # DataSplits(train, test, meta)
    splits.train.images                 # uint8 [N, C, H, W]; batches are made by indexing
    index, count = stream_shard()       # in an IterableDataset's __iter__: the shard this process reads

The types live in :mod:`ddpkit.data.types`, the registry in :mod:`ddpkit.data.datasets`; this
module only re-exports them.
"""

from .datasets import DATASETS, MNIST_DIR, load_dataset
from .stream import stream_shard, stream_start
from .types import DataSplits, ImageData, Meta, TensorData

__all__ = [
    "DATASETS",
    "MNIST_DIR",
    "DataSplits",
    "ImageData",
    "Meta",
    "TensorData",
    "load_dataset",
    "stream_shard",
    "stream_start",
]
