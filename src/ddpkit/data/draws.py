"""The random draws of a user's data on the DataLoader path, and each rank's own random streams.

A dataset that draws random numbers in ``__getitem__`` (augmentation, a random window) or a
``collate_fn`` that does (MixUp) draws from torch's, numpy's and Python's global generators in the
process that fetches the batch: a DataLoader worker, or the rank itself with ``--num-workers 0``.
Left to torch, a worker's generators are seeded once, when it starts, from a number the rank draws
at the loader's first iteration, and then run on through every batch the worker is sent (batch k of
the iteration goes to worker k mod W). Nothing of that survives a resume: the resumed run's workers
start afresh at the resume's batch, which they also share out differently; and with no workers, the
iteration's draw shifts the rank's own stream by one number at the resume.

So each batch is fetched from generators seeded for that batch alone, from its key: (seed, epoch,
rank, batch index in the epoch) for training, (seed, rank, batch index) for evaluation (the same
draws at every evaluation). A batch's draws are then the same whichever process fetches it, after a
resume at any step, with any number of workers, 0 included: there the rank's own generators are set
aside for the fetch and put back after, so its dropout stream is its own and the snapshot's.
Exact, and cheap: three generators seeded per batch, not per sample; the batch index travels with
the batch's sample indices to the worker (:class:`KeyedBatch`), since a worker is told nothing else
of where it is. Not covered: a generator object the dataset holds itself (``np.random.default_rng()``
made in ``__init__``), which is its own to seed.

The rank's own generators (dropout, a draw in the model's forward) are torch's, seeded by the engine,
and numpy's and Python's, seeded here from (seed, rank): distinct per rank, the same at every rerun,
and saved in every snapshot (``run/checkpoint.py``).
"""

from __future__ import annotations

import itertools
import random
from contextlib import contextmanager
from typing import Callable, Iterator

import numpy as np
import torch
from torch.utils.data import Dataset, Sampler, default_collate, get_worker_info

# Tags that keep each use's seeds apart from every other's drawn from the same numbers
TRAIN, EVAL, RANK, LOADER = 0x7EA1, 0xE7A1, 0x5A4C, 0x10AD


def _words(key: tuple[int, ...], n: int) -> np.ndarray:
    """``n`` uint32 words mixed from ``key`` (any ints; a negative --seed is taken modulo 2**64)."""
    return np.random.SeedSequence([k % 2**64 for k in key]).generate_state(n, np.uint32)


def seed_of(key: tuple[int, ...]) -> int:
    """One 64-bit seed mixed from ``key``."""
    w = _words(key, 2)
    return int(w[0]) | int(w[1]) << 32


def seed_generators(key: tuple[int, ...]) -> None:
    """Seed this process's torch (CPU), numpy and Python global generators from ``key``, each its own
    number. torch's CPU generator alone: ``torch.manual_seed`` would also reseed the rank's CUDA
    generators, which the fetch at ``--num-workers 0`` does not set aside."""
    w = _words(key, 8)
    torch.default_generator.manual_seed(int(w[0]) | int(w[1]) << 32)
    np.random.seed(w[2:6])
    random.seed(int(w[6]) | int(w[7]) << 32)


def seed_rank(seed: int, rank: int) -> None:
    """numpy's and Python's global generators of this rank, from (seed, rank): a rank started from a
    forked process holds its parent's numpy state, the same on every rank and new at every run."""
    w = _words((seed, rank, RANK), 6)
    np.random.seed(w[:4])
    random.seed(int(w[4]) | int(w[5]) << 32)


@contextmanager
def generators_set_aside() -> Iterator[None]:
    """This process's torch (CPU), numpy and Python global generators as they were, afterwards."""
    saved = torch.default_generator.get_state(), np.random.get_state(), random.getstate()
    try:
        yield
    finally:
        torch.default_generator.set_state(saved[0])
        np.random.set_state(saved[1])
        random.setstate(saved[2])


class KeyedBatch(list):
    """One batch's sample indices, with the key its generators are seeded from (pickled with it to a worker)."""

    def __init__(self, indices, key: tuple[int, ...]):
        super().__init__(indices)
        self.key = key


class KeyedBatches(Sampler):
    """``sampler``'s indices in batches of ``batch``, each a :class:`KeyedBatch` keyed ``(*key, j)`` for
    the j-th batch of the pass; a pass starts at batch ``start`` (a mid-epoch resume, without reading
    the samples before it). ``key`` and ``start`` may change between passes: a persistent DataLoader
    keeps this one object."""

    def __init__(self, sampler, batch: int, drop_last: bool, key: tuple[int, ...] = ()):
        self.sampler, self.batch, self.drop_last = sampler, batch, drop_last
        self.key, self.start = key, 0

    def __iter__(self) -> Iterator[KeyedBatch]:
        key, b = self.key, self.batch  # as they are when the pass begins
        indices = itertools.islice(iter(self.sampler), self.start * b, None)
        for j in itertools.count(self.start):
            chunk = list(itertools.islice(indices, b))
            if not chunk or (self.drop_last and len(chunk) < b):
                return
            yield KeyedBatch(chunk, (*key, j))

    def __len__(self) -> int:
        n = max(0, len(self.sampler) - self.start * self.batch)
        return n // self.batch if self.drop_last else -(-n // self.batch)


class SeededFetch(Dataset):
    """``data`` fetched a batch at a time: ``self[batch]`` is ``collate([data[i] for i in batch])``
    (or ``data.__getitems__(batch)`` collated, where the dataset has one), drawn from generators
    seeded from ``batch.key``. The collate runs here too, so its draws are the batch's as well."""

    def __init__(self, data: Dataset, collate_fn: Callable | None = None):
        self.data, self.collate = data, collate_fn or default_collate

    def __len__(self) -> int:
        return len(self.data)

    def __getitem__(self, batch: KeyedBatch):
        if get_worker_info() is not None:  # a worker: its generators serve the batches it is sent, nothing else
            seed_generators(batch.key)
            return self._fetch(batch)
        with generators_set_aside():  # the rank itself: its own streams are the snapshot's
            seed_generators(batch.key)
            return self._fetch(batch)

    def _fetch(self, batch: KeyedBatch):
        getitems = getattr(self.data, "__getitems__", None)
        samples = getitems(list(batch)) if getitems else [self.data[i] for i in batch]
        return self.collate(samples)


def as_is(batch):
    """The DataLoader's collate_fn over :class:`SeededFetch`, whose items are whole batches already."""
    return batch
