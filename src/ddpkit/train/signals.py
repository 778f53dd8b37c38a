"""SIGTERM, SIGUSR1 and SIGINT (Ctrl-C) as a request to stop at the next safe point, not a kill; and the loss of
the launcher too.

    with StopSignal() as stop:
        ...
        if stop.received: ...   # checked by the engine at log intervals, on an all-reduced flag

The handler only records the signal: a snapshot needs every rank at the same step, so
the engine decides when (see ``Engine._sync``). Schedulers (SLURM preemption, Kubernetes,
torch's elastic agent shutting down) send SIGTERM and wait a grace period before
SIGKILL; the agent's is 30 s, so a log interval should take less than that. SLURM sends
SIGUSR1 instead where a job asks for it (``sbatch --signal=USR1@90``: 90 s before the time
limit), the signal PyTorch Lightning and submitit requeue on; it stops the run as SIGTERM does,
with its own exit status (:class:`ddpkit.errors.Stopped`).

A worker of torch's elastic agent (torchrun's or ddpkit's: ``TORCHELASTIC_RUN_ID`` set) also stops when its
launcher dies without a word (SIGKILL, the out-of-memory killer): torchrun's workers outlived a killed agent
and trained on to the end, into a run directory nothing watched any more. The kernel hands an orphan to init
or a subreaper, so its parent's pid changes: ``received`` looks (one ``getppid()``, no thread) each time it is
read, which is at log intervals, off the step's path, and says ``LAUNCHER_GONE`` as a signal's name. Every
rank reads it again after the flag's all-reduce, so all name the same reason. Under ``ddpkit run`` and
``ddpkit.launch`` the kernel's parent-death signal (``ranks/child.py``) may end the worker first. A rank
started by hand with RANK and WORLD_SIZE set, or by srun, is not watched: its parent is a shell (a ``nohup``
run outlives it on purpose) or SLURM's step daemon, which ends its tasks itself.
"""

from __future__ import annotations

import os
import signal
import threading

from ..ranks.env import RUN_ID, under_launcher

STOP_SIGNALS = (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT)
LAUNCHER_GONE = "the loss of its launcher"  # read as "stopped on the loss of its launcher at step N"


class StopSignal:
    def __init__(self, signals: tuple[signal.Signals, ...] = STOP_SIGNALS, watch_parent: bool | None = None):
        self.signals = signals
        self.watch_parent = watch_parent  # None: where a launcher started this process (decided on entry)
        self._received: str | None = None
        self._parent: int | None = None  # the launcher's pid, while watched
        self._previous: dict = {}

    @property
    def received(self) -> str | None:
        """The name of the stop signal received, or ``LAUNCHER_GONE``; None while none came."""
        if self._received is None and self._parent is not None and os.getppid() != self._parent:
            self._received = LAUNCHER_GONE
        return self._received

    @received.setter
    def received(self, name: str | None) -> None:
        self._received = name

    def _handle(self, signum, frame) -> None:
        self._received = signal.Signals(signum).name

    def __enter__(self) -> "StopSignal":
        # Handlers can only be set from the main thread; elsewhere the default stays.
        if threading.current_thread() is threading.main_thread():
            for sig in self.signals:
                self._previous[sig] = signal.signal(sig, self._handle)
        if elastic_worker() if self.watch_parent is None else self.watch_parent:
            self._parent = os.getppid()
        return self

    def __exit__(self, *exc) -> None:
        # A launched rank stopped by a signal is on its way out, and still has to say and file its stop
        # (ranks/child.py, ``as_returned``) while its launcher's agent sends the signal again every 0.5 s
        # (ranks/launcher.py ``RESEND_S``). With the default action back, one that came in between ended rank 0
        # unsaid, and the job said it was interrupted before any snapshot (a loaded CI machine). It keeps
        # noting them; the agent's SIGKILL after its grace period still ends a rank that never leaves.
        leaving = self._received not in (None, LAUNCHER_GONE) and elastic_worker()
        for sig, previous in self._previous.items():
            if not leaving:
                signal.signal(sig, previous)
        self._previous.clear()
        self._parent = None


def elastic_worker() -> bool:
    """This process is a worker of torch's elastic agent (torchrun, ``ddpkit run``, ``ddpkit.launch``): the agent
    sets ``TORCHELASTIC_RUN_ID`` for its workers, and a worker it leaves behind would train on unwatched."""
    return under_launcher() and RUN_ID in os.environ
