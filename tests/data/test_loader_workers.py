"""A rank's DataLoader workers: SIGTERM from outside the rank (SLURM signals every process of a job
step) ignored, the rank's own obeyed, so a rank that exits with its loader alive still exits."""

from __future__ import annotations

import signal

import pytest
from clirun import run_python

SCRIPT = """
import os, subprocess
from types import SimpleNamespace
import torch
from user_code import Draws
from ddpkit.data.loader import LoaderSource
from ddpkit.ranks.context import DistContext

if __name__ == "__main__":
    flags = SimpleNamespace(seed=0, channels_last=False, num_workers=2)
    src = LoaderSource(Draws(64), None, flags, DistContext(0, 0, 1, 1, torch.device("cpu"), "gloo"), 4)
    first = list(src.batches(0))  # both workers have started and served batches
    pids = [w.pid for w in src.loader._iterator._workers]
    for pid in pids:
        subprocess.run(["kill", "-TERM", str(pid)], check=True)  # from another process, as SLURM sends it
    second = list(src.batches(1))
    alive = all(os.path.exists(f"/proc/{pid}") for pid in pids)
    print("BATCHES", len(first), len(second), "ALIVE", alive, flush=True)
    # Exits with the loader alive: multiprocessing's exit handler sends the workers SIGTERM and joins them
"""


@pytest.mark.multiprocess
@pytest.mark.skipif(not hasattr(signal, "sigwaitinfo"), reason="the sender of a signal is known on Linux only")
def test_workers_ignore_sigterm_from_outside_and_obey_their_rank():
    """Regression: a SIGTERM sent to every process of the job killed the workers, and their rank raised
    "DataLoader worker is killed by signal: Terminated" mid-step instead of saving its snapshot."""
    proc = run_python("-c", SCRIPT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "BATCHES 16 16 ALIVE True" in proc.stdout, proc.stdout + proc.stderr[-3000:]
