"""Snapshots written in the background (run/staging.py, ``Checkpointer(background=True)``), in one process: the
state is the step's whatever the step does next, the buffers are allocated once, one write is in flight, and a
failed write is raised by the next wait or save. The kills inside a write, under both faces, are in
tests/system/test_fault_tolerance.py."""

from __future__ import annotations

import errno
import threading

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
    """A module's own state_dict, with tied weights (a language model's embedding and output layer: one
    parameter under two names, each detached anew), and the containers a schedule hands out."""
    model = torch.nn.Sequential(torch.nn.Embedding(5, 3), torch.nn.Linear(3, 5, bias=False))
    model[1].weight = model[0].weight
    lr = [0.1]
    tree = {"model": model.state_dict(), "sched": {"_last_lr": lr}, "step": 3, "pair": (model[0].weight[0], "x")}
    before = model[0].weight.detach().clone()
    stager = Stager()
    staged = stager.stage(tree)
    with torch.no_grad():
        model[0].weight.add_(100)  # the next optimizer step, in place
    lr.append(0.2)
    sd = staged["model"]
    assert type(sd) is type(tree["model"]) and list(sd) == ["0.weight", "1.weight"]
    assert sd["1.weight"] is sd["0.weight"] and torch.equal(sd["0.weight"], before)  # one tensor, the step's
    assert staged["sched"]["_last_lr"] == [0.1] and staged["step"] == 3 and staged["pair"][1] == "x"
    assert torch.equal(staged["pair"][0], before[0]) and isinstance(staged["pair"], tuple)
    assert stager.nbytes == 15 * 4 + 3 * 4  # the weight once, and the row of it in "pair" (its own view)
    pointer = sd["0.weight"].data_ptr()
    again = stager.stage(tree)  # the next snapshot: the same buffers, the new values
    assert again["model"]["0.weight"].data_ptr() == pointer and torch.equal(again["model"]["0.weight"], before + 100)


def test_a_buffer_the_next_snapshot_does_not_use_is_freed():
    """A per-rank value whose shape changes between snapshots (a prefetched batch of another length)."""
    stager = Stager()
    for n in (3, 4, 5):
        stager.stage({"X": torch.ones(n), "w": torch.ones(2)})
    assert stager.nbytes == (5 + 2) * 4


def _held_at(monkeypatch, point: str, gate: threading.Event, passed: list) -> None:
    """The writer stops at ``point`` until ``gate`` is set (run/checkpoint.py's test hook)."""

    def hook(step):
        def moment(name):
            passed.append(name)
            if name == point:
                gate.wait(30)

        return moment

    monkeypatch.setattr(checkpoint, "_kill_hook", hook)


def test_a_background_snapshot_holds_the_step_it_was_taken_at(tmp_path, monkeypatch):
    """The save returns with the writer held before it serialises anything; the weights then change in place
    (the next step), and the file holds the weights of the step that was saved."""
    ckpt = make(tmp_path)
    model = torch.nn.Linear(64, 64)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    gate, passed = threading.Event(), []
    _held_at(monkeypatch, "staged", gate, passed)
    ckpt.save({"model": model.state_dict(), "rank_state": None}, 1)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)
    assert passed == ["staged"]  # nothing serialised yet
    gate.set()
    ckpt.wait()
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


def _disk_fills(monkeypatch, at_step: int) -> None:
    """ENOSPC half-way through the snapshot file of ``at_step`` (run/checkpoint.py's test hook)."""

    def hook(step):
        def moment(name):
            if step == at_step and name == "half-written":
                raise OSError(errno.ENOSPC, "No space left on device")

        return moment

    monkeypatch.setattr(checkpoint, "_kill_hook", hook)


def test_a_failed_background_write_is_said_by_the_safe_point_and_the_next_wait(tmp_path, monkeypatch):
    """A write that fails (a full disk, half-way through the file) is known without waiting (``write_error``:
    what a safe point's all-reduce carries) and said once, or raised by the next wait; no partial file stays."""
    _disk_fills(monkeypatch, at_step=2)
    ckpt = make(tmp_path)
    ckpt.save({"x": torch.ones(3)}, 1)
    ckpt.wait()
    ckpt.save({"x": torch.ones(3)}, 2)
    ckpt._writing.thread.join()
    error = ckpt.write_error()
    assert (
        isinstance(error, RunDirError) and "no space left writing" in str(error) and "snapshot-000000002" in str(error)
    )
    assert ckpt.write_error() is None  # said once
    ckpt.wait()  # and not raised again
    ckpt.save({"x": torch.ones(3)}, 2)
    ckpt._writing.thread.join()
    with pytest.raises(RunDirError, match="no space left writing"):
        ckpt.wait()
    assert [p.name for p in ckpt.snapshots()] == ["snapshot-000000001.pt"]
    assert not list((tmp_path / "checkpoints").glob("*.tmp"))


def test_a_run_that_ends_on_another_error_still_says_a_failed_write(tmp_path, monkeypatch):
    """``close()`` (a run ending on its own error: no collective) ends the write in flight and warns of its
    failure, which no safe point will say."""
    _disk_fills(monkeypatch, at_step=1)
    ckpt, said = make(tmp_path), []
    ckpt.save({"x": torch.ones(3)}, 1)
    ckpt.close(warn=said.append)
    assert len(said) == 1 and said[0].startswith("ddpkit: warning: ") and "no space left writing" in said[0]


def test_the_next_save_raises_a_failed_background_write_before_it_stages_anything(tmp_path, monkeypatch):
    """Where no safe point came between (a snapshot every step), the next save says the failure: the
    previous write's end travels with the save's own gather, and nothing new is written."""
    _disk_fills(monkeypatch, at_step=1)
    ckpt = make(tmp_path)
    ckpt.save({"x": torch.ones(3)}, 1)
    with pytest.raises(RunDirError, match="no space left writing .*snapshot-000000001.pt"):
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
