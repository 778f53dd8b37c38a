"""The random draws of a user's data on the DataLoader path: the keys travel with each batch to the
process that reads it, and each read is seeded from its own (the seeds themselves: ``data/seeds.py``).

A dataset that draws random numbers in ``__getitem__`` (augmentation, a random window) or a
``collate_fn`` that does (MixUp) draws from torch's, numpy's and Python's global generators in the
process that fetches the batch: a DataLoader worker, or the rank itself with ``--num-workers 0``.
Left to torch, a worker's generators are seeded once, when it starts, from a number the rank draws
at the loader's first iteration, and then run on through every batch the worker is sent (batch k of
the iteration goes to worker k mod W). Nothing of that survives a resume: the resumed run's workers
start afresh at the resume's batch, which they also share out differently; and with no workers, the
iteration's draw shifts the rank's own stream by one number at the resume.

So each sample is read from generators seeded for that sample alone, from its key: (seed, epoch, sample
index in the dataset) for training, (seed, sample index) for evaluation (the same draws at every
evaluation). A sample's draws are then the same whichever rank and process reads it, in whichever batch
position, at any world size, after a resume at any step, with any number of workers, 0 included: there
the rank's own generators are set aside for the fetch and put back after, so its dropout stream is its
own and the snapshot's. The batch's ``collate_fn`` is then run under generators seeded again, for the
batch: (seed, epoch, rank, batch index in the epoch), (seed, rank, batch index) in evaluation; so is a
dataset's own batched ``__getitems__``, which reads the batch's samples in one call. Those draws belong
to the rank's batch: each rank's are its own, and another world size cuts other batches.

The indices and both keys travel with the batch to the worker (:class:`KeyedBatch`), since a worker is
told nothing else of where it is. What a sample's seeding costs: ``data/seeds.py``.
"""

from __future__ import annotations

import itertools
from typing import Callable, Iterator

from torch.utils.data import Dataset, Sampler, Subset, default_collate, get_worker_info

from .seeds import (
    generators_set_aside,
    seed_batch,
    seed_sample,
)


class KeyedBatch(list):
    """One batch's sample indices, with the key its collate is seeded from and the key prefix each of its
    samples is (pickled with it to a worker)."""

    def __init__(self, indices, key: tuple[int, ...], samples: tuple[int, ...] = ()):
        super().__init__(indices)
        self.key, self.samples = key, samples


class KeyedBatches(Sampler):
    """``sampler``'s indices in batches of ``batch``, each a :class:`KeyedBatch` keyed ``(*key, j)`` for
    the j-th batch of the pass, its samples ``(*samples, i)``; a pass starts at batch ``start`` (a mid-epoch
    resume, without reading the samples before it). ``key``, ``samples`` and ``start`` may change between
    passes: a persistent DataLoader keeps this one object."""

    def __init__(self, sampler, batch: int, drop_last: bool, key: tuple[int, ...] = (), samples: tuple[int, ...] = ()):
        self.sampler, self.batch, self.drop_last = sampler, batch, drop_last
        self.key, self.samples, self.start = key, samples, 0

    def __iter__(self) -> Iterator[KeyedBatch]:
        key, samples, b = self.key, self.samples, self.batch  # as they are when the pass begins
        indices = itertools.islice(iter(self.sampler), self.start * b, None)
        for j in itertools.count(self.start):
            chunk = list(itertools.islice(indices, b))
            if not chunk or (self.drop_last and len(chunk) < b):
                return
            yield KeyedBatch(chunk, (*key, j), samples)

    def __len__(self) -> int:
        n = max(0, len(self.sampler) - self.start * self.batch)
        return n // self.batch if self.drop_last else -(-n // self.batch)


def batched_reader(data: Dataset) -> Callable | None:
    """The dataset's own ``__getitems__`` (one call reads a whole batch), or None where samples are read
    one by one: torch's ``Subset`` has one that only defers to its dataset's, so it counts as its dataset's."""
    while isinstance(data, Subset):
        if not callable(getattr(data.dataset, "__getitems__", None)):
            return None
        data = data.dataset
    getitems = getattr(data, "__getitems__", None)
    return getitems if callable(getitems) else None


def read_samples(data: Dataset, indices: list[int], sample_key: tuple[int, ...], batch_key: tuple[int, ...]) -> list:
    """``data``'s samples at ``indices``, each read under its own seeds (``(*sample_key, i)``); a dataset's
    own ``__getitems__`` is called once, under the batch's (``batch_key``)."""
    getitems = batched_reader(data)
    if getitems is not None:
        seed_batch(batch_key, batched=True)
        return list(data.__getitems__(list(indices)))  # through a Subset's, which maps the indices
    out = []
    for i in indices:
        seed_sample(sample_key, i)
        out.append(data[i])
    return out


class SeededFetch(Dataset):
    """``data`` fetched a batch at a time: ``self[batch]`` is ``collate([data[i] for i in batch])`` (or
    ``data.__getitems__(batch)`` collated, where the dataset has one), each sample read under its own seeds
    (``batch.samples``), the collate under the batch's (``batch.key``)."""

    def __init__(self, data: Dataset, collate_fn: Callable | None = None):
        self.data, self.collate = data, collate_fn or default_collate

    def __len__(self) -> int:
        return len(self.data)

    def __getitem__(self, batch: KeyedBatch):
        if get_worker_info() is not None:  # a worker: its generators serve the batches it is sent, nothing else
            return self._fetch(batch)
        with generators_set_aside():  # the rank itself: its own streams are the snapshot's
            return self._fetch(batch)

    def _fetch(self, batch: KeyedBatch):
        samples = read_samples(self.data, list(batch), batch.samples, batch.key)
        seed_batch(batch.key)  # what the collate draws is the batch's
        return self.collate(samples)


def as_is(batch):
    """The DataLoader's collate_fn over :class:`SeededFetch`, whose items are whole batches already."""
    return batch
