"""What fault tolerance costs: snapshot save time, and restart-to-first-step time.

    python benchmarks/faults.py                 # both, on this machine (CPU)
    python benchmarks/faults.py --json out.json

(1) Snapshot save: ``Checkpointer.save`` of a full training state (model, SGD momentum,
    schedule, RNG of every rank, accumulators) at world size 1, median of --repeats saves,
    for the MNIST ConvNet and resnet9 (CIFAR shape); the time includes serialisation,
    fsync and rename. The file size is reported alongside.
(2) Restart: ``ddpkit train --nproc 2 --max-restarts 1`` on MNIST; one worker is SIGKILLed
    after step --kill-after-step, and the figure is the wall time from the kill to the first
    step logged by the restarted group (the agent noticing, stopping the survivor, a new
    rendezvous, process start, data load, snapshot load, and one step).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from ddpkit import TrainConfig  # noqa: E402
from ddpkit.models import build_model  # noqa: E402
from ddpkit.ranks.context import distributed  # noqa: E402
from ddpkit.run.checkpoint import Checkpointer  # noqa: E402
from ddpkit.train.optim import build_optimizer, build_schedule  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]


def snapshot_save_s(model_name: str, shape: tuple[int, int, int], repeats: int) -> dict:
    work = Path(tempfile.mkdtemp(prefix="ddpkit-bench-snap-"))
    try:
        cfg = TrainConfig(dataset="synthetic", model=model_name, run_dir=str(work), device="cpu").resolved()
        with distributed("cpu") as ctx:
            model = build_model(model_name, *shape, 10)
            opt = build_optimizer(model, cfg, ctx.device)
            model(torch.randn(2, *shape)).sum().backward()
            opt.step()  # momentum buffers exist, as in a real snapshot
            sched = build_schedule(opt, cfg, 1000)
            ckpt = Checkpointer(work, ctx, cfg, keep=2)
            times = []
            for step in range(repeats):
                state = {
                    "model": model.state_dict(),
                    "optimizer": opt.state_dict(),
                    "scheduler": sched.state_dict(),
                    "rank_state": {"acc": torch.zeros(2, dtype=torch.float64)},
                }
                t = time.perf_counter()
                path = ckpt.save(state, step)
                times.append(time.perf_counter() - t)
            size = path.stat().st_size
        params = sum(p.numel() for p in model.parameters())
        return {"model": model_name, "params": params, "file_mb": size / 2**20, "save_s": statistics.median(times)}
    finally:
        shutil.rmtree(work, ignore_errors=True)


def worker_pids(launcher: int) -> list[int]:
    """The workers: children of the launcher's forkserver, or children of the launcher, spawned
    (spawn_main), a ``ddpkit run`` script's (script_child) or forked (the launcher's own command line and
    name). A forkserver says so in its
    command line, or, forked rather than exec'd (the tests' warm interpreter: tests/helpers/zygote.py),
    in its name."""

    def read(pid: int) -> tuple[bytes, str]:
        proc = Path("/proc") / str(pid)
        return (proc / "cmdline").read_bytes(), (proc / "comm").read_text().strip()

    def kids(pid: int) -> list[tuple[int, tuple[bytes, str]]]:
        out = []
        for entry in Path("/proc").iterdir():
            try:
                if entry.name.isdigit() and int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1]) == pid:
                    out.append((int(entry.name), read(int(entry.name))))
            except (OSError, IndexError):
                pass
        return out

    own = read(launcher)
    found = []
    for pid, (cmd, name) in kids(launcher):
        if b"forkserver" in cmd or name == "forkserver":
            found += [child for child, _ in kids(pid)]
        elif b"spawn_main" in cmd or b"script_child" in cmd or (cmd, name) == own:
            found.append(pid)
    return sorted(found)


def src_env(src: Path = ROOT / "src") -> dict:
    """os.environ with ``src`` first on PYTHONPATH; what was there stays behind it (dependencies
    installed with ``pip --target``, as on a GPU machine that cannot reach an index)."""
    rest = os.environ.get("PYTHONPATH")
    return {**os.environ, "PYTHONPATH": str(src) + (os.pathsep + rest if rest else "")}


def train_killing_one_worker(args: list[str], run_dir: Path, kill_after_step: int) -> tuple[int, float]:
    """``ddpkit train ARGS --run-dir RUN_DIR`` (with restarts allowed in ARGS); SIGKILL the newest
    worker once a step record at or after ``kill_after_step`` is logged. Returns (exit code, kill time)."""
    cmd = [sys.executable, "-m", "ddpkit", "train", *args, "--run-dir", str(run_dir)]
    proc = subprocess.Popen(
        cmd, env=src_env(), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True
    )
    try:
        metrics = run_dir / "metrics.jsonl"
        while True:
            assert proc.poll() is None, "the run ended before the kill"
            lines = metrics.read_text().splitlines() if metrics.exists() else []
            steps = [json.loads(line) for line in lines if line.endswith("}")]
            if any(r.get("event") == "step" and r["step"] >= kill_after_step for r in steps):
                break
            time.sleep(0.01)
        workers = worker_pids(proc.pid)
        killed_at = time.time()
        os.kill(max(workers), signal.SIGKILL)
        return proc.wait(timeout=600), killed_at
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)


def restart_to_first_step_s(kill_after_step: int) -> dict:
    work = Path(tempfile.mkdtemp(prefix="ddpkit-bench-restart-"))
    run_dir = work / "run"
    args = [
        "--dataset",
        "mnist",
        "--nproc",
        "2",
        "--epochs",
        "1",
        "--lr",
        "0.05",
        "--log-every",
        "1",
        "--save-every-steps",
        "10",
        "--max-restarts",
        "1",
        "--no-progress",
        "--device",
        "cpu",
    ]
    try:
        exit_code, killed_at = train_killing_one_worker(args, run_dir, kill_after_step)
        records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
        restart = next(i for i, r in enumerate(records) if r["event"] == "start" and r.get("resumed_at_step"))
        first = next(r for r in records[restart:] if r["event"] == "step")
        return {
            "exit_code": exit_code,
            "resumed_at_step": records[restart]["resumed_at_step"],
            "restart_to_first_step_s": first["time"] - killed_at,
            "restart_to_start_event_s": records[restart]["time"] - killed_at,
        }
    finally:
        shutil.rmtree(work, ignore_errors=True)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--kill-after-step", type=int, default=15)
    p.add_argument("--json", type=Path)
    args = p.parse_args(argv)
    figures = {
        "torch": str(torch.__version__),
        "snapshots": [
            snapshot_save_s("convnet", (1, 28, 28), args.repeats),
            snapshot_save_s("resnet9", (3, 32, 32), args.repeats),
        ],
        "restart": restart_to_first_step_s(args.kill_after_step),
    }
    for s in figures["snapshots"]:
        print(
            f"snapshot save  {s['model']:8s} {s['params'] / 1e6:6.2f} M params  {s['file_mb']:7.1f} MiB  "
            f"{1e3 * s['save_s']:8.1f} ms (median of {args.repeats})"
        )
    r = figures["restart"]
    print(
        f"restart        SIGKILL -> first step of the restarted group: {r['restart_to_first_step_s']:.2f} s "
        f"(start event after {r['restart_to_start_event_s']:.2f} s; resumed at step {r['resumed_at_step']}; "
        f"exit {r['exit_code']})"
    )
    if args.json:
        args.json.write_text(json.dumps(figures, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
