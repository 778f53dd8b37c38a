"""Seed-style DDP pipeline vs ddpkit, side by side in one invocation on one machine.

    python benchmarks/pipelines.py --nproc 2 --batch-size 200 --epochs 1

(a) seed:   torchvision MNIST with ToTensor + Normalize per PIL image, DataLoader with
            DistributedSampler, ``loss.item()`` every step, plain DDP (the DDP tutorial's
            program), one intra-op thread per process as torchrun sets by default.
(b) ddpkit: the same ConvNet, global batch, epochs, optimizer and world size through
            ``ddpkit.Trainer`` (device-resident uint8 data, no per-step host sync).
(c) ddpkit at world size 1 with and without the DDP wrapper, for the wrapper's overhead.

Both throughputs count training-loop time only (no process start or data decoding
before the loop). With --repeats N the four runs go round N times, interleaved so that a
slow spell on a shared machine hits every pipeline alike, and each figure is the median.
Prints a table and, with --json, writes the figures.
"""

from __future__ import annotations

import argparse
import gzip
import json
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler, Subset

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from ddpkit import TrainConfig, Trainer  # noqa: E402
from ddpkit.data import MNIST_DIR  # noqa: E402
from ddpkit.models import ConvNet  # noqa: E402
from ddpkit.ranks.context import distributed  # noqa: E402
from ddpkit.ranks.launcher import run_workers  # noqa: E402


def torchvision_mnist_root() -> Path:
    """The bundled files, uncompressed where torchvision.datasets.MNIST looks for them."""
    root = Path(tempfile.mkdtemp(prefix="ddpkit-bench-"))
    raw = root / "MNIST" / "raw"
    raw.mkdir(parents=True)
    for gz in MNIST_DIR.glob("*.gz"):
        with gzip.open(gz) as src, open(raw / gz.stem, "wb") as dst:
            shutil.copyfileobj(src, dst)
    return root


def seed_worker(root: str, global_batch: int, epochs: int, lr: float, limit: int, device: str = "cpu") -> dict:
    """The seed program's loop, kept as the tutorial writes it (on ``device``: cpu or cuda)."""
    from torchvision import datasets, transforms

    with distributed(device) as ctx:
        if ctx.local_world_size > 1:
            torch.set_num_threads(1)  # torchrun's default OMP_NUM_THREADS=1 for multi-process jobs
        dev = ctx.device
        tf = transforms.Compose([transforms.ToTensor(), transforms.Normalize((0.1307,), (0.3081,))])
        data = datasets.MNIST(root, train=True, transform=tf, download=False)
        if limit:
            data = Subset(data, range(limit))
        sampler = DistributedSampler(data, num_replicas=ctx.world_size, rank=ctx.rank, shuffle=True, drop_last=True)
        loader = DataLoader(data, batch_size=global_batch // ctx.world_size, sampler=sampler, drop_last=True)
        torch.manual_seed(0)
        model = DDP(ConvNet().to(dev), device_ids=[dev] if dev.type == "cuda" else None)
        opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)
        loss_fn = torch.nn.CrossEntropyLoss()
        seen, start = 0, time.perf_counter()
        for epoch in range(epochs):
            sampler.set_epoch(epoch)
            for x, y in loader:
                x, y = x.to(dev), y.to(dev)
                opt.zero_grad()
                loss = loss_fn(model(x), y)
                loss.backward()
                opt.step()
                total = torch.tensor([loss.item()], device=dev)  # the seed's per-step host sync and loss all-reduce
                dist.all_reduce(total)
                seen += len(x) * ctx.world_size
        elapsed = time.perf_counter() - start
        return {"samples_per_s": seen / elapsed, "train_time_s": elapsed, "samples": seen}


def ddpkit_run(run_dir: Path, **overrides) -> dict:
    cfg = TrainConfig(run_dir=str(run_dir), progress=False, log_every=10_000, **overrides)
    return Trainer(cfg).fit()


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--batch-size", type=int, default=200, help="global batch")
    p.add_argument("--epochs", type=int, default=1)
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument("--limit-train", type=int, default=0, help="first N training samples (0 = all 60000)")
    p.add_argument("--repeats", type=int, default=1, help="rounds of all four runs; figures are medians")
    p.add_argument("--json", type=Path, help="write the figures here")
    args = p.parse_args(argv)

    root = torchvision_mnist_root()
    work = Path(tempfile.mkdtemp(prefix="ddpkit-bench-runs-"))
    rounds = []
    try:
        # recipe "mnist": float32 like the seed script (auto picks bf16 on CPUs with native bf16)
        common = dict(
            dataset="mnist",
            recipe="mnist",
            model="convnet",
            batch_size=args.batch_size,
            epochs=args.epochs,
            lr=args.lr,
            limit_train=args.limit_train,
            device="cpu",
        )
        for r in range(args.repeats):
            seed = run_workers(
                seed_worker, (str(root), args.batch_size, args.epochs, args.lr, args.limit_train), args.nproc
            )
            ours = ddpkit_run(work / f"ddp-{r}", nproc=str(args.nproc), **common)
            one_ddp = ddpkit_run(work / f"w1-ddp-{r}", nproc="1", ddp=True, **common)  # forced: off at world 1
            one_raw = ddpkit_run(work / f"w1-noddp-{r}", nproc="1", ddp=False, **common)
            rounds.append(
                {
                    "seed": seed["samples_per_s"],
                    "ddpkit": ours["samples_per_s"],
                    "w1_ddp": one_ddp["samples_per_s"],
                    "w1_raw": one_raw["samples_per_s"],
                    "ddpkit_test_accuracy": ours["test_accuracy"],
                }
            )
    finally:
        shutil.rmtree(root, ignore_errors=True)
        shutil.rmtree(work, ignore_errors=True)
    med = {k: statistics.median(r[k] for r in rounds) for k in rounds[0]}
    figures = {
        "config": {**vars(args), "json": None, "torch": str(torch.__version__)},
        "seed_samples_per_s": med["seed"],
        "ddpkit_samples_per_s": med["ddpkit"],
        "speedup": med["ddpkit"] / med["seed"],
        "ddpkit_test_accuracy": med["ddpkit_test_accuracy"],
        "world1_ddp_samples_per_s": med["w1_ddp"],
        "world1_no_ddp_samples_per_s": med["w1_raw"],
        "ddp_wrapper_overhead": 1 - med["w1_ddp"] / med["w1_raw"],
        "rounds": rounds,
    }
    print(
        f"world {args.nproc}, global batch {args.batch_size}, {args.epochs} epoch(s), ConvNet on MNIST, CPU, "
        f"median of {args.repeats} round(s)"
    )
    print(f"  (a) seed-style pipeline : {figures['seed_samples_per_s']:9.0f} samples/s")
    print(
        f"  (b) ddpkit              : {figures['ddpkit_samples_per_s']:9.0f} samples/s   "
        f"ratio {figures['speedup']:.2f}x   test acc {figures['ddpkit_test_accuracy']:.4f}"
    )
    print(f"  (c) world 1, DDP        : {figures['world1_ddp_samples_per_s']:9.0f} samples/s")
    print(
        f"      world 1, no DDP     : {figures['world1_no_ddp_samples_per_s']:9.0f} samples/s   "
        f"wrapper overhead {100 * figures['ddp_wrapper_overhead']:.1f}%"
    )
    if args.json:
        args.json.write_text(json.dumps(figures, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
