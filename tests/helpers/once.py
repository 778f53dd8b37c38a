"""A fixture's work done once per pytest run, shared by every xdist worker: for the uninterrupted reference
runs that several tests compare against.

    @pytest.fixture(scope="module")
    def uninterrupted(tmp_path_factory) -> Path:
        return once(tmp_path_factory, "fault-tolerance-a", lambda where: train(where / "run"))

``pytest -n 3 --dist worksteal`` may hand tests of one module to several workers, and a module-scoped fixture
then runs in each (a world-2 reference run: 10-50 s on a loaded 2-core machine). Here the first worker to
ask computes into a folder all see, under a file lock; the others wait on the lock and read it.
"""

from __future__ import annotations

import fcntl
import os
import shutil
from pathlib import Path
from typing import Callable


def once(tmp_path_factory, name: str, make: Callable[[Path], None]) -> Path:
    """The folder ``make(folder)`` filled, made once per pytest run under ``name``.

    A ``make`` that raises leaves nothing behind: the next test to ask tries again, and fails as the first
    did, so each test still reports the reference run's failure."""
    root = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        root = root.parent  # pytest-N/, above each worker's popen-gwK/
    where, done = root / f"once-{name}", root / f"once-{name}.done"
    with open(root / f"once-{name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # held while the first worker computes; released when the file closes
        if not done.exists():
            shutil.rmtree(where, ignore_errors=True)  # what a failed try left
            where.mkdir()
            make(where)
            done.touch()
    return where
