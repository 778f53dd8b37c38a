"""SIGUSR1, SLURM's preemption warning (``sbatch --signal=USR1@90``), stops a run as SIGTERM does: a
snapshot at the next log interval, exit 138 (128 + SIGUSR1), and the same command resumes there.

Runs go through the public API in their own process (tests/helpers/custom_train.py), slowed to
0.03 s a step so that the signal lands mid-run.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest
from clirun import ROOT, WAIT_S, read_jsonl, run_python, start_python

pytestmark = pytest.mark.multiprocess  # every test here starts processes

SCRIPT = str(ROOT / "tests" / "helpers" / "custom_train.py")
# 1,000 MNIST images, global batch 100: 10 steps per epoch, 20 in all.
CONFIG = dict(
    dataset="mnist",
    recipe="mnist",
    limit_train=1000,
    limit_test=200,
    batch_size=100,
    lr=0.05,
    epochs=2,
    progress=False,
    device="cpu",
    plots=False,
    log_every=2,
)


def _spec(run_dir: Path, nproc: str) -> str:
    return json.dumps({"fault": "slow", "seconds": 0.03, "config": {**CONFIG, "nproc": nproc, "run_dir": str(run_dir)}})


def _first_step(run_dir: Path, proc: subprocess.Popen, timeout: float = 120) -> None:
    deadline, path = time.monotonic() + timeout, run_dir / "metrics.jsonl"
    while time.monotonic() < deadline:
        assert proc.poll() is None, f"run ended early: {proc.communicate()}"
        if path.exists() and any(r.get("event") == "step" for r in read_jsonl_lenient(path)):
            return
        time.sleep(0.02)
    raise AssertionError("no step record came")


def read_jsonl_lenient(path: Path) -> list[dict]:
    out = []
    for line in path.read_text().splitlines():
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:  # a line being written
            pass
    return out


@pytest.mark.slow
@pytest.mark.parametrize("nproc,to", [("2", "launcher"), ("2", "process group"), ("1", "launcher")])
def test_sigusr1_saves_a_snapshot_exits_138_and_the_rerun_resumes_there(tmp_path, nproc, to):
    """``launcher``: the signal to ddpkit's launcher alone, which forwards it to its workers; ``process
    group``: to every process of the job at once, as SLURM signals every process of a job step; nproc 1:
    the one process trains itself (as each task does under SLURM one task per GPU, or under torchrun)."""
    run_dir = tmp_path / "run"
    cmd = [SCRIPT, _spec(run_dir, nproc)]
    proc = start_python(*cmd)
    try:
        _first_step(run_dir, proc)
        if to == "launcher":
            os.kill(proc.pid, signal.SIGUSR1)
        else:
            os.killpg(proc.pid, signal.SIGUSR1)
        out, err = proc.communicate(timeout=WAIT_S)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == 128 + signal.SIGUSR1 == 138, err
    assert err.count("stopped on SIGUSR1 at step") == 1 and "run the same command again" in err, err
    # Issue 33, case 14: "error: interrupted ..." after the clean stop, and, from the whole process group, the
    # resource tracker killed (9 KeyError tracebacks)
    assert "error" not in err and "Traceback" not in err, err
    stopped = [r for r in read_jsonl(run_dir / "metrics.jsonl") if r["event"] == "stopped"]
    assert [(r["reason"], r["signal"]) for r in stopped] == [("signal", "SIGUSR1")]
    step = stopped[0]["step"]
    assert (run_dir / "checkpoints" / f"snapshot-{step:09d}.pt").exists() and step < 20
    assert not (run_dir / "model.pt").exists()

    again = run_python(*cmd)
    assert again.returncode == 0, again.stderr
    starts = [r for r in read_jsonl(run_dir / "metrics.jsonl") if r["event"] == "start"]
    assert starts[-1]["resumed_at_step"] == step
    assert json.loads((run_dir / "summary.json").read_text())["steps"] == 20
