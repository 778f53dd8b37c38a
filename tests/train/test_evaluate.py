"""Exact distributed evaluation with real gloo processes launched through torch's elastic agent."""

import pytest
from workers import eval_counts

from ddpkit.ranks.launcher import run_workers


@pytest.mark.multiprocess
def test_world_3_counts_every_test_sample_once():
    result = run_workers(eval_counts, (1000,), 3)  # 1000 is not divisible by 3
    assert result["world"] == 3
    assert result["test_samples"] == 1000
    assert round(result["test_accuracy"] * 1000) == result["expected_correct"] == 100


def test_world_1_matches():
    result = run_workers(eval_counts, (1001,), 1)
    assert result["test_samples"] == 1001 and round(result["test_accuracy"] * 1001) == 101
