"""Shared helpers: run the real CLI in a subprocess, and build datasets in real on-disk formats.

Two rules hold for every test here (see ``pytest_runtest_protocol`` below):

- A test that starts a process (ranks, the CLI, torchrun, a forkserver, DataLoader workers) is
  marked ``multiprocess``; an unmarked one that tries fails, naming the marker. So
  ``pytest -m "not multiprocess"`` is a fast loop that starts nothing.
- Nothing depends on the CPU it runs on: ``--recipe auto`` picks by CPU flags, so in-process
  tests see an AVX2-only CPU unless they inject flags, and tests that run MNIST through the CLI
  pin ``--recipe mnist``.
"""

from __future__ import annotations

import gc
import multiprocessing.forkserver
import multiprocessing.process
import multiprocessing.resource_tracker
import multiprocessing.util
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[1]
# The helpers (tests/helpers: the CLI as a user runs it, user code, worker functions) are imported by their
# plain names here and in every process a test starts (clirun.cli_env puts the same folder on PYTHONPATH).
sys.path.insert(0, str(ROOT / "tests" / "helpers"))

# matplotlib builds its font cache on first import, running `fc-list` in a subprocess where the cache is
# cold (a fresh venv): done here, at collection, so no test meets it while processes are refused.
import matplotlib.font_manager  # noqa: E402, F401
from cpu import AVX2_ONLY  # noqa: E402

from ddpkit import recipes  # noqa: E402

REFUSED = pytest.StashKey[list]()


def refuse_processes(mp: pytest.MonkeyPatch, item: pytest.Item) -> None:
    refused = item.stash.setdefault(REFUSED, [])

    def refuse(*args, **kwargs):
        refused.append(f"{item.nodeid} starts a process: mark it @pytest.mark.multiprocess")
        raise AssertionError(refused[-1])

    # Every way a process starts: subprocess, multiprocessing (spawn, fork, and the forkserver and resource
    # tracker: refused even when already running, so the verdict does not depend on what ran before), os.
    for owner, name in (
        (subprocess.Popen, "_execute_child"),
        (multiprocessing.process.BaseProcess, "start"),
        (multiprocessing.util, "spawnv_passfds"),
        (multiprocessing.forkserver, "ensure_running"),
        (multiprocessing.forkserver.ForkServer, "ensure_running"),
        (multiprocessing.resource_tracker, "ensure_running"),
        (multiprocessing.resource_tracker.ResourceTracker, "ensure_running"),
        (os, "fork"),
        (os, "forkpty"),
        (os, "system"),
        (os, "posix_spawn"),
        (os, "posix_spawnp"),
    ):
        mp.setattr(owner, name, refuse)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    """Around a test's whole setup, call and teardown (module fixtures it sets up included):
    the CPU flags pinned, and processes refused unless it is marked ``multiprocess``."""
    mp = pytest.MonkeyPatch()
    mp.setattr(recipes, "cpu_flags", lambda: AVX2_ONLY)
    multiprocess = item.get_closest_marker("multiprocess") is not None
    if not multiprocess:
        refuse_processes(mp, item)
    try:
        yield
    finally:
        if multiprocess:
            # Finalizers of what a launch left (a multiprocessing semaphore's unregister asks the resource
            # tracker to run) run here, where processes are allowed, not in whichever test collects it next
            gc.collect()
        mp.undo()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """A refusal fails its test even where the code under test caught it (``except Exception``)."""
    report = (yield).get_result()
    refused = item.stash.get(REFUSED, [])
    if refused and report.passed:
        report.outcome, report.longrepr = "failed", f"{refused[0]} (the code under test caught the refusal)"
    refused.clear()  # reported once, in the phase where it happened


@pytest.fixture
def rng():
    return np.random.default_rng(0)
