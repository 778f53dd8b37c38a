"""The CLI as a user runs it, in a subprocess, and what its runs leave: the helpers most system tests share.

proc = run_cli("train", "--dataset", "mnist", ...)    # python -m ddpkit ..., returns the finished process
records = read_jsonl(run_dir / "metrics.jsonl")
"""

from __future__ import annotations

import importlib.util
import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import zygote

ROOT = Path(__file__).resolve().parents[2]
# The longest a test waits on a process it started: a guard against a hang, not a time limit. A machine busy with
# another job stretched a world-2 start from seconds to 45 s, and tests failed on limits of 60-180 s that
# timed nothing they tested. Where time is what a test tests, it times that span alone.
WAIT_S = 600


def cli_env(**extra) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE")}
    env["PYTHONPATH"] = (
        str(ROOT / "src") + os.pathsep + str(ROOT / "tests" / "helpers") + os.pathsep + env.get("PYTHONPATH", "")
    )
    env.update(extra)
    return env


def run_cli(
    *args: str, cwd=None, timeout: float = WAIT_S, module: str = "ddpkit", fresh: bool = False, **env
) -> subprocess.CompletedProcess:
    """``python -m ddpkit ARGS`` as a user would run it, with ``cli_env(**env)``; returns the finished process.
    It is forked from a warm interpreter (``zygote.py``: the same run less its import of torch; in its own process
    group) unless ``fresh``: a new interpreter, for a test of what the interpreter's own start does."""
    return run_python("-m", module, *args, cwd=cwd, timeout=timeout, fresh=fresh, **env)


def run_python(*argv, cwd=None, timeout: float = WAIT_S, fresh: bool = False, **env) -> subprocess.CompletedProcess:
    """``python ARGV`` (a script and its arguments, ``-c CODE ...`` or ``-m MODULE ...``) with ``cli_env(**env)``;
    the finished process, its output as text. Forked from the warm interpreter as ``run_cli`` is, unless ``fresh``
    (then in this process's group, as ``subprocess.run`` starts it)."""
    argv = [str(a) for a in argv]
    if not fresh:
        return zygote.run_python(argv, cwd=cwd, env=cli_env(**env), timeout=timeout)
    return subprocess.run(
        [sys.executable, *argv], cwd=cwd, env=cli_env(**env), capture_output=True, text=True, timeout=timeout
    )


def start_python(
    *argv, cwd=None, stdout=subprocess.PIPE, stderr=subprocess.PIPE, fresh: bool = False, **env
) -> zygote.Started | subprocess.Popen:
    """``python ARGV`` started and running, for a test that watches or signals it: what
    ``subprocess.Popen([python, *ARGV], text=True, start_new_session=True, stdin=DEVNULL)`` gives (``pid``,
    ``poll``, ``wait``, ``communicate``, ``send_signal``, text pipes), forked from the warm interpreter unless
    ``fresh``. It leads its own process group, so ``os.killpg(proc.pid, sig)`` signals the whole job."""
    argv = [str(a) for a in argv]
    if not fresh:
        return zygote.start_python(argv, cwd=cwd, env=cli_env(**env), stdout=stdout, stderr=stderr)
    return subprocess.Popen(
        [sys.executable, *argv],
        cwd=cwd,
        env=cli_env(**env),
        stdin=subprocess.DEVNULL,
        stdout=stdout,
        stderr=stderr,
        text=True,
        start_new_session=True,
    )


def start_cli(*args: str, cwd=None, module: str = "ddpkit", **kw) -> zygote.Started | subprocess.Popen:
    """``python -m ddpkit ARGS`` started and running (``start_python``)."""
    return start_python("-m", module, *args, cwd=cwd, **kw)


def bench_finished(proc: subprocess.CompletedProcess, bench_json: Path) -> dict:
    """A ``ddpkit bench`` that measured everything: exit 0, or exit 1 only because other processes
    loaded the machine (the suite runs three tests at a time on two cores: the others are load)."""
    assert proc.returncode in (0, 1), proc.stdout[-3000:] + proc.stderr[-3000:]
    rep = json.loads(Path(bench_json).read_text())
    if proc.returncode == 1:
        reasons = [why for row in rep["rows"] for why in row["invalid"]]
        assert not rep["valid"] and all(
            "other processes used" in why or "relative to the world-1 run" in why or "above 100%" in why
            for why in reasons
        ), reasons
        assert any("other processes used" in why for why in reasons), reasons
    return rep


def run_nodes(commands: list, timeout: float = WAIT_S) -> list[subprocess.CompletedProcess]:
    """Start every command at once (the "nodes" of one job, each ``cmd`` or ``(cmd, extra env)``), wait for
    all; a node still running after ``timeout`` is killed. A ``python`` command is forked (``start_python``)."""
    commands = [c if isinstance(c, tuple) else (c, {}) for c in commands]
    procs = [
        start_python(*cmd[1:], **extra)
        if cmd[0] == sys.executable
        else subprocess.Popen(cmd, env=cli_env(**extra), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        for cmd, extra in commands
    ]
    results = []
    try:
        for (cmd, _), p in zip(commands, procs):
            out, err = p.communicate(timeout=timeout)
            results.append(subprocess.CompletedProcess(cmd, p.returncode, out, err))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    return results


def free_port() -> int:
    """A loopback port nothing listens on now (the kernel's choice), for a test's rendezvous endpoint."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]


def _load_benchmark(name: str):
    """A script of benchmarks/ as a module, loaded from its file (benchmarks/ is not a package)."""
    spec = importlib.util.spec_from_file_location(f"benchmarks_{name}", ROOT / "benchmarks" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


# The fault benchmark and the tests find the workers to kill in one way (benchmarks/faults.py).
worker_pids = _load_benchmark("faults").worker_pids
