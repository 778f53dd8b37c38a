"""The child side of a launch: what every worker runs first, around the function it was given.

    elastic_launch(config, worker_entry)(env, fn, *args)      # in ddpkit.ranks.launcher.run_workers

It takes the launcher's environment, dies with the launcher, and turns an error into the right
exit: an error every rank met alike is returned as a :class:`~ddpkit.ranks.failures.Failure` (the
launcher reports it once, and the agent does not restart into it), one rank's own error is printed
by that rank and filed for the launcher, and a bug keeps its traceback.
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys
import threading
import time
from typing import Any, Callable

from ..errors import DdpkitError
from . import env as names
from .endnotes import note_returned
from .failures import CONSEQUENCE_EXIT_DELAY_S, as_returned, outside_group_bug, outside_group_failure

RESULT_GRACE_S = 5.0  # after returning a stop or failure, a worker exits this long later if nobody reads it


def worker_entry(env: dict, fn: Callable, *args) -> Any:
    """Worker entry: set the launcher's variables, then turn a DdpkitError into one line, printed once,
    and the right exit."""
    os.environ.update(env)
    # A forked worker inherits the agent's handlers (SIGTERM would raise the agent's SignalException here),
    # a forkserver worker the forkserver's ignored SIGTERM and SIGUSR1 (ranks/_forkserver_exit.py): the
    # defaults back, so that the engine's stop handler and the agent's SIGTERM reach it.
    for sig in (signal.SIGTERM, signal.SIGUSR1, signal.SIGHUP, signal.SIGQUIT):
        signal.signal(sig, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    die_with_launcher()
    try:
        result = fn(*args)
        note_returned(result)  # for a launcher stopped during the teardown that follows (ranks/endnotes.py)
        return result
    except DdpkitError as exc:
        if exc.all_ranks:
            # torch's worker wrapper waits, after handing over this result, for the agent to read it; an agent
            # shutting down (the launcher was sent SIGTERM or Ctrl-C) never does, and would SIGKILL this process
            # after its 30 s grace period. The snapshot is saved: leave a few seconds later regardless.
            threading.Timer(RESULT_GRACE_S, os._exit, args=(0,)).start()
            return as_returned(exc, names.env_rank())
        outside_group_failure(exc)
        if getattr(exc, "deferred", False):
            # It only lost a peer (see failures.report_failure): leave the agent time to see that peer's
            # death first; the agent stops this process as soon as it does.
            time.sleep(CONSEQUENCE_EXIT_DELAY_S)
        sys.exit(exc.exit_code)
    except KeyboardInterrupt:  # Ctrl-C outside the training loop (start-up, data loading): no traceback
        sys.exit(130)
    except Exception as exc:
        outside_group_bug(exc)
        sys.exit(1)


def die_with_launcher(direct: bool = False) -> None:
    """Have the kernel SIGKILL this worker when its parent dies (Linux ``PR_SET_PDEATHSIG``).

    The parent is the launcher (spawn, fork, and ``ddpkit run``'s script workers, which the agent in the
    launcher starts itself: ``direct``) or the forkserver, which exits as soon as the launcher is gone.
    Otherwise workers of a killed launcher run on for seconds (a script's, for good), and may write to a
    run directory whose lock the kernel has already released to another run.
    """
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, int(signal.SIGKILL))  # 1 = PR_SET_PDEATHSIG
    except (OSError, AttributeError):  # not Linux: nothing to ask for
        return
    _release_forkserver()
    launcher = os.environ.get(names.LAUNCHER_PID, "")
    if direct and launcher.isdecimal():
        # A launcher that died before we asked left this process to init or a subreaper: kill(pid, 0) below
        # would still find it while its own parent has not reaped it yet
        if os.getppid() != int(launcher):
            os._exit(1)
        return
    try:
        os.kill(int(launcher or os.getppid()), 0)
    except (ProcessLookupError, ValueError):
        os._exit(1)  # the launcher died before we asked


def _release_forkserver() -> None:
    """Close this worker's copy of the forkserver's "alive" pipe.

    CPython hands it to every child the forkserver makes, so that the forkserver lives while
    any of them does; then a killed launcher's forkserver, and with it the workers' parent-death
    signal, would wait for the workers. Only the launcher should keep the forkserver alive.
    """
    from multiprocessing import forkserver

    server = getattr(forkserver, "_forkserver", None)
    fd = getattr(server, "_forkserver_alive_fd", None)
    if fd is None:
        return
    try:
        os.close(fd)
    except OSError:
        pass
    server._forkserver_alive_fd = server._forkserver_pid = server._forkserver_address = None
