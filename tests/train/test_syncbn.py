"""SyncBatchNorm on CPU/gloo: the same numbers as BatchNorm over the whole global batch, and
every precision and memory-format combination at world size 2."""

import pytest
import torch
from torch import nn
from workers import precision_matrix, syncbn_vs_bn

from ddpkit.ranks.launcher import run_workers
from ddpkit.train.syncbn import AllReduceBatchNorm, convert_sync_batchnorm


@pytest.mark.multiprocess
def test_two_rank_syncbn_equals_full_batch_bn():
    result = run_workers(syncbn_vs_bn, (0,), 2)
    assert result["type"] == "AllReduceBatchNorm"
    assert result["rank0"] == {
        "out": True,
        "input_grad": True,
        "weight_grad": True,
        "running_var": True,
        "running_mean": True,
    }
    assert result["all_ranks_ok"]


@pytest.mark.multiprocess
def test_every_amp_sync_bn_and_memory_format_combination_trains_at_world_2(tmp_path):
    """Regression: --amp bf16 --sync-bn raised a dtype error in syncbn.py (each flag worked alone)."""
    results = run_workers(precision_matrix, (str(tmp_path),), 2)
    assert len(results) == 12
    failed = [combo for combo, r in results.items() if not r["ok"]]
    assert not failed, failed
    assert all(r["bn"] == ["AllReduceBatchNorm"] for c, r in results.items() if "/sync/" in c)
    assert all(r["bn"] == ["BatchNorm2d"] for c, r in results.items() if "/local/" in c)


def test_cuda_keeps_torchs_syncbn_unless_asked_and_cpu_gets_ours():
    model = nn.Sequential(nn.Conv2d(1, 2, 3), nn.BatchNorm2d(2))
    assert isinstance(convert_sync_batchnorm(model, torch.device("cuda", 0))[1], nn.SyncBatchNorm)
    for device, impl in ((torch.device("cpu"), "auto"), (torch.device("cpu"), "allreduce")):
        model = nn.Sequential(nn.Conv2d(1, 2, 3), nn.BatchNorm2d(2))
        assert isinstance(convert_sync_batchnorm(model, device, impl)[1], AllReduceBatchNorm)
