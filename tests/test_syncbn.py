"""SyncBatchNorm on CPU/gloo: the same numbers as BatchNorm over the whole global batch."""

from ddpkit.launch import launch
from workers import syncbn_vs_bn


def test_two_rank_syncbn_equals_full_batch_bn():
    result = launch(syncbn_vs_bn, (0,), 2)
    assert result["type"] == "CPUSyncBatchNorm"
    assert result["rank0"] == {"out": True, "input_grad": True, "weight_grad": True, "running_var": True,
                               "running_mean": True}
    assert result["all_ranks_ok"]
