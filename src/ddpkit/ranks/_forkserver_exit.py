"""Imported only by the forkserver (see ddpkit.ranks.prestart.PRELOAD): when the launcher dies, exit at once.

The forkserver exits when its launcher does, and the workers it forked die with it (their
parent-death signal). Finalising an interpreter that holds torch and dynamo takes ~2.5 s,
during which the workers of a killed launcher would run on. Nothing in the forkserver
needs finalising, so its first exit handler ends the process. (Workers never run exit
handlers: a forkserver child leaves through ``os._exit``.)

It also ignores SIGTERM and SIGUSR1. SLURM (``scancel``, ``--signal=USR1``) signals every process
of a job step at once, the forkserver included: dying of it, the forkserver would take its
workers with it (their parent-death signal) before they saved their snapshot. The launcher's
own exit still ends it (its first exit handler, above); workers restore the default handlers.
"""

import atexit
import os
import signal

atexit.register(os._exit, 0)  # registered after torch's handlers, so it runs first
for _sig in (signal.SIGTERM, signal.SIGUSR1):
    signal.signal(_sig, signal.SIG_IGN)
