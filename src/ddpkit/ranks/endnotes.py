"""What a worker leaves its launcher as its work ends, beside the agent's per-worker error file
(``TORCHELASTIC_ERROR_FILE``), for a launcher that was sent a stop signal after that: so that it can tell a
job interrupted in its work from one interrupted in its teardown (the porter's item G, issue 42).

    note_returned(result)               # each worker, once its entry returned: its global rank and result
    note_run_end(run_dir, step, epoch, rerun)  # global rank 0, once the run's last files are whole (the session)
    read_returned(log_dir, nproc)       # the launcher: every local worker's result, or None
    read_run_end(log_dir)               # the launcher: rank 0's note, or None

Written only under ddpkit's own launcher (torchrun reads no such note). A note is written whole (a temporary
file, then a rename), so a worker stopped as it writes leaves none, and its launcher says it was interrupted.
Only the newest attempt's notes are read: a restarted job's earlier attempt finished nothing.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import pickle
import re
from pathlib import Path
from typing import Any

from ..errors import RunDirError
from ..files import atomic_write
from . import env as names

RETURNED = "returned.pkl"  # (global rank, the entry's result), pickled
RUN_END = "run_end.json"  # {"run_dir", "step", "epoch", "rerun"}
# A result bigger than this, pickled, is not kept (a user's launch(fn) may return a model's weights): its
# launcher, stopped after the workers returned, then says it was interrupted, as before these notes. The pickling
# stops there too, so a big result costs no more than this much of a second pickling
RESULT_MAX_BYTES = 64 * 2**20
_ATTEMPT = re.compile(r"attempt_(\d+)$")


def _beside_error_file(name: str) -> Path | None:
    error_file = os.environ.get(names.ERROR_FILE)
    if not error_file or not os.environ.get(names.LAUNCHER_PID):  # torchrun's worker, or not a worker
        return None
    return Path(error_file).with_name(name)


class _TooBig(Exception):
    pass


class _Capped(io.RawIOBase):
    """A file that takes at most ``RESULT_MAX_BYTES``: a bigger result stops being pickled there."""

    def __init__(self, fh) -> None:
        self.fh, self.size = fh, 0

    def writable(self) -> bool:
        return True

    def write(self, data) -> int:
        self.size += len(data)
        if self.size > RESULT_MAX_BYTES:
            raise _TooBig
        return self.fh.write(data)


def note_returned(result: Any) -> None:
    """This worker's entry returned ``result`` (a script: None): its work is done, its teardown may remain."""
    path = _beside_error_file(RETURNED)
    if path is None:
        return
    tmp = path.with_name(path.name + ".tmp")
    try:
        with open(tmp, "wb") as fh:
            pickle.dump((names.env_rank(), result), _Capped(fh))
        os.replace(tmp, path)
    except Exception:  # noqa: BLE001 - too big, unpicklable (torch's agent says so) or unwritable: no note
        tmp.unlink(missing_ok=True)


def note_run_end(run_dir: str | Path, step: int, epoch: int, rerun: str) -> None:
    """Global rank 0: the run in ``run_dir`` ended at ``step`` and its files are whole; ``rerun``: what the same
    command run again does (a face's own words)."""
    path = _beside_error_file(RUN_END)
    if path is not None:
        note = {"run_dir": str(run_dir), "step": step, "epoch": epoch, "rerun": rerun}
        # a note is a courtesy to the launcher: without it, a late stop reads as an interruption
        with contextlib.suppress(RunDirError):
            atomic_write(path, json.dumps(note).encode())


def _newest_attempt(log_dir: str | Path) -> list[Path]:
    """The per-worker folders of the newest attempt (``LOG_DIR/RUN_ID/attempt_N/LOCAL_RANK``, torch's layout)."""
    attempts = [p for p in Path(log_dir).glob("*/attempt_*") if _ATTEMPT.search(p.name) and p.is_dir()]
    if not attempts:
        return []
    newest = max(attempts, key=lambda p: int(_ATTEMPT.search(p.name).group(1)))
    return [p for p in newest.iterdir() if p.is_dir()]


def read_returned(log_dir: str | Path, nproc: int) -> dict[int, Any] | None:
    """Every one of this node's ``nproc`` workers' results by global rank, when each left its note; else None."""
    results = {}
    for folder in _newest_attempt(log_dir):
        try:
            rank, result = pickle.loads((folder / RETURNED).read_bytes())
        except Exception:  # noqa: BLE001 - no note (or a torn one): that worker did not return
            continue
        results[rank] = result
    return results if len(results) == nproc else None


def read_run_end(log_dir: str | Path) -> dict | None:
    for folder in _newest_attempt(log_dir):
        try:
            return json.loads((folder / RUN_END).read_text())
        except (OSError, ValueError):
            continue
    return None
