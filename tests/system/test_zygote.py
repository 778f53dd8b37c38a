"""``run_cli``'s warm interpreter (tests/helpers/zygote.py) gives what a fresh ``python -m`` gives: the output,
the exit status (a signal's as ``-N``), the working directory, the environment and the arguments; and
``start_python``'s running child what ``subprocess.Popen`` gives."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path

import pytest
from clirun import WAIT_S, run_cli, run_python, start_python, worker_pids

pytestmark = pytest.mark.multiprocess

PROBE = """
import atexit, os, sys
atexit.register(print, "at exit")
print("cwd", os.getcwd(), "argv", sys.argv[1:], "path0", sys.path[0] == os.getcwd(), "env", os.environ["PROBE"])
print("to stderr", file=sys.stderr)
if sys.argv[1] == "signal":
    os.kill(os.getpid(), 15)
if sys.argv[1] == "uncaught":
    raise ValueError("not caught")
if sys.argv[1] == "interrupt":
    raise KeyboardInterrupt
if sys.argv[1] == "ddpkit":  # a ddpkit error left uncaught after a launch: its line and its status
    from ddpkit.errors import ConfigError
    from ddpkit.ranks.failures import stop_exits_with_its_status
    stop_exits_with_its_status()
    raise ConfigError("a bad setting")
raise SystemExit(3 if sys.argv[1] == "code" else "a message")
"""


@pytest.mark.parametrize("how", ["code", "message", "signal"])
def test_a_forked_run_gives_what_a_fresh_interpreter_gives(tmp_path, monkeypatch, how):
    monkeypatch.setenv("PROBE", "set")  # set after the warm interpreter started: each child takes the caller's
    (tmp_path / "probe_mod.py").write_text(PROBE)
    fresh = run_cli(how, cwd=tmp_path, module="probe_mod", fresh=True)
    forked = run_cli(how, cwd=tmp_path, module="probe_mod")
    assert (forked.returncode, forked.stdout, forked.stderr) == (fresh.returncode, fresh.stdout, fresh.stderr)
    assert fresh.returncode == {"code": 3, "message": 1, "signal": -signal.SIGTERM}[how]
    assert f"cwd {tmp_path} argv ['{how}'] path0 True env set" in fresh.stdout


def test_a_forked_run_past_its_timeout_is_killed_and_raises_as_subprocess_does(tmp_path):
    (tmp_path / "sleeper_mod.py").write_text("import time\nprint('started', flush=True)\ntime.sleep(600)\n")
    with pytest.raises(subprocess.TimeoutExpired) as raised:
        run_cli(cwd=tmp_path, module="sleeper_mod", timeout=3)
    assert "started" in raised.value.output
    (tmp_path / "probe_mod.py").write_text(PROBE)
    assert run_cli("code", cwd=tmp_path, module="probe_mod").returncode == 1  # no PROBE: a KeyError; served on


ENDS = {"code": 3, "uncaught": 1, "interrupt": -signal.SIGINT, "ddpkit": 2}


@pytest.mark.parametrize("end", ENDS)
@pytest.mark.parametrize("how", ["script", "code"])
def test_a_forked_script_or_code_gives_what_a_fresh_interpreter_gives(tmp_path, monkeypatch, how, end):
    """And ends as the interpreter does: an uncaught exception through sys.excepthook (ddpkit's, for its own
    errors), a KeyboardInterrupt by SIGINT, the atexit handlers run."""
    monkeypatch.setenv("PROBE", "set")
    (tmp_path / "probe.py").write_text(PROBE.replace("path0", "path0_is_cwd"))
    argv = ["probe.py", end] if how == "script" else ["-c", PROBE, end]
    fresh = run_python(*argv, cwd=tmp_path, fresh=True)
    forked = run_python(*argv, cwd=tmp_path)
    assert fresh.returncode == ENDS[end] and "at exit" in fresh.stdout, fresh.stderr
    assert (forked.returncode, forked.stdout, forked.stderr) == (fresh.returncode, fresh.stdout, fresh.stderr)


LAUNCHES = """
import os, signal, sys, tempfile

import ddpkit
import ddpkit.ranks.prestart as patched

patched.TIMES = getattr(patched, "TIMES", 0) + 1  # a script's patch of a ddpkit module, made again by each worker


def probe(ctx):
    import __main__

    signals = (signal.SIGINT, signal.SIGTERM, signal.SIGUSR1, signal.SIGHUP)
    handlers = {s.name: str(signal.getsignal(s)) for s in signals}
    parent = open(f"/proc/{os.getppid()}/cmdline").read()  # the forkserver's
    execd = "from multiprocessing.forkserver import main" in parent
    fds = sorted(int(fd) for fd in os.listdir("/proc/self/fd"))
    return __main__.__name__, patched.TIMES, handlers, fds, sys.argv[0], execd


if __name__ == "__main__":
    print("TMP", tempfile.gettempdir())
    print("RANK0", ddpkit.launch(probe, nproc=2))
"""


def test_a_forked_scripts_workers_are_what_an_execd_forkservers_are(tmp_path):
    """A child's forkserver is forked, not exec'd (zygote.py): its workers still import the script again
    (``__mp_main__``) into a clean interpreter (a patch the script makes at import is made once in each), start
    with the same signal handlers and descriptors, and read TMPDIR afresh."""
    (tmp_path / "launches.py").write_text(LAUNCHES)
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    fresh = run_python("launches.py", cwd=tmp_path, fresh=True, TMPDIR=str(tmp))
    forked = run_python("launches.py", cwd=tmp_path, TMPDIR=str(tmp))
    assert fresh.returncode == 0, fresh.stderr[-3000:]
    assert f"TMP {tmp}" in fresh.stdout and "('__mp_main__', 1, " in fresh.stdout, fresh.stdout
    assert fresh.stdout.endswith("True)\n") and forked.stdout.endswith("False)\n"), (fresh.stdout, forked.stderr)
    same = forked.stdout.replace("False)\n", "True)\n")  # the one difference: whose fork the forkserver is
    assert (forked.returncode, same) == (fresh.returncode, fresh.stdout), forked.stderr[-3000:]


WATCHED = """
import os, signal, sys, time

def said(sig, frame):
    print("got", signal.Signals(sig).name, flush=True)
    sys.exit(7)

if os.fork() == 0:  # a grandchild in the group, as a launcher's workers are
    time.sleep(600)
signal.signal(signal.SIGUSR1, said)  # after the fork: a signal in an at-fork hook would be lost
print("ready", flush=True)
print("to stderr", file=sys.stderr, flush=True)
time.sleep(600)
"""


@pytest.mark.parametrize("fresh", [True, False], ids=["fresh", "forked"])
def test_a_started_child_is_watched_and_signalled_as_popen_gives_it(tmp_path, fresh):
    """``start_python``: its output read line by line as it comes, stderr into stdout, a signal to it alone
    handled by it, one to its process group reaching what it started; forked or fresh alike."""
    (tmp_path / "watched.py").write_text(WATCHED)
    proc = start_python("watched.py", cwd=tmp_path, fresh=fresh, stderr=subprocess.STDOUT)
    try:
        assert [proc.stdout.readline() for _ in range(2)] == ["ready\n", "to stderr\n"] and proc.poll() is None
        proc.send_signal(signal.SIGUSR1)
        assert proc.wait(timeout=WAIT_S) == 7
        os.killpg(proc.pid, signal.SIGKILL)  # the grandchild, still in the group, holding the pipe open
        out, err = proc.communicate(timeout=WAIT_S)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert (out, err) == ("got SIGUSR1\n", None)


def test_children_run_side_by_side(tmp_path):
    """Two children at once (a job's two "nodes"): each waits for the other's file, so one served after the
    other ends would wait out its timeout."""
    code = (
        "import pathlib, sys, time\n"
        "here, there = map(pathlib.Path, sys.argv[1:])\n"
        "here.touch()\n"
        "while not there.exists(): time.sleep(0.01)\n"
        "print('met', here.name)\n"
    )
    a, b = tmp_path / "a", tmp_path / "b"
    procs = [start_python("-c", code, a, b), start_python("-c", code, b, a)]
    try:
        said = [proc.communicate(timeout=WAIT_S) for proc in procs]
    finally:
        for proc in procs:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
    assert said == [("met a\n", ""), ("met b\n", "")] and [p.returncode for p in procs] == [0, 0]


WORKERS = """
import os, pathlib, sys, time

import ddpkit


def wait(ctx):
    pathlib.Path(f"rank{ctx.rank}.pid").write_text(str(os.getpid()))
    while not pathlib.Path("done").exists():
        time.sleep(0.01)


if __name__ == "__main__":
    ddpkit.launch(wait, nproc=2)
"""


@pytest.mark.parametrize("fresh", [True, False], ids=["fresh", "forked"])
def test_worker_pids_finds_a_started_launchers_workers(tmp_path, fresh):
    """``worker_pids`` (benchmarks/faults.py, how the fault tests find whom to kill) tells a forked forkserver
    by its name, where an exec'd one's command line says it: the workers are found, and not the spare."""
    (tmp_path / "workers.py").write_text(WORKERS)
    proc = start_python("workers.py", cwd=tmp_path, fresh=fresh)
    try:
        deadline = time.monotonic() + WAIT_S
        while not all((tmp_path / f"rank{r}.pid").exists() for r in (0, 1)) and time.monotonic() < deadline:
            assert proc.poll() is None, proc.communicate()
            time.sleep(0.05)
        workers = sorted(int((tmp_path / f"rank{r}.pid").read_text()) for r in (0, 1))
        assert worker_pids(proc.pid) == workers
        names = {Path(f"/proc/{pid}/comm").read_text() for pid in [proc.pid, *workers]}
        assert len(names) == 1, names  # the workers are named as their launcher is
        (tmp_path / "done").touch()
        out, err = proc.communicate(timeout=WAIT_S)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == 0, err[-3000:]


def test_a_warm_interpreter_that_dies_at_its_start_is_an_error_not_a_hang(tmp_path):
    """A server that ends with a request unread (its import failed) resets the socket: the waiting caller is
    told, and the next request starts a new server."""
    import threading

    import zygote
    from clirun import cli_env

    (tmp_path / "torch").mkdir()
    (tmp_path / "torch" / "__init__.py").write_text("raise ImportError('a broken torch')\n")
    broken = cli_env(PYTHONPATH=str(tmp_path))
    server = zygote._Server(broken)
    raised = []

    def ask():
        try:
            server.start(["-c", "pass"], str(tmp_path), broken, subprocess.DEVNULL, subprocess.DEVNULL)
        except BaseException as exc:
            raised.append(exc)

    asking = threading.Thread(target=ask, daemon=True)
    asking.start()
    server.proc.wait(WAIT_S)
    asking.join(30)  # the server has ended: the answer is due now
    assert not asking.is_alive() and len(raised) == 1, "the caller still waits for a server that ended"
    assert isinstance(raised[0], RuntimeError) and "ended" in str(raised[0])
    assert run_python("-c", "print('served')").stdout == "served\n"


def test_a_ctrl_c_to_the_group_is_the_runs_alone_to_answer(tmp_path):
    """A Ctrl-C reaches a run's whole process group; the spare forkserver that a run never asked for ends by it
    silently (no KeyboardInterrupt traceback in the run's stderr), as a run without one shows nothing."""
    code = (
        "import os, signal, sys\n"
        "signal.signal(signal.SIGINT, lambda *_: print('interrupted'))\n"
        "os.killpg(os.getpgid(0), signal.SIGINT)\n"
        "try:\n"
        "    os.wait()  # the spare, where there is one, reaped once it has ended\n"
        "except ChildProcessError:\n"
        "    pass\n"
    )
    said = {}
    for fresh in (True, False):  # each in its own process group
        proc = start_python("-c", code, cwd=tmp_path, fresh=fresh)
        said[fresh] = (*proc.communicate(timeout=WAIT_S), proc.returncode)
    assert said[True] == ("interrupted\n", "", 0)
    assert said[False] == said[True]


def test_a_forked_runs_output_is_read_back_as_text_mode_reads_it(tmp_path):
    """Line ends as ``text=True`` gives them (universal newlines: a progress bar's ``\\r`` is a line end)."""
    code = "import sys; sys.stdout.write('a\\r\\nb\\rc\\n'); sys.stdout.flush()"
    fresh = run_python("-c", code, cwd=tmp_path, fresh=True)
    assert fresh.stdout == "a\nb\nc\n"
    assert run_python("-c", code, cwd=tmp_path).stdout == fresh.stdout


def test_a_signal_to_a_child_that_just_ended_is_no_error():
    """Between a child's end and the server's word of it, ``send_signal`` finds no process: as Popen's, a no-op."""
    import zygote

    gone = subprocess.Popen(["true"])
    gone.wait()  # reaped: its pid names no process
    child = zygote.Started(["true"], server=None, ident=0, stdout=None, stderr=None)
    child.pid = gone.pid
    child.send_signal(signal.SIGTERM)
