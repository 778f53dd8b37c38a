"""Buffers and optimizer state broadcast in one collective per (device, dtype) group, not one per tensor."""

import pytest
import torch
from workers import coalesced_broadcast, coalesced_engine

from ddpkit.ranks.context import DistContext
from ddpkit.ranks.launcher import run_workers


@pytest.mark.multiprocess
def test_broadcast_many_gives_rank0s_values_in_one_broadcast_per_dtype():
    result = run_workers(coalesced_broadcast, (), 2)
    assert result == {
        "world": 2,
        "bn_equal": True,
        "bn_broadcasts": 2,  # float32 running stats, int64 num_batches_tracked: not 9
        "mixed_ok": True,  # channels-last kept, in place; float64 and a 0-d int64 in their own groups
        "mixed_broadcasts": 3,
        "empty_broadcasts": 0,
    }


@pytest.mark.multiprocess
def test_the_ddp_wrap_and_evaluation_broadcast_buffers_coalesced(tmp_path):
    result = run_workers(coalesced_engine, (str(tmp_path),), 2)
    assert result["wrapped"] and result["buffers"] >= 6  # the ConvNet's BatchNorms: 3 buffers each
    assert result["wrap_equal"] and result["eval_equal"]
    assert result["wrap_broadcasts"] == 2 and result["eval_broadcasts"] == 2


def test_broadcast_many_at_world_size_1_touches_nothing(monkeypatch):
    ctx = DistContext(0, 0, 1, 1, torch.device("cpu"), "gloo")
    monkeypatch.setattr(torch.distributed, "broadcast", lambda *a, **kw: pytest.fail("no collective at world size 1"))
    t = torch.arange(4.0)
    ctx.broadcast_many([t])
    ctx.broadcast_many([])
    assert torch.equal(t, torch.arange(4.0))
