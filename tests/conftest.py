"""Shared helpers: run the real CLI in a subprocess, and build datasets in real on-disk formats.

Two rules hold for every test here (see ``host_independent``):

- A test that starts a process (ranks, the CLI, torchrun, a forkserver, DataLoader workers) is
  marked ``multiprocess``; an unmarked one that tries fails, naming the marker. So
  ``pytest -m "not multiprocess"`` is a fast loop that starts nothing.
- Nothing depends on the CPU it runs on: ``--recipe auto`` picks by CPU flags, so in-process
  tests see an AVX2-only CPU unless they inject flags, and tests that run MNIST through the CLI
  pin ``--recipe mnist``.
"""

from __future__ import annotations

import json
import multiprocessing.process
import multiprocessing.util
import os
import socket
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[1]


def cli_env(**extra) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE")}
    env["PYTHONPATH"] = str(ROOT / "src") + os.pathsep + str(ROOT / "tests") + os.pathsep + env.get("PYTHONPATH", "")
    env.update(extra)
    return env


def run_cli(*args: str, cwd=None, timeout: float = 300, module: str = "ddpkit") -> subprocess.CompletedProcess:
    """``python -m ddpkit ARGS`` as a user would run it; returns the finished process."""
    return subprocess.run([sys.executable, "-m", module, *args], cwd=cwd, env=cli_env(), capture_output=True,
                          text=True, timeout=timeout)


def free_port() -> int:
    """A loopback port nothing listens on now (the kernel's choice), for a test's rendezvous endpoint."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]


# The fault benchmark and the tests find the workers to kill in one way (benchmarks/faults.py).
sys.path.insert(0, str(ROOT / "benchmarks"))
import faults  # noqa: E402

worker_pids = faults.worker_pids


# The flags of the AVX2-only machines (no native bf16): what in-process tests see.
AVX2_ONLY = frozenset({"sse4_2", "avx", "avx2", "fma"})


def refuse_processes(mp: pytest.MonkeyPatch, nodeid: str) -> None:
    def refuse(*args, **kwargs):
        raise AssertionError(f"{nodeid} starts a process: mark it @pytest.mark.multiprocess")

    # Every way a process starts here: subprocess, multiprocessing (spawn, fork, forkserver's own start), os.fork.
    mp.setattr(subprocess.Popen, "_execute_child", refuse)
    mp.setattr(multiprocessing.process.BaseProcess, "start", refuse)
    mp.setattr(multiprocessing.util, "spawnv_passfds", refuse)
    mp.setattr(os, "fork", refuse)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    """Around a test's whole setup, call and teardown (module fixtures it sets up included):
    the CPU flags pinned, and processes refused unless it is marked ``multiprocess``."""
    from ddpkit import recipes

    mp = pytest.MonkeyPatch()
    mp.setattr(recipes, "cpu_flags", lambda: AVX2_ONLY)
    if item.get_closest_marker("multiprocess") is None:
        refuse_processes(mp, item.nodeid)
    try:
        yield
    finally:
        mp.undo()


@pytest.fixture
def rng():
    return np.random.default_rng(0)
