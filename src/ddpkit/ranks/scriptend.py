"""A run object that lives as long as its script: ended by the script's end, by the script's own
``destroy_process_group()``, or with an uncaught error said once. ``ddpkit.Loop.start()`` is its one user.

    loop = ddpkit.Loop.start("out")     # the Loop is entered, then
    end_with_script(loop, globals)      # closed at exit (atexit), or at the script's destroy_process_group()

The owner (a started ``Loop``) gives: ``ctx`` (None once gone), ``close()`` (its end as a success: the final
snapshot and record, then the group's teardown), ``_teardown(exc)`` (the group's teardown alone, after an
error), ``world_size`` and ``config.timeout_s``, and its flag ``_exited`` (set once it has ended, as a ``with``
block's end ends it). Its flags ``_started``, ``_closed``, ``_uncaught`` and ``_lost`` are this module's to set and
read. A Loop in a ``with`` block is closed by the script's own ``destroy_process_group()`` inside the block too.
"""

from __future__ import annotations

import atexit
import os
import sys
import traceback
import weakref
from typing import Any

import torch.distributed as dist

from ..errors import DdpkitError
from .env import LAUNCHER_PID, under_launcher
from .failures import comm_failure, exit_status

# torch's own destroy_process_group, once ddpkit's stands in front of it (closes_at_destroy); the owners opened on
# the default group (started, or in a with-block), weakly: an ended one is not kept alive with its model and loaders
# (a review finding); whether an owner destroyed a group it made (group_gone)
_TORCH_DESTROY: list = [None]
_OPEN: list[weakref.ref] = []
_GONE: list = [False]


def end_with_script(owner: Any, script: dict) -> None:
    """From now, ``owner`` ends when its script does: the script's uncaught error is noted by the excepthook (so
    that the end does not save after it) and said as the ``with`` form says it; ``atexit`` closes it
    (:func:`close_at_exit`); the script's own ``destroy_process_group()`` closes it there. ``script``: the
    calling script's globals."""
    owner._uncaught = None
    previous = sys.excepthook

    def seen(kind, exc, tb):  # the script's uncaught error: close() must not save after it
        owner._uncaught = exc
        lost = isinstance(exc, RuntimeError) and comm_failure(exc, owner.config.timeout_s) is not None
        # Under torchrun, several ranks (ddpkit's launcher names the lost peer itself; a world of 1 has no peer,
        # and its teardown says nothing: a RuntimeError there keeps its traceback)
        if lost and under_launcher() and owner.world_size > 1 and not os.environ.get(LAUNCHER_PID):
            # A peer lost mid-collective (or a timeout) under torchrun: the group's teardown at exit says it in one
            # line, as the with form does. Before, torch's hook printed a [rank0]: traceback wall first (the
            # porter's item C)
            owner._lost = True
            return
        previous(kind, exc, tb)

    sys.excepthook = seen
    atexit.register(close_at_exit, owner)
    owner._started = True
    closes_at_destroy(owner, script)


def close_at_exit(owner: Any) -> None:
    """The script has ended: ``owner`` closes as a success, or after the script's uncaught error only the group's
    teardown runs. A failure here ends the process with its exit status, not the script's 0."""
    if owner.ctx is None or getattr(owner, "_closed", False):
        return
    owner._closed = True
    exc = getattr(owner, "_uncaught", None)
    if exc is not None:  # said already, by the excepthook, with its status: the teardown is all that is left
        exc.already_said = True  # its line or traceback: the teardown notes the cause, prints it no more
        try:
            owner._teardown(exc)
        except DdpkitError as error:  # a lost peer or a timeout, said by the teardown: its status, not 1
            if getattr(owner, "_lost", False):
                _exit_now(exit_status(error))
        except Exception:  # noqa: BLE001 - a teardown after a failure fails too (a lost peer); said already
            pass
        return
    try:
        owner.__exit__(None, None, None)
    except SystemExit as done:  # a launcher's one line, printed by __exit__: its status is the process's
        _exit_now(done.code if isinstance(done.code, int) else 1)
    except DdpkitError as error:  # the final save or the teardown failed after the script ended
        _exit_now(exit_status(error))
    except BaseException:  # noqa: BLE001 - a bug there: its traceback, and a failed status, not 0
        traceback.print_exc()
        _exit_now(1)


def closes_at_destroy(owner: Any, script: dict) -> None:
    """A ported script's own ``destroy_process_group()``, the plain script's last line kept under ``Loop.start()``
    or inside a ``with ddpkit.Loop(...)`` block, closes that Loop there, as the script's end (or the block's) would:
    the final snapshot and the ``end`` record need the group. Then the group goes: the Loop's teardown destroys one
    it made, torch's destroys the script's own (or ``ddpkit.launch``'s, which its end then leaves alone). Before,
    the Loop found the group gone at its end: a traceback per rank and no ``end`` record (the porter's seed-002
    port, and seed 003's in a with-block under launch()). After the Loop's end, the same line destroys what is left,
    if anything. ``script``: the calling script's globals, where a name bound to torch's function (``from
    torch.distributed import destroy_process_group``, as the DDP tutorial writes it) is bound to this one too."""
    _OPEN[:] = [ref for ref in _OPEN if ref() is not None and ref() is not owner] + [weakref.ref(owner)]
    if _TORCH_DESTROY[0] is None:
        _TORCH_DESTROY[0] = dist.destroy_process_group
        dist.destroy_process_group = _destroy
    for name, value in list(script.items()):
        if value is _TORCH_DESTROY[0]:
            script[name] = _destroy


def group_gone(made_it: bool) -> None:
    """An owner's end destroyed the group it made (``made_it``): the script's own destroy after it does nothing."""
    _GONE[0] = _GONE[0] or made_it


def _open_owner() -> Any:
    """The newest owner still open (not ended, not closed): a with-block's Loop inside a started one's script is
    ended by its block, and the script's destroy is then the started one's (a review finding)."""
    for ref in reversed(_OPEN):
        owner = ref()
        if owner is not None and not getattr(owner, "_exited", False) and not getattr(owner, "_closed", False):
            return owner
    return None


def _destroy(group=None) -> None:
    owner = _open_owner()
    if group is None or group is dist.GroupMember.WORLD:
        if owner is not None:
            if sys.exc_info()[1] is not None:
                # In a ``finally:`` an error (or a stop) is on its way up: it is said by the script's excepthook
                # and the group torn down at exit without a save, as for any error (closed here as a success, the
                # run would be saved and marked finished at the step it broke in: a review finding)
                return
            owner.close()  # its teardown calls this again, once closed: torch's then destroys a group it made
        if _GONE[0] and not dist.is_initialized():
            return  # destroyed by an owner's end (a started one's, or a with-block's): the script's own line is done
    _TORCH_DESTROY[0](group)


def _exit_now(code: int) -> None:
    """End the process with ``code`` from an ``atexit`` handler, where an exception would be printed as a
    traceback and leave the status the script's (0): its output flushed first."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
