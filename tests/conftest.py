"""Shared helpers: run the real CLI in a subprocess, and build datasets in real on-disk formats."""

from __future__ import annotations

import json
import os
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


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]


# The fault benchmark and the tests find the workers to kill in one way (benchmarks/faults.py).
sys.path.insert(0, str(ROOT / "benchmarks"))
import faults  # noqa: E402

worker_pids = faults.worker_pids


@pytest.fixture
def rng():
    return np.random.default_rng(0)
