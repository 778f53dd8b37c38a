"""``python ARGV`` in a child forked from a warm interpreter: the CLI, a script or ``-c`` code as a user runs
it, less the interpreter's start and its import of torch (3.5 s of CPU each on the 2-core AVX2 CI machine, where
the suite is CPU-bound: BENCHMARKS.md, "The test suite's wall time").

    result = run_python(["-m", "ddpkit", "train", ...], cwd=..., env=cli_env(), timeout=600)   # CompletedProcess
    proc = start_python([script, spec], cwd=None, env=cli_env())   # running: pid, poll, wait, communicate, pipes

The warm interpreter (one per pytest worker, started at its first use) imports torch, ddpkit's CLI, what
ddpkit's forkserver imports (ranks/prestart.py: dynamo) and what a launcher imports to draw its plots
(matplotlib: run/plots.py's ``import_matplotlib``), and runs no torch op (no OpenMP pool exists to be
forked half-made), so a fork of it is what that forkserver hands its workers. Each request forks one child,
handed its stdout and stderr as descriptors (a pipe, a file, /dev/null; stdin is /dev/null), which takes the
request's working directory, environment and arguments, runs what it is given as ``python`` does, and exits;
the server reports the child's pid at once and its exit status when it ends (``-N`` for a signal, as
``subprocess`` reports it). Children run side by side: a test's two "nodes", or a run it signals while it
watches the output. A test that tests the interpreter's own start (what ``--help`` imports) starts a fresh one
itself.

Any ``python ARGV`` runs so (``-m MODULE``, ``-c CODE`` or a script), and ends as the interpreter would: an
uncaught exception through ``sys.excepthook``, then the atexit handlers. Each child leads its own process group
(as ``start_new_session=True``).

A child's forkserver (ddpkit's workers are forked from one: ranks/prestart.py) is not started as
``python -c`` (an interpreter that imports torch and dynamo: 5.2 s of CPU each) but from a spare forked at
the child's start, before the run's own code: torch and dynamo are imported here already. It is what the
exec'd one would be: a clean interpreter (the workers import the script again into it), only the descriptors
it is handed, the environment, directory, ignored signals and mask of the moment it was asked for; it is named
``forkserver`` (/proc/PID/comm), its command line being the run's. Each pytest worker's own launches keep the
exec'd one.
"""

from __future__ import annotations

import fcntl
import importlib.machinery
import json
import os
import selectors
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import types
from pathlib import Path

_server: _Server | None = None
_lock = threading.Lock()


def run_python(argv: list[str], cwd, env: dict, timeout: float) -> subprocess.CompletedProcess:
    """``python ARGV`` (``-m MODULE ARGS``, ``-c CODE ARGS`` or ``SCRIPT ARGS``), forked; a CompletedProcess.
    Its output goes to files, not pipes: a process it started and left running cannot hold the wait open."""
    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
        child = start_python(argv, cwd, env, stdout=out, stderr=err)
        try:
            child.wait(timeout)
            late = False
        except subprocess.TimeoutExpired:
            child.kill_group()
            child.wait()
            late = True
        stdout, stderr = (_read_back(f) for f in (out, err))
    if late:
        raise subprocess.TimeoutExpired(child.args, timeout, stdout, stderr)
    return subprocess.CompletedProcess(child.args, child.returncode, stdout, stderr)


def start_python(argv: list[str], cwd, env: dict, stdout=subprocess.PIPE, stderr=subprocess.PIPE) -> Started:
    """``python ARGV`` forked and running, as ``subprocess.Popen(..., text=True, start_new_session=True)`` starts
    it: ``stdout`` and ``stderr`` each ``PIPE``, ``DEVNULL``, an open file or None (this process's own);
    ``stderr=STDOUT`` too. Stdin is /dev/null."""
    global _server
    if (
        not argv
        or (argv[0] in ("-m", "-c") and len(argv) < 2)
        or (argv[0].startswith("-") and argv[0] not in ("-m", "-c"))
    ):
        raise ValueError(f"run_python takes -m MODULE, -c CODE or a script, then its arguments: {argv}")
    with _lock:
        if _server is None or _server.gone or _server.proc.poll() is not None:
            _server = _Server(env)
        server = _server
    return server.start([str(a) for a in argv], str(cwd or os.getcwd()), env, stdout, stderr)


def _read_back(f) -> str:
    """As ``text=True`` reads it: UTF-8, universal newlines (``\r\n`` and ``\r`` each a ``\n``)."""
    f.seek(0)
    return f.read().decode(errors="replace").replace("\r\n", "\n").replace("\r", "\n")


class _Server:
    """This process's end of the warm interpreter: requests go out, with the child's stdin, stdout and stderr as
    descriptors (SCM_RIGHTS); each child's pid, and later its exit status, come back, read by one thread."""

    def __init__(self, env: dict):
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self.proc = subprocess.Popen(
            [sys.executable, __file__, str(theirs.fileno())],
            pass_fds=[theirs.fileno()],
            stdin=subprocess.DEVNULL,
            env=env,
        )
        theirs.close()
        self.sock, self.changed, self.children, self.gone = ours, threading.Condition(), {}, False
        self.sent = 0
        threading.Thread(target=self._read, daemon=True).start()

    def start(self, argv: list[str], cwd: str, env: dict, stdout, stderr) -> Started:
        fds, ends, pipes = [], [], []  # the child's stdin, stdout and stderr; those opened here; this side's pipes
        try:
            fds.append(os.open(os.devnull, os.O_RDONLY))
            ends.append(fds[0])
            for where, own in ((stdout, 1), (stderr, 2)):
                pipe = None
                if where is None:
                    fd = own
                elif where == subprocess.PIPE:
                    read, fd = os.pipe()
                    pipe = open(read, encoding="utf-8", errors="replace")
                    ends.append(fd)
                elif where == subprocess.DEVNULL:
                    fd = os.open(os.devnull, os.O_WRONLY)
                    ends.append(fd)
                elif where == subprocess.STDOUT:
                    fd = fds[1]
                else:
                    fd = where.fileno()
                fds.append(fd)
                pipes.append(pipe)
            with self.changed:
                self.sent += 1
                child = Started([sys.executable, *argv], self, self.sent, *pipes)
                self.children[child.ident] = child
                request = {"id": child.ident, "argv": argv, "cwd": cwd, "env": env}
                try:
                    socket.send_fds(self.sock, [json.dumps(request).encode()], fds)
                except OSError:  # the server has ended (EPIPE): the reader sees it too, and says so below
                    pass
                self.changed.wait_for(lambda: child.pid is not None or self.gone)
        finally:
            for fd in ends:
                os.close(fd)
        if child.pid is None:
            raise RuntimeError(
                "the warm interpreter (tests/helpers/zygote.py) ended before it started the child; "
                "its own error is in the pytest worker's stderr"
            )
        return child

    def _read(self) -> None:
        try:
            # A server that ends with a request unread resets the connection (ECONNRESET), where one that read
            # all it was sent ends it (an empty read): either way it is gone, and whoever waits on it is told
            while message := self.sock.recv(1 << 16):
                said = json.loads(message)
                with self.changed:
                    child = self.children[said["id"]]
                    if "pid" in said:
                        child.pid = said["pid"]
                    else:
                        child.returncode = said["returncode"]
                        del self.children[said["id"]]
                    self.changed.notify_all()
        except OSError:
            pass
        finally:
            with self.changed:
                self.gone = True
                self.changed.notify_all()


class Started:
    """A forked ``python ARGV``, as ``subprocess.Popen`` is one: ``pid``, ``returncode``, ``poll``, ``wait``,
    ``communicate``, ``send_signal``, ``terminate``, ``kill``, and ``stdout``/``stderr`` where piped (text). The
    child leads its own process group: ``os.killpg(child.pid, sig)`` signals all it started."""

    def __init__(self, args, server: _Server, ident: int, stdout, stderr):
        self.args, self.ident, self.stdout, self.stderr = args, ident, stdout, stderr
        self.pid: int | None = None
        self.returncode: int | None = None
        self._server, self._read = server, None

    def poll(self) -> int | None:
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        changed = self._server.changed
        with changed:
            if not changed.wait_for(lambda: self.returncode is not None or self._server.gone, timeout):
                raise subprocess.TimeoutExpired(self.args, timeout)
        if self.returncode is None:
            raise RuntimeError("the warm interpreter (tests/helpers/zygote.py) ended before its child did")
        return self.returncode

    def communicate(self, input=None, timeout: float | None = None) -> tuple[str | None, str | None]:
        """Each pipe read to its end (what the child, and whatever it started, wrote), then the exit status."""
        import time

        deadline = None if timeout is None else time.monotonic() + timeout
        if self._read is None:
            self._read = [[], []]
            self._readers = [
                threading.Thread(target=lambda f=f, into=into: into.append(f.read()), daemon=True)
                for f, into in zip((self.stdout, self.stderr), self._read)
                if f is not None
            ]
            for reader in self._readers:
                reader.start()
        for reader in self._readers:
            reader.join(None if deadline is None else max(0, deadline - time.monotonic()))
            if reader.is_alive():
                raise subprocess.TimeoutExpired(self.args, timeout)
        self.wait(None if deadline is None else max(0, deadline - time.monotonic()))
        said = [("".join(into) if f is not None else None) for f, into in zip((self.stdout, self.stderr), self._read)]
        for f in (self.stdout, self.stderr):
            if f is not None:
                f.close()
        return said[0], said[1]

    def send_signal(self, sig: int) -> None:
        if self.returncode is None:
            try:
                os.kill(self.pid, sig)
            except ProcessLookupError:  # it ended and was reaped; the server's word of it is on its way
                pass

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)

    def kill_group(self) -> None:
        """SIGKILL to the child's process group: the child and all it started that did not leave it."""
        try:
            os.killpg(self.pid, signal.SIGKILL)
        except ProcessLookupError:  # all of it ended just now
            pass

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        for f in (self.stdout, self.stderr):
            if f is not None:
                f.close()
        self.wait()


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
    # A Ctrl-C to the run's group reaches the spare too. Until it is asked for, it ends by one silently (as the
    # forkserver not yet started shows nothing), not by a KeyboardInterrupt raised at whatever line it is on:
    # SIGINT held back across the fork, the default action set in the spare, then let through in both
    held = signal.pthread_sigmask(signal.SIG_BLOCK, [signal.SIGINT])
    spare = os.fork()
    if spare == 0:
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        signal.pthread_sigmask(signal.SIG_SETMASK, held)
        ours.close()
        comm = Path("/proc/self/comm")
        launchers = comm.read_text().strip()
        comm.write_text("spare")  # not taken for a worker the run forks itself (its command line is theirs)
        _become_forkserver(theirs, launchers)
    signal.pthread_sigmask(signal.SIG_SETMASK, held)
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


def _name_forkserver(workers: str) -> None:
    """Name this process ``forkserver`` (/proc/PID/comm) and each worker it forks ``workers`` (the run's own
    name). Its command line is the run's (it is a fork), where an exec'd one's says ``forkserver``: the name is
    how ``worker_pids`` (benchmarks/faults.py) tells it from a worker forked by the run itself."""
    from multiprocessing import forkserver

    comm = Path("/proc/self/comm")
    comm.write_text("forkserver")
    serve_one = forkserver._serve_one

    def _serve_one(*args, **kwargs):
        comm.write_text(workers)
        return serve_one(*args, **kwargs)

    forkserver._serve_one = _serve_one


def _become_forkserver(sock, name: str) -> None:
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
        _name_forkserver(name)
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


def _child(request: dict, fds: list[int]) -> None:
    """In the forked child: become ``python ARGV`` in the request's directory and environment, its stdin, stdout
    and stderr ``fds``, and end as it would."""
    import runpy
    import traceback

    code = 1
    try:
        # Its own session and process group, as start_new_session=True: a job signalled whole (os.killpg, as SLURM
        # signals a job step) is this child's alone, and a run past its timeout is killed with all it started
        os.setsid()
        for target, fd in enumerate(fds):  # stdin, stdout and stderr, as the caller sent them
            os.dup2(fd, target)
        for fd in set(fds):
            os.close(fd)
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


def _serve(fd: int) -> None:
    import torch  # noqa: F401  (the import each child is spared)

    import ddpkit.cli  # noqa: F401
    from ddpkit.ranks.prestart import PRELOAD

    for name in PRELOAD:  # what a forkserver imports (dynamo: 1.9 s), less its exit hook (its own to run)
        if name != "ddpkit.ranks._forkserver_exit":
            __import__(name)
    from ddpkit.run.plots import import_matplotlib

    import_matplotlib()  # what a launcher that draws its plots imports (1.1 s of CPU here)

    # Children run side by side (a test's two "nodes", or a run it signals while the next starts): one loop waits
    # on the requests and on each child's end (a pidfd, readable once it exits), and reaps each as it ends
    sock = socket.socket(fileno=fd)
    waiting = selectors.DefaultSelector()
    waiting.register(sock, selectors.EVENT_READ)
    while True:
        for key, _ in waiting.select():
            if key.fileobj is sock:
                message, fds, _, _ = socket.recv_fds(sock, 1 << 20, 3)
                if not message:  # the caller ended
                    return
                request = json.loads(message)
                pid = os.fork()
                if pid == 0:  # none of the server's descriptors stays open in the child
                    for key in waiting.get_map().values():
                        os.close(key.fd)
                    waiting.close()  # the epoll descriptor itself
                    _child(request, fds)
                for sent in fds:
                    os.close(sent)
                waiting.register(os.pidfd_open(pid), selectors.EVENT_READ, (request["id"], pid))
                sock.send(json.dumps({"id": request["id"], "pid": pid}).encode())
            else:
                ident, pid = key.data
                waiting.unregister(key.fileobj)
                os.close(key.fileobj)
                _, status = os.waitpid(pid, 0)
                sock.send(json.dumps({"id": ident, "returncode": os.waitstatus_to_exitcode(status)}).encode())


if __name__ == "__main__":
    _serve(int(sys.argv[1]))
