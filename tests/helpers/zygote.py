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
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

_server: subprocess.Popen | None = None
_lock = threading.Lock()


def run_module(module: str, args: list[str], cwd, env: dict, timeout: float) -> subprocess.CompletedProcess:
    global _server
    with _lock, tempfile.TemporaryDirectory() as scratch:
        if _server is None or _server.poll() is not None:
            _server = subprocess.Popen(
                [sys.executable, __file__], stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env, text=True
            )
        out, err = Path(scratch) / "out", Path(scratch) / "err"
        request = {"module": module, "args": list(args), "cwd": str(cwd or os.getcwd()), "env": env}
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
        argv = [sys.executable, "-m", module, *args]
        stdout, stderr = out.read_text(errors="replace"), err.read_text(errors="replace")
        if late:
            raise subprocess.TimeoutExpired(argv, timeout, stdout, stderr)
        return subprocess.CompletedProcess(argv, ended["returncode"], stdout, stderr)


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
        sys.path[0] = os.getcwd()  # as -m puts the working directory first
        sys.argv = ["-m", *request["args"]]
        runpy.run_module(request["module"], run_name="__main__", alter_sys=True)
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
