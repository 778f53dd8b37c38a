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

import signal
import subprocess
from pathlib import Path

import pytest
import torch
from clirun import read_jsonl, run_cli
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
    # group 1 killed at its 12th training forward (its step 11), and again at the 30th of its next attempt
    done = train(run_dir, "--replicas", "2", "--max-restarts", "2", fault="kill@12:1,kill@30:1")
    assert done.returncode == 0, done.stderr
    assert done.stderr.count("replica group 1: rank 0 was killed (SIGKILL)") == 2, done.stderr
    assert "Traceback" not in done.stderr, done.stderr  # torchft's own logging of the failed all-reduce is off
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


@pytest.mark.slow
def test_a_group_lost_for_good_leaves_the_other_to_finish_the_run_with_its_share_computed_too(tmp_path, ddp):
    run_dir = tmp_path / "run"
    done = train(run_dir, "--replicas", "2", fault="kill@12:1")  # no --max-restarts: nothing brings it back
    assert done.returncode == 0, done.stderr
    assert "replica group 1 ended early (exit 137;" in done.stderr and str(run_dir) in done.stderr, done.stderr
    changes = [r for r in read_jsonl(run_dir / "metrics.jsonl") if r["event"] == "replicas"]
    assert [(r["change"], r["step"]) for r in changes][:2] == [("redone", 11), ("groups", 11)], changes
    assert changes[1]["present"] == "0" and changes[1]["gone"] == "1", changes
    # 53 of the 64 steps with both shares computed by group 0: the run's weights are still DDP's, to rounding
    off = {k: (weights(run_dir)[k].double() - ddp[k].double()).abs().max().item() for k in ddp}
    assert max(off.values()) < ROUNDING, off
    assert not (groups(run_dir)[1] / "model.pt").exists()


@pytest.mark.slow
def test_the_whole_job_stopped_and_run_again_resumes_every_group_exactly(tmp_path, ddp):
    run_dir = tmp_path / "run"
    stopped = train(run_dir, "--replicas", "2", fault="term@20:0")
    assert stopped.returncode == 128 + signal.SIGTERM, stopped.stderr
    for g in (0, 1):
        assert f"replica group {g}: stopped on SIGTERM" in stopped.stderr, stopped.stderr
    done = train(run_dir, "--replicas", "2")
    assert done.returncode == 0, done.stderr
    for d in groups(run_dir):
        starts = [r["resumed_at_step"] for r in read_jsonl(d / "metrics.jsonl") if r["event"] == "start"]
        assert len(starts) == 2 and starts[0] is None and 0 < starts[1] < STEPS, starts
    assert_equal_groups_and_ddp(run_dir, ddp)


@pytest.mark.skip(
    reason="timing-dependent (issue 45): the live groups may finish before the killed one is back, and then no heal "
    "is served; it passed 3 of 4 runs on a quiet machine and failed in a clean-clone run"
)
@pytest.mark.slow
def test_three_groups_the_one_serving_a_heal_killed_while_it_serves_all_end_equal(tmp_path, tmp_path_factory):
    # A global batch of 48: 3 shares of 16 (21 steps an epoch of 1,024 samples), for 8 epochs: long enough that the
    # killed groups come back before the others end (a group that comes back to no one trains on alone, from its
    # own snapshot, and ends equal too, but serves no test of a heal)
    three = ["--batch-size", "48", "--epochs", "8"]

    def make(where: Path) -> None:
        done = train(where / "run", "--nproc", "3", *three)
        assert done.returncode == 0, done.stderr

    ddp3 = weights(once(tmp_path_factory, "replicas-ddp3", make) / "run")
    run_dir = tmp_path / "run"
    # group 1 killed at its step 11; the group that then serves its heal (0 or 2, torchft's choice) killed as it serves
    serving = {"DDPKIT_TEST_KILL_SERVING": str(tmp_path)}
    done = train(run_dir, "--replicas", "3", *three, "--max-restarts", "2", fault="kill@12:1", **serving)
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
    assert_equal_groups_and_ddp(run_dir, ddp3, count=3, steps=8 * 21)


def test_replicas_with_an_option_it_cannot_take_is_one_line_before_anything_starts(tmp_path):
    done = train(tmp_path / "run", "--replicas", "2", "--nproc", "2")
    assert done.returncode == 2
    assert done.stderr.count("\n") == 1 and "--replicas 2 cannot be combined with --nproc 2" in done.stderr
    assert not (tmp_path / "run").exists()
