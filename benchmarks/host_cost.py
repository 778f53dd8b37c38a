"""The training step's host cost, cut by cut: each piece as it was (old) and as it is (new), side by side.

    python benchmarks/host_cost.py --out host_cost.json                  # CPU, a few minutes
    python benchmarks/host_cost.py --device cuda --out host_cost.json    # one GPU
    python benchmarks/host_cost.py --quick --out /tmp/hc.json            # seconds: exercises the script only

On a GPU the step of a small model (the MNIST ConvNet) is bound by the host: Python and kernel
launches. Each row times one piece of ``Engine._step`` as ddpkit had it before the cuts (copied in
this script, so the comparison needs no second checkout) against what ``ddpkit`` has now, in one
process, interleaved: the repeats alternate old, new, new, old, ... so drift (clocks, caches, other
load) falls on both alike. Figures are medians over the repeats of the mean time per call.

| cut | old | new |
|---|---|---|
| (a) amp off | a disabled ``torch.autocast``, entered | ``optim.autocast()``'s; a bare ``nullcontext`` |
| (b) EMA.update | walks ``buffers()``, copies one by one | (module, name) slots, ``_foreach_copy_`` |
| (c) schedule step | ``LambdaLR(ScheduleFactor)`` | ``build_schedule()``'s ``TableLR``: a look-up |
| (d) Accumulator.add | per part detach, ``to``, reshape; stack | one stack and one add (common case) |
| (e) whole step | ``Engine._step`` with the four old pieces swapped in | ``Engine._step`` as it is |

Micro rows (a-d) time the host only: on CUDA the device is drained before each timed block, not
inside it (the kernels they launch are tiny; the queue never fills). Row (e) times the whole step,
the device drained at the end of each block: what a host-bound step's wall time is.

Writes ``--out`` (JSON: the environment and, per row, every repeat's figure) and prints a markdown table.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import gc
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from ddpkit.config import TrainConfig  # noqa: E402
from ddpkit.data import load_dataset  # noqa: E402
from ddpkit.models import ConvNet, build_model  # noqa: E402
from ddpkit.ranks.context import distributed  # noqa: E402
from ddpkit.train.engine import Engine  # noqa: E402
from ddpkit.train.metrics import Accumulator  # noqa: E402
from ddpkit.train.optim import EMA, ScheduleFactor, autocast, build_schedule  # noqa: E402
from ddpkit.train.task import Classification  # noqa: E402


# ------------------------------------------------------------------ the old pieces, as they were
class OldEMA:
    """ddpkit's EMA before the cut."""

    def __init__(self, model: nn.Module, decay: float):
        self.decay = decay
        self.module = copy.deepcopy(model)
        for p in self.module.parameters():
            p.requires_grad_(False)
        self.params = [p for p in self.module.parameters()]
        self.src = [p for p in model.parameters()]

    @torch.no_grad()
    def update(self, model: nn.Module) -> None:
        torch._foreach_lerp_(self.params, [p.detach() for p in self.src], 1 - self.decay)
        for b_ema, b in zip(self.module.buffers(), model.buffers()):
            b_ema.copy_(b)

    def state_dict(self) -> dict:
        return self.module.state_dict()


class OldAccumulator(Accumulator):
    """ddpkit's Accumulator.add before the cut: each part detached, converted and reshaped, then stacked
    (the rest, local/state/load, is today's: the cut changed only add)."""

    def __init__(self, names: tuple[str, ...], device: torch.device):
        super().__init__(names, device)
        self._index: dict[tuple, torch.Tensor] = {}

    @torch.no_grad()
    def add(self, values: list[tuple]) -> None:
        self._old_add(self.sums, self.host_sums, [v[0] for v in values])
        self._old_add(self.counts, self.host_counts, [v[1] for v in values])

    def _old_add(self, dev: torch.Tensor, host: list, parts: list) -> None:
        tensors, where = [], []
        for i, part in enumerate(parts):
            if isinstance(part, torch.Tensor):
                tensors.append(part.detach().to(device=self.device, dtype=torch.float64).reshape(()))
                where.append(i)
            else:
                host[i] += float(part)
        if len(tensors) == len(parts):
            dev += torch.stack(tensors)
        elif tensors:
            key = tuple(where)
            if key not in self._index:
                self._index[key] = torch.tensor(where, device=self.device)
            dev.index_add_(0, self._index[key], torch.stack(tensors))


def old_schedule(opt: torch.optim.Optimizer, kind: str, total: int, warmup: float):
    return torch.optim.lr_scheduler.LambdaLR(opt, ScheduleFactor(kind, total, warmup))


# ------------------------------------------------------------------ timing
def drain(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def block_us(fn, calls: int, device: torch.device, wall: bool) -> float:
    """Mean µs per call over ``calls`` calls: host time, or (``wall``) until the device is done too."""
    drain(device)
    t = time.perf_counter()
    for _ in range(calls):
        fn()
    if wall:
        drain(device)
    elapsed = time.perf_counter() - t
    drain(device)
    return 1e6 * elapsed / calls


def side_by_side(old, new, calls: int, repeats: int, device: torch.device, wall: bool = False) -> dict:
    """Both, interleaved (old new, new old, ...) after a warm-up of each; medians of the repeats."""
    for fn in (old, new):
        for _ in range(max(3, calls // 10)):
            fn()
    runs = {"old": [], "new": []}
    gc_was = gc.isenabled()
    gc.disable()
    try:
        for r in range(repeats):
            order = ("old", "new") if r % 2 == 0 else ("new", "old")
            for side in order:
                runs[side].append(block_us(old if side == "old" else new, calls, device, wall))
    finally:
        if gc_was:
            gc.enable()
    o, n = statistics.median(runs["old"]), statistics.median(runs["new"])
    return {
        "old_us": o,
        "new_us": n,
        "new_over_old": n / o if o else None,
        "saved_us": o - n,
        "calls_per_repeat": calls,
        "repeats": repeats,
        "old_runs_us": runs["old"],
        "new_runs_us": runs["new"],
    }


# ------------------------------------------------------------------ the cases
def case_autocast(device, calls, repeats):
    off = TrainConfig(amp="none")
    old_ctx = torch.autocast(device.type, enabled=False)  # the engine made it once and entered it every step
    new_ctx = autocast(off, device)
    floor = contextlib.nullcontext()

    def enter(ctx):
        def fn():
            with ctx:
                pass

        return fn

    yield (
        "a",
        "amp off: enter and leave the step's context",
        side_by_side(enter(old_ctx), enter(new_ctx), calls, repeats, device),
    )
    yield (
        "a",
        "amp off: a bare nullcontext (the floor)",
        side_by_side(enter(old_ctx), enter(floor), calls, repeats, device),
    )


def bn_stack(blocks: int = 20, width: int = 8) -> nn.Module:
    """Many BatchNorm layers and few weights: the buffer copies' host cost, not the lerp's arithmetic."""
    layers = [nn.Conv2d(1, width, 3, padding=1)]
    for _ in range(blocks):
        layers += [nn.Conv2d(width, width, 3, padding=1, bias=False), nn.BatchNorm2d(width), nn.ReLU()]
    return nn.Sequential(*layers)


def case_ema(device, calls, repeats):
    torch.manual_seed(0)
    models = {
        "ConvNet (2 BatchNorm, 6 buffers)": ConvNet().to(device),
        "20 conv + BatchNorm blocks, 8 channels (60 buffers)": bn_stack().to(device),
    }
    if device.type == "cuda":
        models["ResNet9 (8 BatchNorm, 24 buffers)"] = build_model("resnet9", 3, 32, 32, 10).to(device)
    for name, model in models.items():
        old, new = OldEMA(model, 0.999), EMA(model, 0.999)
        result = side_by_side(lambda: old.update(model), lambda: new.update(model), calls, repeats, device)
        same = all(torch.equal(a, b) for a, b in zip(old.state_dict().values(), new.state_dict().values()))
        yield "b", f"EMA.update, {name}", {**result, "same_result": same}


def case_schedule(device, calls, repeats):
    total = (repeats * calls + max(3, calls // 10)) + 10  # every timed step inside the schedule
    cfg = TrainConfig(schedule="onecycle", warmup_frac=0.15, lr=0.1)

    def make():
        return torch.optim.SGD(nn.Linear(4, 4).to(device).parameters(), lr=0.1, momentum=0.9)

    old_opt, new_opt = make(), make()
    old = old_schedule(old_opt, "onecycle", total, 0.15)
    new = build_schedule(new_opt, cfg, total)
    old_opt.step(), new_opt.step()  # before the schedules' steps, as in training: no warning
    result = side_by_side(old.step, new.step, calls, repeats, device)
    same = old.get_last_lr() == new.get_last_lr() and old.last_epoch == new.last_epoch
    yield "c", f"schedule step, onecycle over {total} steps ({type(new).__name__})", {**result, "same_result": same}


def classification_values(device):
    torch.manual_seed(0)
    model, task = ConvNet().to(device), Classification(classes=10)
    x, y = torch.randn(128, 1, 28, 28, device=device), torch.randint(0, 10, (128,), device=device)
    loss, logits = task.loss(model, (x, y))
    loss.backward()
    norm = nn.utils.clip_grad_norm_(model.parameters(), 1.0, foreach=True)
    return task, task.measure(loss, logits, (x, y)), norm


def case_accumulator(device, calls, repeats):
    task, values, norm = classification_values(device)
    old, new = OldAccumulator(task.names, device), Accumulator(task.names, device)
    result = side_by_side(lambda: old.add(values), lambda: new.add(values), calls, repeats, device)
    yield "d", "Accumulator.add, Classification (loss, accuracy)", {**result, "same_result": same_sums(old, new)}
    names = task.names + ("grad_norm",)
    old, new = OldAccumulator(names, device), Accumulator(names, device)
    step_values, norm_values = values + [(0.0, 0.0)], [(0.0, 0.0)] * len(task.names) + [(norm, 1)]

    def both(acc):
        def fn():
            acc.add(step_values)
            acc.add(norm_values)

        return fn

    result = side_by_side(both(old), both(new), calls, repeats, device)
    yield "d", "Accumulator.add x2, Classification + --clip-grad-norm", {**result, "same_result": same_sums(old, new)}


def same_sums(old: OldAccumulator, new: Accumulator) -> bool:
    """Both accumulated the same calls: the same float64 bits, on the device and on the host."""
    return (
        torch.equal(old.sums.view(torch.int64), new.sums.view(torch.int64))
        and torch.equal(old.counts.view(torch.int64), new.counts.view(torch.int64))
        and old.host_sums + old.host_counts == new.host_sums + new.host_counts
    )


def case_step(ctx, calls, repeats, batch):
    """Engine._step of the ConvNet, EMA on, amp off: the old pieces swapped in, or not."""
    device = ctx.device
    steps = 2 * (repeats * calls + max(3, calls // 10))  # both sides step the one optimizer
    with tempfile.TemporaryDirectory() as run_dir:
        cfg = TrainConfig(
            dataset="synthetic",
            synthetic_shape="1,28,28",
            synthetic_size=batch * 16,
            synthetic_classes=10,
            model="convnet",
            batch_size=batch,
            lr=0.1,
            schedule="onecycle",
            warmup_frac=0.15,
            ema=0.999,
            amp="none",
            epochs=steps // 16 + 2,  # 16 steps an epoch: every timed step inside the schedule's table
            num_workers=0,
            device=device.type,
            progress=False,
            plots=False,
            log_every=10**6,
            run_dir=run_dir,
        ).resolved()
        torch.manual_seed(0)
        engine = Engine(cfg, ctx, build_model("convnet", 1, 28, 28, 10), load_dataset(cfg), Classification(classes=10))
        batches = engine.train_src.batches(0)
        micro = [(next(batches),) for _ in range(8)]
        batches.close()
        new_parts = (engine.autocast, engine.sched, engine.ema, engine.acc)
        old_parts = (
            torch.autocast(device.type, enabled=False),
            old_schedule(engine.opt, cfg.schedule, engine.total_steps, cfg.warmup_frac),
            OldEMA(engine.raw, cfg.ema),
            OldAccumulator(engine.acc.names, device),
        )
        i = [0]

        def step(parts):
            def fn():
                engine.autocast, engine.sched, engine.ema, engine.acc = parts
                engine._step(micro[i[0] % len(micro)])
                i[0] += 1

            return fn

        result = side_by_side(step(old_parts), step(new_parts), calls, repeats, device, wall=True)
        engine.log.close(True)
    yield "e", f"Engine._step, ConvNet batch {batch}, EMA, amp off ({device.type})", result


# ------------------------------------------------------------------ main
def markdown(rows: list[dict]) -> str:
    lines = ["| cut | what | old µs | new µs | new/old | saved µs |", "|---|---|---:|---:|---:|---:|"]
    for r in rows:
        lines.append(
            f"| {r['cut']} | {r['name']} | {r['old_us']:.2f} | {r['new_us']:.2f} | "
            f"{r['new_over_old']:.2f} | {r['saved_us']:.2f} |"
        )
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    p.add_argument("--repeats", type=int, default=21, help="timed blocks per side and row (medians)")
    p.add_argument("--scale", type=float, default=1.0, help="multiplies the calls per timed block")
    p.add_argument("--quick", action="store_true", help="3 repeats of few calls, batch 16: exercises the script (CI)")
    p.add_argument("--batch-size", type=int, default=128, help="the whole-step row's batch (e)")
    p.add_argument("--no-step", action="store_true", help="leave out the whole-step row (e)")
    p.add_argument("--out", type=Path, required=True, help="the JSON written")
    args = p.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        p.error("--device cuda: no CUDA device here")
    repeats = 3 if args.quick else args.repeats
    scale = 0.01 if args.quick else args.scale

    def n(calls: int) -> int:
        return max(2, int(calls * scale))

    rows = []
    with distributed(args.device) as ctx:
        device = ctx.device
        cases = [
            case_autocast(device, n(20_000), repeats),
            case_ema(device, n(2_000), repeats),
            case_schedule(device, n(20_000), repeats),
            case_accumulator(device, n(5_000), repeats),
        ]
        if not args.no_step:
            cases.append(case_step(ctx, n(100), repeats, 16 if args.quick else args.batch_size))
        for case in cases:
            for cut, name, result in case:
                rows.append({"cut": cut, "name": name, **result})
                print(f"  {cut}) {name}: {result['old_us']:.2f} -> {result['new_us']:.2f} µs", file=sys.stderr)
        threads = torch.get_num_threads()
    info = {
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "torch": torch.__version__,
        "python": sys.version.split()[0],
        "threads": threads,
        "quick": args.quick,
        "repeats": repeats,
        "date": time.strftime("%Y-%m-%d"),
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"environment": info, "rows": rows}, indent=2) + "\n")
    quick = " (--quick: these figures exercise the script, they measure nothing)" if args.quick else ""
    print(f"{info['device']}, torch {info['torch']}, {threads} threads, median of {repeats} repeats{quick}\n")
    print(markdown(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
