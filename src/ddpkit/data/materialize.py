"""User datasets on the fast path: held in memory as tensors once, then served by indexing.

    splits = materialize(splits, cfg)     # in the launcher, before any worker starts

The resident path (indexing tensors, on the device when they fit) is ddpkit's fast path;
the DataLoader path decodes or builds every sample again every epoch. So a dataset that
fits the memory budget is held as tensors, once per node (the workers receive it through
shared memory), with the same batches as the DataLoader would give:

| dataset | becomes |
|---|---|
| any dataset with a ``collate_fn`` | itself, on the DataLoader path: the collate makes every batch |
| ``ImageData`` | itself |
| ``TensorDataset`` | ``TensorData`` over its very tensors (no copy) |
| ``imagefolder:PATH`` | ``ImageData``, decoded in parallel the first time and cached beside the data |
| any other map-style dataset | ``TensorData``, read once, if its samples are tensors or numbers of fixed shapes, the same on every read (no random transforms) |

Anything else stays on the DataLoader path; ``DataSplits.note`` says which path each split
took and why, and the run's ``[start]`` line shows it.
"""

from __future__ import annotations

import dataclasses
import os
import sys
import time
from pathlib import Path

import torch
from torch.utils.data import Dataset, IterableDataset, Subset, TensorDataset, default_collate

from ..config import TrainConfig
from ..errors import DataError, raised_at
from ..ranks.context import cpu_cores
from .batch import tensor_leaves
from .folder import cached_decode
from .types import DataSplits, ImageData, TensorData

HOST_FRACTION = 0.25  # of the memory available, for all the data held in memory on a node
# A split whose reading into memory is estimated to take longer than this (seconds) stays on the DataLoader path
# under --data-path auto, which reads samples as the steps need them (reading 1M windows of a memmap, one
# sample at a time, took 84 s before a 10 s run); --data-path host or device holds it anyway, with progress.
READ_LIMIT_S = 5.0
PROBE = 32  # samples read, spread over the split, to estimate what reading all of it costs
PROGRESS_S = 5.0  # a read expected to take longer than this says how far it is, every this many seconds


def materialize(splits: DataSplits, cfg: TrainConfig, available: int | None = None) -> DataSplits:
    """``splits`` with each split held as tensors where it can be (see the module docstring)."""
    if cfg.data_path == "loader":
        return _with_note(splits, "DataLoader path, as --data-path loader asks")
    budget = HOST_FRACTION * available if available else float("inf")
    out, notes = {}, []
    for name in ("train", "test", "val"):
        data = getattr(splits, name)
        if data is None:  # no validation split
            continue
        held, note = _held(data, name, splits, cfg, budget)
        out[name] = held
        budget -= _nbytes(held)
        notes.append(note)
    return dataclasses.replace(splits, **out, note="; ".join(notes))


def _with_note(splits: DataSplits, note: str) -> DataSplits:
    return dataclasses.replace(splits, note=note)


def _nbytes(data) -> int:
    if isinstance(data, ImageData):
        return data.images.numel() + data.labels.numel() * 8
    return data.nbytes() if isinstance(data, TensorData) else 0


def _held(data: Dataset | None, split: str, splits: DataSplits, cfg: TrainConfig, budget: float) -> tuple[Dataset, str]:
    if data is None:  # evaluate() needs no training split
        return None, f"no {split} split"
    if isinstance(data, IterableDataset):
        return data, f"{split} streamed as an IterableDataset (each rank reads its shard: ddpkit.data.stream)"
    if splits.collate_fn is not None:
        # before any in-memory path: batches made by indexing tensors would never call it
        return data, f"{split} streamed (a collate_fn is given: it makes each batch, as in torch's DataLoader)"
    if isinstance(data, (ImageData, TensorData)):
        return data, f"{split} in memory"
    if isinstance(data, TensorDataset):
        # a list, as default_collate makes of tuple samples: the batches are the DataLoader path's, type and all
        return TensorData(list(data.tensors)), f"{split} in memory (a TensorDataset, indexed in place)"
    folder = data.dataset if isinstance(data, Subset) else data
    if cfg.dataset.startswith("imagefolder:") and hasattr(folder, "samples"):
        need = len(data) * 3 * cfg.image_size**2
        if need > budget:
            return data, f"{split} streamed ({need / 2**30:.1f} GiB decoded is over the memory budget)"
        root = Path(cfg.dataset.split(":", 1)[1])
        return cached_decode(data, root, split, cfg.image_size, cpu_cores())
    return _read_all(data, split, budget, limit_s=None if cfg.data_path in ("host", "device") else READ_LIMIT_S)


def _read_all(data: Dataset, split: str, budget: float, limit_s: float | None = READ_LIMIT_S) -> tuple[Dataset, str]:
    """A generic map-style dataset as TensorData, when that is safe and quick; else why not. What reading it
    all costs is estimated from a few samples first (bytes times length, seconds per sample); past the
    memory budget, or ``limit_s`` (None: the user asked for it in memory), it stays on the DataLoader path."""
    if len(data) == 0:
        return data, f"{split} empty"
    first, again = _read(data, 0, split), _read(data, 0, split)
    if not _same(first, again):
        return data, f"{split} streamed (its samples differ between reads: random transforms run per epoch)"
    try:
        one = default_collate([first])
    except (TypeError, RuntimeError):
        one = None
    if one is None or not _only_tensors(one):
        return data, f"{split} streamed (its samples are not tensors or numbers)"
    per_sample = sum(t.numel() * t.element_size() for t in tensor_leaves(one))
    n = len(data)
    if per_sample * n > budget:
        return data, f"{split} streamed ({per_sample * n / 2**30:.1f} GiB is over the memory budget)"
    probe = sorted({int(i) for i in torch.linspace(0, n - 1, min(PROBE, n)).round().tolist()})
    t = time.perf_counter()
    for i in probe:
        _read(data, i, split)
    expected = (time.perf_counter() - t) / len(probe) * n  # seconds to read every sample, one at a time
    if limit_s is not None and expected > limit_s:
        return data, (
            f"{split} streamed ({n:,} samples: reading them into memory would take about {expected:.0f} s and "
            f"{per_sample * n / 2**30:.2f} GiB; read as the steps need them instead, --data-path host to hold them)"
        )
    say = _progress(split, n) if expected > PROGRESS_S else None
    t = time.perf_counter()
    batches = []
    for start in range(0, n, 256):
        if say is not None:
            say(start)
        samples = [_read(data, i, split) for i in range(start, min(start + 256, n))]
        try:
            batches.append(default_collate(samples))
        except (TypeError, RuntimeError, ValueError):
            return data, f"{split} streamed (its samples are not all of one shape)"
    try:
        tree = _concat(batches)
    except (TypeError, RuntimeError, ValueError):
        return data, f"{split} streamed (its samples are not all of one shape)"
    return TensorData(tree), f"{split} in memory (read once in {time.perf_counter() - t:.1f} s)"


def _progress(split: str, n: int):
    """A function of the samples read so far that prints, every PROGRESS_S seconds, how far the read is (the
    launcher's, or global rank 0's under torchrun)."""
    t0 = last = time.perf_counter()
    quiet = os.environ.get("RANK", "0") != "0"

    def say(done: int) -> None:
        nonlocal last
        now = time.perf_counter()
        if quiet or now - last < PROGRESS_S or not done:
            return
        last = now
        left = (now - t0) / done * (n - done)
        print(f"ddpkit: reading {split} into memory: {done:,}/{n:,} samples, about {left:.0f} s left", file=sys.stderr)

    return say


def _read(data: Dataset, i: int, split: str):
    """Sample ``i``; a dataset that raises on it is one line naming the index, here, before launch
    (inside the workers it would end one rank's epoch part-way)."""
    try:
        return data[i]
    except Exception as exc:  # noqa: BLE001 - the dataset's own code
        raise DataError(
            f"{split} dataset {type(data).__name__}: reading sample {i} of {len(data)} raised "
            f"{raised_at(exc)}; fix that sample, or leave it out (torch.utils.data.Subset)"
        ) from None


def _only_tensors(tree) -> bool:
    """Every leaf a tensor (strings and other objects cannot be indexed as a batch)."""
    if isinstance(tree, torch.Tensor):
        return True
    if isinstance(tree, dict):
        return bool(tree) and all(_only_tensors(v) for v in tree.values())
    if isinstance(tree, (list, tuple)):
        return bool(tree) and all(_only_tensors(v) for v in tree)
    return False


def _same(a, b) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.shape == b.shape and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return isinstance(b, (list, tuple)) and len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    try:
        import numpy as np

        if isinstance(a, np.ndarray):
            return isinstance(b, np.ndarray) and np.array_equal(a, b)
    except ImportError:
        pass
    return a == b


def _concat(batches: list):
    """Collated batches joined along the first dimension, whatever their structure."""
    head = batches[0]
    if isinstance(head, torch.Tensor):
        return torch.cat(batches)
    if isinstance(head, dict):
        return {k: _concat([b[k] for b in batches]) for k in head}
    if isinstance(head, tuple) or (isinstance(head, list) and all(isinstance(x, torch.Tensor) for x in head)):
        return type(head)(_concat([b[i] for b in batches]) for i in range(len(head)))
    raise TypeError("not a tensor tree")
