"""Snapshots: weights_only round trip, atomic files, config checks and corrupt-file fallback."""

from __future__ import annotations

import dataclasses
import random
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

from ddpkit.config import TrainConfig
from ddpkit.errors import RunDirError
from ddpkit.ranks.context import DistContext
from ddpkit.run.checkpoint import Checkpointer, rng_state, set_rng_state
from ddpkit.run.checksums import checksums

CTX = DistContext(0, 0, 1, 1, torch.device("cpu"), "gloo")
FIXTURE = Path(__file__).resolve().parents[1] / "fixtures" / "run_v0.2_step6"


def make(tmp_path, **kw):
    cfg = TrainConfig(run_dir=str(tmp_path), **kw).resolved()
    return Checkpointer(tmp_path, CTX, cfg, keep=2), cfg


def test_round_trip_loads_with_weights_only(tmp_path):
    ckpt, _ = make(tmp_path)
    model = torch.nn.Linear(3, 2)
    ckpt.save({"model": model.state_dict(), "position": {"epoch": 1}, "rank_state": {"acc": torch.ones(2)}}, 10)
    snap = ckpt.load_latest()
    assert snap["global_step"] == 10 and snap["trainer"]["position"] == {"epoch": 1}
    assert torch.equal(snap["trainer"]["model"]["weight"], model.weight)
    assert torch.equal(snap["ranks"][0]["rank_state"]["acc"], torch.ones(2))
    assert snap["versions"]["torch"] == str(torch.__version__)
    assert not list(tmp_path.glob("checkpoints/*.tmp"))


def test_keeps_the_newest_k(tmp_path):
    ckpt, _ = make(tmp_path)
    for step in (1, 2, 3):
        ckpt.save({}, step)
    assert [p.name for p in ckpt.snapshots()] == ["snapshot-000000003.pt", "snapshot-000000002.pt"]


def test_truncated_latest_is_named_and_the_previous_is_used(tmp_path):
    ckpt, _ = make(tmp_path)
    ckpt.save({"x": 1}, 1)
    ckpt.save({"x": 2}, 2)
    latest = ckpt.snapshots()[0]
    latest.write_bytes(latest.read_bytes()[:100])
    warnings = []
    snap = ckpt.load_latest(warn=warnings.append)
    assert snap["trainer"] == {"x": 1}
    assert len(warnings) == 1 and str(latest) in warnings[0] and "corrupt or truncated" in warnings[0]


def test_a_killed_save_leaves_the_previous_snapshot(tmp_path):
    ckpt, _ = make(tmp_path)
    ckpt.save({"x": 1}, 1)
    (ckpt.dir / "snapshot-000000002.pt.tmp").write_bytes(b"half a file")  # what a kill mid-write leaves
    assert ckpt.load_latest()["trainer"] == {"x": 1}


def flip_a_bit_of(path, tensor: torch.Tensor) -> None:
    """Flip one bit inside ``tensor``'s data where ``path`` (a torch file) stores it, as a disk or a copy can."""
    data, raw = bytearray(path.read_bytes()), tensor.numpy().tobytes()
    assert data.count(raw) == 1  # random weights: their bytes occur once in the file
    data[data.find(raw) + len(raw) // 2] ^= 0x04
    path.write_bytes(bytes(data))


def test_a_bit_flipped_in_a_tensor_is_found_and_the_snapshot_before_used(tmp_path):
    """Regression (issue 33): a bit flipped in a snapshot's tensor loaded silently: torch.load checks no checksum."""
    ckpt, _ = make(tmp_path)
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 4)
    ckpt.save({"model": model.state_dict()}, 1)
    ckpt.save({"model": model.state_dict()}, 2)
    newest = ckpt.snapshots()[0]
    flip_a_bit_of(newest, model.weight.detach())
    warnings = []
    snap = ckpt.load_latest(warn=warnings.append)
    assert snap["global_step"] == 1 and torch.equal(snap["trainer"]["model"]["weight"], model.weight)
    assert len(warnings) == 1, warnings
    assert f"snapshot {newest} is damaged (checksum of trainer.model.weight differs)" in warnings[0]
    assert warnings[0].endswith("resuming from snapshot-000000001.pt")
    assert (ckpt.dir / "corrupt" / newest.name).exists() and not newest.exists()


def test_a_changed_value_outside_the_tensors_is_found(tmp_path):
    """A flip in the pickled part (here the data position) changes no tensor: the other values' checksum finds it."""
    ckpt, _ = make(tmp_path)
    ckpt.save({"position": {"epoch": 1, "step_in_epoch": 3}}, 1)
    ckpt.save({"position": {"epoch": 1, "step_in_epoch": 7}}, 2)
    newest = ckpt.snapshots()[0]
    snap = torch.load(newest, weights_only=True)
    snap["trainer"]["position"]["step_in_epoch"] = 5  # the old checksums kept
    torch.save(snap, newest)
    warnings = []
    assert ckpt.load_latest(warn=warnings.append)["trainer"]["position"]["step_in_epoch"] == 3
    assert len(warnings) == 1 and "checksum of its other values" in warnings[0], warnings


def test_a_damaged_only_snapshot_is_a_one_line_error_moving_nothing(tmp_path):
    ckpt, _ = make(tmp_path)
    model = torch.nn.Linear(8, 4)
    ckpt.save({"model": model.state_dict()}, 3)
    only = ckpt.snapshots()[0]
    flip_a_bit_of(only, model.bias.detach())
    damaged = only.read_bytes()
    with pytest.raises(RunDirError) as raised:
        ckpt.load_latest(warn=pytest.fail)
    message = str(raised.value)
    assert "\n" not in message
    assert f"no snapshot in {ckpt.dir} can be resumed: snapshot-000000003.pt is damaged" in message
    assert "(checksum of trainer.model.bias differs)" in message and "Restore an intact copy" in message
    assert only.read_bytes() == damaged and not (ckpt.dir / "corrupt").exists()  # nothing moved or changed


def test_a_damaged_snapshot_passed_as_init_from_is_refused(tmp_path):
    from ddpkit.run.checkpoint import read_weights

    ckpt, _ = make(tmp_path)
    model = torch.nn.Linear(8, 4)
    ckpt.save({"model": model.state_dict()}, 1)
    path = ckpt.snapshots()[0]
    assert torch.equal(read_weights(path, "--init-from")["weight"], model.weight)
    flip_a_bit_of(path, model.weight.detach())
    with pytest.raises(RunDirError, match=r"--init-from .* is a damaged snapshot \(checksum of trainer.model.weight"):
        read_weights(path, "--init-from")


def test_a_snapshot_without_checksums_still_loads_and_says_nothing(tmp_path):
    """Snapshots written before checksums (the ddpkit 0.2 fixture's) load unchecked, without a warning."""
    run = tmp_path / "run"
    shutil.copytree(FIXTURE, run)
    cfg = dataclasses.replace(TrainConfig.from_toml(run / "config.toml"), run_dir=str(run))
    warnings = []
    snap = Checkpointer(run, CTX, cfg).load_latest(warn=warnings.append)
    assert "checksums" not in snap and snap["global_step"] == 6 and warnings == []


def test_other_config_is_refused(tmp_path):
    ckpt, _ = make(tmp_path, seed=1)
    ckpt.save({}, 1)
    other, _ = make(tmp_path, seed=2)
    with pytest.raises(RunDirError, match="different config \\(differs in: seed\\)"):
        other.load_latest()


def test_rng_states_restore_exactly():
    state = rng_state(torch.device("cpu"))
    expected = (torch.rand(3), np.random.rand(3), random.random())
    set_rng_state(state, torch.device("cpu"))
    again = (torch.rand(3), np.random.rand(3), random.random())
    assert torch.equal(expected[0], again[0]) and np.array_equal(expected[1], again[1]) and expected[2] == again[2]


def test_resume_on_a_gpu_loads_the_snapshot_onto_the_cpu(tmp_path):
    """Regression: snapshots were loaded with map_location=<training device>, which put the
    numpy RNG key tensor on the GPU, and ``.numpy()`` raised on every CUDA resume. ``meta``
    stands in for CUDA here: it raises on ``.numpy()`` the same way."""
    cfg = TrainConfig(run_dir=str(tmp_path)).resolved()
    Checkpointer(tmp_path, CTX, cfg).save({"rank_state": {"acc": [1.0, 2.0]}}, 5)
    gpu_like = DistContext(0, 0, 1, 1, torch.device("meta"), "nccl")
    snap = Checkpointer(tmp_path, gpu_like, cfg).load_latest()
    assert snap["global_step"] == 5
    set_rng_state(snap["ranks"][0]["rng"], gpu_like.device)  # raised "Cannot copy out of meta tensor" before


def test_per_rank_state_must_be_host_data_before_it_is_gathered(tmp_path):
    """all_gather_object pickles; a CUDA tensor would be rebuilt on the sender's GPU in every rank."""
    ckpt, _ = make(tmp_path)
    with pytest.raises(ValueError, match="per-rank snapshot state holds a tensor on meta"):
        ckpt.save({"rank_state": {"acc": torch.zeros(2, device="meta")}}, 1)
    assert not ckpt.snapshots()


def test_another_world_size_is_taken_but_not_for_a_join_run(tmp_path):
    """Elastic resume loads a snapshot made at another world size; --join weights an epoch's last,
    uneven batch per rank, so a --join run is refused in one line instead."""
    for join, expect in ((False, None), (True, "made at world size 2 with --join, this run has 1")):
        ckpt, _ = make(tmp_path / str(join), join=join)
        ckpt.save({"x": 1}, 3)
        path = ckpt.snapshots()[0]
        snap = torch.load(path, weights_only=True)
        del snap["checksums"]
        snap = {**snap, "world_size": 2, "ranks": snap["ranks"] * 2}  # as 2 ranks write it
        torch.save({**snap, "checksums": checksums(snap)}, path)
        if expect is None:
            assert ckpt.load_latest()["world_size"] == 2
        else:
            with pytest.raises(RunDirError, match=expect):
                ckpt.load_latest()


@pytest.mark.slow
@pytest.mark.multiprocess
def test_ranks_agree_on_the_snapshot_step_exactly_past_float32s_range(tmp_path):
    """float32 holds integers exactly only up to 2**24: 2**24 + 1 and 2**24 once compared as equal."""
    from workers import agree_on_steps

    from ddpkit.ranks.launcher import run_workers

    said = run_workers(agree_on_steps, (str(tmp_path), (2**24 + 1, 2**24)), 2)
    assert len(said) == 2 and all(f"(steps {2**24} and {2**24 + 1})" in s for s in said), said
    assert run_workers(agree_on_steps, (str(tmp_path), (2**24 + 1, 2**24 + 1)), 2) == ["agreed", "agreed"]
