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
    "ddpkit.dist.child",
    "ddpkit.train.workers",
    "torch._dynamo",  # torch, ddpkit; and dynamo (~1.9 s), which DDP.__init__ imports
    "ddpkit.dist._forkserver_exit",
]  # last: the forkserver then exits at once when the launcher dies


def forkserver_available() -> bool:
    return "forkserver" in multiprocessing.get_all_start_methods()


def prestart_workers() -> None:
    """Start the forkserver (with ``PRELOAD`` imported) if this platform has one; it returns at once."""
    if not forkserver_available():
        return
    from multiprocessing import forkserver

    multiprocessing.get_context("forkserver").set_forkserver_preload(PRELOAD)
    forkserver.ensure_running()
