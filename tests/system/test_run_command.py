"""``ddpkit run --nproc 2 script.py ARGS``: a user's own script under torch's elastic agent, with ``ddpkit train``'s
one-line errors, exit statuses, stop signals and workers that die with their launcher; and a Loop under plain
torchrun that stops when its agent is killed.

The CLI is under test, so each behaviour is one subprocess: a tiny script written to tmp_path makes a
``ddpkit.Loop`` at world size 2 on CPU and trains a linear model, writing its ranks' pids (and rank 0 its
``sys.argv`` and ``__name__``) beside the run dir first.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from clirun import WAIT_S, read_jsonl, run_cli, run_python, start_python
from zygote import Started

pytestmark = pytest.mark.multiprocess  # every test here starts processes

SCRIPT = """\
import json, os, sys, time
from pathlib import Path

import torch

import ddpkit


def main(run_dir, steps, mode):
    pids = Path(run_dir + "-pids")
    pids.mkdir(parents=True, exist_ok=True)
    rank = os.environ["RANK"]
    (pids / f"rank{rank}.pid").write_text(str(os.getpid()))
    if rank == "0":
        (pids / "argv.json").write_text(json.dumps({"argv": sys.argv, "name": __name__}))
    with ddpkit.Loop(run_dir, log_every=2, device="cpu") as loop:
        # mode "shard": a ddpkit error every rank meets alike (Loop.wrap's shard= needs strategy='fsdp2')
        model = loop.wrap(torch.nn.Linear(4, 1), **({"shard": lambda m: False} if mode == "shard" else {}))
        opt = torch.optim.SGD(model.parameters(), lr=0.01)
        loop.resume(model=model, optimizer=opt)
        for step in loop.steps(steps):
            if (mode == "raise" and loop.rank == 1 or mode == "raise_all") and step == 3:
                raise ValueError("boom at step 3")
            loss = model(torch.ones(8, 4)).sum()
            loss.backward()
            opt.step()
            opt.zero_grad()
            loop.log(loss=loss.detach())
            time.sleep(0.05)  # so that a signal lands mid-run
    # After the loop (issue 42's item G): "after", the script's own code; "teardown", an object of its torn down
    # as the interpreter ends, after the script and its exit handlers
    if mode == "after":
        (pids / f"after{rank}").write_text("")
        time.sleep(600)
    if mode == "teardown":
        import builtins
        builtins.slow = SlowTeardown(pids / f"teardown{rank}")


class SlowTeardown:
    def __init__(self, path):
        self.path = path

    def __del__(self):
        self.path.write_text("")
        time.sleep(600)


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), sys.argv[3] if len(sys.argv) > 3 else "")
"""


@pytest.fixture
def script(tmp_path) -> Path:
    path = tmp_path / "train.py"
    path.write_text(SCRIPT)
    return path


def _start(cmd: list[str], tmp_path: Path, name: str) -> tuple[Started, Path]:
    """``cmd`` (``python ARGS``) in its own session, its output in a file (workers that outlive it would hold a
    pipe open)."""
    out = tmp_path / f"{name}.log"
    with open(out, "w") as fh:
        proc = start_python(*cmd[1:], stdout=fh, stderr=subprocess.STDOUT)
    return proc, out


def _first_step(run: Path, proc: subprocess.Popen, out: Path, timeout: float = WAIT_S) -> None:
    deadline, path = time.monotonic() + timeout, run / "metrics.jsonl"
    while time.monotonic() < deadline:
        assert proc.poll() is None, f"the run ended early: {out.read_text()[-3000:]}"
        if path.exists() and '"step"' in path.read_text():
            return
        time.sleep(0.05)
    raise AssertionError(f"no step record came: {out.read_text()[-3000:]}")


def _worker_pids(run: Path) -> list[int]:
    return [int(p.read_text()) for p in sorted(Path(f"{run}-pids").glob("rank*.pid"))]


def _alive(pid: int) -> bool:
    """Running, not a zombie waiting for init (or no init) to reap it."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state not in ("Z", "X")


def _end(proc: subprocess.Popen, pids: list[int]) -> None:
    """Whatever of this test's processes is still running, by pid."""
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    for pid in pids:
        if _alive(pid):
            os.kill(pid, signal.SIGKILL)


@pytest.mark.slow
def test_a_scripts_exception_is_one_line_naming_its_rank(tmp_path, script):
    run = tmp_path / "run"
    proc = run_cli("run", "--nproc", "2", str(script), str(run), "50", "raise")
    said = [line for line in proc.stderr.splitlines() if line.startswith("ddpkit: error:")]
    assert proc.returncode == 1, proc.stderr[-3000:]
    assert len(said) == 1 and "rank 1 raised ValueError: boom at step 3" in said[0], proc.stderr[-3000:]
    # the rank's own traceback, once: not one per rank, nor torchrun's ChildFailedError and its box
    assert proc.stderr.count("Traceback") == 1, proc.stderr[-3000:]
    assert "ChildFailedError" not in proc.stderr and "torch/distributed/elastic" not in proc.stderr, proc.stderr


STARTED_THEN_A_BLOCK = """\
import sys, torch, ddpkit
from torch.distributed import destroy_process_group
loop = ddpkit.Loop.start(sys.argv[1] + "/main", device="cpu", log_every=0)
model = loop.wrap(torch.nn.Linear(4, 1))
opt = torch.optim.SGD(model.parameters(), lr=0.1)
loop.resume(model=model, opt=opt)
for s in loop.steps(3):
    loss = model(torch.ones(8, 4)).pow(2).mean(); opt.zero_grad(); loss.backward(); opt.step()
with ddpkit.Loop(sys.argv[1] + "/side", device="cpu", log_every=0) as side:  # a second, short Loop (a probe)
    side.resume(m=side.wrap(torch.nn.Linear(4, 1)))
destroy_process_group()  # the tutorial's last line, kept
"""


@pytest.mark.slow
def test_a_started_loops_destroy_after_a_with_block_loop_still_closes_the_started_one(tmp_path):
    """Review finding: the with-block's Loop took the started one's place as the Loop a script's destroy closes;
    at its end the destroy found it ended and tore down the started Loop's group under it (exit 1, no end record)."""
    (tmp_path / "s.py").write_text(STARTED_THEN_A_BLOCK)
    proc = run_cli("run", "--nproc", "2", str(tmp_path / "s.py"), str(tmp_path), cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert read_jsonl(tmp_path / "main" / "metrics.jsonl")[-1]["event"] == "end"


STARTED_RAISES = """\
import sys, torch, ddpkit
loop = ddpkit.Loop.start(sys.argv[1], device="cpu")
model = loop.wrap(torch.nn.Linear(4, 1))
loop.resume(model=model)
for step in loop.steps(50):
    if step == 3:
        raise ValueError("boom at step 3")
"""


def _run_in_form(tmp_path: Path, script: Path, form: str, started: str, *args: str, flags: tuple = ()):
    """``ddpkit run --nproc 2 [FLAGS]`` of the with-form script, or (``form`` "start") of ``started``, a Loop.start()
    one; the run and its ``ddpkit: error:`` lines."""
    if form == "start":
        script = tmp_path / "started.py"
        script.write_text(started)
    proc = run_cli("run", "--nproc", "2", *flags, str(script), str(tmp_path / "run"), *args)
    return proc, [line for line in proc.stderr.splitlines() if line.startswith("ddpkit: error:")]


@pytest.mark.slow
@pytest.mark.parametrize("form", ["with", "start"])
def test_the_same_exception_on_every_rank_is_one_traceback(tmp_path, script, form):
    """The porter's item I: a plain ValueError every rank raised printed every rank's traceback, the same one twice;
    and under ``Loop.start()`` still (the porter's seed-002 port: its script's excepthook printed one per rank)."""
    proc, said = _run_in_form(tmp_path, script, form, STARTED_RAISES, "50", "raise_all")
    assert proc.returncode == 1, proc.stderr[-3000:]
    assert len(said) == 1 and "raised ValueError: boom at step 3 (its traceback is above)" in said[0], proc.stderr
    assert proc.stderr.count("Traceback") == 1, proc.stderr[-3000:]


STARTED = """\
import sys, torch, ddpkit
loop = ddpkit.Loop.start(sys.argv[1], device="cpu")
model = loop.wrap(torch.nn.Linear(4, 1), shard=lambda m: False)
"""


@pytest.mark.parametrize("form", ["with", "start"])
def test_a_ddpkit_error_every_rank_meets_in_a_loop_is_said_once(tmp_path, script, form):
    """Before: each rank's process-group teardown printed it, one line per rank (``with``); and with
    ``Loop.start()`` nothing was printed at all: the teardown at exit filed the error as printed. Under
    ``--max-restarts 1``, before: the restart ran the script into it again and said it again (two lines); now
    the restart stops at the Loop, quiet, on the note the first attempt left (run dir's .fatal.json)."""
    proc, said = _run_in_form(tmp_path, script, form, STARTED, "5", "shard", flags=("--max-restarts", "1"))
    assert proc.returncode == 2, proc.stderr[-3000:]
    # one line (Loop.start()'s as the agent's restart note, its restarts then quiet), the first attempt's
    assert len([line for line in proc.stderr.splitlines() if "strategy='fsdp2'" in line]) == 1, proc.stderr[-3000:]
    assert len(said) <= 1 and "Traceback" not in proc.stderr, proc.stderr[-3000:]


@pytest.mark.slow
def test_sigterm_stops_the_job_with_143_and_the_same_command_resumes_and_finishes(tmp_path, script):
    run = tmp_path / "run"
    cmd = [sys.executable, "-m", "ddpkit", "run", "--nproc", "2", str(script), str(run), "200"]
    proc, out = _start(cmd, tmp_path, "first")
    try:
        _first_step(run, proc, out)
        os.kill(proc.pid, signal.SIGTERM)  # the launcher alone: it passes the signal on to the ranks
        proc.wait(timeout=WAIT_S)
    finally:
        _end(proc, _worker_pids(run))
    err = out.read_text()
    assert proc.returncode == 143, err[-3000:]
    assert err.count("stopped on SIGTERM at step") == 1 and "run the same command again" in err, err[-3000:]
    assert "error" not in err and "Traceback" not in err and "SignalException" not in err, err[-3000:]
    assert json.loads((Path(f"{run}-pids") / "argv.json").read_text()) == {
        "argv": [str(script), str(run), "200"],
        "name": "__main__",
    }
    stopped = [r for r in read_jsonl(run / "metrics.jsonl") if r["event"] == "stopped"]
    assert [(r["reason"], r["signal"]) for r in stopped] == [("signal", "SIGTERM")]  # the engine's record too
    step = stopped[0]["step"]
    assert (run / "checkpoints" / f"snapshot-{step:09d}.pt").exists() and step < 200

    again = run_python(*cmd[1:])
    assert again.returncode == 0, again.stderr[-3000:]
    records = read_jsonl(run / "metrics.jsonl")
    assert [r for r in records if r["event"] == "start"][-1]["resumed_at_step"] == step
    assert records[-1]["event"] == "end" and records[-1]["step"] == 200


@pytest.mark.parametrize("when", ["after", "teardown"])
def test_a_sigterm_after_the_loops_end_is_said_as_what_it_stopped(tmp_path, script, when):
    """Issue 42's item G: a stop after a Loop's ``[end]`` was said as "interrupted ... and stopped the workers",
    exit 143, as if the run were lost. In the script's code after the loop it now names the finished run (still
    143: the script did not end); in the teardown, after every rank's script ended, the job ends as finished."""
    run = tmp_path / "run"
    cmd = [sys.executable, "-m", "ddpkit", "run", "--nproc", "2", str(script), str(run), "4", when]
    proc, out = _start(cmd, tmp_path, when)
    marks = [Path(f"{run}-pids") / f"{when}{rank}" for rank in (0, 1)]
    try:
        deadline = time.monotonic() + WAIT_S
        while not all(m.exists() for m in marks) and time.monotonic() < deadline:
            assert proc.poll() is None, out.read_text()[-3000:]
            time.sleep(0.05)
        assert all(m.exists() for m in marks), out.read_text()[-3000:]
        os.kill(proc.pid, signal.SIGTERM)
        proc.wait(timeout=WAIT_S)
    finally:
        _end(proc, _worker_pids(run))
    err = out.read_text()
    assert (run / "checkpoints" / "finished").read_text() == "4"
    said = [line for line in err.splitlines() if line.startswith("ddpkit:")]
    if when == "after":
        assert proc.returncode == 143, err[-3000:]
        assert len(said) == 1 and f"after the run in {run} finished at step 4" in said[0], err[-3000:]
        assert "a rerun resumes at its end" in said[0]
    else:
        assert proc.returncode == 0, err[-3000:]
        assert said == [
            "ddpkit: the launcher received SIGTERM after every worker had finished its work: only their teardown "
            "was stopped, and nothing was lost; the job ends as finished"
        ], err[-3000:]
    assert "Traceback" not in err, err[-3000:]


@pytest.mark.slow
def test_a_killed_launcher_leaves_no_worker_running(tmp_path, script):
    run = tmp_path / "run"
    cmd = [sys.executable, "-m", "ddpkit", "run", "--nproc", "2", str(script), str(run), "100000"]
    proc, out = _start(cmd, tmp_path, "killed")
    pids: list[int] = []
    try:
        _first_step(run, proc, out)
        pids = _worker_pids(run)
        assert len(pids) == 2 and all(_alive(p) for p in pids), pids
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=WAIT_S)
        deadline = time.monotonic() + 10  # what is tested: the workers go with it, within seconds
        while any(_alive(p) for p in pids) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not [p for p in pids if _alive(p)], f"workers outlived their launcher: {out.read_text()[-2000:]}"
    finally:
        _end(proc, pids)


@pytest.mark.parametrize(
    "args,fragment",
    [
        (["--nproc", "0", "SCRIPT"], "--nproc must be a positive integer or 'auto', got '0'"),
        (["--nproc", "two", "SCRIPT"], "--nproc must be a positive integer or 'auto', got 'two'"),
        (["--nproc", "2", "missing.py"], "no such script: missing.py"),
        (["--nproc", "2", "."], ". is a directory"),
        # Each replica group is one process
        (["--replicas", "2", "--nproc", "2", "SCRIPT"], "--replicas 2 cannot be combined with --nproc 2"),
    ],
    ids=["nproc 0", "nproc two", "missing script", "a directory", "replicas and nproc"],
)
def test_bad_input_is_one_line_and_exit_2_before_anything_starts(tmp_path, script, args, fragment):
    args = [str(script) if a == "SCRIPT" else a for a in args]
    proc = run_cli("run", *args, cwd=tmp_path)
    said = [line for line in proc.stderr.splitlines() if line.startswith("ddpkit: error:")]
    assert proc.returncode == 2 and len(said) == 1 and fragment in said[0], proc.stderr
    assert "Traceback" not in proc.stderr + proc.stdout, proc.stderr


SPAWNING = """\
import torch.multiprocessing as mp


def work(i):
    print("worker", i, flush=True)


if __name__ == "__main__":
    mp.spawn(work, nprocs=2)
"""


@pytest.mark.slow
def test_an_unported_mp_spawn_script_is_one_line_at_two_ranks_and_runs_at_one(tmp_path):
    """Regression (the porter's seed-001 port): an mp.spawn script run unported under ``ddpkit run --nproc 2``
    started 2 x 2 processes that hung at the script's rendezvous with no output; refused in one line now, once
    for the job. At one rank its own processes are the only ones, and it runs as under python."""
    path = tmp_path / "spawning.py"
    path.write_text(SPAWNING)
    two = run_cli("run", "--nproc", "2", str(path), cwd=tmp_path)
    said = [line for line in two.stderr.splitlines() if "torch.multiprocessing.spawn" in line]
    assert two.returncode == 2 and len(said) == 1 and "ddpkit run has started 2 ranks already" in said[0], two.stderr
    assert "Traceback" not in two.stderr, two.stderr
    one = run_cli("run", "--nproc", "1", str(path), cwd=tmp_path)
    workers = sorted(line for line in one.stdout.splitlines() if line.startswith("worker"))
    assert one.returncode == 0 and workers == ["worker 0", "worker 1"], one.stdout + one.stderr


@pytest.mark.slow
def test_a_loop_under_torchrun_stops_and_saves_when_its_agent_is_killed(tmp_path, script):
    """Before, a SIGKILLed torchrun left its workers training on to the end. Each rank's StopSignal notices its
    parent is gone and stops the run at its next log interval, with a snapshot."""
    run = tmp_path / "run"
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node",
        "2",
        str(script),
        str(run),
        "100000",
    ]
    proc, out = _start(cmd, tmp_path, "torchrun")
    pids: list[int] = []
    try:
        _first_step(run, proc, out)
        pids = _worker_pids(run)
        assert len(pids) == 2, pids
        os.kill(proc.pid, signal.SIGKILL)  # the agent alone: torchrun's workers run in their own sessions
        proc.wait(timeout=WAIT_S)
        deadline = time.monotonic() + WAIT_S  # a guard: unstopped, they would train on for over an hour
        while any(_alive(p) for p in pids) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not [p for p in pids if _alive(p)], f"workers trained on: {out.read_text()[-2000:]}"
    finally:
        _end(proc, pids)
    stopped = [r for r in read_jsonl(run / "metrics.jsonl") if r["event"] == "stopped"]
    assert [r["signal"] for r in stopped] == ["the loss of its launcher"], out.read_text()[-3000:]
    assert (run / "checkpoints" / f"snapshot-{stopped[0]['step']:09d}.pt").exists()
    assert out.read_text().count("stopped on the loss of its launcher at step") == 1, out.read_text()[-3000:]
