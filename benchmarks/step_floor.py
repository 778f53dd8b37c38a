"""Where a small model's training step spends its time on one device: the floor under ddpkit.

    python benchmarks/step_floor.py --device cuda --out floor/     # one GPU, about a minute

The seed ConvNet on MNIST does little arithmetic per step, so on a GPU its step is bound by
the host: Python and kernel launches. This times, in one process and side by side, the same
step built up layer by layer, so a gap between ddpkit's samples/s and the hardware can be
put where it belongs:

| variant | what it adds |
|---|---|
| bare | model fwd + cross-entropy + backward + fused SGD + LambdaLR, float data already on the device (ddpkit also normalises uint8 batches and sums its metrics) |
| + ddpkit task | ddpkit's Classification loss and its on-device (sum, count) metrics per step |
| + DDP (world 1) | DistributedDataParallel around the model, one process, with DDP's defaults |
| bare, batch 512 | fewer, larger steps: how much of the step is fixed cost |
| bare, cudnn.benchmark | cuDNN's algorithm search on (ddpkit leaves it off) |
| bare, CUDA graph | the whole step replayed as one graph: the launch-free floor (fixed lr) |

| ddpkit Engine._step | ddpkit's own step, world 1 (no DDP there), on the real MNIST |
| ddpkit, --cuda-graph on | the same step captured and replayed by ddpkit (train/graph.py), with its lr table and metrics |

Writes ``floor.json`` and ``profile_engine.txt``, the profiler's table of ddpkit's step.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from ddpkit.models import ConvNet, to_channels_last  # noqa: E402
from ddpkit.train.metrics import Accumulator  # noqa: E402
from ddpkit.train.optim import ScheduleFactor  # noqa: E402
from ddpkit.train.task import Classification  # noqa: E402


def setup(device: torch.device, batch: int, ddp: bool):
    torch.manual_seed(0)
    model = to_channels_last(ConvNet().to(device), device.type)  # as ddpkit's engine does
    net = (
        DDP(model, device_ids=[device] if device.type == "cuda" else None, gradient_as_bucket_view=True)
        if ddp
        else model
    )
    impl = {"fused": True} if device.type == "cuda" else {"foreach": True}
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, nesterov=True, weight_decay=5e-4, **impl)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, ScheduleFactor("onecycle", 10_000, 0.15))
    x = torch.randn(60_000 // batch * batch, 1, 28, 28, device=device)
    y = torch.randint(0, 10, (x.shape[0],), device=device)
    return net, opt, sched, x, y


def time_steps(step, steps: int, device: torch.device, warmup: int = 30) -> float:
    """Seconds per step, after warm-up; the device is drained before both clock reads."""
    for i in range(warmup):
        step(i)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    sync()
    t = time.perf_counter()
    for i in range(steps):
        step(i)
    sync()
    return (time.perf_counter() - t) / steps


def variant(device, batch, steps, *, task=False, ddp=False, profile_to=None, cudnn_benchmark=False) -> float:
    torch.backends.cudnn.benchmark = cudnn_benchmark  # ddpkit leaves torch's default, off
    net, opt, sched, x, y = setup(device, batch, ddp)
    order = torch.randperm(x.shape[0], device=device)
    cls = Classification(label_smoothing=0.0, classes=10) if task else None
    acc = Accumulator(cls.names, device) if task else None
    n = x.shape[0] // batch

    def step(i):
        idx = order[(i % n) * batch : (i % n + 1) * batch]
        xb, yb = x.index_select(0, idx).contiguous(memory_format=torch.channels_last), y.index_select(0, idx)
        opt.zero_grad(set_to_none=True)
        if cls is None:
            loss = F.cross_entropy(net(xb), yb)
        else:
            loss, out = cls.loss(net, (xb, yb))
            acc.add(cls.measure(loss, out, (xb, yb)))
        loss.backward()
        opt.step()
        sched.step()

    per_step = time_steps(step, steps, device)
    if profile_to is not None:
        profile(step, device, profile_to)
    return per_step


def mnist_engine(device, batch: int, run_dir: str, cuda_graph: str = "off", **kw):
    """ddpkit's Engine on the real MNIST, device-resident, world 1, in this process (recipe "mnist":
    float32 like the bare step; auto picks bf16 on CPUs with native bf16)."""
    from ddpkit.config import TrainConfig
    from ddpkit.data import load_dataset
    from ddpkit.models import build_model
    from ddpkit.ranks.context import DistContext
    from ddpkit.train.engine import Engine

    cfg = TrainConfig(
        dataset="mnist",
        recipe="mnist",
        batch_size=batch,
        epochs=1,
        device=device.type,
        progress=False,
        log_every=10**6,
        run_dir=run_dir,
        cuda_graph=cuda_graph,
        **kw,
    ).resolved()
    ctx = DistContext(0, 0, 1, 1, device, "nccl" if device.type == "cuda" else "gloo")
    torch.manual_seed(0)
    return Engine(cfg, ctx, build_model(cfg.model, 1, 28, 28, 10), load_dataset(cfg), Classification(classes=10))


def engine_step(device, batch, steps, profile_to=None) -> float:
    """ddpkit's own step (Engine._step)."""
    import tempfile

    torch.backends.cudnn.benchmark = False
    with tempfile.TemporaryDirectory() as run_dir:
        engine = mnist_engine(device, batch, run_dir)
        batches = engine.train_src.batches(0)
        step = lambda i: engine._step((next(batches),))  # noqa: E731
        per_step = time_steps(step, min(steps, engine.steps_per_epoch - 60), device)
        if profile_to is not None:
            profile(step, device, profile_to)
    return per_step


def engine_graph_step(device, batch, steps) -> float:
    """ddpkit's step under --cuda-graph on (train/graph.py): warm-up and capture happen within
    time_steps' warm-up, then replays."""
    import tempfile

    from ddpkit.train.graph import GraphedSteps

    torch.backends.cudnn.benchmark = False
    with tempfile.TemporaryDirectory() as run_dir:
        engine = mnist_engine(device, batch, run_dir, cuda_graph="on")
        engine.graph = GraphedSteps(engine)
        slots = engine.graph.epoch(0, 0)

        def step(i):
            next(slots)
            engine.graph.step()

        per_step = time_steps(step, min(steps, engine.steps_per_epoch - 60), device)
        assert engine.graph.status.startswith("captured"), engine.graph.status
    return per_step


def profile(step, device, path: Path) -> None:
    """Host and device time per op over 20 steps, largest host total first."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with torch_profile(activities=acts) as prof:
        for i in range(20):
            step(i)
        if device.type == "cuda":
            torch.cuda.synchronize()
    path.write_text(prof.key_averages().table(sort_by="cpu_time_total", row_limit=50))


def graphed(device, batch, steps) -> float:
    """The whole step captured once and replayed: no Python, no per-kernel launch cost."""
    torch.backends.cudnn.benchmark = False
    net, opt, _, x, y = setup(device, batch, ddp=False)
    xb, yb = x[:batch].contiguous(memory_format=torch.channels_last), y[:batch].clone()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm up on a side stream, as torch's graph docs require
        for _ in range(5):
            opt.zero_grad(set_to_none=False)
            F.cross_entropy(net(xb), yb).backward()
            opt.step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    opt.zero_grad(set_to_none=False)
    with torch.cuda.graph(graph):
        F.cross_entropy(net(xb), yb).backward()
        opt.step()
    return time_steps(lambda i: graph.replay(), steps, device)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--batch-size", type=int, default=128)
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--out", type=Path, required=True)
    args = p.parse_args(argv)
    device = torch.device(args.device)
    args.out.mkdir(parents=True, exist_ok=True)
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29533")
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo", rank=0, world_size=1)
    try:
        b = args.batch_size
        rows = {
            "bare": variant(device, b, args.steps),
            "+ ddpkit task": variant(device, b, args.steps, task=True),
            "+ DDP (world 1)": variant(device, b, args.steps, task=True, ddp=True),
            "ddpkit Engine._step": engine_step(device, b, args.steps, profile_to=args.out / "profile_engine.txt"),
            "bare, batch 512": variant(device, 512, args.steps) * b / 512,  # per 128 samples, comparable
        }
        if device.type == "cuda":
            rows["bare, cudnn.benchmark"] = variant(device, b, args.steps, cudnn_benchmark=True)
            rows["bare, CUDA graph"] = graphed(device, b, args.steps)
            rows["ddpkit, --cuda-graph on"] = engine_graph_step(device, b, args.steps)
    finally:
        dist.destroy_process_group()
    table = {k: {"ms_per_step": 1e3 * v, "samples_per_s": b / v} for k, v in rows.items()}
    info = {
        "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
        "torch": torch.__version__,
        "batch_size": b,
        "steps": args.steps,
        "date": time.strftime("%Y-%m-%d"),
    }
    (args.out / "floor.json").write_text(json.dumps({"environment": info, "variants": table}, indent=2) + "\n")
    print(f"{info['device']}, torch {info['torch']}, batch {b} (batch 512 row: per {b} samples)")
    for k, v in table.items():
        print(f"{k:>18}: {v['ms_per_step']:7.3f} ms/step  {v['samples_per_s']:>10,.0f} samples/s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
