"""Data that draws in ``__getitem__`` is keyed by sample (data/seeds.py), so at another world size the
global batch draws the same numbers: ``ddpkit check`` passes on it, and a world-2 run resumed mid-epoch at
world 1 ends where the world-2 run ends (float64: rounding apart)."""

from __future__ import annotations

import json

import pytest
import torch
from user_code import Augmenting, WindowClassifier, noisy_collate

from ddpkit import TrainConfig, Trainer
from ddpkit.data import DataSplits
from ddpkit.tools.check import check, data_draws

pytestmark = [pytest.mark.multiprocess, pytest.mark.slow]  # every test here starts a world of 2

TINY = dict(device="cpu", limit_train=96, limit_test=40, batch_size=16, num_workers=0)


def relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).abs().max() / b.abs().max().clamp_min(1e-300)).item()


def test_check_passes_on_data_that_draws_in_getitem():
    """Regression: each rank read its batches under (seed, epoch, rank, batch), so 2 processes drew other
    noise and windows than 1, and the check could give no verdict on such data."""
    torch.manual_seed(0)
    train = Augmenting(96, 0)
    assert data_draws(DataSplits(train, train, None)) is None  # it draws, keyed by sample
    assert data_draws(DataSplits(train, train, None, noisy_collate)) is not None  # a collate's are the batch's
    report = check(WindowClassifier(), train, Augmenting(40, 1), config=TrainConfig(**TINY), nproc=2, steps=3)
    assert report.passed, report.text()
    assert report.dtype == "float64" and report.worst.diff < 1e-12, report.text()
    assert report.seeds_diff == 0.0  # the data's draws are no global generator's: other seeds move nothing


def test_a_world_2_run_resumed_mid_epoch_at_world_1_ends_where_it_would_have(tmp_path):
    common = dict(
        device="cpu",
        batch_size=8,
        epochs=2,
        lr=0.05,
        dtype="float64",
        data_path="loader",
        num_workers=0,
        save_every_steps=5,
        keep_snapshots=10,
        log_every=4,
        progress=False,
        plots=False,
        run_dir=str(tmp_path / "run"),
    )
    run = tmp_path / "run"

    def fit(nproc: str) -> dict:
        torch.manual_seed(0)  # the same model passed in: the same run
        model = WindowClassifier()
        return Trainer(
            TrainConfig(nproc=nproc, **common), model=model, train_data=Augmenting(96, 0), test_data=Augmenting(48, 1)
        ).fit()

    done = fit("2")
    assert done["steps"] == 24
    reference = torch.load(run / "model.pt", weights_only=True)
    expected = json.loads((run / "summary.json").read_text())
    for path in [run / "model.pt", run / "summary.json"] + [
        p for p in (run / "checkpoints").glob("snapshot-*.pt") if int(p.stem.split("-")[1]) > 5
    ]:
        path.unlink()  # as if the job had been lost right after step 5's snapshot, mid-epoch
    again = fit("1")
    assert again["world_size"] == 1 and again["steps"] == 24
    starts = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    starts = [(r["world_size"], r["resumed_at_step"], r["resumed_from_world"]) for r in starts if r["event"] == "start"]
    assert starts[-1] == (1, 5, 2), starts
    final = torch.load(run / "model.pt", weights_only=True)
    diffs = {name: relative(final[name], tensor) for name, tensor in reference.items()}
    assert max(diffs.values()) < 1e-12, diffs
    summary = json.loads((run / "summary.json").read_text())
    assert abs(summary["test_loss"] - expected["test_loss"]) < 1e-12 * expected["test_loss"]
