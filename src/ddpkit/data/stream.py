"""An ``IterableDataset`` as training data: each rank (and each of its loader workers) reads its own share
of the stream, a whole number of batches per epoch, and a resume goes on at the same batch.

The sharding contract. The stream is cut into ``count = world size x loader workers`` shards; shard
``index = rank x workers + worker`` is this process's. A dataset that can read its own shard alone (its
files, its rows) asks for it with :func:`stream_shard` at the start of ``__iter__`` and yields only that
shard; ddpkit then takes what it yields. A dataset that does not ask is read whole by every shard, and
ddpkit keeps every ``count``-th item from ``index`` on: correct, but each item is read ``count`` times.
Each shard takes ``len(dataset) // count`` items an epoch (its ``__len__`` is the epoch's items over
every rank), so every rank runs the same number of steps with no collective to agree on it; a shard that
yields fewer is one line naming it.

    class Tokens(IterableDataset):
        def __len__(self): return self.total
        def __iter__(self):
            index, count = ddpkit.data.stream_shard()
            rows = self.rows[index::count]                        # this shard's rows
            yield from rows[ddpkit.data.stream_start():]          # after those a resumed epoch trained on

Epochs, resume and randomness. ``set_epoch(epoch)`` is called on the dataset, when it has one, before
each pass. The dataset's random draws come from generators seeded for the shard and epoch alone (seed,
epoch, rank, worker), in the worker, or in the rank set aside from its own streams, so a pass is the same
at every rerun. A resume at step s of an epoch starts each shard after the items it had trained on: a
dataset that asks :func:`stream_start` seeks there itself; otherwise ddpkit reads them again and drops
them, their draws replayed, and goes on exactly. The loader's workers take turns from the one whose turn
step s was, so the batches come in the uninterrupted order. At another world size the shards are other
ones: the epoch goes on after as many samples, not the same ones. Evaluation needs each sample once, by
index: ``test_data`` (and ``val_data``) stay map-style.
"""

from __future__ import annotations

from typing import Iterator

from torch.utils.data import IterableDataset, get_worker_info

from ..errors import DataError
from .seeds import seed_generators, stream_key

# The shard being read in this process: (index, count), whether the dataset asked for it, the shard's items
# already trained on this epoch, whether the dataset asked for that
_shard: list = [None, False, 0, False]


def stream_shard() -> tuple[int, int]:
    """``(index, count)``: the shard of the stream this process reads, when called in an ``IterableDataset``'s
    ``__iter__`` run by ddpkit; ``(0, 1)`` elsewhere. Calling it tells ddpkit the dataset yields that shard
    alone (see the module docstring)."""
    if _shard[0] is None:
        return 0, 1
    _shard[1] = True
    return _shard[0]


def stream_start() -> int:
    """How many items of its shard this epoch has trained on already (0 but after a resume), when called in
    ``__iter__`` run by ddpkit. Calling it tells ddpkit the dataset starts its shard after them (it seeks);
    otherwise ddpkit reads them again and drops them. A dataset that seeks and draws at random keys its draws
    by item (a replay would draw them again in order)."""
    if _shard[0] is None:
        return 0
    _shard[3] = True
    return _shard[2]


class Shard(IterableDataset):
    """``data``'s share for one rank: in each loader worker (or the rank), its shard's first ``quota`` items."""

    def __init__(self, data: IterableDataset, rank: int, world: int, workers: int, quota: int, seed: int, batch: int):
        self.data, self.rank, self.world, self.workers = data, rank, world, max(1, workers)
        self.quota, self.seed, self.batch, self.epoch = quota, seed, batch, 0
        self.start = 0  # the rank's batches of this epoch already trained on (a resume)

    def __iter__(self) -> Iterator:
        info = get_worker_info()
        # The DataLoader takes batches from its workers in turn, from worker 0 on; after a resume at batch s the
        # shard worker 0 reads is the one whose turn batch s was, so the batches come in the uninterrupted order.
        worker = ((info.id if info is not None else 0) + self.start) % self.workers
        index, count = self.rank * self.workers + worker, self.world * self.workers
        done = len(range(worker, self.start, self.workers)) * self.batch  # this shard's items trained on already
        if info is not None:  # a worker: its generators are the shard's (the rank's are set aside: StreamSource)
            seed_generators(stream_key(self.seed, self.epoch, self.rank, worker))
        if hasattr(self.data, "set_epoch"):
            self.data.set_epoch(self.epoch)
        _shard[:] = [(index, count), False, done, False]
        try:
            skipped = taken = 0
            for j, item in enumerate(self.data):  # its __iter__ runs at the first item: it has asked by then
                if taken == self.quota - done:
                    return
                if not (_shard[1] or j % count == index):
                    continue  # another shard's item, in a dataset read whole by every shard
                if not _shard[3] and skipped < done:
                    skipped += 1  # trained on before the resume: read again (the draws replayed), dropped
                    continue
                taken += 1
                yield item
        finally:
            _shard[:] = [None, False, 0, False]


def first_items(data, n: int) -> list:
    """The first ``n`` samples of ``data``: by index, or a stream's first items (read with no shard: what a
    dataset yields at ``(0, 1)``)."""
    if not isinstance(data, IterableDataset):
        return [data[i] for i in range(min(n, len(data)))]
    items = []
    for item in data:
        items.append(item)
        if len(items) == n:
            break
    return items


def check_stream(data, which: str) -> None:
    """An ``IterableDataset`` ddpkit can run: with ``__len__`` (its items per epoch, over every rank)."""
    try:
        n = len(data)
    except TypeError:
        raise DataError(
            f"{which} is an IterableDataset without __len__: give it one (its items per epoch, over every rank), "
            f"so each rank runs the same number of steps without a collective per step to agree on it"
        ) from None
    if n <= 0:
        raise DataError(f"{which} is an IterableDataset whose __len__ is {n}: there is nothing to train on")
