"""The child side of ``ddpkit run``: one rank of the user's script, as ``python script.py ARGS`` would run it.

    python -m ddpkit.ranks.script_child script.py ARGS      # what torch's elastic agent starts on each rank

``sys.argv`` is ``[script.py, ARGS...]``, ``__name__`` is ``"__main__"``, and the script's folder is first on
``sys.path``. Before the script runs, and before it imports torch, the rank asks to die with its launcher
(:func:`ddpkit.ranks.child.die_with_launcher`, the parent-death signal). An error the script leaves uncaught
ends the rank as :func:`ddpkit.ranks.failures.exit_status` says (a ddpkit error: its exit status, left in
the agent's error file for the launcher, which says it once) or, for any other exception, with its
traceback, trimmed to the script's own frames, and status 1; one that only lost a peer of the script's own
process group (gloo's "Connection closed by peer") is left to the launcher, which names the rank that
failed first. The same hook serves a rank of torchrun or srun that ``ddpkit run`` became (``exec``).
"""

from __future__ import annotations

import atexit
import contextlib
import functools
import importlib.abc
import os
import runpy
import sys
import time
import traceback

from ..errors import ConfigError, DdpkitError, PeerLost
from . import env as names
from .child import die_with_launcher
from .endnotes import note_returned
from .failures import (
    CONSEQUENCE_EXIT_DELAY_S,
    comm_failure,
    exit_status,
    filed_for_launcher,
    first_to_say,
    write_error_file,
)


def main(argv: list[str]) -> None:
    script, args = argv[0], argv[1:]
    ours = bool(os.environ.get(names.LAUNCHER_PID))  # started by ddpkit's launcher, not run in its place
    if ours:
        die_with_launcher(direct=True)
    sys.argv = [script, *args]
    sys.path[0] = os.path.dirname(os.path.abspath(script))  # as `python script.py` puts it (-m put the cwd)
    sys.excepthook = _uncaught(script, ours)
    # Before the script imports torch: its own mp.spawn refused in one line, where this run started several ranks
    # (the world as ddpkit run started it, read now: the script may set WORLD_SIZE itself for its own processes)
    world = int(os.environ.get(names.WORLD_SIZE, "1"))
    if world > 1 and "torch.multiprocessing" in sys.modules:  # imported already (a process that preloaded torch)
        _refuse_spawn(sys.modules["torch.multiprocessing"], world)
    elif world > 1:
        sys.meta_path.insert(0, _SpawnGuard(world))
    # Registered before the script's own exit handlers, so run after them: a Loop.start()-ed loop's final
    # snapshot and record are written at exit, and the script's work is done only once they are
    returned = []
    atexit.register(lambda: returned and note_returned(None))
    try:
        runpy.run_path(script, run_name="__main__")
    except SystemExit as done:
        if ours:
            _exit_said(done)
        if done.code in (0, None):
            returned.append(True)
        raise
    returned.append(True)


SPAWN_REFUSED = (
    "the script starts its own processes with torch.multiprocessing.spawn, as an mp.spawn script starts its ranks, "
    "and ddpkit run has started {world} ranks already: each would start its own, and they would wait for each "
    "other at the script's rendezvous for ever. Run it as `python SCRIPT`, or port it: ddpkit.launch(fn, *args, "
    "nproc=N) is mp.spawn's counterpart, or a ddpkit.Loop under ddpkit run (docs/port.md); processes that are not "
    "ranks, start them with Python's multiprocessing"
)


class _SpawnGuard(importlib.abc.MetaPathFinder):
    """Installed where ``ddpkit run`` started more than one rank: ``torch.multiprocessing``, once imported, has its
    ``spawn`` refuse. An mp.spawn script run unported under ``ddpkit run --nproc 2`` started 2 x 2 processes that
    hung at its rendezvous, with no output (the porter's seed-001 port). At one rank the script's own processes are
    all there are, and it runs as under ``python``. No import of torch here: the script's own import is the one
    that runs; this finder answers that one import and leaves ``sys.meta_path`` (``start_processes``, which torch's
    elastic agent also uses, is left as it is)."""

    def __init__(self, world: int):
        self.world = world

    def find_spec(self, fullname, path, target=None):
        if fullname != "torch.multiprocessing":
            return None
        sys.meta_path.remove(self)  # once: the module is imported once
        for finder in sys.meta_path:
            found = finder.find_spec(fullname, path, target) if hasattr(finder, "find_spec") else None
            if found is not None and found.loader is not None and hasattr(found.loader, "exec_module"):
                found.loader = _Refusing(found.loader, self.world)  # a loader of this spec alone: none shared
                return found
        return None


class _Refusing(importlib.abc.Loader):
    """``loader``'s module, with its ``spawn`` refusing (:data:`SPAWN_REFUSED`)."""

    def __init__(self, loader, world: int):
        self.loader, self.world = loader, world

    def create_module(self, spec):
        return self.loader.create_module(spec)

    def exec_module(self, module) -> None:
        self.loader.exec_module(module)
        _refuse_spawn(module, self.world)


def _refuse_spawn(module, world: int) -> None:
    """``module`` (``torch.multiprocessing``) with its ``spawn`` refusing (:data:`SPAWN_REFUSED`)."""
    spawn = getattr(module, "spawn", None)
    if not callable(spawn):
        return

    @functools.wraps(spawn)
    def refused(*args, **kwargs):
        error = ConfigError(SPAWN_REFUSED.format(world=world))
        error.all_ranks = True  # every rank meets it: said once
        raise error

    module.spawn = refused


def _exit_said(done: SystemExit) -> None:
    """A rank's ``sys.exit(N)`` (the script's, or a Loop's that owns its group: SystemExit(status), its error
    filed already) told to the launcher: N != 0 with no error file is filed as the rank's own exit."""
    if done.code in (0, None):
        return
    error_file = os.environ.get(names.ERROR_FILE, "")
    if error_file and not os.path.exists(error_file):
        rank, code = names.env_rank(), done.code if isinstance(done.code, int) else 1
        said = f"called sys.exit({done.code!r})"
        write_error_file(f"rank {rank}: {said}", False, code, text=said, rank=rank, printed=False)
    if getattr(done.__context__, "deferred", False):
        # A rank that only lost a peer leaves the agent time to see that peer's death first (see
        # ddpkit.ranks.failures.CONSEQUENCE_EXIT_DELAY_S)
        time.sleep(CONSEQUENCE_EXIT_DELAY_S)


def _uncaught(script: str, ours: bool):
    """``sys.excepthook`` for the script (a Loop and torch's ``init_process_group`` chain theirs in front)."""
    path = os.path.realpath(script)

    def hook(kind, exc, tb) -> None:
        if isinstance(exc, (DdpkitError, KeyboardInterrupt)):
            # torch's hook, in front once a group was made, prints what this one writes to sys.stderr only after
            # it returns, which an exit never does: the line goes to the real stderr
            with contextlib.redirect_stderr(sys.__stderr__):
                if isinstance(exc, DdpkitError):
                    sys.exit(exit_status(exc))
                if not ours:  # under ddpkit's launcher, the launcher says the job was interrupted
                    print("ddpkit: interrupted", file=sys.stderr)
                sys.exit(130)
        if getattr(exc, "reported", False):  # its rank printed it inside the process group, and filed it
            return
        lost = comm_failure(exc, 0.0) if ours and isinstance(exc, RuntimeError) else None
        if isinstance(lost, PeerLost):  # a peer of the script's own group died first: the launcher names it
            filed_for_launcher(lost)
            time.sleep(CONSEQUENCE_EXIT_DELAY_S)  # so that the agent sees the peer's death before this exit
            sys.exit(lost.exit_code)
        while tb is not None and os.path.realpath(tb.tb_frame.f_code.co_filename) != path:
            tb = tb.tb_next  # runpy's and this module's frames are not the script's
        text = "".join(traceback.format_exception(kind, exc, tb))
        # Once for the job where every rank of the script's group meets the very same one (the count in its store;
        # torch's hook, in front once a group was made, prefixes what this writes): a Loop.start()-ed script's
        # ranks printed one each (the porter's seed 002), as a with-block's did before (failures.report_failure)
        said = first_to_say(text)
        if said:
            sys.stderr.write(text)
        if ours:  # the launcher's one line: "rank 1 raised ValueError: ... (its traceback is above)"
            line = f"rank {names.env_rank()} raised {type(exc).__name__}: {exc}"
            write_error_file(line, False, 1, traceback_printed=True, printed=said)  # the launcher names the rank shown
            with contextlib.suppress(AttributeError):  # (an exception type that takes no attribute)
                exc.filed_for_launcher = True  # a started Loop's teardown at exit leaves this file as it is
        # Python exits with status 1 once the hook returns

    return hook


if __name__ == "__main__":
    main(sys.argv[1:])
