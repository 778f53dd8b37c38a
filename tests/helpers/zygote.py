"""``python -m MODULE ARGS`` in a child forked from a warm interpreter: the CLI as a user runs it, less the
interpreter's start and its import of torch (3.5 s of CPU each on the 2-core AVX2 CI machine, where the suite is
CPU-bound: BENCHMARKS.md, "The test suite's wall time").

    result = run_module("ddpkit", ["train", ...], cwd=..., env=cli_env(), timeout=600)   # a CompletedProcess

The warm interpreter (one per pytest worker, started at its first use) imports torch and ddpkit's CLI and
nothing else: it runs no torch op and starts no thread, so a fork of it is what ddpkit's own forkserver
hands its workers (ranks/prestart.py). Each request forks one child, which takes the request's working
directory, environment and arguments, writes stdout and stderr to files, runs the module as ``-m`` does, and
exits; the server reports the child's pid at once and its exit status when it ends (``-N`` for a signal, as
``subprocess`` reports it). A test that tests the interpreter's own start (what ``--help`` imports) starts
a fresh one itself.

A child's forkserver (ddpkit's workers are forked from one: ranks/prestart.py) is forked from the child too,
not started as ``python -c`` (an interpreter that imports torch and dynamo: 5.2 s of CPU each): torch and
dynamo are imported here already. It is what the exec'd one would be: only the descriptors it is handed, a
fresh ``__main__`` (its workers import the script again, as ``-c``'s do), a fresh interpreter's signal
handlers, no lock held. Where the child has started threads of its own since its fork (an OpenMP pool: a fork
would copy its state half-made), the forkserver is exec'd as ddpkit does. Each pytest worker's own launches
keep the exec'd one.
"""

from __future__ import annotations

import importlib.machinery
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import types
from pathlib import Path

_server: subprocess.Popen | None = None
_lock = threading.Lock()


def run_module(module: str, args: list[str], cwd, env: dict, timeout: float) -> subprocess.CompletedProcess:
    return run_python(["-m", module, *args], cwd=cwd, env=env, timeout=timeout)


def run_python(argv: list[str], cwd, env: dict, timeout: float) -> subprocess.CompletedProcess:
    """``python ARGV`` (``-m MODULE ARGS``, ``-c CODE ARGS`` or ``SCRIPT ARGS``), forked; a CompletedProcess."""
    global _server
    if (
        not argv
        or (argv[0] in ("-m", "-c") and len(argv) < 2)
        or (argv[0].startswith("-") and argv[0] not in ("-m", "-c"))
    ):
        raise ValueError(f"run_python takes -m MODULE, -c CODE or a script, then its arguments: {argv}")
    with _lock, tempfile.TemporaryDirectory() as scratch:
        if _server is None or _server.poll() is not None:
            _server = subprocess.Popen(
                [sys.executable, __file__], stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env, text=True
            )
        out, err = Path(scratch) / "out", Path(scratch) / "err"
        request = {"argv": [str(a) for a in argv], "cwd": str(cwd or os.getcwd()), "env": env}
        _server.stdin.write(json.dumps({**request, "out": str(out), "err": str(err)}) + "\n")
        _server.stdin.flush()
        pid = json.loads(_server.stdout.readline())["pid"]
        # The exit status is read in a thread: a select() on the pipe would miss a line already in the reader's
        # buffer (a child that ends at once, whose status came with its pid) and wait out the timeout
        ended: dict = {}
        waiter = threading.Thread(target=lambda: ended.update(json.loads(_server.stdout.readline())), daemon=True)
        waiter.start()
        waiter.join(timeout)
        late = waiter.is_alive()
        if late:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:  # it ended just now
                pass
            waiter.join()
        argv = [sys.executable, *argv]
        stdout, stderr = out.read_text(errors="replace"), err.read_text(errors="replace")
        if late:
            raise subprocess.TimeoutExpired(argv, timeout, stdout, stderr)
        return subprocess.CompletedProcess(argv, ended["returncode"], stdout, stderr)


def _fork_forkservers(threads_at_start: int) -> None:
    """Have this child's ``multiprocessing`` fork its forkserver from here instead of exec'ing one (above)."""
    from multiprocessing import forkserver, resource_tracker, util

    exec_one = util.spawnv_passfds

    def spawnv_passfds(path, args, passfds):
        if "from multiprocessing.forkserver import main" not in args[-1] or _threads() > threads_at_start:
            return exec_one(path, args, passfds)
        sys.stdout.flush()  # what is buffered here must not be written again by the forkserver's workers
        sys.stderr.flush()
        pid = os.fork()
        if pid:
            return pid
        code = 1
        try:
            kept = sorted(set(passfds))
            low = 3
            for fd in kept:  # close every descriptor but 0-2 and the passed, as the exec would (close_fds)
                os.closerange(low, fd)
                low = fd + 1
            os.closerange(low, os.sysconf("SC_OPEN_MAX"))
            _fresh_signals()
            for state in (forkserver._forkserver, resource_tracker._resource_tracker):
                # held by the thread that forked, in this copy
                state._lock = threading.RLock() if "RLock" in type(state._lock).__name__ else threading.Lock()
            server = forkserver._forkserver
            server._forkserver_address = server._forkserver_alive_fd = server._forkserver_pid = None
            resource_tracker._resource_tracker._fd = resource_tracker._resource_tracker._pid = None
            main = types.ModuleType("__main__")
            sys.modules["__main__"] = main
            sys.argv = ["-c"]
            exec(args[-1], main.__dict__)
            code = 0
        except SystemExit as exc:
            code = exc.code if isinstance(exc.code, int) else 0 if exc.code is None else 1
        except BaseException:
            import traceback

            traceback.print_exc()
        finally:
            os._exit(code)

    util.spawnv_passfds = spawnv_passfds


def _threads() -> int:
    return len(os.listdir("/proc/self/task"))


def _fresh_signals() -> None:
    """The signal handlers an exec'd interpreter starts with: what this process handles goes back to the
    default (an ignored signal stays ignored across exec), and Python's own for SIGINT."""
    signal.set_wakeup_fd(-1)
    for sig in signal.valid_signals():
        try:
            handler = signal.getsignal(sig)
        except (OSError, ValueError):
            continue
        if callable(handler):
            signal.signal(sig, signal.SIG_DFL)
    if signal.getsignal(signal.SIGINT) == signal.SIG_DFL:
        signal.signal(signal.SIGINT, signal.default_int_handler)


def _child(request: dict) -> None:
    """In the forked child: become ``python -m MODULE ARGS`` in the request's directory and environment."""
    import runpy
    import traceback

    code = 1
    try:
        for fd, path, flags in (
            (0, os.devnull, os.O_RDONLY),
            (1, request["out"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC),
            (2, request["err"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC),
        ):
            opened = os.open(path, flags, 0o644)
            os.dup2(opened, fd)
            os.close(opened)
        os.chdir(request["cwd"])
        os.environ.clear()
        os.environ.update(request["env"])
        tempfile.tempdir = None  # read from TMPDIR again, at its first use
        argv = request["argv"]
        _fork_forkservers(_threads())
        if argv[0] == "-m":  # -m puts the working directory first; -c puts ""; a script, its folder
            sys.path[0], sys.argv = os.getcwd(), ["-m", *argv[2:]]
            runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
        elif argv[0] == "-c":
            sys.path[0], sys.argv = "", ["-c", *argv[2:]]
            main = types.ModuleType("__main__")
            sys.modules["__main__"] = main
            exec(compile(argv[1], "<string>", "exec"), main.__dict__)
        else:
            # As Python runs a script (not runpy.run_path, which puts its path in argv[0]): argv[0] as given,
            # __file__ absolute (since 3.9; a relative one is resolved against multiprocessing's ORIGINAL_DIR,
            # this server's directory, when the workers import the script again)
            path = os.path.abspath(argv[0])
            sys.path[0], sys.argv = os.path.dirname(os.path.realpath(path)), list(argv)
            main = types.ModuleType("__main__")
            main.__file__, main.__cached__ = path, None
            main.__loader__ = importlib.machinery.SourceFileLoader("__main__", path)
            sys.modules["__main__"] = main
            exec(compile(Path(path).read_bytes(), path, "exec"), main.__dict__)
        code = 0
    except SystemExit as exc:
        if exc.code is None or isinstance(exc.code, int):
            code = exc.code or 0
        else:
            print(exc.code, file=sys.stderr)
    except BaseException:
        traceback.print_exc()
    finally:
        try:
            sys.stdout.flush()
            sys.stderr.flush()
        finally:
            os._exit(code)


def _serve() -> None:
    import torch  # noqa: F401  (the import each child is spared)

    import ddpkit.cli  # noqa: F401
    from ddpkit.ranks.prestart import PRELOAD

    for name in PRELOAD:  # what a forkserver imports (dynamo: 1.9 s), less its exit hook (its own to run)
        if name != "ddpkit.ranks._forkserver_exit":
            __import__(name)

    for line in sys.stdin:
        request = json.loads(line)
        pid = os.fork()
        if pid == 0:
            _child(request)
        print(json.dumps({"pid": pid}), flush=True)
        _, status = os.waitpid(pid, 0)
        print(json.dumps({"returncode": os.waitstatus_to_exitcode(status)}), flush=True)


if __name__ == "__main__":
    _serve()
