"""What a snapshot costs the step: written in the background (``--async-snapshots``, the default) against
written in the step (``--no-async-snapshots``) and against no snapshots during the run, side by side.

    python benchmarks/async_snapshots.py                  # ResNet-9 + SGD momentum, world 2 on the CPU
    python benchmarks/async_snapshots.py --steps 40 --every 10 --rounds 1    # a quick look
    python benchmarks/async_snapshots.py --strategy fsdp2                    # every rank writes its shards
    python benchmarks/async_snapshots.py --device cuda --nproc 1 --optimizer adam \
        --model torchvision.models:vit_l_16 --model-args '{"num_classes": 10, "image_size": 32}'  # 3.4 GiB of state

The run (by default): ``ddpkit train`` of ResNet-9 (6.57 M parameters; with SGD's momentum a 50 MiB snapshot) on
synthetic CIFAR-shaped data, 2 processes, one epoch of ``--steps`` optimizer steps, a snapshot every ``--every`` steps.
The three modes run interleaved, round after round, so a slow spell of the machine hits each alike. Each
run's figures come from its summary.json: ``snapshot_blocked_ms_median`` (rank 0's time held per snapshot: in
the background the gather and the copy aside, in the step the whole write), ``train_time_s`` (the steps,
with the in-step snapshots), and the process's wall time. The run with no snapshots during the epoch still
writes the one at its end, as the others do.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MODES = {
    "none": ["--save-every-steps", "0"],
    "in the step": ["--no-async-snapshots"],
    "background": ["--async-snapshots"],
}


def run(mode: str, args, run_dir: Path) -> dict:
    every = [] if mode == "none" else ["--save-every-steps", str(args.every)]
    cmd = [
        sys.executable,
        "-m",
        "ddpkit",
        "train",
        "--dataset",
        "synthetic",
        "--synthetic-size",
        str(args.steps * args.batch_size),
        "--image-size",
        "32",
        "--model",
        args.model,
        *(["--model-args", args.model_args] if args.model_args else []),
        "--optimizer",
        args.optimizer,
        "--lr",
        "0.05",
        "--batch-size",
        str(args.batch_size),
        "--limit-test",
        str(args.batch_size),
        "--epochs",
        "1",
        "--nproc",
        str(args.nproc),
        "--device",
        args.device,
        "--no-progress",
        "--no-plots",
        "--run-dir",
        str(run_dir),
        "--strategy",
        args.strategy,
        *every,
        *MODES[mode],
    ]
    t = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True)
    wall = time.perf_counter() - t
    if proc.returncode != 0:
        raise RuntimeError(f"{mode}: {proc.stderr[-3000:]}")
    s = json.loads((run_dir / "summary.json").read_text())
    return {
        "wall_s": wall,
        "train_time_s": s["train_time_s"],
        "snapshots_saved": s["snapshots_saved"],
        "blocked_ms_median": s["snapshot_blocked_ms_median"],
        "snapshots": s["snapshots"],
    }


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=200, help="optimizer steps in the run (one epoch)")
    p.add_argument("--every", type=int, default=50, help="a snapshot every N steps")
    p.add_argument("--batch-size", type=int, default=64, help="the global batch")
    p.add_argument("--rounds", type=int, default=2, help="interleaved rounds; figures are medians")
    p.add_argument("--json", type=Path, help="write the figures here")
    p.add_argument("--device", default="cpu", help="cpu or cuda")
    p.add_argument("--nproc", type=int, default=2, help="processes (ranks)")
    p.add_argument("--model", default="resnet9", help="ddpkit train --model (a registry name or pkg.module:function)")
    p.add_argument("--model-args", default="", help="ddpkit train --model-args (JSON)")
    p.add_argument("--optimizer", default="sgd", help="sgd (with momentum), adam or adamw")
    p.add_argument("--strategy", default="ddp", help="ddp, or fsdp2 (each rank's shards written by every rank)")
    args = p.parse_args(argv)
    work = Path(tempfile.mkdtemp(prefix="ddpkit-async-snapshots-"))
    runs: dict = {mode: [] for mode in MODES}
    for r in range(args.rounds):
        for mode in MODES:
            runs[mode].append(run(mode, args, work / f"{mode.replace(' ', '-')}-{r}"))
            print(f"round {r} {mode}: {runs[mode][-1]}", file=sys.stderr)
    med = {
        mode: {k: statistics.median(x[k] for x in rs) for k in ("wall_s", "train_time_s", "blocked_ms_median")}
        for mode, rs in runs.items()
    }
    base = med["none"]
    print(
        f"{args.model} + {args.optimizer} under {args.strategy}, world {args.nproc} on {args.device} "
        f"({platform.processor() or platform.machine()}), {args.steps} steps, "
        f"a snapshot every {args.every}; median of {args.rounds} interleaved round(s)\n"
    )
    print("| snapshots | held per snapshot (ms, median) | train time (s) | vs none | wall (s) | vs none |")
    print("|---|---|---|---|---|---|")
    for mode, m in med.items():
        print(
            f"| {mode} | {m['blocked_ms_median']:.1f} | {m['train_time_s']:.2f} | "
            f"{m['train_time_s'] / base['train_time_s']:.3f} | {m['wall_s']:.2f} | {m['wall_s'] / base['wall_s']:.3f} |"
        )
    if args.json:
        args.json.write_text(
            json.dumps({"config": {**vars(args), "json": None}, "runs": runs, "median": med}, indent=1)
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
