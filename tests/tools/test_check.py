"""ddpkit check: passes where N processes equal 1, fails (naming the tensor) where they do not."""

from __future__ import annotations

import json

import pytest
import torch
from batch_coupled import BatchCentred, FunctionalBatchNorm, RunningBuffer, max_error, summed_mse
from clirun import run_cli
from random_models import AttentionDropout, DropoutMLP, LateNoise, NoisyMLP
from torch import nn
from user_code import (
    BatchNormMLP,
    RankNoiseMLP,
    RegressionMLP,
    mse,
    regression_data,
    uneven_data,
)

from ddpkit import TrainConfig
from ddpkit.tools.check import FLOOR, check, compare, coverage_verdict, randomness_probe, without_randomness
from ddpkit.train.task import UserLoss

TINY = dict(device="cpu", limit_train=96, limit_test=40, batch_size=16, num_workers=0)


@pytest.mark.slow
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


@pytest.mark.slow
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
    # the noise run perturbed the rounding (it once ran the reference's memory format: noise 0, floor only)
    assert max(t.noise for t in report.tensors) > 0, report.text()


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


@pytest.mark.slow
@pytest.mark.multiprocess
def test_check_fails_on_batchnorm_without_syncbn_and_passes_with_it():
    torch.manual_seed(0)
    model, data = BatchNormMLP(), uneven_data(128)
    without = check(model, data, config=TrainConfig(**TINY), nproc=2, steps=3, loss_fn=mse, sync_bn=False)
    assert not without.passed and "BatchNorm without SyncBN" in without.text()
    assert without.worst.diff > 1e-4
    with_sync = check(model, data, config=TrainConfig(**TINY), nproc=2, steps=3, loss_fn=mse)
    assert with_sync.passed, with_sync.text()


# Models and losses whose N-process step truly differs from 1 process's: each couples its batch's samples.
# The noise run once split the batch into 2 accumulated halves, which shares that very difference, so the
# tolerance grew with it and every one PASSED (issue 33, case 10: 1.6-96% relative).
COUPLED = [
    ("batch-centred model", BatchCentred, mse, "FAILED"),
    ("functional batch norm", FunctionalBatchNorm, mse, "FAILED"),
    ("running buffer from the batch", RunningBuffer, mse, "FAILED"),
    ("summed loss", RegressionMLP, summed_mse, "FAILED"),
    ("max loss", RegressionMLP, max_error, "FAILED"),
    ("per-sample mean loss", RegressionMLP, mse, "PASSED"),
]


@pytest.mark.multiprocess
@pytest.mark.parametrize("case", COUPLED, ids=[c[0] for c in COUPLED])
def test_check_fails_on_what_couples_the_batch_and_its_noise_stays_rounding(case):
    _, factory, loss, verdict = case
    torch.manual_seed(0)
    report = check(factory(), regression_data(128, 0), config=TrainConfig(**TINY), nproc=2, steps=2, loss_fn=loss)
    text = report.text()
    assert report.verdict == verdict and report.dtype == "float64", text
    assert report.exit_code == (1 if verdict == "FAILED" else 0)
    assert "another order" in report.noise_run, text
    # the noise run computed the same steps in another float order: rounding only, on every tensor (a max
    # loss's gradient comes from one sample, summed in no order: its noise may be exactly 0)
    assert max(t.noise for t in report.tensors) < 1e-13, text
    if verdict == "FAILED":
        assert text.splitlines()[-1] == "FAILED: 2 processes do not compute what 1 process does", text
        assert report.worst.diff > 1e-3 and "DIVERGED" in text, text  # not a close call
    else:
        assert report.worst.diff < 1e-12 and max(t.noise for t in report.tensors) > 0, text


def tiny_check(tmp_path, model: str, *more: str):
    """`ddpkit check` of ``model`` on 64 MNIST images, 2 steps on the CPU, its report in tmp_path/check.json."""
    return run_cli(
        "check",
        "--model",
        model,
        *more,
        "--dataset",
        "mnist",
        "--limit-train",
        "64",
        "--limit-test",
        "32",
        "--batch-size",
        "16",
        "--steps",
        "2",
        "--device",
        "cpu",
        "--json",
        str(tmp_path / "check.json"),
    )


@pytest.mark.slow
@pytest.mark.multiprocess
def test_the_cli_check_fails_on_a_batch_centred_model_with_exit_1(tmp_path):
    proc = tiny_check(tmp_path, "batch_coupled:centred_net")
    assert proc.returncode == 1, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert proc.stdout.strip().splitlines()[-1] == "FAILED: 2 processes do not compute what 1 process does"
    report = json.loads((tmp_path / "check.json").read_text())
    assert report["verdict"] == "FAILED" and report["dtype"] == "float64" and "another order" in report["noise_run"]
    assert report["worst"]["diff"] > 1e-3 and report["worst"]["noise"] < 1e-13
    assert "Traceback" not in proc.stderr


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


# ddpkit check's verdict on a table of models: every kind of randomness, with and without SyncBN,
# float32 and float64. (model, data, sync_bn, dtype, verdict, words the report must hold)
TABLE = [
    ("layer dropout argument", AttentionDropout, "plain", None, "float64", "PASSED", ["attn.dropout"]),
    ("dropout modules", DropoutMLP, "plain", None, "float32", "PASSED", ["net.2"]),
    ("no randomness", RegressionMLP, "plain", None, "float32", "PASSED", []),
    ("SyncBN", BatchNormMLP, "uneven", True, "float32", "PASSED", []),
    ("BatchNorm without SyncBN", BatchNormMLP, "uneven", False, "float32", "FAILED", ["without SyncBN"]),
    ("rank-dependent output", RankNoiseMLP, "plain", None, "float32", "FAILED", ["DIVERGED"]),
    (
        "torch.rand in forward",
        lambda: NoisyMLP("torch.rand"),
        "plain",
        None,
        "float64",
        "INCONCLUSIVE",
        ["net.1 (Noise) draws from torch"],
    ),
    (
        "F.dropout with a constant p",
        lambda: NoisyMLP("F.dropout"),
        "plain",
        None,
        "float32",
        "INCONCLUSIVE",
        ["net.1 (Noise) draws from torch"],
    ),
    ("numpy in forward", lambda: NoisyMLP("numpy"), "plain", None, "float64", "INCONCLUSIVE", ["draws from numpy"]),
    ("a draw from the second step on", LateNoise, "plain", None, "float32", "INCONCLUSIVE", ["seeded apart moved"]),
]


@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.parametrize("case", TABLE, ids=[c[0] for c in TABLE])
def test_check_verdicts_on_a_table_of_models(case):
    """Never PASSED where randomness remains or a difference was injected. Before: a layer's dropout
    argument and every draw in a forward stayed on, the noise run measured them as "rounding", and
    the check passed differences of several percent (or failed, blaming the 2 processes)."""
    _, factory, data, sync_bn, dtype, verdict, words = case
    torch.manual_seed(0)
    data = regression_data(128, 0) if data == "plain" else uneven_data(128)
    report = check(
        factory(), data, config=TrainConfig(**TINY), nproc=2, steps=3, loss_fn=mse, sync_bn=sync_bn, dtype=dtype
    )
    text = report.text()
    assert report.verdict == verdict and report.dtype == dtype, text
    assert text.splitlines()[-1].startswith(verdict) and all(w in text for w in words), text
    assert (
        report.passed == (verdict == "PASSED")
        and report.exit_code == {"PASSED": 0, "FAILED": 1, "INCONCLUSIVE": 3}[verdict]
    )
    if report.seeds_diff is not None and verdict != "INCONCLUSIVE":
        assert report.seeds_diff == 0.0  # the same run with other seeds is bitwise the same on CPU
    if verdict == "PASSED":  # the noise run measured rounding only: tolerances stay at rounding's scale
        assert report.worst.tol < (1e-10 if dtype == "float64" else 1e-3), text


def test_every_dropout_argument_is_switched_off_and_named():
    model = nn.Sequential(
        nn.TransformerEncoderLayer(8, 2, 16, dropout=0.2, batch_first=True),
        nn.LSTM(8, 8, num_layers=2, dropout=0.3),
    )
    notes: list[str] = []
    without_randomness(model, notes)
    layer, lstm = model
    assert layer.self_attn.dropout == 0.0 and layer.dropout.p == layer.dropout1.p == layer.dropout2.p == 0.0
    assert lstm.dropout == 0.0
    assert "0.self_attn.dropout" in notes[0] and "and 1 more" in notes[0]


def test_the_probe_names_the_module_that_draws_and_restores_the_generators():
    batch, model = regression_data(8, 0)[:], NoisyMLP("torch.rand")
    state = torch.random.get_rng_state()
    found = randomness_probe(model, UserLoss(mse), batch, "float64")
    assert found is not None and found.sources == ["net.1 (Noise) draws from torch in its forward"]
    assert {n for n, _ in found.moved} >= {"net.0.weight", "loss"}
    assert torch.equal(torch.random.get_rng_state(), state)  # the user's stream is left where it was
    assert randomness_probe(RegressionMLP(), UserLoss(mse), batch, "float64") is None


@pytest.mark.slow
@pytest.mark.multiprocess
def test_the_cli_says_inconclusive_with_its_own_exit_code(tmp_path):
    proc = tiny_check(tmp_path, "random_models:noisy_net", "--model-args", '{"source": "torch.rand"}')
    assert proc.returncode == 3, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = json.loads((tmp_path / "check.json").read_text())
    assert report["verdict"] == "INCONCLUSIVE" and not report["passed"] and "2 (Noise)" in report["inconclusive"][0]
    assert "INCONCLUSIVE" in proc.stdout and "Traceback" not in proc.stderr


@pytest.mark.slow
@pytest.mark.multiprocess
def test_check_is_inconclusive_on_data_that_draws_random_numbers_as_it_is_read():
    """Each rank collates its batches under seeds of their own (seed, epoch, rank, batch: data/seeds.py),
    which the seeds run does not reach. Without the data probe the noise run (each batch's samples in
    another order, each drawn anew) measured the draws as rounding, and the check PASSED a random dataset
    whose 2 processes drew other numbers than 1 (14% apart). Draws in ``__getitem__`` are keyed by sample
    now, the same at any world size (the check passes on them: tests/data/test_seeds_world.py); a
    ``collate_fn``'s stay the batch's."""
    from user_code import NoisyData, PlainData, drawing_collate, noisy_collate

    from ddpkit.data import DataSplits
    from ddpkit.tools.check import data_draws

    report = check(
        RegressionMLP(),
        PlainData(128, 0),
        config=TrainConfig(**TINY),
        nproc=2,
        steps=3,
        loss_fn=mse,
        collate_fn=noisy_collate,
    )
    assert report.verdict == "INCONCLUSIVE", report.text()
    assert "reading the training data draws random numbers in its collate_fn" in report.text()
    plain = regression_data(16, 0)
    assert data_draws(DataSplits(plain, plain, None)) is None
    assert data_draws(DataSplits(plain, plain, None, lambda s: drawing_collate([x for x, _ in s]))) is not None
    assert data_draws(DataSplits(NoisyData(16), NoisyData(16), None)) is None  # keyed by sample


@pytest.mark.multiprocess
@pytest.mark.parametrize("model_cls", [RegressionMLP, pytest.param(BatchNormMLP, marks=pytest.mark.slow)])
def test_check_under_fsdp2_holds_it_to_one_process_and_to_ddp(model_cls):
    """--strategy fsdp2: FSDP2 at 2 processes against DDP at 2, each tensor held to its rounding noise at 1
    process; and against 1 process too where the model has no BatchNorm (FSDP2 has no SyncBN, so with one
    each rank normalises over its own samples, as DDP without SyncBN does, and 1 process computes otherwise)."""
    torch.manual_seed(0)
    cfg = TrainConfig(**TINY, strategy="fsdp2")
    report = check(model_cls(), uneven_data(128), config=cfg, nproc=2, steps=3, loss_fn=mse)
    assert report.passed, report.text()
    names = [t.name for t in report.tensors]
    vs_ddp = [n for n in names if n.endswith("(vs DDP at 2)")]
    assert vs_ddp and len(vs_ddp) == len(names) // (1 if model_cls is BatchNormMLP else 2)
    assert report.to_dict()["strategy"] == "fsdp2"
    assert report.text().startswith("ddpkit check: 2 processes under FSDP2 against ")
