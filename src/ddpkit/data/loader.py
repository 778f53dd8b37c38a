"""Batch sources: the same epoch order and augmentation on every path.

* :class:`ResidentSource` holds the uint8 train set in memory and makes batches by
  indexing: on the device when it fits (``--data-path device``), or in host memory
  (``host``), where :class:`HostStager` gathers each batch into one of two reused
  staging buffers and copies it to the device, the next batch's copy overlapping the
  current step on CUDA.
* :class:`LoaderSource` is the classic DataLoader + DistributedSampler (``loader``), for
  datasets that do not fit in memory (imagefolder), the user's own Dataset, and any dataset
  given with a ``collate_fn`` (only a DataLoader calls it). Each of its samples is read under
  generators seeded for that sample alone, and each batch collated under the batch's
  (``data/draws.py``, ``data/seeds.py``), so what the dataset draws at random is the same after a
  resume, at any number of workers, and (in ``__getitem__``) at any world size.

Both follow DistributedSampler(shuffle=True, drop_last=True) semantics: each epoch's
permutation comes from (seed, epoch), every rank takes every world_size-th index, and
no sample is used twice in an epoch. Both drop the last partial batch, so every rank
runs the same number of steps and shapes stay static (CUDA graphs, compile). With
gradient accumulation a step is ``group`` micro-batches, and the epoch ends on a whole
step.

Image datasets (those with a :class:`Meta`) yield ``(images, labels)`` augmented and
normalised on the device; any other dataset yields its batches as its DataLoader
collates them (the user's ``collate_fn`` if given), moved to the device whatever their
structure.

    src = make_train_source(splits, cfg, ctx, per_rank_batch)
    for batch in src.batches(epoch, start_step=0): ...
"""

from __future__ import annotations

import functools
import itertools
import os
import signal
import sys
import threading
from typing import Iterator

import torch
from torch.utils.data import DataLoader, Dataset, DistributedSampler, IterableDataset, Sampler, Subset

from ..config import TrainConfig
from ..errors import ConfigError, DataError, DdpkitError
from ..ranks.context import DistContext, cpu_threads
from .augment import CROP_PAD, Normalize, crop_flip, epoch_params
from .batch import tensor_leaves, to_device, tree_map
from .draws import KeyedBatches, SeededFetch, as_is, batched_reader
from .seeds import (
    PrivateGenerators,
    eval_keys,
    loader_generator,
    order_generator,
    seed_loader_epoch,
    stream_key,
    train_keys,
)
from .stream import Shard
from .types import DataSplits, ImageData, Meta, TensorData


def epoch_order(
    n: int, world: int, rank: int, seed: int, epoch: int, drop_last: bool = True, shuffle_block: int = 0
) -> torch.Tensor:
    """This rank's sample indices for ``epoch``: torch's ``DistributedSampler(shuffle=True, drop_last=True)``
    itself, the order a plain DDP loop reads (not a copy of it: the one epoch order, for every data path).

    Two variants it has no form of are ddpkit's, on the same permutation (``data/seeds.order_generator``:
    seed + epoch, as the sampler's; held equal by tests/data/test_data_loader.py): ``drop_last=False``, every
    index once, the ranks' shares differing by at most one (``--join``); and ``shuffle_block`` B > 1 (one
    micro-batch of every rank, in samples), which reorders the samples of every whole block of B among
    themselves (``shuffle_in_batch``, ddpkit check's noise run): each micro-batch holds the same samples, in
    another order."""
    if drop_last and shuffle_block <= 1:
        sampler = DistributedSampler(range(n), num_replicas=world, rank=rank, shuffle=True, seed=seed, drop_last=True)
        sampler.set_epoch(epoch)
        return torch.tensor(list(sampler), dtype=torch.long)
    gen = order_generator(seed, epoch)
    perm = torch.randperm(n, generator=gen)
    if shuffle_block > 1:
        perm = shuffled_within(perm, shuffle_block, gen)
    total = (n // world) * world if drop_last else n
    return perm[rank:total:world]


def shuffled_within(perm: torch.Tensor, block: int, gen: torch.Generator) -> torch.Tensor:
    """``perm`` with each whole block of ``block`` entries in another order drawn from ``gen``, never
    the block's own (a drawn identity is reversed); a partial block at the end as it was."""
    whole = len(perm) // block * block
    if not whole:
        return perm
    order = torch.rand(whole // block, block, generator=gen).argsort(dim=1)
    same = (order == torch.arange(block)).all(dim=1)
    order[same] = order[same].flip(1)
    return torch.cat([perm[:whole].view(-1, block).gather(1, order).view(-1), perm[whole:]])


def float_dtype(cfg: TrainConfig) -> torch.dtype:
    """The dtype ``--dtype`` asks for (float32 unless float64)."""
    return torch.float64 if getattr(cfg, "dtype", "float32") == "float64" else torch.float32


class Preprocess:
    """uint8 batch on the device -> augmented (train) or plain (eval) normalised float batch.

    With ``dtype`` float64 the image batch comes out in float64, and so do the floating
    tensors of any other batch (:meth:`cast`); float32 leaves the user's tensors as they are.
    """

    def __init__(
        self, meta: Meta | None, device: torch.device, channels_last: bool, dtype: torch.dtype = torch.float32
    ):
        self.meta, self.dtype = meta, dtype
        self.norm = Normalize(meta.mean, meta.std, device, channels_last) if meta else None
        self.pad = CROP_PAD if meta and meta.augment == "crop-flip" else 0

    @classmethod
    def for_config(cls, meta: Meta | None, device: torch.device, cfg: TrainConfig) -> "Preprocess":
        """As ``cfg`` asks: ``--channels-last`` and ``--dtype``."""
        return cls(meta, device, bool(cfg.channels_last), float_dtype(cfg))

    def train(self, x: torch.Tensor, offsets: torch.Tensor, flips: torch.Tensor) -> torch.Tensor:
        if self.norm is None:  # a user Dataset that already yields float tensors
            return x
        if self.meta.augment != "none":
            x = crop_flip(x, offsets, flips, self.pad)
        return self.norm(x).to(self.dtype)

    def eval(self, x: torch.Tensor) -> torch.Tensor:
        return x if self.norm is None else self.norm(x).to(self.dtype)

    def cast(self, batch):
        """A user's batch with its floating tensors in float64 when that is asked for."""
        if self.dtype == torch.float32:
            return batch
        return tree_map(lambda t: t.to(self.dtype) if t.is_floating_point() else t, batch)


class _Source:
    """What both paths share: the epoch geometry and the per-sample augmentation draws."""

    path = "?"

    def __init__(
        self, n: int, meta: Meta | None, cfg: TrainConfig, ctx: DistContext, per_rank_batch: int, group: int = 1
    ):
        self.n, self.meta, self.cfg, self.ctx, self.batch = n, meta, cfg, ctx, per_rank_batch
        self.per_rank = n // ctx.world_size
        self.steps_per_epoch = self.per_rank // (per_rank_batch * group) * group  # whole groups only
        self.pre = Preprocess.for_config(meta, ctx.device, cfg)
        # The block shuffle_in_batch reorders within, in samples: one micro-batch of every rank (at world 1,
        # where check's noise run trains, exactly one micro-batch). Not the whole accumulated step: a sample
        # moved to another micro-batch would change what a batch-coupled model computes, not only the order.
        self.shuffle_block = per_rank_batch * ctx.world_size if getattr(cfg, "shuffle_in_batch", False) else 0

    def epoch_indices(self, epoch: int) -> torch.Tensor:
        """This rank's sample indices for ``epoch``, in the order its batches take them (what
        ``ddpkit check`` counts): every index the epoch's steps use, and no other."""
        order = epoch_order(self.n, self.ctx.world_size, self.ctx.rank, self.cfg.seed, epoch, True, self.shuffle_block)
        return order[: self.used]

    @property
    def used(self) -> int:
        return self.steps_per_epoch * self.batch

    def _params(self, epoch: int):
        """This rank's epoch of augmentation draws, in the order its batches take the samples."""
        offsets, flips = epoch_params(self.n, self.cfg.seed, epoch, self.meta.augment if self.meta else "none")
        mine = self.epoch_indices(epoch)
        return offsets[mine].to(self.ctx.device), flips[mine].to(self.ctx.device)


class HostStager:
    """Batches gathered from host memory into two reused staging buffers, then copied to the device.

    The train set itself stays in pageable memory: pinning it all would double it in
    page-locked RAM on every rank for nothing, since indexing a pinned tensor returns
    pageable memory anyway. On CUDA the two staging buffers are pinned and each copy runs on
    a side stream, so batch k+1's transfer overlaps step k's compute; the compute stream
    waits on that copy's event alone, and a buffer is refilled only once its previous copy
    (two batches back) has finished. On CPU the same code gathers and copies, so CI runs it.
    """

    def __init__(self, images: torch.Tensor, labels: torch.Tensor, batch: int, device: torch.device):
        self.images, self.labels, self.device = images, labels, device
        cuda = device.type == "cuda"
        self.buffers = [
            (
                torch.empty((batch, *images.shape[1:]), dtype=images.dtype, pin_memory=cuda),
                torch.empty((batch,), dtype=labels.dtype, pin_memory=cuda),
            )
            for _ in range(2)
        ]
        self.stream = torch.cuda.Stream(device) if cuda else None
        self.copied: list = [None, None]  # per buffer: the CUDA event of its last copy
        self.slot = 0

    def copy(self, idx: torch.Tensor) -> tuple:
        """Gather samples ``idx`` and start their copy to the device; hand the result to :meth:`ready`."""
        slot, self.slot = self.slot, self.slot ^ 1
        xb, yb = self.buffers[slot]
        if self.copied[slot] is not None:
            self.copied[slot].synchronize()  # never overwrite a buffer the copy engine is still reading
        torch.index_select(self.images, 0, idx, out=xb)
        torch.index_select(self.labels, 0, idx, out=yb)
        if self.stream is None:
            return xb.clone(), yb.clone(), None  # the buffer is refilled two batches on
        with torch.cuda.stream(self.stream):
            x, y = xb.to(self.device, non_blocking=True), yb.to(self.device, non_blocking=True)
            event = torch.cuda.Event()
            event.record(self.stream)
        self.copied[slot] = event
        return x, y, event

    def ready(self, handle: tuple) -> tuple[torch.Tensor, torch.Tensor]:
        """The batch, safe to use on the current stream."""
        x, y, event = handle
        if event is not None:
            stream = torch.cuda.current_stream(self.device)
            stream.wait_event(event)
            # x and y were allocated on the side stream: keep the allocator from reusing them early.
            x.record_stream(stream)
            y.record_stream(stream)
        return x, y


def resident_path(ctx: DistContext) -> str:
    """The name of the path that holds the data where the step runs: "device-resident" on a GPU; on the CPU,
    where the device is the host's memory, "in-memory" (device-resident read as GPU memory there)."""
    return "device-resident" if ctx.device.type != "cpu" else "in-memory"


class ResidentSource(_Source):
    def __init__(
        self,
        data: ImageData,
        meta: Meta,
        cfg: TrainConfig,
        ctx: DistContext,
        per_rank_batch: int,
        on_device: bool,
        group: int = 1,
    ):
        super().__init__(len(data), meta, cfg, ctx, per_rank_batch, group)
        self.on_device = on_device
        self.path = resident_path(ctx) if on_device else "host-staged"
        if on_device:
            self.images, self.labels = data.images.to(ctx.device), data.labels.to(ctx.device)
        else:
            self.images, self.labels = data.images, data.labels
            self.stager = HostStager(data.images, data.labels, per_rank_batch, ctx.device)

    def batches(self, epoch: int, start_step: int = 0) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        order = self.epoch_indices(epoch)
        offsets, flips = self._params(epoch)
        b, steps = self.batch, self.steps_per_epoch
        if self.on_device:
            order = order.to(self.ctx.device)  # one small copy per epoch; every batch after is on-device indexing
            for step in range(start_step, steps):
                idx = order[step * b : (step + 1) * b]
                yield (
                    self.pre.train(
                        self.images[idx], offsets[step * b : (step + 1) * b], flips[step * b : (step + 1) * b]
                    ),
                    self.labels[idx],
                )
            return
        pending = self.stager.copy(order[start_step * b : (start_step + 1) * b]) if start_step < steps else None
        for step in range(start_step, steps):
            x, y = self.stager.ready(pending)
            if step + 1 < steps:
                pending = self.stager.copy(order[(step + 1) * b : (step + 2) * b])  # overlaps this step's compute
            yield self.pre.train(x, offsets[step * b : (step + 1) * b], flips[step * b : (step + 1) * b]), y


class TensorSource(_Source):
    """A TensorData (a TensorDataset, or a materialised user dataset) batched by indexing on the device:
    the very batches the DataLoader path collates, without a DataLoader."""

    on_device = True

    def __init__(self, data: TensorData, cfg: TrainConfig, ctx: DistContext, per_rank_batch: int, group: int = 1):
        self.path = resident_path(ctx)
        super().__init__(len(data), None, cfg, ctx, per_rank_batch, group)
        self.data = data.to(ctx.device)

    def batches(self, epoch: int, start_step: int = 0) -> Iterator:
        order = self.epoch_indices(epoch).to(self.ctx.device)
        b = self.batch
        for step in range(start_step, self.steps_per_epoch):
            yield self.pre.cast(self.data.take(order[step * b : (step + 1) * b]))


class OrderSampler(Sampler):
    """:func:`epoch_order` as a sampler: torch's DistributedSampler's order, or one of ddpkit's two variants.
    ``drop_last=False`` is DistributedSampler's shuffle without its padding or dropping: rank r takes every
    world_size-th index of the epoch's permutation from r on, so every sample is used once and the ranks'
    shares differ by at most one sample (``--join``). ``shuffle_block``: as epoch_order's (``shuffle_in_batch``)."""

    def __init__(self, n: int, world: int, rank: int, seed: int, drop_last: bool = False, shuffle_block: int = 0):
        self.n, self.world, self.rank, self.seed, self.epoch = n, world, rank, seed, 0
        self.drop_last, self.shuffle_block = drop_last, shuffle_block

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __iter__(self):
        order = epoch_order(self.n, self.world, self.rank, self.seed, self.epoch, self.drop_last, self.shuffle_block)
        return iter(order.tolist())

    def __len__(self):
        return self.n // self.world if self.drop_last else len(range(self.rank, self.n, self.world))


class LoaderSource(_Source):
    path = "dataloader"

    def __init__(
        self,
        data: Dataset,
        meta: Meta | None,
        cfg: TrainConfig,
        ctx: DistContext,
        per_rank_batch: int,
        group: int = 1,
        collate_fn=None,
        worker_init_fn=None,
    ):
        super().__init__(len(data), meta, cfg, ctx, per_rank_batch, group)
        self.data, self.collate_fn = data, collate_fn
        self.uneven = bool(getattr(cfg, "join", False))
        if self.uneven:
            self.sampler = OrderSampler(len(data), ctx.world_size, ctx.rank, cfg.seed, False, self.shuffle_block)
            own = len(self.sampler)
            self.steps_per_epoch = -(-own // per_rank_batch)  # this rank's, the last batch partial
            self.max_steps_per_epoch = -(-len(range(0, self.n, ctx.world_size)) // per_rank_batch)  # rank 0's
        else:
            # epoch_order's: torch's DistributedSampler, or with shuffle_in_batch its reordered blocks
            self.sampler = OrderSampler(len(data), ctx.world_size, ctx.rank, cfg.seed, True, self.shuffle_block)
            self.max_steps_per_epoch = self.steps_per_epoch
        # The epoch's batches from a step on, each keyed for its random draws: its samples by (seed, epoch,
        # sample), its collate by (seed, epoch, rank, batch)
        self.positioned = KeyedBatches(self.sampler, self.batch, drop_last=not self.uneven)
        # Built once: with workers, they start once per run, not once per epoch.
        self.loader = _dataloader(data, self.positioned, cfg, ctx, collate_fn, worker_init_fn)

    @property
    def used(self) -> int:
        return len(self.sampler) if self.uneven else self.steps_per_epoch * self.batch

    @property
    def draws_by_batch(self) -> bool:
        """Whether what reading draws may follow each rank's batches, so change at another world size: a
        ``collate_fn`` of the user's, or a dataset's own batched ``__getitems__`` (``data/seeds.py``). Draws
        in ``__getitem__`` are keyed by sample: the same at any world size."""
        return self.collate_fn is not None or batched_reader(self.data) is not None

    def epoch_indices(self, epoch: int) -> torch.Tensor:
        """The DistributedSampler's indices for ``epoch`` that the DataLoader's steps use."""
        self.sampler.set_epoch(epoch)
        return torch.tensor(list(itertools.islice(iter(self.sampler), self.used)), dtype=torch.long)

    def batches(self, epoch: int, start_step: int = 0) -> Iterator:
        self.sampler.set_epoch(epoch)
        self.positioned.start = start_step
        self.positioned.key, self.positioned.samples = train_keys(self.cfg.seed, epoch, self.ctx.rank)
        # what a worker started now is seeded from, never the rank's own generator (draws/docstring)
        seed_loader_epoch(self.loader.generator, self.cfg.seed, epoch, self.ctx.rank)
        offsets, flips = self._params(epoch)
        for step, batch in enumerate(unwrapped(self.loader), start=start_step):
            if step >= self.steps_per_epoch:
                break
            batch = to_device(batch, self.ctx.device)
            if self.meta is not None:  # an image dataset: uint8 (images, labels), augmented here
                x, y = batch
                sl = slice(step * self.batch, step * self.batch + len(y))
                batch = (self.pre.train(x, offsets[sl], flips[sl]), y)
            else:
                batch = self.pre.cast(batch)
            yield batch


class StreamSource:
    """An ``IterableDataset``'s batches (:mod:`ddpkit.data.stream`): this rank's shard, a whole number of
    steps an epoch, resumable at any step by replaying the epoch's stream up to it."""

    path = "stream"

    def __init__(
        self,
        data: IterableDataset,
        meta: Meta | None,
        cfg: TrainConfig,
        ctx: DistContext,
        per_rank_batch: int,
        group: int = 1,
        collate_fn=None,
        worker_init_fn=None,
    ):
        self.data, self.cfg, self.ctx, self.batch = data, cfg, ctx, per_rank_batch
        # The shards, their quotas and the steps an epoch follow from the workers: the same on every rank and at
        # every rerun, so --num-workers as given, never a count of this host's cores (0 unless given)
        self.workers = cfg.num_workers or 0
        shards = ctx.world_size * max(1, self.workers)
        quota = len(data) // shards  # each shard's items an epoch: the same on every rank
        # every worker's batches are whole (drop_last): a worker's tail does not make a partial batch
        per_rank_batches = max(1, self.workers) * (quota // per_rank_batch)
        self.steps_per_epoch = per_rank_batches // group * group
        if not self.steps_per_epoch:
            raise DataError(
                f"the IterableDataset's {len(data):,} items make no whole step: {shards} shard(s) of {quota} items "
                f"(world size x loader workers) in batches of {per_rank_batch}; lower --batch-size or --num-workers"
            )
        self.n, self.per_rank = len(data), self.steps_per_epoch * per_rank_batch
        self.pre = Preprocess.for_config(meta, ctx.device, cfg)
        self.shard = Shard(data, ctx.rank, ctx.world_size, self.workers, quota, cfg.seed, per_rank_batch)
        kwargs = {"collate_fn": collate_fn} if collate_fn is not None else {}
        self.loader = DataLoader(
            self.shard,
            batch_size=per_rank_batch,
            drop_last=True,
            num_workers=self.workers,
            pin_memory=ctx.device.type == "cuda",
            # new workers each epoch, seeded for it (a resumed epoch's are the same), never the rank's generator
            generator=loader_generator(cfg.seed, ctx.rank),  # seeded again as each epoch starts
            multiprocessing_context=WORKER_START if self.workers else None,
            worker_init_fn=functools.partial(_worker_start, user_init=worker_init_fn) if self.workers else None,
            **kwargs,
        )

    @property
    def used(self) -> int:
        return self.per_rank

    def batches(self, epoch: int, start_step: int = 0) -> Iterator:
        self.shard.epoch, self.shard.start = epoch, start_step  # before iter(): the workers start with them
        seed_loader_epoch(self.loader.generator, self.cfg.seed, epoch, self.ctx.rank)
        own = None if self.workers else PrivateGenerators(stream_key(self.cfg.seed, epoch, self.ctx.rank, 0))
        it = iter(unwrapped(self.loader))
        for step in range(start_step, self.steps_per_epoch):
            try:
                batch = own.read(it) if own is not None else next(it)
            except StopIteration:
                raise DataError(
                    f"rank {self.ctx.rank}'s share of the IterableDataset ended after {step} of its epoch's "
                    f"{self.steps_per_epoch} batches: a shard yields fewer items than len(dataset) / shards; "
                    f"check its __len__ and how it reads its shard (ddpkit.data.stream_shard)"
                ) from None
            yield self.pre.cast(to_device(batch, self.ctx.device))


def unwrapped(loader: DataLoader) -> Iterator:
    """Iterate ``loader``; a ddpkit error raised in a DataLoader worker comes back as the one line it was,
    not wrapped in the worker's traceback text."""
    try:
        yield from loader
    except DdpkitError as exc:
        lines = [line for line in str(exc).strip().splitlines() if line.strip()]
        last = lines[-1] if lines else ""
        for prefix in (f"{type(exc).__module__}.{type(exc).__name__}: ", f"{type(exc).__name__}: "):
            last = last.removeprefix(prefix)
        raise type(exc)(last) from None


def loader_workers(cfg: TrainConfig, ctx: DistContext) -> int:
    """DataLoader worker processes per rank: ``--num-workers``, or (auto) this rank's cores less one
    for the training process itself, at most 8; 0 when a rank has one core."""
    if cfg.num_workers is not None:
        return cfg.num_workers
    return max(0, min(8, cpu_threads(ctx.local_world_size) - 1))


# How a rank starts its DataLoader workers. Not the start method it inherits from the launcher (a
# forkserver, ranks/prestart.py): a worker watches its parent and exits when that dies, and a rank's
# forkserver outlives a SIGKILLed rank, kept alive by the very workers that watch it, so they ran on
# for ever (holding their dataset and the job's output pipes). Forked from the rank itself, they end
# within torch's watchdog interval (5 s) of it; spawned where fork is unsafe (macOS).
WORKER_START = "fork" if sys.platform.startswith("linux") else "spawn"


def _worker_start(worker_id: int, user_init=None) -> None:
    """Each DataLoader worker, as it starts: SIGTERM obeyed from its rank alone, SIGUSR1 ignored; then the
    user's own ``worker_init_fn`` (from the DataLoader they passed), as torch would call it.

    SLURM signals every process of a job step at once (``scancel``, ``--signal``), and a worker dying of
    it ends its rank (torch raises in the rank on a worker's death) before the rank saves its snapshot:
    the rank decides when to stop, and its workers end with it. Its own SIGTERM (torch's shutdown, or
    multiprocessing's at the rank's exit) still ends a worker at once, as torch's handler does; that is
    told by the sender, which only ``sigwaitinfo`` sees (Linux; elsewhere torch's handling stays)."""
    if hasattr(signal, "sigwaitinfo"):
        signal.signal(signal.SIGUSR1, signal.SIG_IGN)
        signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})  # every thread: only the waiter takes it
        threading.Thread(target=_obey_rank, args=(os.getppid(),), daemon=True, name="ddpkit-sigterm").start()
    if user_init is not None:
        user_init(worker_id)  # what it seeds is reseeded per sample and batch at each read (data/draws.py)


def _obey_rank(rank_pid: int) -> None:
    while True:
        if signal.sigwaitinfo({signal.SIGTERM}).si_pid == rank_pid:
            os._exit(0)  # as torch's worker does on its parent's SIGTERM: a quiet end, not a failure


def _dataloader(
    data, batches: KeyedBatches, cfg: TrainConfig, ctx: DistContext, collate_fn=None, worker_init_fn=None
) -> DataLoader:
    """The engine's :func:`seeded_loader`: ``--num-workers`` workers, memory pinned for a GPU."""
    workers = loader_workers(cfg, ctx)
    return seeded_loader(
        data, batches, cfg.seed, ctx.rank, workers, ctx.device.type == "cuda", collate_fn, worker_init_fn
    )


def seeded_loader(
    data,
    batches: KeyedBatches,
    seed: int,
    rank: int,
    workers: int,
    pin_memory: bool,
    collate_fn=None,
    worker_init_fn=None,
) -> DataLoader:
    """A DataLoader whose every item is one of ``batches``, each sample read under its own seeds and the
    batch collated under the batch's (``data/draws.py``); its ``generator``, not the rank's, seeds the
    workers when they start, and the user's ``worker_init_fn`` runs in each worker after ddpkit's own
    start-up. The one such loader, for ``Trainer``'s loader path and ``Loop.data()``'s workers alike."""
    return DataLoader(
        SeededFetch(data, collate_fn),
        batch_size=None,  # each item is a whole batch: SeededFetch batches and collates
        sampler=batches,
        num_workers=workers,
        pin_memory=pin_memory,
        persistent_workers=workers > 0,  # started once, not at every epoch
        prefetch_factor=4 if workers else None,  # batches in flight per worker
        collate_fn=as_is,
        generator=loader_generator(seed, rank),
        multiprocessing_context=WORKER_START if workers else None,
        worker_init_fn=functools.partial(_worker_start, user_init=worker_init_fn) if workers else None,
    )


def free_device_bytes(ctx: DistContext) -> int | None:
    """This rank's free memory on its GPU, in bytes; None off CUDA (the data is in host memory anyway)."""
    if ctx.device.type != "cuda":
        return None
    free, _ = torch.cuda.mem_get_info(ctx.device)
    return free


def least_free_bytes(ctx: DistContext, free: int | None) -> int | None:
    """The least of every rank's ``free`` (one all-reduce MIN). Other processes on a GPU make each
    rank's free memory differ, and ranks that chose apart would run different data code.

    Every rank calls it; it skips the collective only where every rank does alike: at world 1, and
    off CUDA (``free`` is None on every rank then). The value starts on the host: over gloo (a shared
    GPU) it is reduced there, NCCL needs it on the device.
    """
    if free is None or ctx.world_size == 1:
        return free
    where = ctx.device if ctx.backend == "nccl" else torch.device("cpu")
    least = ctx.all_reduce(torch.tensor([free], dtype=torch.int64, device=where), op=torch.distributed.ReduceOp.MIN)
    return int(least.item())  # once per run, before the first step


def path_for(kind: str, nbytes: int, free: int | None, cfg: TrainConfig) -> str:
    """``device``, ``host`` or ``loader`` for a train set of ``kind`` (``image``: an ImageData, ``tensor``:
    a TensorData, ``stream``: any other Dataset) and ``nbytes`` bytes, with ``free`` bytes free on the
    device (the least over ranks; None off CUDA). Pure: every rank given the same values decides alike."""
    if getattr(cfg, "join", False):
        return "loader"  # its sampler is the one that neither pads nor drops
    if kind == "stream":
        if cfg.data_path in ("device", "host"):
            raise ConfigError(
                f"--data-path {cfg.data_path} needs an in-memory dataset; {cfg.dataset} streams from disk"
            )
        return "loader"
    if cfg.data_path == "host" and kind == "tensor":
        return "device"  # a TensorData is indexed where it is; on CPU that is host memory
    if cfg.data_path != "auto":
        return cfg.data_path
    if free is None:
        return "device"
    if nbytes <= cfg.device_data_fraction * free:
        return "device"
    return "host" if kind == "image" else "loader"


def choose_path(data: Dataset, cfg: TrainConfig, ctx: DistContext, collate_fn=None) -> str:
    """``device``, ``host`` or ``loader``: what ``--data-path auto`` resolves to here, the same on every
    rank. Every rank calls it (one all-reduce on CUDA at world > 1, whatever the flags). With a
    ``collate_fn`` any dataset streams: only a DataLoader calls it on each batch's samples."""
    free = least_free_bytes(ctx, free_device_bytes(ctx))
    if collate_fn is not None:
        kind, nbytes = "stream", 0
    elif isinstance(data, TensorData):
        kind, nbytes = "tensor", data.nbytes()
    elif isinstance(data, ImageData):
        kind, nbytes = "image", data.images.numel() + data.labels.numel() * 8  # uint8 images, int64 labels
    else:
        kind, nbytes = "stream", 0
    return path_for(kind, nbytes, free, cfg)


def make_train_source(splits: DataSplits, cfg: TrainConfig, ctx: DistContext, per_rank_batch: int, group: int = 1):
    """The batch source for ``splits.train``; ``per_rank_batch`` is the micro-batch with accumulation."""
    data, meta = splits.train, splits.meta
    if isinstance(data, IterableDataset):
        return StreamSource(data, meta, cfg, ctx, per_rank_batch, group, splits.collate_fn, splits.worker_init_fn)
    path = choose_path(data, cfg, ctx, splits.collate_fn)
    if path == "loader":
        return LoaderSource(data, meta, cfg, ctx, per_rank_batch, group, splits.collate_fn, splits.worker_init_fn)
    if isinstance(data, TensorData):
        return TensorSource(data, cfg, ctx, per_rank_batch, group)
    return ResidentSource(data, meta, cfg, ctx, per_rank_batch, on_device=path == "device", group=group)


class EvalSource:
    """This rank's test samples (every world_size-th, no padding: each sample counted once), in batches.
    A DataLoader, where one is needed, is built once and reused for every evaluation of the run."""

    def __init__(
        self,
        data: Dataset,
        pre: Preprocess,
        cfg: TrainConfig,
        ctx: DistContext,
        batch: int,
        collate_fn=None,
        worker_init_fn=None,
    ):
        self.data, self.pre, self.ctx, self.batch = data, pre, ctx, batch
        self.indices = range(ctx.rank, len(data), ctx.world_size)
        self.loader = None
        self.index = None
        if isinstance(data, (ImageData, TensorData)) and collate_fn is None:  # a collate needs the DataLoader
            # Made once, where the data lives, and sliced per batch: a host index into device-resident
            # data is a synchronous host-to-device copy at every batch
            where = data.images.device if isinstance(data, ImageData) else _device_of(data)
            self.index = torch.arange(ctx.rank, len(data), ctx.world_size, device=where)
            # the same tensor unless a user's labels live on another device than their images
            self._label_index = self.index.to(data.labels.device if isinstance(data, ImageData) else where)
        else:
            key, samples = eval_keys(cfg.seed, ctx.rank)
            keyed = KeyedBatches(list(self.indices), batch, drop_last=False, key=key, samples=samples)
            self.loader = _dataloader(data, keyed, cfg, ctx, collate_fn, worker_init_fn)

    def batches(self) -> Iterator:
        data, ctx = self.data, self.ctx
        if self.loader is not None:
            for b in unwrapped(self.loader):
                b = to_device(b, ctx.device)
                yield (self.pre.eval(b[0]), b[1]) if self.pre.meta is not None else self.pre.cast(b)
            return
        for start in range(0, len(self.indices), self.batch):
            idx = self.index[start : start + self.batch]
            if isinstance(data, TensorData):
                yield self.pre.cast(to_device(data.take(idx), ctx.device))
            else:
                labels = data.labels[self._label_index[start : start + self.batch]]
                yield self.pre.eval(data.images[idx].to(ctx.device, non_blocking=True)), labels.to(ctx.device)


def _device_of(data: TensorData) -> torch.device:
    leaves = tensor_leaves(data.tree)
    return leaves[0].device if leaves else torch.device("cpu")


def make_sources(splits: DataSplits, cfg: TrainConfig, ctx: DistContext):
    """This rank's train and eval batch sources (the engine's, and what ``ddpkit check`` counts)."""
    per_rank_batch = cfg.batch_size // ctx.world_size
    train_src = make_train_source(splits, cfg, ctx, per_rank_batch // cfg.grad_accum, group=cfg.grad_accum)
    return train_src, eval_source(splits.test, splits, cfg, ctx, getattr(train_src, "on_device", False))


def eval_source(data, splits: DataSplits, cfg: TrainConfig, ctx: DistContext, on_device: bool) -> EvalSource:
    """The test split's batches, or the validation split's: each sample once over the ranks."""
    if on_device and isinstance(data, ImageData):  # the training images are on the device: these too
        data = ImageData(data.images.to(ctx.device), data.labels.to(ctx.device))
    return EvalSource(
        data,
        Preprocess.for_config(splits.meta, ctx.device, cfg),
        cfg,
        ctx,
        max(256, cfg.batch_size // ctx.world_size),
        splits.collate_fn,
        splits.worker_init_fn,
    )


def rank_share(data: DataLoader | Dataset, ctx: DistContext, batch_size: int | None = None) -> Iterator:
    """This rank's every world_size-th sample of ``data``, in order, as batches on its device: what
    ``Loop.evaluate`` reads (no padded repeats, no shuffle). A DataLoader gives its dataset, batch size and
    collate_fn; a dataset needs ``batch_size``."""
    loader = data if isinstance(data, DataLoader) else None
    dataset = loader.dataset if loader is not None else data
    bs = batch_size or (loader.batch_size if loader is not None else None)
    if not bs:
        raise ConfigError("Loop.evaluate(dataset, ...) needs batch_size= (or pass a DataLoader)")
    if len(dataset) < ctx.world_size:
        raise ConfigError(f"Loop.evaluate(): {len(dataset)} samples for {ctx.world_size} ranks; each rank needs one")
    share = Subset(dataset, range(ctx.rank, len(dataset), ctx.world_size))
    collate = {"collate_fn": loader.collate_fn} if loader is not None else {}
    batches = DataLoader(share, batch_size=bs, shuffle=False, **collate)  # checked above, read when iterated
    return (tree_map(lambda t: t.to(ctx.device, non_blocking=True), b) for b in batches)
