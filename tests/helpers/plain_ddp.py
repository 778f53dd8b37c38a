"""A plain DDP training loop as a user writes it before porting to ddpkit (the DDP tutorial series'
shape): torch.multiprocessing, gloo, DistributedSampler with set_epoch, the user's own AdamW at a
constant lr, gradient clipping, the loss all-reduced for the log. Tests only."""

from __future__ import annotations

import os

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

LR, CLIP, EPOCHS, BATCH = 1e-3, 1.0, 3, 32  # BATCH: global, split across ranks


class ConvClassifier(nn.Module):
    """A small conv net with BatchNorm, so memory format and buffer sync matter."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Sequential(nn.Conv2d(1, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(), nn.MaxPool2d(2))
        self.head = nn.Linear(8 * 4 * 4, 3)

    def forward(self, x):
        return self.head(self.conv(x).flatten(1))


def data() -> TensorDataset:
    gen = torch.Generator().manual_seed(7)
    x = torch.randn(200, 1, 8, 8, generator=gen)
    y = (x.mean((1, 2, 3)) > 0).long() + (x[:, 0, 0, 0] > 1).long()
    return TensorDataset(x, y)


def model() -> ConvClassifier:
    torch.manual_seed(0)
    return ConvClassifier()


def optimizer(m: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.AdamW(m.parameters(), lr=LR)


def _worker(rank: int, world: int, port: int, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        ds = data()
        net = DDP(model())
        opt = optimizer(net.module)
        sampler = DistributedSampler(ds, num_replicas=world, rank=rank, shuffle=True, seed=0, drop_last=True)
        loader = DataLoader(ds, batch_size=BATCH // world, sampler=sampler, drop_last=True)
        losses = []
        for epoch in range(EPOCHS):
            sampler.set_epoch(epoch)
            for x, y in loader:
                loss = F.cross_entropy(net(x), y)
                opt.zero_grad()
                loss.backward()
                nn.utils.clip_grad_norm_(net.parameters(), CLIP)
                opt.step()
                mean = loss.detach().clone()
                dist.all_reduce(mean)
                losses.append(mean.item() / world)
        if rank == 0:
            torch.save(losses, out)
    finally:
        dist.destroy_process_group()
    # Test harness only: end without the interpreter's teardown, where gloo's threads (still referenced by the
    # DDP object after destroy_process_group) abort now and then: "terminate called without an active exception",
    # exit -6, in plain DDP and Loop scripts alike (CI, 2026-11-26). Everything is written by now.
    os._exit(0)


def plain_losses(world: int, port: int, out: str) -> list[float]:
    import torch.multiprocessing as mp

    mp.spawn(_worker, args=(world, port, out), nprocs=world)
    return torch.load(out)
