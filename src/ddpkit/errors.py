"""User-facing errors.

A :class:`DdpkitError` is a problem the user can act on (bad flag, missing file, corrupt
data, conflicting run dir, a stalled rank, a diverged loss). The CLI prints its message
on one line and exits with its ``exit_code``; it never shows a traceback for these.
Anything else is a bug and keeps its traceback.

Inside workers, ``all_ranks`` says how an error travels (see :func:`ddpkit.ranks.child.worker_entry`):

* ``True``: every rank raises it at the same step from the same all-reduced facts. The
  workers hand it back to the launcher, which reports it once; the elastic agent does
  not restart them, since a restart would meet the same error again.
* ``False``: raised where one rank saw it. That rank reports it and exits non-zero, so
  the agent stops the others (and restarts the group if ``--max-restarts`` allows).

What ``Trainer.fit()``, ``evaluate()`` and ``ddpkit.launch()`` raise is the same class at every
world size: at 1 the error itself, at 2 or more the launching process raises the class a worker
raised, with its message (the worker records the class name; only the classes in ``__all__`` are
rebuilt, by name). A rank's own error also carries ``rank``, the global rank that met it. Anything
else that ends the workers (an exception of your own code, whose traceback its rank printed, a
``sys.exit``, the launcher interrupted) is a :class:`WorkersFailed`.

    try: Trainer(cfg).fit()
    except NonFiniteLoss: ...       # --on-nan stop, at any world size
    except WorkersFailed: ...       # your code raised in a worker: its rank printed the traceback
"""

import os
import traceback

__all__ = [
    "AlreadyReported",
    "CollectiveTimeout",
    "ConfigError",
    "DataError",
    "DdpkitError",
    "NonFiniteLoss",
    "PeerLost",
    "RunDirError",
    "Stopped",
    "TaskError",
    "WorkersFailed",
]


class DdpkitError(Exception):
    """A problem with the user's input or run, reported as one line."""

    exit_code = 2
    all_ranks = False
    rank: int | None = None  # the global rank that met it, when raised again by the launcher; None at world size 1


class ConfigError(DdpkitError):
    """An invalid flag or config value."""


class DataError(DdpkitError):
    """A dataset that is missing, corrupt or inconsistent."""


class TaskError(ConfigError):
    """A model, batch or metric that does not fit the step contract (see ddpkit.train.task).

    Raised where a rank meets it: preflight catches it once before launch; in a worker
    it is one rank's error, so the others are stopped rather than left waiting."""


class RunDirError(DdpkitError):
    """A run directory that cannot be used as asked (e.g. it holds another config)."""

    all_ranks = True  # workers meet it while every rank loads the same snapshot


class NonFiniteLoss(DdpkitError):
    """The training loss or weights became NaN/Inf (``--on-nan stop``)."""

    all_ranks = True  # decided on an all-reduced value


class Stopped(DdpkitError):
    """A rank received SIGTERM, SIGUSR1 or SIGINT (Ctrl-C); every rank saved a snapshot and stopped."""

    exit_code = 143  # 128 + SIGTERM, as a shell reports a process ended by it; 130 for SIGINT
    all_ranks = True  # decided on an all-reduced flag

    def __init__(self, message: str, signal_name: str = "SIGTERM"):
        super().__init__(message)
        # 128 + the signal's number on Linux: 130 SIGINT, 138 SIGUSR1 (SLURM's --signal=USR1@90, on which an
        # sbatch script runs `scontrol requeue`: the snapshot is saved), 143 SIGTERM and anything else
        self.exit_code = {"SIGINT": 130, "SIGUSR1": 138}.get(signal_name, 143)


class CollectiveTimeout(DdpkitError):
    """A collective did not complete within ``--timeout-s``: a peer stalled or vanished. Also a rank
    aborted as NCCL's watchdog aborts one (SIGABRT), said by the launcher."""

    exit_code = 3


class PeerLost(DdpkitError):
    """A rank was lost: ended by a signal (the launcher names it, from the agent's record of its exit), or,
    where this node's launcher did not see it die, a peer that closed its connection mid-collective."""

    exit_code = 4


class AlreadyReported(DdpkitError):
    """An error from a previous attempt of this job that a restart could not fix (bad data, a task
    mismatch): the restarted workers stop at once; its message was printed when it happened."""

    all_ranks = True  # every restarted rank reads the same note in the run dir

    def __init__(self, message: str, exit_code: int = 2):
        super().__init__(message)
        self.exit_code = exit_code


class WorkersFailed(Exception):
    """Workers failed or stopped for a reason that is not one of the classes above (raised by the
    launcher): an exception of your own code in a worker (its rank printed the traceback; the
    message names the rank and the exception), a rank's ``sys.exit(N)``, the launcher itself
    interrupted (SIGTERM, Ctrl-C). ``reported``: the workers already printed why; ``exit_code``: the
    CLI's exit status. ``results``: when the launcher was interrupted after every worker (of this node) had
    finished its work, only their teardown stopped, their results by global rank (the ``ddpkit`` command then
    exits 0: nothing was lost); else None."""

    def __init__(self, message: str, reported: bool, exit_code: int = 1, results: dict | None = None):
        super().__init__(message)
        self.reported, self.exit_code, self.results = reported, exit_code, results


def article(noun: str) -> str:
    """``noun`` after its indefinite article, by its first letter: "an int", "a str", "an IterableDataset"."""
    return f"{'an' if noun[:1].lower() in 'aeiou' else 'a'} {noun}"


def raised_at(exc: BaseException) -> str:
    """``Type: first line of the message (file.py:line)``: an exception of your code, and where it was
    raised, for a one-line error that names it (the traceback is not shown). Where it was raised inside a
    library (torch, numpy, ddpkit itself), the line of your code that called into it."""
    frames = traceback.extract_tb(exc.__traceback__)
    text = str(exc).strip().splitlines()[0][:300] if str(exc).strip() else ""
    frame = next((f for f in reversed(frames) if not _library(f.filename)), frames[-1] if frames else None)
    at = f" ({shown_path(frame.filename)}:{frame.lineno})" if frame else ""
    return f"{type(exc).__name__}: {text}{at}" if text else f"{type(exc).__name__}{at}"


_PACKAGE = os.path.dirname(os.path.abspath(__file__))
_STDLIB = os.path.dirname(os.path.abspath(os.__file__))
_INSTALLED = ("site-packages", "dist-packages")


def _library(filename: str) -> bool:
    """Whether a frame's file is not the user's own: ddpkit's, an installed package's, the standard
    library's, or Python's own (``<frozen runpy>``)."""
    path = os.path.abspath(filename)
    return (
        filename.startswith("<")
        or path.startswith(_PACKAGE + os.sep)
        or path.startswith(_STDLIB + os.sep)
        or any(part in _INSTALLED for part in path.split(os.sep))
    )


def shown_path(filename: str) -> str:
    """A source file as an error line names it: relative to the working directory when it lies below it,
    ``site-packages/pkg/...`` inside an installed package, else absolute (never ``../../..``)."""
    path = os.path.abspath(filename)
    parts = path.split(os.sep)
    for i, part in enumerate(parts):
        if part in _INSTALLED:
            return os.sep.join(parts[i:])
    try:
        rel = os.path.relpath(path)
    except ValueError:  # another drive (Windows)
        return path
    return path if rel.startswith(os.pardir) else rel
