"""Start the process that forks the workers, early, so its import of torch overlaps the launcher's.

    prestart_workers()     # at once, before the launcher imports torch and loads data

Workers are forked from a forkserver: a clean process that imports torch and ddpkit once
(about 2.4 s on a 2-core machine) and never runs an OpenMP region, so each fork is safe
and starts in milliseconds, instead of every worker importing torch anew as ``spawn``
does. Started here, before anything heavy, the forkserver's import runs on the other
core while the launcher imports torch itself and loads the data. This module imports
nothing heavy: the CLI calls it before torch is loaded.
"""

from __future__ import annotations

import multiprocessing

PRELOAD = [
    "ddpkit.ranks.child",
    "ddpkit.train.workers",
    "torch._dynamo",  # torch, ddpkit; and dynamo (~1.9 s), which DDP.__init__ imports
    "ddpkit.ranks._forkserver_exit",
]  # last: the forkserver then exits at once when the launcher dies


def start_resource_tracker() -> None:
    """Start multiprocessing's resource tracker (if it is not running yet) deaf to SIGUSR1, SIGTERM and SIGINT.

    It is started by the first process-shared object (the forkserver's, torch's queues), with SIGINT and
    SIGTERM ignored but SIGUSR1 at its default action: a SIGUSR1 to the whole job step (SLURM's
    ``--signal=USR1@90``) killed it, and the launcher's next semaphore release printed one KeyError
    traceback each. A signal blocked when it starts stays blocked in it (it unblocks only SIGINT and SIGTERM,
    which it ignores)."""
    import signal
    from multiprocessing import resource_tracker

    if not hasattr(signal, "pthread_sigmask"):
        return
    before = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGUSR1, signal.SIGTERM, signal.SIGINT})
    try:
        resource_tracker.ensure_running()
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, before)


def forkserver_available() -> bool:
    return "forkserver" in multiprocessing.get_all_start_methods()


def prestart_workers() -> None:
    """Start the forkserver (with ``PRELOAD`` imported) if this platform has one; it returns at once."""
    if not forkserver_available():
        return
    from multiprocessing import forkserver

    multiprocessing.get_context("forkserver").set_forkserver_preload(PRELOAD)
    start_resource_tracker()  # the forkserver's start would start it otherwise, SIGUSR1 not blocked
    forkserver.ensure_running()
