"""Batch sources: the same epoch order and augmentation on every path.

* :class:`ResidentSource` holds the uint8 train set in memory, on the device when it
  fits (``--data-path device``) or in pinned host memory with non-blocking copies and
  one batch of prefetch (``host``), and makes batches by indexing.
* :class:`LoaderSource` is the classic DataLoader + DistributedSampler (``loader``), for
  datasets that do not fit in memory (imagefolder) or the user's own Dataset.

Both follow DistributedSampler(shuffle=True, drop_last=True) semantics: each epoch's
permutation comes from (seed, epoch), every rank takes every world_size-th index, and
no sample is used twice in an epoch. Both drop the last partial batch, so every rank
runs the same number of steps and shapes stay static (CUDA graphs, compile).

    src = make_train_source(splits, cfg, ctx)
    for x, y in src.batches(epoch, start_step=0): ...
"""

from __future__ import annotations

import itertools
from typing import Iterator

import torch
from torch.utils.data import DataLoader, Dataset, DistributedSampler, Sampler

from ..errors import ConfigError
from . import ImageData, Meta
from .augment import CROP_PAD, Normalize, crop_flip, epoch_params


def epoch_order(n: int, world: int, rank: int, seed: int, epoch: int) -> torch.Tensor:
    """This rank's sample indices for ``epoch``: exactly DistributedSampler(drop_last=True)."""
    gen = torch.Generator().manual_seed(seed + epoch)
    perm = torch.randperm(n, generator=gen)
    total = (n // world) * world
    return perm[rank:total:world]


class Preprocess:
    """uint8 batch on the device -> augmented (train) or plain (eval) normalised float batch."""

    def __init__(self, meta: Meta | None, device: torch.device, channels_last: bool):
        self.meta = meta
        self.norm = Normalize(meta.mean, meta.std, device, channels_last) if meta else None
        self.pad = CROP_PAD if meta and meta.augment == "crop-flip" else 0

    def train(self, x: torch.Tensor, offsets: torch.Tensor, flips: torch.Tensor) -> torch.Tensor:
        if self.norm is None:  # a user Dataset that already yields float tensors
            return x
        if self.meta.augment != "none":
            x = crop_flip(x, offsets, flips, self.pad)
        return self.norm(x)

    def eval(self, x: torch.Tensor) -> torch.Tensor:
        return x if self.norm is None else self.norm(x)


class _Source:
    """What both paths share: the epoch geometry and the per-sample augmentation draws."""

    path = "?"

    def __init__(self, n: int, meta: Meta | None, cfg, ctx, per_rank_batch: int):
        self.n, self.meta, self.cfg, self.ctx, self.batch = n, meta, cfg, ctx, per_rank_batch
        self.per_rank = n // ctx.world_size
        self.steps_per_epoch = self.per_rank // per_rank_batch
        self.pre = Preprocess(meta, ctx.device, bool(cfg.channels_last))

    def _params(self, epoch: int):
        offsets, flips = epoch_params(self.per_rank, self.cfg.seed, epoch, self.ctx.rank,
                                      self.meta.augment if self.meta else "none")
        return offsets.to(self.ctx.device), flips.to(self.ctx.device)


class ResidentSource(_Source):
    def __init__(self, data: ImageData, meta: Meta, cfg, ctx, per_rank_batch: int, on_device: bool):
        super().__init__(len(data), meta, cfg, ctx, per_rank_batch)
        cuda = ctx.device.type == "cuda"
        self.on_device = on_device or not cuda  # on CPU, host memory *is* the device
        self.path = "device-resident" if self.on_device else "pinned-host"
        if self.on_device:
            self.images, self.labels = data.images.to(ctx.device), data.labels.to(ctx.device)
        else:
            self.images, self.labels = data.images.pin_memory(), data.labels.pin_memory()

    def batches(self, epoch: int, start_step: int = 0) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        order = epoch_order(self.n, self.ctx.world_size, self.ctx.rank, self.cfg.seed, epoch)
        offsets, flips = self._params(epoch)
        if self.on_device:
            order = order.to(self.ctx.device)  # one small copy per epoch; every batch after is on-device indexing
        fetch = self._fetch_device if self.on_device else self._fetch_host
        nxt = fetch(order, start_step)
        for step in range(start_step, self.steps_per_epoch):
            x, y = nxt
            if step + 1 < self.steps_per_epoch:
                nxt = fetch(order, step + 1)  # host path: the next copy overlaps this step's compute
            sl = slice(step * self.batch, (step + 1) * self.batch)
            yield self.pre.train(x, offsets[sl], flips[sl]), y

    def _fetch_device(self, order, step):
        idx = order[step * self.batch:(step + 1) * self.batch]
        return self.images[idx], self.labels[idx]

    def _fetch_host(self, order, step):
        idx = order[step * self.batch:(step + 1) * self.batch]
        x, y = self.images[idx].pin_memory(), self.labels[idx].pin_memory()
        return x.to(self.ctx.device, non_blocking=True), y.to(self.ctx.device, non_blocking=True)


class _From(Sampler):
    """A sampler's indices from position ``start`` on (mid-epoch resume without reading skipped samples)."""

    def __init__(self, sampler: Sampler, start: int):
        self.sampler, self.start = sampler, start

    def __iter__(self):
        return itertools.islice(iter(self.sampler), self.start, None)

    def __len__(self):
        return max(0, len(self.sampler) - self.start)


class LoaderSource(_Source):
    path = "dataloader"

    def __init__(self, data: Dataset, meta: Meta | None, cfg, ctx, per_rank_batch: int):
        super().__init__(len(data), meta, cfg, ctx, per_rank_batch)
        self.data = data
        self.sampler = DistributedSampler(data, num_replicas=ctx.world_size, rank=ctx.rank, shuffle=True,
                                          seed=cfg.seed, drop_last=True)

    def batches(self, epoch: int, start_step: int = 0) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        self.sampler.set_epoch(epoch)
        loader = _dataloader(self.data, _From(self.sampler, start_step * self.batch), self.batch, self.cfg, self.ctx)
        offsets, flips = self._params(epoch)
        for step, (x, y) in enumerate(loader, start=start_step):
            if step >= self.steps_per_epoch:
                break
            x, y = x.to(self.ctx.device, non_blocking=True), y.to(self.ctx.device, non_blocking=True)
            sl = slice(step * self.batch, (step + 1) * self.batch)
            yield self.pre.train(x, offsets[sl], flips[sl]), y


def _dataloader(data, sampler, batch: int, cfg, ctx, drop_last: bool = True) -> DataLoader:
    workers = cfg.num_workers
    return DataLoader(data, batch_size=batch, sampler=sampler, drop_last=drop_last, num_workers=workers,
                      pin_memory=ctx.device.type == "cuda", persistent_workers=False,
                      prefetch_factor=2 if workers else None)


def choose_path(data: Dataset, cfg, ctx) -> str:
    """``device``, ``host`` or ``loader``: what ``--data-path auto`` resolves to here."""
    if not isinstance(data, ImageData):
        if cfg.data_path in ("device", "host"):
            raise ConfigError(f"--data-path {cfg.data_path} needs an in-memory dataset; {cfg.dataset} streams from disk")
        return "loader"
    if cfg.data_path != "auto":
        return cfg.data_path
    if ctx.device.type != "cuda":
        return "device"
    free, _ = torch.cuda.mem_get_info(ctx.device)
    nbytes = data.images.numel() + data.labels.numel() * 8
    return "device" if nbytes <= cfg.device_data_fraction * free else "host"


def make_train_source(data: Dataset, meta: Meta | None, cfg, ctx, per_rank_batch: int):
    path = choose_path(data, cfg, ctx)
    if path == "loader":
        return LoaderSource(data, meta, cfg, ctx, per_rank_batch)
    return ResidentSource(data, meta, cfg, ctx, per_rank_batch, on_device=path == "device")


def eval_batches(data: Dataset, pre: Preprocess, cfg, ctx, batch: int) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """This rank's test samples (every world_size-th, no padding: each sample counted once)."""
    indices = range(ctx.rank, len(data), ctx.world_size)
    if isinstance(data, ImageData):
        for start in range(0, len(indices), batch):
            idx = torch.tensor(indices[start:start + batch])
            yield pre.eval(data.images[idx].to(ctx.device, non_blocking=True)), data.labels[idx].to(ctx.device)
        return
    for x, y in _dataloader(data, list(indices), batch, cfg, ctx, drop_last=False):
        yield pre.eval(x.to(ctx.device, non_blocking=True)), y.to(ctx.device, non_blocking=True)
