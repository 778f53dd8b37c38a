"""A user's DataLoader, split into this rank's share and resumable at any batch: what
``Loop.data()`` returns (:mod:`ddpkit.loop`).

    loader = ShardedLoader(dataset, ctx, batch_size=32, shuffle=True)   # batch_size: this rank's
    for epoch in range(2):
        loader.set_epoch(epoch)        # optional: a pass that ends moves to the next epoch by itself
        for x, y in loader: ...
    loader.state_dict()                # {"epoch": e, "batch": b}: b batches of epoch e handed out

The order is torch's own ``DistributedSampler`` (the same object, with its ``shuffle``, ``seed``
and ``drop_last``, padded as it pads), cut into batches as the user's DataLoader cut them
(``batch_size``, ``drop_last``), and collated by the user's ``collate_fn``. So a loop ported from
``DataLoader(..., sampler=DistributedSampler(ds))`` reads exactly the samples it read before.

Random draws. With ``num_workers=0`` the dataset and the collate draw from the rank's own
generators, as they do in a plain DataLoader; the snapshot saves those generators, so a resume is
exact. A plain DataLoader also draws one number from the rank's torch generator each time a pass
starts (its workers' base seed); this loader draws it too, at the start of each epoch only, so the
rank's stream is the plain loop's, and a mid-epoch resume does not draw it twice. With workers,
each sample is read under generators seeded for that sample alone, from (seed, epoch, sample index),
and each batch collated under the batch's, from (seed, epoch, rank, batch) (:mod:`ddpkit.data.draws`,
:mod:`ddpkit.data.seeds`), the only way its draws are the same after a resume; the ``[start]`` line
says so.
"""

from __future__ import annotations

from typing import Any, Callable, Iterator

from torch.utils.data import (
    DataLoader,
    Dataset,
    DistributedSampler,
    IterableDataset,
    RandomSampler,
    SequentialSampler,
    default_collate,
)

from ..errors import ConfigError, article
from ..ranks.context import DistContext
from .batch import to_device
from .draws import KeyedBatches
from .loader import seeded_loader, unwrapped
from .seeds import discarded_generator, plain_loader_draw, train_keys


class ShardedLoader:
    """``dataset`` in this rank's share, in batches of ``batch_size`` (this rank's, as with a
    DistributedSampler), at a position that is saved and loaded with :meth:`state_dict`."""

    def __init__(
        self,
        dataset: Dataset,
        ctx: DistContext,
        *,
        batch_size: int,
        shuffle: bool = True,
        drop_last: bool = False,
        seed: int = 0,
        even: bool = False,
        collate_fn: Callable | None = None,
        num_workers: int = 0,
        worker_init_fn: Callable | None = None,
        pin_memory: bool = False,
        to_device: bool = True,
    ):
        if isinstance(dataset, IterableDataset):
            raise ConfigError(
                "Loop.data() takes a map-style dataset (with __len__ and __getitem__), not an IterableDataset: "
                "an IterableDataset shards itself; iterate it in your loop as you do today"
            )
        if not isinstance(batch_size, int) or batch_size < 1:
            raise ConfigError(f"Loop.data(): batch_size must be a positive int (each rank's batch), got {batch_size!r}")
        self.dataset, self.ctx, self.batch_size = dataset, ctx, batch_size
        self.shuffle, self.drop_last, self.seed, self.to_device = shuffle, drop_last, seed, to_device
        self.num_workers = num_workers
        # even=True (the sampler's drop_last): the tail that does not divide by the world size is dropped,
        # not padded with repeated samples; Loop.evaluate() uses its own unpadded split instead.
        self.sampler = DistributedSampler(
            dataset, num_replicas=ctx.world_size, rank=ctx.rank, shuffle=shuffle, seed=seed, drop_last=even
        )
        self.batches = KeyedBatches(self.sampler, batch_size, drop_last)
        self.epoch, self.batch = 0, 0
        self._resume_at = 0  # where the next pass starts: a loaded snapshot's batch, once
        # The batches read, all passes, and their samples (a Loop's samples/s, and its check that its epochs step):
        # counted by position, each (epoch, batch) once, so a peek's batch (next(iter(loader))), given again as the
        # pass's first, counts once; and by the sampler's share, not the batch's shapes (a collate_fn's own batch
        # type, tuple(zip(*b)), has none to count by)
        self.yielded, self.samples, self._furthest = 0, 0, (0, 0)
        if num_workers:  # each sample read, and each batch collated, under its own seeds, in whichever worker
            self.loader = seeded_loader(
                dataset, self.batches, seed, ctx.rank, num_workers, pin_memory, collate_fn, worker_init_fn
            )
        else:
            # As the user's DataLoader would read them: in this process, on the rank's own generators.
            # Its base-seed draw is made by __iter__ (see the module docstring), not by a generator here.
            kwargs = {"collate_fn": collate_fn} if collate_fn is not None else {}
            self.loader = DataLoader(
                dataset, batch_sampler=self.batches, pin_memory=pin_memory, generator=discarded_generator(), **kwargs
            )

    @classmethod
    def from_dataloader(cls, loader: DataLoader, ctx: DistContext, **overrides: Any) -> "ShardedLoader":
        """The DataLoader's dataset, batch size, shuffle, collate, workers and drop_last, split over ranks."""
        if loader.batch_size is None:
            raise ConfigError(
                "Loop.data() got a DataLoader with batch_size=None (or a batch_sampler of its own): pass the "
                "dataset and batch_size= instead, e.g. loop.data(dataset, batch_size=32)"
            )
        sampler = loader.sampler
        plain_random = isinstance(sampler, RandomSampler) and not sampler.replacement and sampler._num_samples is None
        if not (type(sampler) is SequentialSampler or plain_random or isinstance(sampler, DistributedSampler)):
            raise ConfigError(
                f"Loop.data() got a DataLoader whose sampler is {article(type(sampler).__name__)}: it reads the "
                f"dataset in DistributedSampler's order instead, which would not be yours. Pass shuffle=True or "
                f"False (no sampler), or split the dataset first (torch.utils.data.Subset) and pass that"
            )
        settings = {
            "batch_size": loader.batch_size,
            "shuffle": plain_random or (isinstance(sampler, DistributedSampler) and sampler.shuffle),
            "drop_last": loader.drop_last,
            "collate_fn": None if loader.collate_fn is default_collate else loader.collate_fn,
            "num_workers": loader.num_workers,
            "worker_init_fn": loader.worker_init_fn,
            "pin_memory": loader.pin_memory,
        }
        if isinstance(sampler, DistributedSampler):  # the user's own: its seed and its drop_last (no padding)
            settings.update(seed=sampler.seed, even=sampler.drop_last)
        settings.update(overrides)
        return cls(loader.dataset, ctx, **settings)

    def __len__(self) -> int:
        """Batches per epoch on this rank."""
        n = len(self.sampler)
        return n // self.batch_size if self.drop_last else -(-n // self.batch_size)

    def _size_of(self, index: int) -> int:
        """How many samples batch ``index`` of a pass holds: the batch size, but the last one's of a pass that
        keeps its short tail."""
        return self.batch_size if self.drop_last else min(self.batch_size, len(self.sampler) - index * self.batch_size)

    def set_epoch(self, epoch: int) -> None:
        """As ``DistributedSampler.set_epoch``; the epoch the loader is in already keeps its position."""
        if epoch != self.epoch:
            self.epoch, self.batch, self._resume_at = int(epoch), 0, 0

    def __iter__(self) -> Iterator:
        # As a DataLoader: every iter() starts the epoch's pass at its first batch, so a peek with
        # next(iter(loader)) costs nothing later. After a snapshot was loaded mid-epoch, "first" is the
        # snapshot's batch, until that epoch's pass ends: the uninterrupted run made its iter() calls of this
        # epoch (and their draws below) before the snapshot, so the resumed run's make none.
        start = self._resume_at
        if start == 0:
            # The plain DataLoader's draw of its workers' base seed, from the rank's torch generator
            # (torch.utils.data.dataloader._BaseDataLoaderIter): the same stream as the plain loop's.
            plain_loader_draw()
        self.sampler.set_epoch(self.epoch)
        self.batch = start
        self.batches.start = start
        self.batches.key, self.batches.samples = train_keys(self.seed, self.epoch, self.ctx.rank)
        for batch in unwrapped(self.loader):
            self.batch += 1  # before the yield: a snapshot taken in the loop's body counts this batch as read
            if (self.epoch, self.batch) > self._furthest:
                self._furthest = (self.epoch, self.batch)
                self.yielded += 1
                self.samples += self._size_of(self.batch - 1)
            yield to_device(batch, self.ctx.device) if self.to_device else batch
        # a whole pass: the next one is the next epoch's order, from its start
        self.epoch, self.batch, self._resume_at = self.epoch + 1, 0, 0

    def batch_at(self, epoch: int, index: int) -> Any:
        """Batch ``index`` of ``epoch``'s pass, read apart from this loader's position and counts, and without a
        pass's draw from the rank's generator (a replica group reading the share of a group that is gone)."""
        self.sampler.set_epoch(epoch)
        self.batches.start = index
        self.batches.key, self.batches.samples = train_keys(self.seed, epoch, self.ctx.rank)
        batch = next(iter(unwrapped(self.loader)))
        return to_device(batch, self.ctx.device) if self.to_device else batch

    def state_dict(self) -> dict:
        return {
            "epoch": self.epoch,
            "batch": self.batch,
            "world_size": self.ctx.world_size,
            "batch_size": self.batch_size,
        }

    def load_state_dict(self, state: dict) -> tuple[int, int] | None:
        """Load a saved position; return the saved (world size, each rank's batch) when the global batch they
        make is not this loader's (the caller says so: each step then reads another number of samples), else
        None."""
        self.epoch, self.batch = int(state["epoch"]), int(state["batch"])
        old_world = int(state.get("world_size", self.ctx.world_size))
        old_batch = int(state.get("batch_size", self.batch_size))
        changed = old_world * old_batch != self.ctx.world_size * self.batch_size
        if (old_world, old_batch) != (self.ctx.world_size, self.batch_size) and self.batch:
            # Another world size: another split. Carry on after as many samples of the epoch's order as the old
            # world read (said by Loop in its one line). Counted in samples, not batches: a loop that keeps its
            # global batch (each rank's = global / world) reads the very samples of each step it would have.
            read = self.batch * old_batch * old_world
            self.batch = min(len(self), read // (self.batch_size * self.ctx.world_size))
        self._resume_at = self.batch
        return (old_world, old_batch) if changed else None
