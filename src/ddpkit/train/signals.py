"""SIGTERM, SIGUSR1 and SIGINT (Ctrl-C) as a request to stop at the next safe point, not a kill.

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
"""

from __future__ import annotations

import signal
import threading

STOP_SIGNALS = (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT)


class StopSignal:
    def __init__(self, signals: tuple[signal.Signals, ...] = STOP_SIGNALS):
        self.signals = signals
        self.received: str | None = None
        self._previous: dict = {}

    def _handle(self, signum, frame) -> None:
        self.received = signal.Signals(signum).name

    def __enter__(self) -> "StopSignal":
        # Handlers can only be set from the main thread; elsewhere the default stays.
        if threading.current_thread() is threading.main_thread():
            for sig in self.signals:
                self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, *exc) -> None:
        for sig, previous in self._previous.items():
            signal.signal(sig, previous)
        self._previous.clear()
