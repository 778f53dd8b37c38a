"""Snapshots written in the background (run/staging.py, ``Checkpointer(background=True)``), in one process: the
state is the step's whatever the step does next, the buffers are allocated once, one write is in flight, and a
failed write is raised by the next wait or save. The kills inside a write, under both faces, are in
tests/system/test_fault_tolerance.py."""

from __future__ import annotations

import threading
from collections import OrderedDict

import pytest
import torch

from ddpkit.config import TrainConfig
from ddpkit.errors import RunDirError
from ddpkit.ranks.context import DistContext
from ddpkit.run import checkpoint
from ddpkit.run.checkpoint import Checkpointer
from ddpkit.run.staging import Stager

CTX = DistContext(0, 0, 1, 1, torch.device("cpu"), "gloo")


def make(tmp_path, background=True, **kw) -> Checkpointer:
    cfg = TrainConfig(run_dir=str(tmp_path), **kw).resolved()
    return Checkpointer(tmp_path, CTX, cfg, keep=2, background=background)


def test_a_staged_tree_is_a_copy_in_buffers_reused_and_keeps_tied_tensors_one():
    w = torch.arange(6.0).reshape(2, 3)
    lr = [0.1]
    tree = {"model": OrderedDict(a=w, tied=w), "sched": {"_last_lr": lr}, "step": 3, "pair": (w[0], "x")}
    stager = Stager()
    staged = stager.stage(tree)
    w.add_(100)  # the next optimizer step, in place
    lr.append(0.2)
    assert torch.equal(staged["model"]["a"], torch.arange(6.0).reshape(2, 3))
    assert staged["model"]["tied"] is staged["model"]["a"] and type(staged["model"]) is OrderedDict
    assert staged["sched"]["_last_lr"] == [0.1] and staged["step"] == 3 and staged["pair"][1] == "x"
    assert torch.equal(staged["pair"][0], torch.arange(3.0)) and isinstance(staged["pair"], tuple)
    pointers = {k: staged["model"][k].data_ptr() for k in ("a",)}
    again = stager.stage(tree)  # the next snapshot: the same buffers, the new values
    assert again["model"]["a"].data_ptr() == pointers["a"] and torch.equal(again["model"]["a"], w)
    assert stager.nbytes == 6 * 4 + 3 * 4  # the weight and the row of it in "pair" (a view: its own buffer)


def test_a_background_snapshot_holds_the_step_it_was_taken_at(tmp_path):
    """The save returns at once; the weights then change in place (the next step) while the thread writes,
    and the file holds the weights of the step that was saved."""
    ckpt = make(tmp_path)
    model = torch.nn.Linear(64, 64)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    gate, written = threading.Event(), []
    original = checkpoint.atomic_write

    def held(path, data, *args, **kw):  # the writer waits until the step below has changed the weights
        gate.wait(30)
        original(path, data, *args, **kw)
        written.append(path.name)

    checkpoint.atomic_write = held
    try:
        ckpt.save({"model": model.state_dict(), "rank_state": None}, 1)
        assert not written  # the write has not happened: the step goes on
        with torch.no_grad():
            for p in model.parameters():
                p.add_(1.0)
        gate.set()
        ckpt.wait()
    finally:
        checkpoint.atomic_write = original
    assert written == ["snapshot-000000001.pt", "newest"]
    snap = make(tmp_path).load_latest()
    assert all(torch.equal(snap["trainer"]["model"][k], before[k]) for k in before)


def test_one_write_is_in_flight_and_the_next_save_waits_for_it(tmp_path):
    ckpt = make(tmp_path)
    order, gate = [], threading.Event()
    original = checkpoint.atomic_write

    def logged(path, data, *args, **kw):
        if path.name == "snapshot-000000001.pt":
            gate.wait(30)
        order.append(path.name)
        original(path, data, *args, **kw)

    checkpoint.atomic_write = logged
    try:
        ckpt.save({"x": torch.ones(3)}, 1)
        threading.Timer(0.2, gate.set).start()
        ckpt.save({"x": torch.full((3,), 2.0)}, 2)  # waits for the first write, then starts its own
        ckpt.wait()
    finally:
        checkpoint.atomic_write = original
    assert order == ["snapshot-000000001.pt", "newest", "snapshot-000000002.pt", "newest"]
    assert torch.equal(make(tmp_path).load_latest()["trainer"]["x"], torch.full((3,), 2.0))


def test_a_failed_background_write_is_said_by_the_safe_point_and_the_next_wait(tmp_path):
    """A write that fails is known without waiting (``write_error``: what a safe point's all-reduce carries),
    raised by the next wait, and leaves no partial file."""
    ckpt = make(tmp_path)
    ckpt.save({"x": torch.ones(3)}, 1)
    ckpt.wait()
    (tmp_path / "checkpoints" / "snapshot-000000002.pt.tmp").mkdir()  # the temporary file cannot be made
    ckpt.save({"x": torch.ones(3)}, 2)
    ckpt._writing.thread.join()
    error = ckpt.write_error()
    assert isinstance(error, RunDirError) and "snapshot-000000002.pt" in str(error)
    with pytest.raises(RunDirError, match="snapshot-000000002.pt"):
        ckpt.wait()
    assert [p.name for p in ckpt.snapshots()] == ["snapshot-000000001.pt"]
    assert ckpt.write_error() is None  # said once


def test_the_next_save_raises_a_failed_background_write_before_it_stages_anything(tmp_path):
    """Where no safe point came between (a snapshot every step), the next save says the failure: the
    previous write's end travels with the save's own gather, and nothing new is written."""
    ckpt = make(tmp_path)
    (tmp_path / "checkpoints").mkdir()
    (tmp_path / "checkpoints" / "snapshot-000000001.pt.tmp").mkdir()
    ckpt.save({"x": torch.ones(3)}, 1)
    with pytest.raises(RunDirError, match="snapshot-000000001.pt"):
        ckpt.save({"x": torch.ones(3)}, 2)
    assert ckpt.snapshots() == [] and ckpt._writing is None


def test_the_writer_passes_its_moments_in_order(tmp_path, monkeypatch):
    """The points the kill-anywhere tests stop a write at, in the order the write passes them."""
    passed = []
    monkeypatch.setattr(checkpoint, "_kill_hook", lambda step: passed.append)
    ckpt = make(tmp_path)
    ckpt.save({"x": torch.ones(3)}, 1)
    ckpt.wait()
    assert passed == list(MOMENTS)


MOMENTS = (
    "staged",
    "serialised",
    "opened",
    "half-written",
    "written",
    "fsynced",
    "renamed",
    "dir-synced",
    "newest",
    "pruned",
)
