"""ddpkit check: passes where N processes equal 1, fails (naming the tensor) where they do not."""

from __future__ import annotations

import json

import pytest
import torch
from clirun import run_cli
from user_code import (
    BatchNormMLP,
    RankNoiseMLP,
    RegressionMLP,
    mse,
    regression_data,
    uneven_data,
)

from ddpkit import TrainConfig
from ddpkit.tools.check import FLOOR, check, compare, coverage_verdict

TINY = dict(device="cpu", limit_train=96, limit_test=40, batch_size=16, num_workers=0)


@pytest.mark.multiprocess
def test_the_cli_check_passes_on_the_convnet_in_float64(tmp_path):
    proc = run_cli(
        "check",
        "--model",
        "convnet",
        "--dataset",
        "mnist",
        "--nproc",
        "2",
        "--steps",
        "3",
        "--limit-train",
        "96",
        "--limit-test",
        "40",
        "--batch-size",
        "16",
        "--device",
        "cpu",
        "--json",
        str(tmp_path / "check.json"),
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = json.loads((tmp_path / "check.json").read_text())
    assert report["passed"] and report["dtype"] == "float64" and report["world_size"] == 2
    # float64: the runs agree to rounding, far below the floor; every tensor and buffer compared
    assert report["max_abs_rel_diff"] < 1e-12
    names = {t["name"] for t in report["tensors"]}
    assert "layer1.1.running_mean" in names and "layer1.1.num_batches_tracked" in names
    assert "PASSED" in proc.stdout and "exactly once" in proc.stdout and "--sync-bn" in proc.stdout
    assert "[step]" not in proc.stdout  # the runs themselves are quiet


@pytest.mark.multiprocess
@pytest.mark.parametrize("model,dataset,steps", [("mlp", "synthetic", 2), ("resnet9", "synthetic", 1)])
def test_check_passes_on_registry_models(model, dataset, steps):
    """synthetic (3 channels) is augmented with crops and flips: regression for draws made per rank,
    which made every augmented dataset fail the check."""
    small = dict(TINY, limit_train=32, limit_test=8) if model == "resnet9" else TINY
    report = check(
        config=TrainConfig(model=model, dataset=dataset, synthetic_shape="3,8,8", synthetic_size=240, **small),
        nproc=2,
        steps=steps,
    )
    assert report.passed, report.text()
    assert report.dtype == "float64" and report.worst.diff < 1e-12


@pytest.mark.multiprocess
def test_check_passes_on_a_user_model_through_the_python_api(tmp_path):
    torch.manual_seed(0)
    report = check(
        RegressionMLP,
        regression_data(128, 0),
        regression_data(30, 1),
        config=TrainConfig(**TINY, log="csv"),
        nproc=2,
        steps=4,
        loss_fn=mse,
        work_dir=tmp_path,
    )
    assert report.passed, report.text()
    # its own short runs draw no plots and open no loggers (each drew three PNGs, 1.5 s, once plots came)
    assert not list(tmp_path.rglob("plots")) and not list(tmp_path.rglob("metrics.csv"))
    assert report.coverage["ok"] and any(
        "30 test samples is evaluated exactly once" in line for line in report.coverage["lines"]
    )


@pytest.mark.multiprocess
def test_check_fails_on_rank_dependent_noise_and_names_the_tensor():
    torch.manual_seed(0)
    report = check(RankNoiseMLP(), regression_data(128, 0), config=TrainConfig(**TINY), nproc=2, steps=3, loss_fn=mse)
    assert not report.passed
    worst = report.worst
    assert worst.diff > 1e6 * worst.noise and worst.diff > 1e-6  # not a close call
    assert "DIVERGED" in report.text() and worst.name in report.text()


@pytest.mark.multiprocess
def test_check_fails_on_batchnorm_without_syncbn_and_passes_with_it():
    torch.manual_seed(0)
    model, data = BatchNormMLP(), uneven_data(128)
    without = check(model, data, config=TrainConfig(**TINY), nproc=2, steps=3, loss_fn=mse, sync_bn=False)
    assert not without.passed and "BatchNorm without SyncBN" in without.text()
    assert without.worst.diff > 1e-4
    with_sync = check(model, data, config=TrainConfig(**TINY), nproc=2, steps=3, loss_fn=mse)
    assert with_sync.passed, with_sync.text()


def test_a_batch_that_does_not_divide_is_a_config_error_before_any_run(tmp_path):
    from ddpkit.errors import ConfigError

    with pytest.raises(ConfigError, match="--batch-size 15 .* must divide by --nproc 2.*use 14 or 16"):
        check(
            RegressionMLP(),
            regression_data(64, 0),
            config=TrainConfig(**dict(TINY, batch_size=15)),
            nproc=2,
            loss_fn=mse,
            work_dir=tmp_path / "w",
        )
    assert not (tmp_path / "w").exists()


def test_compare_takes_its_tolerance_per_tensor_from_the_noise_run():
    ref = {"w": torch.tensor([1.0, 2.0], dtype=torch.float64), "n": torch.tensor(3)}
    noisy = {"w": ref["w"] + 1e-6, "n": torch.tensor(3)}
    same = compare(ref, {"w": ref["w"] + 5e-6, "n": torch.tensor(3)}, noisy, "float64")
    assert all(t.ok for t in same)  # 2.5e-6 relative, within 10 x the 5e-7 noise
    off = compare(ref, {"w": ref["w"] + 1e-4, "n": torch.tensor(4)}, noisy, "float64")
    assert [t.ok for t in off] == [False, False] and off[1].diff == float("inf")
    assert compare(ref, ref, ref, "float64")[0].tol == FLOOR["float64"]


def test_coverage_verdict_catches_each_data_bug():
    order = torch.randperm(10)
    good = [order[:8].view(2, 4), torch.randperm(10)[:8].view(2, 4)]
    test = torch.tensor([[0, 2, 4], [1, 3, -1]])
    assert coverage_verdict(good, test, 10, 5, 4)["ok"]
    dup = [torch.tensor([[0, 1], [1, 2]]), torch.tensor([[3, 4], [5, 6]])]
    assert "more than once" in " ".join(coverage_verdict(dup, test, 4, 5, 4)["lines"])
    assert "set_epoch" in " ".join(coverage_verdict([good[0], good[0]], test, 10, 5, 4)["lines"])
    too_few = [order[:4].view(2, 2), order[4:8].view(2, 2)]
    assert not coverage_verdict(too_few, test, 10, 5, 2)["ok"]  # 6 of 10 unused with a global batch of 2
    twice = torch.tensor([[0, 2, 4], [1, 3, 4]])
    assert "1 counted twice" in " ".join(coverage_verdict(good, twice, 10, 5, 4)["lines"])
