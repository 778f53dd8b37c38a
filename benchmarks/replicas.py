"""Live recovery (``--replicas 2``) against a whole-job restart (``--max-restarts``), on the same run.

    python benchmarks/replicas.py                 # MNIST ConvNet, 2 groups of 1 process, 3 kills of group 1
    python benchmarks/replicas.py --kills 1 --json out.json
    python benchmarks/replicas.py --loop          # the same on a ddpkit.Loop: examples/live_recovery.py, ddpkit run

(1) Live recovery: ``ddpkit train --replicas 2 --max-restarts K``, one step record per step (``--log-every 1``);
    group 1's worker is SIGKILLed K times (after step --first, then every --every steps of group 0). For each kill:
    the seconds from the kill to group 1's first committed step (its agent's restart, a fresh process, its data,
    the heal from group 0, one step), and group 0's stall (from the kill to its next committed step: the step in
    flight fails, and is computed again). Then group 1 is lost for good (its agent killed too): group 0's steps/s
    alone, computing both shares of every step, against its steps/s over the --every/2 steps before. Group 0
    never exits.
(2) The same run with plain DDP (``--nproc 2 --max-restarts 1``, ``benchmarks/faults.py``'s method): a worker
    SIGKILLed after step --first, and the seconds from the kill to the first step of the restarted job.
(3) The step without faults: ``--replicas 2`` against ``--nproc 2`` (DDP), steps/s over the run's second half.

``--loop``: (1) and (3) for a user's own loop, ``ddpkit run [--replicas 2 | --nproc 2] examples/live_recovery.py``
(the same ConvNet, batch and data, a cosine schedule; its step records every step); (2) is ``ddpkit train``'s.

Each group is one process, on its own half of the machine's cores (ranks/replicas.py); the DDP run's 2 ranks
take one core's threads each.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from faults import src_env, train_killing_one_worker, worker_pids  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]


def base_args(steps: int) -> list[str]:
    return [
        *("--dataset", "mnist", "--limit-train", str(steps * 128), "--batch-size", "128", "--epochs", "1"),
        *("--lr", "0.05", "--log-every", "1", "--save-every-steps", "50", "--no-progress", "--no-plots"),
        *("--device", "cpu"),
    ]


def records(run_dir: Path) -> list[dict]:
    path = run_dir / "metrics.jsonl"
    lines = path.read_text().splitlines() if path.exists() else []
    return [json.loads(line) for line in lines if line.endswith("}")]


def steps(run_dir: Path) -> list[dict]:
    return [r for r in records(run_dir) if r["event"] == "step"]


def group_launcher(parent: int, group: int) -> int | None:
    """The pid of group ``group``'s launcher: the parent's child whose environment names that group."""
    for entry in Path("/proc").iterdir():
        try:
            if not entry.name.isdigit():
                continue
            if int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1]) != parent:
                continue
            if f"DDPKIT_REPLICA={group}".encode() in (entry / "environ").read_bytes().split(b"\0"):
                return int(entry.name)
        except (OSError, IndexError):
            pass
    return None


def command(args, extra: list[str], run_dir: Path) -> list[str]:
    """The run: ``ddpkit train`` on the MNIST ConvNet, or (``--loop``) examples/live_recovery.py's Loop under
    ``ddpkit run``; ``extra``: its launch flags."""
    if args.loop:
        script = [str(ROOT / "examples" / "live_recovery.py"), "--steps", str(args.steps), "--log-every", "1"]
        return [sys.executable, "-m", "ddpkit", "run", *extra, *script, "--run-dir", str(run_dir)]
    return [sys.executable, "-m", "ddpkit", "train", *base_args(args.steps), *extra, "--run-dir", str(run_dir)]


def rate(rs: list[dict]) -> float:
    """Steps per second over consecutive step records."""
    return (rs[-1]["step"] - rs[0]["step"]) / (rs[-1]["time"] - rs[0]["time"]) if len(rs) > 1 else float("nan")


def live(args) -> dict:
    work = Path(tempfile.mkdtemp(prefix="ddpkit-bench-replicas-"))
    run_dir, other = work / "run", work / "run-group-1"
    cmd = command(args, ["--replicas", "2", "--max-restarts", str(args.kills)], run_dir)
    proc = subprocess.Popen(
        cmd, env=src_env(), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, start_new_session=True
    )
    kills = []
    try:
        for k in range(args.kills):
            at = args.first + k * args.every
            while not any(r["step"] >= at for r in steps(run_dir)):
                assert proc.poll() is None, proc.stderr.read().decode()
                time.sleep(0.01)
            launcher = group_launcher(proc.pid, 1)
            workers = worker_pids(launcher) if launcher else []
            assert workers, "group 1 has no worker"
            killed_at = time.time()
            os.kill(max(workers), signal.SIGKILL)
            kills.append(killed_at)
            # group 1 back: its first step record after the kill
            while not any(r["time"] > killed_at for r in steps(other)):
                assert proc.poll() is None, proc.stderr.read().decode()
                time.sleep(0.01)
        # Lost for good: its agent and worker killed, so nothing restarts it
        at = args.first + args.kills * args.every
        while not any(r["step"] >= at for r in steps(run_dir)):
            assert proc.poll() is None, proc.stderr.read().decode()
            time.sleep(0.01)
        launcher = group_launcher(proc.pid, 1)
        lost_at = time.time()
        for pid in [launcher, *worker_pids(launcher)]:
            os.kill(pid, signal.SIGKILL)
        code = proc.wait(timeout=1200)
        a, b = steps(run_dir), steps(other)
        out = []
        b_all = records(other)
        for killed_at in kills:
            back = min(r["time"] for r in b if r["time"] > killed_at)
            # where the way back went: the new attempt's start record (the agent's restart, the imports, the script
            # to its resume()), and its heal from group 0 (the quorum it met, the state received)
            start = min((r["time"] for r in b_all if r["event"] == "start" and r["time"] > killed_at), default=None)
            heal = min(
                (r["time"] for r in b_all if r.get("change") == "healed" and r["time"] > killed_at), default=None
            )
            before = [r for r in a if r["time"] <= killed_at]
            after = min(r["time"] for r in a if r["time"] > killed_at)
            out.append(
                {
                    "killed_after_step": before[-1]["step"],
                    "back_committing_s": round(back - killed_at, 3),
                    "start_record_s": None if start is None else round(start - killed_at, 3),
                    "healed_s": None if heal is None else round(heal - killed_at, 3),
                    "group_0_stall_s": round(after - killed_at, 3),
                    "group_0_step_s_before": round(1 / rate(before[-(args.every // 2) :]), 4),
                }
            )
        together = [r for r in a if r["time"] <= lost_at][-(args.every // 2) :]
        alone = [r for r in a if r["time"] > lost_at + 2]  # after the stall of the step in flight
        starts = [r for r in records(run_dir) if r["event"] == "start"]
        return {
            "kills": out,
            "lost_for_good": {
                "steps_per_s_together": round(rate(together), 2),
                "steps_per_s_alone": round(rate(alone), 2),
                "kept": round(rate(alone) / rate(together), 3),
                "steps_alone": len(alone),
            },
            "group_0_starts": len(starts),
            "group_0_finished": any(r["event"] in ("summary", "end") for r in records(run_dir)),
            "exit_code": code,  # group 1's loss, said as the job's status (137: SIGKILL)
        }
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        shutil.rmtree(work, ignore_errors=True)


def restart(args) -> dict:
    work = Path(tempfile.mkdtemp(prefix="ddpkit-bench-restart-"))
    run_dir = work / "run"
    try:
        code, killed_at = train_killing_one_worker(
            [*base_args(args.steps), "--nproc", "2", "--max-restarts", "1"], run_dir, args.first
        )
        rs = records(run_dir)
        again = next(i for i, r in enumerate(rs) if r["event"] == "start" and r.get("resumed_at_step") is not None)
        first = next(r for r in rs[again:] if r["event"] == "step")
        return {
            "exit_code": code,
            "restart_to_first_step_s": round(first["time"] - killed_at, 3),
            # the job's every rank resumes from the newest snapshot (--save-every-steps 50): the steps after it
            # are computed again, and the first step record of the new attempt is its first step's
            "killed_after_step": args.first,
            "resumed_at_step": rs[again]["resumed_at_step"],
        }
    finally:
        shutil.rmtree(work, ignore_errors=True)


def steady(args, extra: list[str]) -> float:
    """Steps per second over the second half of an unfaulted run."""
    work = Path(tempfile.mkdtemp(prefix="ddpkit-bench-steady-"))
    try:
        done = subprocess.run(command(args, extra, work / "r"), env=src_env(), capture_output=True, text=True)
        assert done.returncode == 0, done.stderr
        rs = steps(work / "r")
        return rate(rs[len(rs) // 2 :])
    finally:
        shutil.rmtree(work, ignore_errors=True)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=600, help="optimizer steps of the run (global batch 128)")
    parser.add_argument("--first", type=int, default=60, help="the first kill after this step")
    parser.add_argument("--every", type=int, default=100, help="steps between kills")
    parser.add_argument("--kills", type=int, default=3)
    parser.add_argument(
        "--loop", action="store_true", help="a ddpkit.Loop under ddpkit run (examples/live_recovery.py)"
    )
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    result = {
        "machine": f"{platform.machine()}, {os.cpu_count()} CPUs",
        "date": time.strftime("%Y-%m-%d"),
        "workload": "examples/live_recovery.py under ddpkit run" if args.loop else "ddpkit train, MNIST ConvNet",
        "live": live(args),
        "restart": None if args.loop else restart(args),
        "steady_steps_per_s": {
            "replicas 2": round(steady(args, ["--replicas", "2"]), 2),
            "ddp nproc 2": round(steady(args, ["--nproc", "2"]), 2),
        },
    }
    back = [k["back_committing_s"] for k in result["live"]["kills"]]
    result["median_back_committing_s"] = statistics.median(back)
    print(json.dumps(result, indent=2))
    if args.json:
        args.json.write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
