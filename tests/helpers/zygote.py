"""``python -m MODULE ARGS`` in a child forked from a warm interpreter: the CLI as a user runs it, less the
interpreter's start and its import of torch (3.5 s of CPU each on the 2-core AVX2 CI machine, where the suite is
CPU-bound: BENCHMARKS.md, "The test suite's wall time").

    result = run_python(["-m", "ddpkit", "train", ...], cwd=..., env=cli_env(), timeout=600)   # a CompletedProcess

The warm interpreter (one per pytest worker, started at its first use) imports torch, ddpkit's CLI and what
ddpkit's forkserver imports (ranks/prestart.py: dynamo), and runs no torch op (no OpenMP pool exists to be
forked half-made), so a fork of it is what that forkserver hands its workers. Each request forks one child,
which takes the request's working directory, environment and arguments, writes stdout and stderr to files, runs
what it is given as ``python`` does, and exits; the server reports the child's pid at once and its exit status
when it ends (``-N`` for a signal, as ``subprocess`` reports it). A test that tests the interpreter's own start
(what ``--help`` imports) starts a fresh one itself.

Any ``python ARGV`` runs so (``run_python``: ``-m MODULE``, ``-c CODE`` or a script), and ends as the
interpreter would: an uncaught exception through ``sys.excepthook``, then the atexit handlers. Each child leads
its own process group (as ``start_new_session=True``).

A child's forkserver (ddpkit's workers are forked from one: ranks/prestart.py) is not started as
``python -c`` (an interpreter that imports torch and dynamo: 5.2 s of CPU each) but from a spare forked at
the child's start, before the run's own code: torch and dynamo are imported here already. It is what the
exec'd one would be: a clean interpreter (the workers import the script again into it), only the descriptors
it is handed, the environment, directory, ignored signals and mask of the moment it was asked for. Each
pytest worker's own launches keep the exec'd one.
"""

from __future__ import annotations

import fcntl
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
                os.killpg(pid, signal.SIGKILL)
            except ProcessLookupError:  # it ended just now
                pass
            waiter.join()
        argv = [sys.executable, *argv]
        stdout, stderr = out.read_text(errors="replace"), err.read_text(errors="replace")
        if late:
            raise subprocess.TimeoutExpired(argv, timeout, stdout, stderr)
        return subprocess.CompletedProcess(argv, ended["returncode"], stdout, stderr)


def _spare_forkserver() -> None:
    """Fork, now, before the run's own code, the process that becomes this run's forkserver when it starts one.

    Forked later, from the run, it would carry what the run changed by then (a script's patches of ddpkit's
    modules, applied again by each worker that imports the script: two sleeps where one was meant); forked
    here it is what the exec'd one is: this interpreter as it started, torch and dynamo imported. The run's
    ``multiprocessing`` hands it the forkserver's command, its descriptors (at the same numbers), and the
    directory, environment, ignored signals and signal mask of that moment; one that is never asked for ends
    with the run (end of file on its socket)."""
    import socket
    from multiprocessing import util

    ours, theirs = socket.socketpair()
    spare = os.fork()
    if spare == 0:
        ours.close()
        _become_forkserver(theirs)
    theirs.close()
    exec_one, used = util.spawnv_passfds, []

    def spawnv_passfds(path, args, passfds):
        if used or "from multiprocessing.forkserver import main" not in args[-1]:
            return exec_one(path, args, passfds)
        used.append(spare)
        sys.stdout.flush()  # nothing buffered here may be written again by the forkserver's workers
        sys.stderr.flush()
        fds = sorted(set(map(int, passfds)))
        ignored = [s for s in signal.valid_signals() if _handler(s) == signal.SIG_IGN]
        mask = [int(s) for s in signal.pthread_sigmask(signal.SIG_BLOCK, [])]
        order = {"cmd": args[-1], "fds": fds, "cwd": os.getcwd(), "env": dict(os.environ)}
        order.update(ignored=[int(s) for s in ignored], mask=mask)
        try:
            socket.send_fds(ours, [json.dumps(order).encode()], fds)
            ours.shutdown(socket.SHUT_WR)
        except OSError:  # the spare is gone (a signal to the whole group): exec one, as ddpkit does
            return exec_one(path, args, passfds)
        return spare

    util.spawnv_passfds = spawnv_passfds


def _handler(sig):
    try:
        return signal.getsignal(sig)
    except (OSError, ValueError):
        return None


def _become_forkserver(sock) -> None:
    """In the spare: wait for the order, then become ``python -c FORKSERVER_COMMAND`` as it was asked for."""
    import socket

    code = 0
    try:
        data, fds, _, _ = socket.recv_fds(sock, 1 << 20, 64)
        if not fds:  # the run ended without a forkserver
            return
        while chunk := sock.recv(1 << 20):
            data += chunk
        order = json.loads(data)
        # the passed descriptors at the numbers the command names; every other one closed (close_fds)
        high = [fcntl.fcntl(fd, fcntl.F_DUPFD, 1 << 12) for fd in fds]
        sock.close()
        keep = sorted(high)
        low = 3
        for fd in keep:
            os.closerange(low, fd)
            low = fd + 1
        os.closerange(low, os.sysconf("SC_OPEN_MAX"))
        for fd, target in zip(high, order["fds"]):
            os.dup2(fd, target)
            os.close(fd)
        os.chdir(order["cwd"])
        os.environ.clear()
        os.environ.update(order["env"])
        # a fresh interpreter's handlers: ignored signals stay ignored across exec, the rest are the default
        # but for Python's own (SIGPIPE and SIGXFSZ ignored, SIGINT raising KeyboardInterrupt)
        ignored = set(order["ignored"]) | {signal.SIGPIPE, signal.SIGXFSZ}
        for sig in signal.valid_signals():
            if sig not in (signal.SIGKILL, signal.SIGSTOP):
                signal.signal(sig, signal.SIG_IGN if sig in ignored else signal.SIG_DFL)
        if signal.SIGINT not in ignored:
            signal.signal(signal.SIGINT, signal.default_int_handler)
        signal.pthread_sigmask(signal.SIG_SETMASK, order["mask"])
        main = types.ModuleType("__main__")
        sys.modules["__main__"] = main
        sys.argv, sys.path[0] = ["-c"], ""
        exec(order["cmd"], main.__dict__)
    except SystemExit as exc:
        code = _exit_code(exc)
    except BaseException:
        import traceback

        traceback.print_exc()
        code = 1
    finally:
        os._exit(code)


def _child(request: dict) -> None:
    """In the forked child: become ``python ARGV`` in the request's directory and environment, and end as it
    would."""
    import runpy
    import traceback

    code = 1
    try:
        # Its own session and process group, as start_new_session=True: a job signalled whole (os.killpg, as SLURM
        # signals a job step) is this child's alone, and a run past its timeout is killed with all it started
        os.setsid()
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
        _spare_forkserver()
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
        code = _exit_code(exc)
    except BaseException as exc:
        # As the interpreter ends on an uncaught exception: through sys.excepthook, without this function's frame
        # (ddpkit's hook says its own errors in one line and raises SystemExit with their status, which the
        # interpreter exits with); a KeyboardInterrupt ends the process by SIGINT
        code = -signal.SIGINT if isinstance(exc, KeyboardInterrupt) else 1
        try:
            exc.__traceback__ = exc.__traceback__.tb_next  # the hook prints the exception's own
            sys.excepthook(type(exc), exc, exc.__traceback__)
        except SystemExit as hook_exit:
            code = _exit_code(hook_exit)
        except BaseException:
            traceback.print_exc()
    finally:
        _finalize(code)


def _exit_code(exc: SystemExit) -> int:
    """The status a SystemExit ends the interpreter with (a message is printed, and is status 1)."""
    if exc.code is None or isinstance(exc.code, int):
        return exc.code or 0
    print(exc.code, file=sys.stderr)
    return 1


def _finalize(code: int) -> None:
    """What the interpreter does at exit, then exit with ``code``: wait for non-daemon threads, run the atexit
    handlers (a Loop left open closes in one), flush."""
    import atexit

    try:
        try:
            threading._shutdown()
        finally:
            atexit._run_exitfuncs()
            sys.stdout.flush()
            sys.stderr.flush()
    finally:
        if code == -signal.SIGINT:
            signal.signal(signal.SIGINT, signal.SIG_DFL)
            os.kill(os.getpid(), signal.SIGINT)
        os._exit(code & 0xFF)


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
