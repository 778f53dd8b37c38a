"""Imported only by the forkserver (see ddpkit.dist.prestart.PRELOAD): when the launcher dies, exit at once.

The forkserver exits when its launcher does, and the workers it forked die with it (their
parent-death signal). Finalising an interpreter that holds torch and dynamo takes ~2.5 s,
during which the workers of a killed launcher would run on. Nothing in the forkserver
needs finalising, so its first exit handler ends the process. (Workers never run exit
handlers: a forkserver child leaves through ``os._exit``.)
"""

import atexit
import os

atexit.register(os._exit, 0)  # registered after torch's handlers, so it runs first
