"""A dataset that draws random numbers in ``__getitem__`` (a random window, noise from torch, numpy and
Python's random) and a model that draws in its forward (dropout, numpy, random), trained through the
CLI at world 2 on the DataLoader path: stopped mid-epoch by SIGTERM to every process of the job (as
SLURM sends it, DataLoader workers included), rerun, SIGKILLed mid-epoch and restarted, it ends
bitwise where an uninterrupted run ends, with 0 workers and with 2.

The faults are rank 1's, sent at a chosen training forward (``user_code.DrawingMLP``), so every run
stops at the same step whatever the machine's load.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
from pathlib import Path

import pytest
import torch
from clirun import read_jsonl, run_cli
from once import once

pytestmark = pytest.mark.multiprocess  # every test here starts processes

STEPS_PER_EPOCH = 12  # 96 samples, a global batch of 8


def train(run_dir: Path, workers: int, fault: str = "") -> subprocess.CompletedProcess:
    args = [
        *("train", "--model", "user_code:DrawingMLP", "--dataset", "user_code:augmenting_data"),
        *("--data-path", "loader", "--num-workers", str(workers), "--nproc", "2", "--device", "cpu"),
        *("--batch-size", "8", "--epochs", "2", "--lr", "0.05", "--log-every", "1", "--save-every-steps", "5"),
        *("--max-restarts", "1", "--no-progress", "--no-plots", "--run-dir", str(run_dir)),
    ]
    # its own process group (run_cli's always are), which the SIGTERM fault signals whole
    return run_cli(*args, DDPKIT_TEST_FAULT=fault)


def weights(run_dir: Path) -> dict:
    return torch.load(run_dir / "model.pt", map_location="cpu", weights_only=True)


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory) -> Path:
    """Once per pytest run, shared by both parameters on any worker (tests/helpers/once.py)."""

    def make(where: Path) -> None:
        done = train(where / "run", workers=2)
        assert done.returncode == 0, done.stderr

    return once(tmp_path_factory, "random-resume", make) / "run"


@pytest.mark.slow
@pytest.mark.parametrize("workers", [0, 2])
def test_random_draws_resume_bitwise_after_sigterm_and_sigkill(tmp_path, uninterrupted, workers):
    run_dir = tmp_path / "run"
    stopped = train(run_dir, workers, fault="term@7")
    assert stopped.returncode == 128 + signal.SIGTERM, stopped.stderr
    assert "stopped on SIGTERM" in stopped.stderr
    finished = train(run_dir, workers, fault="kill@9")
    assert finished.returncode == 0, finished.stderr
    assert "rank 1 was killed (SIGKILL)" in finished.stderr, finished.stderr

    records = [r for r in read_jsonl(run_dir / "metrics.jsonl") if r["event"] == "start"]
    assert all("each sample read under its own seeds (seed, epoch, sample)" in r["data"] for r in records)
    starts = [r["resumed_at_step"] for r in records]
    assert len(starts) == 3 and starts[0] is None, starts
    assert all(step % STEPS_PER_EPOCH for step in starts[1:]), starts  # both resumes mid-epoch
    assert starts[1] < STEPS_PER_EPOCH < starts[2], starts  # one in each epoch
    mine, reference = weights(run_dir), weights(uninterrupted)
    assert mine.keys() == reference.keys()
    assert [k for k in mine if not torch.equal(mine[k], reference[k])] == []
    # The test split's draws too: every evaluation fetches each batch under its own seeds
    summary, expected = (json.loads((d / "summary.json").read_text()) for d in (run_dir, uninterrupted))
    assert summary["test_loss"] == expected["test_loss"] and summary["steps"] == 2 * STEPS_PER_EPOCH
    assert os.listdir(run_dir / "checkpoints")
