"""A loop on ``ddpkit.Loop`` against the same loop with plain DDP, interleaved in the same processes.

    python benchmarks/loop_overhead.py [--steps 150] [--repeats 5] [--out loop_overhead.json]

World 2 on the CPU (gloo), ddpkit's MNIST ConvNet on the bundled MNIST train images (float32,
normalised once), SGD with momentum, 64 images per rank per step. Each repeat runs the plain loop
(``DDP(model)``, ``DataLoader`` with ``DistributedSampler`` and ``set_epoch``, the loss all-reduced for
the log every 50 steps, as a tutorial script does) and the ported one (``loop.wrap``, ``loop.data``,
``loop.steps``, ``loop.log`` every step, records every 50 steps), alternating which goes first; the
first 10 steps of each are warm-up and not timed. Reports samples/s per repeat and the median ratio.
Run it on a quiet machine: nothing else may use the cores while it runs.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

import ddpkit
from ddpkit.config import TrainConfig
from ddpkit.data.datasets import load_dataset
from ddpkit.models import build_model

BATCH, WARMUP, LOG_EVERY = 64, 10, 50


def mnist() -> TensorDataset:
    train = load_dataset(TrainConfig(dataset="mnist")).train
    x = (train.images.float() / 255 - 0.1307) / 0.3081
    return TensorDataset(x, train.labels)


def plain(data: TensorDataset, steps: int) -> float:
    torch.manual_seed(0)
    model = DDP(build_model("convnet", 1, 28, 28, 10))
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    sampler = DistributedSampler(data)
    loader = DataLoader(data, batch_size=BATCH, sampler=sampler)
    step, t0 = 0, None
    for epoch in range(100):
        sampler.set_epoch(epoch)
        for x, y in loader:
            if step == WARMUP:
                t0 = time.perf_counter()
            loss = F.cross_entropy(model(x), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
            step += 1
            if step % LOG_EVERY == 0:
                logged = loss.detach().clone()
                dist.all_reduce(logged)
                logged.item()
            if step == steps:
                dist.barrier()
                return (steps - WARMUP) * BATCH * dist.get_world_size() / (time.perf_counter() - t0)


def ported(data: TensorDataset, steps: int, run_dir: str) -> float:
    with ddpkit.Loop(run_dir, log_every=LOG_EVERY, check_code=False) as loop:
        torch.manual_seed(0)
        model = loop.wrap(build_model("convnet", 1, 28, 28, 10))
        opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
        loader = loop.data(data, batch_size=BATCH)
        loop.resume(model=model, optimizer=opt)
        batches, t0 = iter(()), None
        for step in loop.steps(steps):
            batch = next(batches, None)
            if batch is None:
                batches = iter(loader)
                batch = next(batches)
            if step == WARMUP:
                t0 = time.perf_counter()
            x, y = batch
            loss = F.cross_entropy(model(x), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
            loop.log(loss=loss.detach())
        dist.barrier()
        rate = (steps - WARMUP) * BATCH * loop.world_size / (time.perf_counter() - t0)
    return rate


def worker(ctx, steps: int, repeats: int) -> dict:
    data = mnist()
    rows = []
    for r in range(repeats):
        with tempfile.TemporaryDirectory() as tmp:
            run_dir = [tmp + "/run"]
            dist.broadcast_object_list(run_dir, src=0)
            order = ("plain", "loop") if r % 2 == 0 else ("loop", "plain")
            row = {}
            for name in order:
                row[name] = plain(data, steps) if name == "plain" else ported(data, steps, run_dir[0])
            rows.append(row)
    ratios = [row["loop"] / row["plain"] for row in rows]
    return {
        "rows": rows,
        "ratio_median": statistics.median(ratios),
        "ratio_min": min(ratios),
        "ratio_max": max(ratios),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=150)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out", default="")
    args = parser.parse_args()
    result = ddpkit.launch(worker, args.steps, args.repeats, nproc=2, device="cpu")
    text = json.dumps(result, indent=1)
    print(text)
    if args.out:
        with open(args.out, "w") as fh:
            fh.write(text)


if __name__ == "__main__":
    main()
