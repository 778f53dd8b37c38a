"""``ddpkit train --replicas 2``: two replica groups of one process each under torchft, through the CLI as a user
runs it, in float64 on the 2-core machine.

A group SIGKILLed mid-step: the other computes the step again with the lost group's share, the lost group is
restarted by its agent and healed from the live one, and both end bitwise equal to each other and within float64
rounding of a plain DDP run of 2 ranks with the same global batch (a share dropped or used twice would move the
weights by ~1e-3; the rounding measured is 2.2e-16). The whole job stopped by SIGTERM and run again resumes each
group from its own snapshot and ends the same way. The faults are sent from the model's K-th training forward
(``user_code.ReplicaNet``), so they land mid-step whatever the machine's load.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from clirun import read_jsonl, run_cli, start_python
from once import once

pytest.importorskip("torchft")  # ddpkit[ft], in the test extras
pytestmark = pytest.mark.multiprocess  # every test here starts processes

STEPS = 64  # 1,024 samples, a global batch of 32, 2 epochs
ARGS = [
    *("--dataset", "synthetic", "--synthetic-shape", "1,8,8", "--synthetic-size", "1024", "--synthetic-classes", "4"),
    *("--model", "user_code:replica_net", "--dtype", "float64", "--device", "cpu", "--batch-size", "32"),
    *("--epochs", "2", "--lr", "0.05", "--log-every", "8", "--no-progress", "--no-plots"),
]
# The largest difference from the DDP run measured: 2.2e-16 (float64 sums in another order); a bound far above
# it, and far below what one lost or doubled share of a step does to the weights
ROUNDING = 1e-12


def train(run_dir: Path, *extra: str, fault: str = "", **env: str) -> subprocess.CompletedProcess:
    # its own process group (run_cli's always are), which the SIGTERM fault signals whole
    return run_cli("train", *ARGS, "--run-dir", str(run_dir), *extra, DDPKIT_TEST_FAULT=fault, **env)


def weights(run_dir: Path) -> dict:
    return torch.load(run_dir / "model.pt", map_location="cpu", weights_only=True)


def groups(run_dir: Path, count: int = 2) -> list[Path]:
    return [run_dir, *(Path(f"{run_dir}-group-{g}") for g in range(1, count))]


@pytest.fixture(scope="module")
def ddp(tmp_path_factory) -> dict:
    """A plain DDP run of 2 ranks with the same global batch, once per pytest run (tests/helpers/once.py)."""

    def make(where: Path) -> None:
        done = train(where / "run", "--nproc", "2")
        assert done.returncode == 0, done.stderr

    return weights(once(tmp_path_factory, "replicas-ddp", make) / "run")


def assert_every_sample_used_once(
    run_dir: Path, count: int = 2, steps: int = STEPS, per_epoch: int = 32, batch: int = 32
) -> None:
    """The groups' samples.jsonl (--sample-log) read together: every share of every step, and every sample an epoch
    takes (of the 1,024: all of them at a batch of 32) once. A step computed again after a resume is logged again,
    with the same samples."""
    logged: dict[tuple[int, int], list[int]] = {}
    for d in groups(run_dir, count):
        for r in read_jsonl(d / "samples.jsonl"):
            key = (r["step"], r["share"])
            assert r["epoch"] == r["step"] // per_epoch and logged.setdefault(key, r["samples"]) == r["samples"], key
    assert sorted(logged) == [(s, g) for s in range(steps) for g in range(count)]
    for epoch in range(steps // per_epoch):
        used = [i for (s, _), samples in logged.items() if s // per_epoch == epoch for i in samples]
        assert len(set(used)) == len(used) == per_epoch * batch and set(used) <= set(range(1024)), epoch


def assert_equal_groups_and_ddp(run_dir: Path, ddp: dict, count: int = 2, steps: int = STEPS) -> None:
    first, *others = (weights(d) for d in groups(run_dir, count))
    for other in others:  # the groups: bitwise equal
        assert [k for k in first if not torch.equal(first[k], other[k])] == []
    off = {k: (first[k].double() - ddp[k].double()).abs().max().item() for k in ddp}
    assert max(off.values()) < ROUNDING, off  # buffers too (BatchNorm's statistics, as DDP keeps rank 0's)
    for d in groups(run_dir, count):
        assert [r["steps"] for r in read_jsonl(d / "metrics.jsonl") if r["event"] == "summary"] == [steps]


@pytest.mark.slow
def test_a_group_killed_mid_step_twice_is_healed_while_the_other_trains_on_and_no_sample_is_lost(tmp_path, ddp):
    run_dir = tmp_path / "run"
    # group 1 killed at its 12th training forward (its step 11), and again at the 30th of its next attempt; every
    # forward takes 0.2 s more until both restarts have healed, so that group 0 cannot end the run first
    slow = {"DDPKIT_TEST_SLOW_UNTIL_HEALED": f"{run_dir}:2:2"}
    done = train(run_dir, "--replicas", "2", "--max-restarts", "2", "--sample-log", fault="kill@12:1,kill@30:1", **slow)
    assert done.returncode == 0, done.stderr
    assert done.stderr.count("replica group 1: rank 0 was killed (SIGKILL)") == 2, done.stderr
    assert "Traceback" not in done.stderr, done.stderr  # torchft's own logging of the failed all-reduce is off
    # nor its two lines per heal: the serving group's HTTP request log, and torch's C++ warning at each process group
    assert "GET /checkpoint" not in done.stderr and "setSequenceNumberForGroup" not in done.stderr, done.stderr
    survivor = [r for r in read_jsonl(run_dir / "metrics.jsonl") if r["event"] in ("start", "replicas")]
    assert [r["event"] for r in survivor].count("start") == 1  # group 0 never stopped
    # Each step a kill landed in could not commit, and was computed again, with the lost group's share
    redone = [r["step"] for r in survivor if r.get("change") == "redone"]
    lost = [r for r in read_jsonl(groups(run_dir)[1] / "metrics.jsonl") if r["event"] in ("start", "replicas")]
    assert [r.get("restart_count") for r in lost if r["event"] == "start"] == [0, 1, 2]
    # each restart healed from group 0, at the step group 0 was at: the step it computed again, or (the restart
    # slower than the lighthouse's heartbeat timeout, 1 s, so group 0 went on alone) a later one
    healed = [r["step"] for r in lost if r.get("change") == "healed"]
    assert redone[0] == 11 and len(redone) == len(healed) == 2, (survivor, lost)
    assert all(h >= r for h, r in zip(healed, redone)), (redone, healed)
    assert redone[1] == healed[0] + 29, (redone, healed)  # the 30th forward of the attempt healed at healed[0]
    assert_equal_groups_and_ddp(run_dir, ddp)
    assert_every_sample_used_once(run_dir)


@pytest.mark.slow
def test_a_group_lost_for_good_leaves_the_other_to_finish_the_run_with_its_share_computed_too(tmp_path, ddp):
    run_dir = tmp_path / "run"
    done = train(run_dir, "--replicas", "2", "--sample-log", fault="kill@12:1")  # no --max-restarts: none back
    assert done.returncode == 0, done.stderr
    assert "replica group 1 ended early (exit 137;" in done.stderr and str(run_dir) in done.stderr, done.stderr
    changes = [r for r in read_jsonl(run_dir / "metrics.jsonl") if r["event"] == "replicas"]
    assert [(r["change"], r["step"]) for r in changes][:2] == [("redone", 11), ("groups", 11)], changes
    assert changes[1]["present"] == "0" and changes[1]["gone"] == "1", changes
    # 53 of the 64 steps with both shares computed by group 0: the run's weights are still DDP's, to rounding
    off = {k: (weights(run_dir)[k].double() - ddp[k].double()).abs().max().item() for k in ddp}
    assert max(off.values()) < ROUNDING, off
    assert not (groups(run_dir)[1] / "model.pt").exists()
    assert_every_sample_used_once(run_dir)  # group 1's steps 0-10, and group 0's: both shares from step 11


@pytest.mark.slow
def test_the_whole_job_stopped_and_run_again_resumes_every_group_exactly(tmp_path, ddp):
    run_dir = tmp_path / "run"
    stopped = train(run_dir, "--replicas", "2", "--sample-log", fault="term@20:0")
    assert stopped.returncode == 128 + signal.SIGTERM, stopped.stderr
    for g in (0, 1):
        assert f"replica group {g}: stopped on SIGTERM" in stopped.stderr, stopped.stderr
    done = train(run_dir, "--replicas", "2", "--sample-log")
    assert done.returncode == 0, done.stderr
    for d in groups(run_dir):
        starts = [r["resumed_at_step"] for r in read_jsonl(d / "metrics.jsonl") if r["event"] == "start"]
        assert len(starts) == 2 and starts[0] is None and 0 < starts[1] < STEPS, starts
    assert_equal_groups_and_ddp(run_dir, ddp)
    assert_every_sample_used_once(run_dir)


@pytest.mark.slow
def test_a_group_lost_before_the_groups_meet_is_awaited_until_its_restart_meets_them(tmp_path, ddp):
    run_dir = tmp_path / "run"
    # group 1's first attempt killed as its worker copies the model, before the meeting; its restart meets group 0,
    # which waited for it (not for --timeout-s: it would then start alone, and group 1 heal from it)
    done = train(run_dir, "--replicas", "2", "--max-restarts", "1", "--timeout-s", "30", fault="kill@0:1")
    assert done.returncode == 0, done.stderr
    assert done.stderr.count("replica group 1: rank 0 was killed (SIGKILL)") == 1, done.stderr
    for d in groups(run_dir):
        changes = [r for r in read_jsonl(d / "metrics.jsonl") if r["event"] == "replicas"]
        assert changes == [], changes  # none "started" without the other, none healed, no step redone
    assert_equal_groups_and_ddp(run_dir, ddp)


@pytest.mark.slow
def test_a_group_stuck_in_its_own_code_ends_itself_after_the_timeout_and_comes_back_healed(tmp_path, ddp):
    # group 1 stuck in its 12th training forward, its heartbeats going on: the lighthouse would wait for it for ever
    done = stuck_group_run(tmp_path / "run", ddp, "hang@12:1")
    said = "no progress in its own part of a step for --timeout-s 8 s (in `_fault` at user_code.py:"
    assert done.stderr.count(said) == 1 and "replica group 1: no progress" in done.stderr, done.stderr
    assert "the agent restarts the workers (restart 1 of --max-restarts 1)" in done.stderr, done.stderr


def stuck_group_run(run_dir: Path, ddp: dict, fault: str) -> subprocess.CompletedProcess:
    """A run whose group 1 gets stuck (``fault``) at ``--timeout-s 8``, ends itself, is restarted once and healed:
    the run ends well, with no traceback, equal to DDP's and every sample used once. Every forward takes 0.2 s more
    until group 1 has healed, so that group 0 cannot end the run first on a busy machine."""
    slow = {"DDPKIT_TEST_SLOW_UNTIL_HEALED": f"{run_dir}:2:1"}
    args = ("--replicas", "2", "--max-restarts", "1", "--timeout-s", "8", "--sample-log")  # evaluated at epoch ends
    done = train(run_dir, *args, fault=fault, **slow)
    assert done.returncode == 0, done.stderr
    assert "Traceback" not in done.stderr, done.stderr
    lost = read_jsonl(groups(run_dir)[1] / "metrics.jsonl")
    assert [r.get("restart_count") for r in lost if r["event"] == "start"] == [0, 1]
    assert [r for r in lost if r.get("change") == "healed"], lost
    assert_equal_groups_and_ddp(run_dir, ddp)
    assert_every_sample_used_once(run_dir)
    return done


@pytest.mark.slow
def test_a_group_stuck_outside_its_step_ends_itself_once_another_has_waited_the_timeout_for_it(tmp_path, ddp):
    """Before: group 1 stuck in an evaluation kept its heartbeats going, so group 0 waited at the next quorum until
    its timeout, ended, and its restarts waited again, until --max-restarts ran out; group 1 never ended, and the job
    never did. Now group 1 reads in the launcher's store that group 0 has waited --timeout-s for a quorum it has not
    asked for, ends itself with one line, is restarted and healed, and the run ends as DDP's."""
    done = stuck_group_run(tmp_path / "run", ddp, "evalhang@1:1")  # its first evaluation forward, at epoch 0's end
    said = [line for line in done.stderr.splitlines() if "outside its step, it has not asked for the quorum" in line]
    assert len(said) == 1 and said[0].startswith("ddpkit: replica group 1: outside its step"), done.stderr
    assert "at which replica group 0 has waited --timeout-s 8 s (in `_fault` at user_code.py:" in said[0], said
    assert "the agent restarts the workers (restart 1 of --max-restarts 1)" in said[0], said
    assert "did not form" not in done.stderr, done.stderr


@pytest.mark.slow
def test_a_group_healed_into_a_later_epoch_than_its_snapshot_trains_that_epoch_from_the_healed_step(tmp_path, ddp):
    run_dir = tmp_path / "run"
    # group 1: snapshots every 8 steps, killed at its step 29 (epoch 0), back from its step-24 snapshot once group 0
    # is in epoch 1, where group 0 (held at its first step there until group 1 is back) heals it: a step or so into
    # epoch 1, before the 24th step its own epoch had reached
    later = {"DDPKIT_TEST_HEAL_LATER": str(run_dir)}
    done = train(
        run_dir,
        "--replicas",
        "2",
        "--max-restarts",
        "1",
        "--save-every-steps",
        "8",
        "--sample-log",
        fault="kill@30:1",
        **later,
    )
    assert done.returncode == 0, done.stderr
    lost = read_jsonl(groups(run_dir)[1] / "metrics.jsonl")
    assert [r["resumed_at_step"] for r in lost if r["event"] == "start"] == [None, 24]
    healed = [r["step"] for r in lost if r.get("change") == "healed"]
    assert len(healed) == 1 and 32 <= healed[0] < 32 + 24, healed
    # its epoch 1 ran to its end (its one epoch record), and each log interval after the heal counts from it
    assert [(r["epoch"], r["step"]) for r in lost if r["event"] == "epoch"] == [(1, STEPS)]
    after = [r for r in lost if r["event"] == "step" and r["step"] > healed[0]]
    assert after and all(r["samples_per_s"] > 0 for r in after), after
    assert_equal_groups_and_ddp(run_dir, ddp)
    assert_every_sample_used_once(run_dir)


@pytest.mark.slow
def test_three_groups_the_one_serving_a_heal_killed_while_it_serves_all_end_equal(tmp_path, tmp_path_factory):
    # A global batch of 48: 3 shares of 16 (21 steps an epoch of 1,024 samples), for 4 epochs; every forward takes
    # 0.2 s more until both killed groups have healed (user_code.ReplicaNet), so that the others cannot end first
    three = ["--batch-size", "48", "--epochs", "4"]

    def make(where: Path) -> None:
        done = train(where / "run", "--nproc", "3", *three)
        assert done.returncode == 0, done.stderr

    ddp3 = weights(once(tmp_path_factory, "replicas-ddp3", make) / "run")
    run_dir = tmp_path / "run"
    # group 1 killed at its step 11; the group that then serves its heal (0 or 2, torchft's choice) killed as it serves
    serving = {"DDPKIT_TEST_KILL_SERVING": str(tmp_path), "DDPKIT_TEST_SLOW_UNTIL_HEALED": f"{run_dir}:3:2"}
    done = train(
        run_dir, "--replicas", "3", *three, "--max-restarts", "2", "--sample-log", fault="kill@12:1", **serving
    )
    assert done.returncode == 0, done.stderr
    served = (tmp_path / "served").exists()
    assert served, done.stderr
    killed = [g for g in range(3) if f"replica group {g}: rank 0 was killed (SIGKILL)" in done.stderr]
    assert len(killed) == 2 and 1 in killed, done.stderr  # group 1, and the group that served it
    healed = {
        g: [r["step"] for r in read_jsonl(d / "metrics.jsonl") if r.get("change") == "healed"]
        for g, d in enumerate(groups(run_dir, 3))
    }
    assert all(healed[g] for g in killed), healed  # each came back by a heal, the second from the third group
    assert_equal_groups_and_ddp(run_dir, ddp3, count=3, steps=4 * 21)
    assert_every_sample_used_once(run_dir, count=3, steps=4 * 21, per_epoch=21, batch=48)  # 1,008 of the 1,024


@pytest.mark.slow
def test_each_group_draws_the_dropout_of_the_rank_whose_share_it_computes(tmp_path, tmp_path_factory):
    dropout = ["--model", "user_code:replica_net_dropout", "--epochs", "1"]  # (the last of an option given twice)

    def make(where: Path) -> None:
        done = train(where / "run", "--nproc", "2", *dropout)
        assert done.returncode == 0, done.stderr

    ddp = weights(once(tmp_path_factory, "replicas-ddp-dropout", make) / "run")
    run_dir = tmp_path / "run"
    done = train(run_dir, "--replicas", "2", *dropout)
    assert done.returncode == 0, done.stderr
    assert_equal_groups_and_ddp(run_dir, ddp, steps=STEPS // 2)  # (group 1 drawing rank 0's masks: 5.6e-2 apart)


def test_replicas_with_an_option_it_cannot_take_is_one_line_before_anything_starts(tmp_path):
    done = train(tmp_path / "run", "--replicas", "2", "--nproc", "2")
    assert done.returncode == 2
    assert done.stderr.count("\n") == 1 and "--replicas 2 cannot be combined with --nproc 2" in done.stderr
    assert not (tmp_path / "run").exists()


# A group's process, as ranks/replicas.py starts it: enter_group() first; and a launcher that starts it
GROUP = """
import os, time
from ddpkit.ranks.replicas import enter_group
enter_group()
print(os.getpid(), sorted(os.sched_getaffinity(0)), flush=True)
time.sleep(120)
"""
LAUNCHER = """
import subprocess, sys, time
subprocess.Popen([sys.executable, "-c", sys.argv[1]])
time.sleep(120)
"""


def _alive(pid: int) -> bool:
    try:  # a zombie (dead, not yet reaped by whoever adopted it) is not alive
        return Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0] != "Z"
    except FileNotFoundError:
        return False


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the parent-death signal is Linux's")
def test_a_group_runs_on_its_own_cores_and_is_stopped_when_its_launcher_dies():
    launcher = start_python("-c", LAUNCHER, GROUP, DDPKIT_REPLICA_CORES="0", fresh=True)
    try:
        pid, cores = launcher.stdout.readline().split(" ", 1)
        assert cores.strip() == "[0]"
        os.kill(launcher.pid, signal.SIGKILL)  # the launcher lost (the OOM killer, say): its lighthouse goes with it
        launcher.wait()
        deadline = time.monotonic() + 60  # a guard: the kernel signals it at once
        while _alive(int(pid)) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not _alive(int(pid))  # SIGTERM, as from the launcher: it stops at its next safe point
    finally:
        os.killpg(launcher.pid, signal.SIGKILL)


def test_the_groups_are_stopped_and_a_rerun_said_when_the_lighthouse_ends(capsys):
    from torch.distributed import TCPStore

    from ddpkit.ranks.replicas import _wait, here_key

    store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    for g in (0, 1):  # training has begun
        store.set(here_key(g), "0")
    groups = [subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"]) for _ in range(2)]
    lighthouse = subprocess.Popen([sys.executable, "-c", "raise SystemExit(3)"])
    codes, _ = _wait(groups, 2, store, lighthouse)
    assert codes == [128 + signal.SIGTERM] * 2  # not left to wait out their quorum's timeout (--timeout-s)
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "torchft's lighthouse ended (exit 3)" in err and "run the same command" in err


def test_a_group_that_does_not_stop_after_a_stop_signal_is_killed_after_the_wait():
    from types import SimpleNamespace

    from torch.distributed import TCPStore

    from ddpkit.ranks.replicas import STOP_WAIT_S, _wait

    store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    stuck = subprocess.Popen([sys.executable, "-c", "import signal, time; signal.signal(15, 1); time.sleep(120)"])
    lighthouse = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    try:  # a SIGTERM passed on STOP_WAIT_S ago, which the group ignores (stuck in its own code)
        signals = SimpleNamespace(received=[signal.SIGTERM], first_at=time.monotonic() - STOP_WAIT_S - 1)
        codes, _ = _wait([stuck], 1, store, lighthouse, signals)
        assert codes == [128 + signal.SIGKILL]
    finally:
        lighthouse.kill()
