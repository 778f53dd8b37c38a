"""The data types every layer above shares: what a dataset is once loaded.

DataSplits(train, test, meta)      # train/test (and val): ImageData, TensorData, or any map-style Dataset
ImageData(images, labels)          # uint8 [N, C, H, W] and int64 [N], a whole split in memory
TensorData(tree)                   # any nest of tensors [N, ...], batched by indexing
Meta(channels, height, width, classes, mean, std, augment)
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import numpy as np
import torch
from torch.utils.data import Dataset

from ..errors import DataError
from .batch import tensor_leaves, tree_map


@dataclass(frozen=True)
class Meta:
    """What the model builder and the batch preprocessor need to know about a dataset."""

    channels: int
    height: int
    width: int
    classes: int
    mean: tuple[float, ...]  # per channel, in [0, 1] pixel units
    std: tuple[float, ...]
    augment: str = "none"  # training augmentation: none | flip | crop-flip (pad 4, as in the CIFAR seeds)


class ImageData(Dataset):
    """A whole split in memory: uint8 images [N, C, H, W] and int64 labels [N]."""

    def __init__(self, images: torch.Tensor, labels: torch.Tensor):
        if images.dtype != torch.uint8 or images.ndim != 4:
            raise DataError(f"images must be uint8 [N, C, H, W], got {images.dtype} {tuple(images.shape)}")
        if len(images) != len(labels):
            raise DataError(f"{len(images)} images but {len(labels)} labels")
        self.images, self.labels = images, labels.long()

    def __len__(self) -> int:
        return len(self.images)

    def __getitem__(self, i):
        return self.images[i], self.labels[i]

    def head(self, n: int) -> "ImageData":
        return self if not n or n >= len(self) else ImageData(self.images[:n], self.labels[:n])

    def subset(self, index: torch.Tensor) -> "ImageData":
        return ImageData(self.images[index], self.labels[index])

    @classmethod
    def from_numpy(cls, images: np.ndarray, labels: np.ndarray) -> "ImageData":
        if images.ndim == 3:  # [N, H, W] greyscale
            images = images[:, None]
        return cls(torch.from_numpy(np.ascontiguousarray(images)), torch.from_numpy(labels.astype(np.int64)))


class TensorData(Dataset):
    """A whole dataset as stacked tensors: a tuple, list or dict (or nest) of tensors [N, ...].

    What a TensorDataset already is, and what a small deterministic map-style dataset becomes
    once materialised (:mod:`ddpkit.data.materialize`). Batches are made by indexing every
    tensor with the same indices, exactly as the DataLoader would collate those samples.
    """

    def __init__(self, tree):
        self.tree = tree
        lengths = {len(t) for t in tensor_leaves(tree)}
        if len(lengths) != 1:
            raise DataError(f"tensors of different lengths {sorted(lengths)}; every tensor needs one row per sample")
        self.n = lengths.pop()

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i):
        return self.take(i)

    def take(self, index):
        """The samples at ``index`` (an int, or a tensor of indices for a batch)."""
        return tree_map(lambda t: t[index], self.tree)

    def to(self, device) -> "TensorData":
        return TensorData(tree_map(lambda t: t.to(device), self.tree))

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in tensor_leaves(self.tree))


@dataclass
class DataSplits:
    train: Dataset
    test: Dataset
    meta: Meta | None  # None: a user dataset whose batches go to the model as they come
    collate_fn: Callable | None = None  # the user's, for DataLoader-path datasets
    note: str = ""  # how the data is held, and why (materialised, cached, streamed): logged at start
    worker_init_fn: Callable | None = None  # the user's DataLoader's, called in each loader worker as it starts
    val: Dataset | None = None  # the validation split: passed (val_data), or held out of train (--val-fraction)


def infer_meta(data: Dataset | None) -> Meta | None:
    """Meta for an in-memory ImageData passed without one: shape, class count, and channel statistics."""
    if not isinstance(data, ImageData):
        return None
    x = data.images[:10000].float() / 255
    dims = (0, 2, 3)
    _, c, h, w = data.images.shape
    return Meta(
        c, h, w, int(data.labels.max()) + 1, tuple(x.mean(dims).tolist()), tuple(x.std(dims).clamp_min(1e-3).tolist())
    )
