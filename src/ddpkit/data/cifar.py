"""Reader for the CIFAR-10/100 "python version" pickles, with every corruption named.

Each batch file is a pickled dict with ``b"data"`` (uint8, N x 3072, channel-major
32x32 RGB) and ``b"labels"`` (CIFAR-10) or ``b"fine_labels"`` (CIFAR-100).
"""

from __future__ import annotations

import pickle
from pathlib import Path

import numpy as np

from ..errors import DataError

# name -> (folder inside data_dir, train files, test files, label key, classes)
LAYOUTS = {
    "cifar10": ("cifar-10-batches-py", [f"data_batch_{i}" for i in range(1, 6)], ["test_batch"], b"labels", 10),
    "cifar100": ("cifar-100-python", ["train"], ["test"], b"fine_labels", 100),
}


def read_cifar_batch(path: Path, label_key: bytes, num_classes: int) -> tuple[np.ndarray, np.ndarray]:
    """Images [N, 3, 32, 32] uint8 and labels [N] int64 from one pickle file."""
    try:
        with open(path, "rb") as fh:
            entry = pickle.load(fh, encoding="bytes")
    except FileNotFoundError:
        raise DataError(f"{path}: file not found") from None
    except Exception as exc:  # a truncated pickle raises EOFError, UnpicklingError, ValueError, ...
        raise DataError(f"{path}: corrupt or truncated CIFAR pickle ({type(exc).__name__}: {exc})") from None
    if not isinstance(entry, dict) or b"data" not in entry or label_key not in entry:
        raise DataError(f"{path}: not a CIFAR batch (needs keys b'data' and {label_key!r})")
    data = np.asarray(entry[b"data"])
    labels = np.asarray(entry[label_key], dtype=np.int64)
    if data.dtype != np.uint8 or data.ndim != 2 or data.shape[1] != 3 * 32 * 32:
        raise DataError(f"{path}: data has shape {data.shape} {data.dtype}, expected (N, 3072) uint8")
    if len(data) != len(labels):
        raise DataError(f"{path}: {len(data)} images but {len(labels)} labels")
    if len(labels) and (labels.min() < 0 or labels.max() >= num_classes):
        bad = int(labels.max() if labels.max() >= num_classes else labels.min())
        raise DataError(f"{path}: label {bad} is outside the {num_classes} classes (0..{num_classes - 1})")
    return data.reshape(-1, 3, 32, 32), labels


def read_cifar_split(root: Path, files: list[str], label_key: bytes, num_classes: int) -> tuple[np.ndarray, np.ndarray]:
    parts = [read_cifar_batch(root / name, label_key, num_classes) for name in files]
    return np.concatenate([p[0] for p in parts]), np.concatenate([p[1] for p in parts])


def write_cifar_batch(path: Path, images: np.ndarray, labels: np.ndarray, label_key: bytes = b"labels") -> None:
    """Write a batch in the real on-disk format; used by tests and tools."""
    entry = {
        b"batch_label": b"generated",
        b"data": images.reshape(len(images), -1).astype(np.uint8),
        label_key: [int(v) for v in labels],
    }
    with open(path, "wb") as fh:
        pickle.dump(entry, fh, protocol=2)
