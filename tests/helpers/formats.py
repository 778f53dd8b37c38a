"""Datasets written in their real on-disk formats (IDX for Fashion-MNIST, CIFAR's pickled batches), small."""

from __future__ import annotations

import numpy as np

from ddpkit.data.cifar import write_cifar_batch
from ddpkit.data.datasets import IDX_FILES
from ddpkit.data.idx import write_idx


def write_fashion(root, rng, n=(30, 10), corrupt=None):
    folder = root / "FashionMNIST" / "raw"
    folder.mkdir(parents=True)
    for split, count in zip(("train", "test"), n):
        img, lab = IDX_FILES[split]
        write_idx(folder / img, rng.integers(0, 256, (count, 28, 28), dtype=np.uint8))
        write_idx(folder / lab, rng.integers(0, 10, count, dtype=np.uint8))
    return folder


def write_cifar10(root, rng, per_batch=6):
    folder = root / "cifar-10-batches-py"
    folder.mkdir(parents=True)
    for name in [f"data_batch_{i}" for i in range(1, 6)] + ["test_batch"]:
        write_cifar_batch(
            folder / name, rng.integers(0, 256, (per_batch, 3, 32, 32), dtype=np.uint8), rng.integers(0, 10, per_batch)
        )
    return folder
