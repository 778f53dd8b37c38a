"""Fault tolerance, end to end on 2 gloo processes: kills, a kill mid-save, SIGTERM, NaN, a stall,
resume at another world size.

Every run goes through the public API (tests/helpers/custom_train.py), with the seed ConvNet wrapped to
inject one fault at a chosen step: in its own process where a test signals the launcher or reads its exit
status and output, and launched from the test's process (``fit_here``) where only its files are read.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path

import custom_train
import pytest
import torch
from clirun import ROOT, WAIT_S, read_jsonl, run_python, start_python, worker_pids
from once import once
from zygote import Started

pytestmark = pytest.mark.multiprocess  # every test here starts processes

SCRIPT = str(ROOT / "tests" / "helpers" / "custom_train.py")
BASE = custom_train.BASE  # 2,000 MNIST images, global batch 100: 20 steps per epoch at world 2


def spec(run_dir: Path, fault: str = "none", **kw) -> dict:
    fault_keys = {"at_step", "rank", "seconds"}
    return {
        "fault": fault,
        **{k: kw.pop(k) for k in list(kw) if k in fault_keys},
        "config": {**BASE, "run_dir": str(run_dir), **kw},
    }


def start(s: dict) -> Started:
    return start_python(SCRIPT, json.dumps(s))


def fit_here(s: dict) -> dict:
    """The run of ``s`` launched from this test's process (its workers forked from the warm forkserver), for a
    run whose files are what a test reads: ~4 s where a fresh launcher takes ~12 (BENCHMARKS.md, the test
    suite's wall time)."""
    return custom_train.trainer(s).fit()


def run(s: dict, timeout: float = 240) -> subprocess.CompletedProcess:
    return run_python(SCRIPT, json.dumps(s), timeout=timeout)


def wait_for_step(run_dir: Path, proc: subprocess.Popen, pred, timeout: float = 120) -> dict:
    """Poll metrics.jsonl until a step record satisfies ``pred``."""
    deadline = time.monotonic() + timeout
    path = run_dir / "metrics.jsonl"
    while time.monotonic() < deadline:
        assert proc.poll() is None, f"run ended early: {proc.communicate()}"
        if path.exists():
            for line in path.read_text().splitlines():
                try:
                    rec = json.loads(line)
                except json.JSONDecodeError:
                    continue
                if rec.get("event") == "step" and pred(rec["step"]):
                    return rec
        time.sleep(0.02)
    raise AssertionError("the awaited step never came")


def load(path: Path) -> dict:
    return torch.load(path, map_location="cpu", weights_only=True)


def assert_bitwise_equal(a: Path, b: Path) -> None:
    sa, sb = load(a), load(b)
    assert sa.keys() == sb.keys()
    different = [k for k in sa if not torch.equal(sa[k], sb[k])]
    assert not different, f"tensors differ: {different}"


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory) -> Path:
    """Run A: the same run as the kill test's, never interrupted (once per pytest run: tests/helpers/once.py)."""

    def make(where: Path) -> None:
        fit_here(spec(where / "run", save_every_steps=5, log_every=1))  # not paced: nothing stops it

    return once(tmp_path_factory, "fault-tolerance-a", make) / "run"


@pytest.mark.slow
def test_a_worker_killed_mid_epoch_is_restarted_and_finishes_bitwise_identical(tmp_path, uninterrupted):
    run_dir = tmp_path / "run"
    proc = start(spec(run_dir, "slow", seconds=0.03, save_every_steps=5, log_every=1, max_restarts=2))
    try:
        # Mid-epoch 2 (steps 21..40), past the snapshot at step 25 (whole: it is written in the background
        # while the next steps run) and before the next one.
        wait_for_step(run_dir, proc, lambda step: 26 <= step <= 28)
        snapshot = run_dir / "checkpoints" / "snapshot-000000025.pt"
        while not snapshot.exists():
            assert proc.poll() is None, proc.communicate()
            time.sleep(0.005)
        killed_at = time.monotonic()
        pids = worker_pids(proc.pid)
        assert len(pids) == 2, pids
        os.kill(pids[-1], signal.SIGKILL)
        out, err = proc.communicate(timeout=WAIT_S)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == 0, err
    # The restart is explained by the rank that died (the higher pid: torch starts local ranks in order),
    # not by the survivor's lost connection, and without torch's "Terminating process" lines.
    assert "ddpkit: rank 1 was killed (SIGKILL)" in err and "restart 1 of --max-restarts 2" in err, err
    assert "another rank left" not in err and "Terminating process" not in err, err
    records = read_jsonl(run_dir / "metrics.jsonl")
    starts = [r for r in records if r["event"] == "start"]
    assert len(starts) == 2 and starts[1]["resumed_at_step"] == 25, starts
    assert [r["restart_count"] for r in starts] == [0, 1]  # TORCHELASTIC_RESTART_COUNT, on the [start] line
    steps = [r["step"] for r in records if r["event"] == "step"]
    assert steps == sorted(set(steps)) and steps[-1] == 40  # replayed steps were not logged twice
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["steps"] == 40 and summary["world_size"] == 2
    assert_bitwise_equal(run_dir / "model.pt", uninterrupted / "model.pt")
    print(f"kill -> end of run: {time.monotonic() - killed_at:.1f} s")


@pytest.mark.slow
def test_a_killed_worker_is_named_in_one_line_not_the_rank_that_lost_it(tmp_path):
    """Regression: after rank 1 was SIGKILLed, the job's lines blamed the survivor ("rank 0: another rank
    left mid-collective ... its own output says why", though rank 1 printed nothing), beside torch's
    "Terminating process N via signal SIGTERM"."""
    run_dir = tmp_path / "run"
    proc = start(spec(run_dir, "slow", seconds=0.03, log_every=1, epochs=1))
    try:
        wait_for_step(run_dir, proc, lambda step: step >= 3)
        pids = worker_pids(proc.pid)
        assert len(pids) == 2, pids
        os.kill(pids[-1], signal.SIGKILL)  # rank 1: torch starts local ranks in order
        out, err = proc.communicate(timeout=WAIT_S)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    lines = err.strip().splitlines()
    assert proc.returncode == 4, err  # PeerLost's exit status
    assert len(lines) == 1 and lines[0].startswith("ddpkit: error: rank 1 was killed (SIGKILL)"), err


@pytest.mark.slow
def test_a_kill_during_a_snapshot_write_leaves_the_previous_one_and_resume_is_exact(tmp_path):
    """The snapshot write is SIGKILLed after half its bytes; resuming gives the uninterrupted model."""
    one = dict(nproc="1", save_every_steps=8, log_every=4)
    ref_dir = tmp_path / "ref"
    fit_here(spec(ref_dir, **one))

    run_dir = tmp_path / "run"
    killer = (
        "import os, signal, sys; sys.path[:0] = {paths!r}; import ddpkit.run.checkpoint as c; w = c.atomic_write\n"
        "def half(path, data, *args, **kw):\n"
        "    if path.name == 'snapshot-000000016.pt':\n"
        "        with open(str(path) + '.tmp', 'wb') as fh: fh.write(data[: len(data) // 2]); fh.flush()\n"
        "        os.kill(os.getpid(), signal.SIGKILL)\n"
        "    w(path, data, *args, **kw)\n"
        "c.atomic_write = half\n"
        "sys.argv = [{script!r}, {spec!r}]\n"
        "exec(open({script!r}).read())\n"
    )
    code = killer.format(
        paths=[str(ROOT / "src"), str(ROOT / "tests" / "helpers")], script=SCRIPT, spec=json.dumps(spec(run_dir, **one))
    )
    killed = run_python("-c", code)
    assert killed.returncode == -signal.SIGKILL, killed.stderr
    ckpts = run_dir / "checkpoints"
    assert (ckpts / "snapshot-000000016.pt.tmp").exists()  # the half-written file
    assert not (ckpts / "snapshot-000000016.pt").exists()
    assert load(ckpts / "snapshot-000000008.pt")["global_step"] == 8  # the previous one is whole

    fit_here(spec(run_dir, **one))
    starts = [r for r in read_jsonl(run_dir / "metrics.jsonl") if r["event"] == "start"]
    assert starts[-1]["resumed_at_step"] == 8
    assert not list(ckpts.glob("*.tmp"))  # cleaned up by the next save
    assert_bitwise_equal(run_dir / "model.pt", ref_dir / "model.pt")


# The ten points of a background snapshot write (run/checkpoint.py's test hook, DDPKIT_TEST_KILL_WRITE), in the
# order the writer passes them; each face's run is SIGKILLed at five of them, one per restart of its job.
TRAINER_MOMENTS = ("staged", "opened", "written", "renamed", "newest")
LOOP_MOMENTS = ("serialised", "half-written", "fsynced", "dir-synced", "pruned")


def test_sigkills_all_through_a_trainers_background_write_resume_bitwise(tmp_path, uninterrupted):
    """Rank 0 SIGKILLed at five points of a snapshot's background write, one per restart (each restart's
    next write is killed one point further on): every resume is from a whole snapshot (the previous one until
    the rename, the new one after it) and the run ends with the uninterrupted run's weights bitwise."""
    run_dir, marks = tmp_path / "run", tmp_path / "marks"
    marks.mkdir()
    kills = f"{marks}:10:{','.join(TRAINER_MOMENTS)}"  # writes of step 10 on
    s = spec(run_dir, save_every_steps=5, log_every=1, max_restarts=len(TRAINER_MOMENTS))
    proc = run_python(SCRIPT, json.dumps(s), DDPKIT_TEST_KILL_WRITE=kills)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert sorted(p.name for p in marks.iterdir()) == sorted(TRAINER_MOMENTS)  # each point was reached
    starts = [r for r in read_jsonl(run_dir / "metrics.jsonl") if r["event"] == "start"]
    assert [r["resumed_at_step"] for r in starts] == [None, 5, 5, 5, 10, 15], starts
    assert {r["snapshots"] for r in starts} == {"background"}
    assert not list((run_dir / "checkpoints").glob("*.tmp"))
    assert_bitwise_equal(run_dir / "model.pt", uninterrupted / "model.pt")


def test_sigkills_all_through_a_loops_background_write_resume_bitwise(tmp_path):
    """The same for a Loop (its named state, each rank's own values among them), at the other five points."""
    import loop_workers

    import ddpkit

    reference = ddpkit.launch(loop_workers.snapshot_every_2_steps, str(tmp_path / "ref"), nproc=2, device="cpu")
    run_dir, marks, out = tmp_path / "run", tmp_path / "marks", tmp_path / "out.pt"
    marks.mkdir()
    code = (
        "import sys, torch, ddpkit, loop_workers\n"
        "got = ddpkit.launch(loop_workers.snapshot_every_2_steps, sys.argv[1], nproc=2, device='cpu', "
        "max_restarts=5)\n"
        "torch.save(got, sys.argv[2])\n"
    )
    kills = f"{marks}:4:{','.join(LOOP_MOMENTS)}"  # writes of step 4 on
    proc = run_python("-c", code, run_dir, out, DDPKIT_TEST_KILL_WRITE=kills)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert sorted(p.name for p in marks.iterdir()) == sorted(LOOP_MOMENTS)
    starts = [r for r in read_jsonl(run_dir / "metrics.jsonl") if r["event"] == "start"]
    assert [r["resumed_at_step"] for r in starts] == [None, 2, 2, 2, 4, 6], starts
    got = torch.load(out, weights_only=True)
    assert all(torch.equal(got["weights"][k], v) for k, v in reference["weights"].items())
    for mine, theirs in zip(got["ranks"], reference["ranks"]):
        assert mine["cursor"] == theirs["cursor"] and torch.equal(mine["h"], theirs["h"])
        assert torch.equal(mine["X"], theirs["X"])


@pytest.mark.slow
def test_sigterm_to_the_launcher_saves_a_snapshot_and_the_rerun_resumes_there(tmp_path):
    run_dir = tmp_path / "run"
    s = spec(run_dir, "slow", seconds=0.03, log_every=2)
    proc = start(s)
    try:
        wait_for_step(run_dir, proc, lambda step: step >= 6)
        os.kill(proc.pid, signal.SIGTERM)  # as a scheduler would: the launcher forwards it to the workers
        out, err = proc.communicate(timeout=WAIT_S)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == 128 + signal.SIGTERM, err
    assert "stopped on SIGTERM at step" in err and "run the same command again" in err
    assert "error" not in err, err  # issue 33, case 14: a clean stop was followed by "error: interrupted ..."
    stopped = [r for r in read_jsonl(run_dir / "metrics.jsonl") if r["event"] == "stopped"]
    assert stopped and stopped[0]["reason"] == "signal"
    step = stopped[0]["step"]
    assert (run_dir / "checkpoints" / f"snapshot-{step:09d}.pt").exists() and step < 40
    assert not (run_dir / "model.pt").exists()

    fit_here(s)
    starts = [r for r in read_jsonl(run_dir / "metrics.jsonl") if r["event"] == "start"]
    assert starts[-1]["resumed_at_step"] == step
    assert json.loads((run_dir / "summary.json").read_text())["steps"] == 40


@pytest.mark.slow
def test_sigterm_to_one_worker_stops_every_rank_at_the_same_step(tmp_path):
    run_dir = tmp_path / "run"
    proc = start(spec(run_dir, "slow", seconds=0.03, log_every=2, max_restarts=1))
    try:
        wait_for_step(run_dir, proc, lambda step: step >= 4)
        os.kill(worker_pids(proc.pid)[-1], signal.SIGTERM)
        out, err = proc.communicate(timeout=WAIT_S)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    # A stop is not a failure: the agent does not restart it, even with restarts allowed.
    assert proc.returncode == 143, err
    assert err.count("stopped on SIGTERM") == 1, err
    starts = [r for r in read_jsonl(run_dir / "metrics.jsonl") if r["event"] == "start"]
    assert len(starts) == 1


@pytest.mark.slow
@pytest.mark.parametrize("log_every,caught_by", [(2, "log interval"), (100, "pre-save check")])
def test_a_nan_loss_stops_the_run_and_keeps_the_last_good_snapshot(tmp_path, log_every, caught_by):
    """NaN injected on rank 1 only at step 5; snapshots every 3 steps; logs every `log_every`."""
    run_dir = tmp_path / "run"
    proc = run(spec(run_dir, "nan", at_step=5, rank=1, save_every_steps=3, log_every=log_every, max_restarts=1))
    assert proc.returncode == 2, proc.stderr
    err = proc.stderr.strip().splitlines()
    assert len([line for line in err if "NaN or Inf" in line]) == 1, proc.stderr  # reported once
    assert "by step 6" in proc.stderr and "snapshot-000000003.pt" in proc.stderr
    snaps = sorted(p.name for p in (run_dir / "checkpoints").glob("snapshot-*.pt"))
    assert snaps == ["snapshot-000000003.pt"]
    good = load(run_dir / "checkpoints" / snaps[0])
    assert all(torch.isfinite(v).all() for v in good["trainer"]["model"].values() if v.is_floating_point())
    assert not (run_dir / "model.pt").exists()
    starts = [r for r in read_jsonl(run_dir / "metrics.jsonl") if r["event"] == "start"]
    assert len(starts) == 1  # not restarted into the same NaN


@pytest.mark.slow
def test_a_stalled_rank_ends_the_job_with_the_timeout_named(tmp_path):
    run_dir = tmp_path / "run"
    t0 = time.monotonic()
    # 5 s: every collective gets --timeout-s, and make test runs another test beside this one on 2 cores
    proc = run(spec(run_dir, "stall", at_step=3, rank=1, seconds=12, timeout_s=5, log_every=1), timeout=WAIT_S)
    elapsed = time.monotonic() - t0
    assert proc.returncode == 3, proc.stderr
    assert "rank 0: a collective did not complete within --timeout-s 5 s" in proc.stderr
    assert "Traceback" not in proc.stderr
    assert elapsed < 5 + 12 + 30, elapsed  # timeout + the stall + process start, not a hang


@pytest.mark.slow
def test_a_killed_powersgd_run_is_refused_in_one_line_not_resumed_inexactly(tmp_path):
    """Regression: the PowerSGD hook's error feedback was not in snapshots, so a resumed run was
    neither exact nor refused (14 of 16 tensors differed from the uninterrupted run)."""
    from ddpkit import TrainConfig
    from ddpkit.errors import ConfigError

    run_dir = tmp_path / "r"
    fit_here(spec(run_dir, comm_hook="powersgd", save_every_steps=15, log_every=5))
    for name in ("model.pt", "summary.json"):  # what a kill after the last snapshot leaves
        (run_dir / name).unlink()
    again = run(spec(run_dir, comm_hook="powersgd", save_every_steps=15, log_every=5))
    assert again.returncode != 0 and "Traceback" not in again.stderr
    said = [line for line in again.stderr.splitlines() if "powersgd" in line]
    assert len(said) == 1 and "cannot resume exactly" in said[0] and f"Delete {run_dir}" in said[0]
    assert sorted(p.name for p in (run_dir / "checkpoints").glob("*.pt"))  # nothing deleted
    with pytest.raises(ConfigError, match="--max-restarts 2 resumes from snapshots"):
        TrainConfig(comm_hook="powersgd", max_restarts=2).resolved()


def stop_after(s: dict, run_dir: Path, pred) -> int:
    """Start ``s``, SIGTERM its launcher (a preempted or lost node) once a step record satisfies
    ``pred``; the step of the snapshot it saved."""
    proc = start(s)
    try:
        wait_for_step(run_dir, proc, pred)
        os.kill(proc.pid, signal.SIGTERM)
        out, err = proc.communicate(timeout=WAIT_S)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == 128 + signal.SIGTERM, err
    return [r for r in read_jsonl(run_dir / "metrics.jsonl") if r["event"] == "stopped"][-1]["step"]


@pytest.mark.slow
def test_a_run_resumes_at_another_world_size_2_1_2_with_the_same_samples_and_weights(tmp_path):
    """Elastic resume: 2 processes, then 1 (a node lost), then 2 again, against an uninterrupted
    run at 2. float64 makes the only difference, the order of float reductions, ~1e-16 per step."""
    # SyncBatchNorm: plain BatchNorm normalises each rank's share, which the world size changes.
    common = dict(seconds=0.03, dtype="float64", sync_bn=True, save_every_steps=5, log_every=1)
    ref_dir, run_dir = tmp_path / "ref", tmp_path / "run"
    fit_here(spec(ref_dir, **common))  # (the slow fault only paces the runs that are stopped)

    first = stop_after(spec(run_dir, "slow", **common), run_dir, lambda step: step >= 6)
    second = stop_after(spec(run_dir, "slow", **common, nproc="1"), run_dir, lambda step: step >= 24)
    last = run(spec(run_dir, "slow", **common))
    assert last.returncode == 0, last.stderr
    assert first < 20 < second < 40  # the world-1 leg crosses an epoch end (an evaluation)

    records = read_jsonl(run_dir / "metrics.jsonl")
    starts = [r for r in records if r["event"] == "start"]
    assert [(r["world_size"], r["resumed_at_step"], r["resumed_from_world"]) for r in starts] == [
        (2, None, None),
        (1, first, 2),
        (2, second, 1),
    ]
    said = [line for line in last.stdout.splitlines() if "of a run made at world size 1 at world size 2" in line]
    assert len(said) == 1 and "the same global batch of 100" in said[0], last.stdout
    # The same samples at every step: each step's loss is the reference's, to float64 rounding.
    ref_records = read_jsonl(ref_dir / "metrics.jsonl")
    for kind, key, loss in (("step", "step", "loss"), ("epoch", "epoch", "train_loss")):
        mine = {r[key]: r for r in records if r["event"] == kind}
        theirs = {r[key]: r for r in ref_records if r["event"] == kind}
        assert mine.keys() == theirs.keys()
        for k, r in theirs.items():
            assert mine[k][loss] == pytest.approx(r[loss], rel=1e-9), (kind, k)
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["test_accuracy"] == json.loads((ref_dir / "summary.json").read_text())["test_accuracy"]
    a, b = load(run_dir / "model.pt"), load(ref_dir / "model.pt")
    for name, tensor in b.items():
        assert torch.allclose(a[name], tensor, rtol=1e-9, atol=1e-12), name


@pytest.mark.slow
def test_a_zero_run_is_resharded_when_it_resumes_at_another_world_size(tmp_path):
    """ZeRO's optimizer state is saved whole (gathered to rank 0) and each rank of the new world
    takes its own shard of it: a world-2 run continued at world 1 from step 25 ends where it did."""
    common = dict(dtype="float64", sync_bn=True, zero=True, save_every_steps=5, keep_snapshots=10)
    run_dir = tmp_path / "run"
    fit_here(spec(run_dir, **common))
    reference = {k: v.clone() for k, v in load(run_dir / "model.pt").items()}
    for path in [run_dir / "model.pt", run_dir / "summary.json"] + [
        p for p in (run_dir / "checkpoints").glob("snapshot-*.pt") if int(p.stem.split("-")[1]) > 25
    ]:
        path.unlink()  # as if the job had been killed right after step 25's snapshot
    again = run(spec(run_dir, **common, nproc="1"))
    assert again.returncode == 0, again.stderr
    assert "resuming step 25 (epoch 1) of a run made at world size 2 at world size 1" in again.stdout
    final = load(run_dir / "model.pt")
    for name, tensor in reference.items():
        assert torch.allclose(final[name], tensor, rtol=1e-9, atol=1e-12), name


@pytest.mark.slow
@pytest.mark.multiprocess
def test_sigterm_to_a_python_script_calling_fit_ends_it_with_143_and_one_line(tmp_path):
    """Issue 35, item 6: fit() raised Stopped, but the script ended with a traceback and status 1, after
    torch's agent's own "Received 15 death signal" warning."""
    proc = start_python(ROOT / "tests" / "helpers" / "stop_fit.py", tmp_path / "run")
    for line in proc.stdout:  # the workers are training: a step record is out
        if line.startswith("[step]"):
            break
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=WAIT_S)
    assert proc.returncode == 143, err[-3000:]
    assert err.count("ddpkit: stopped on SIGTERM") == 1, err[-3000:]
    assert "Traceback" not in err and "death signal" not in err, err[-3000:]


@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.parametrize("how", ["plain", "launch"])
def test_sigterm_to_a_script_with_its_own_loop_ends_it_with_143_and_one_line(tmp_path, how):
    """Found in review: where the process made the group itself, torch's excepthook wrapper swallowed the line
    (exit 143, nothing said); under ddpkit.launch the launcher ended with a traceback and status 1."""
    proc = start_python(ROOT / "tests" / "helpers" / "stop_loop.py", how, tmp_path / "run")
    for line in proc.stdout:
        if line.startswith("[step]"):
            break
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=WAIT_S)
    assert proc.returncode == 143, err[-3000:]
    assert err.count("ddpkit: stopped on SIGTERM") == 1, err[-3000:]
    assert "Traceback" not in err, err[-3000:]
