"""The horizon (``epochs``, ``max_steps``) in words (issue 41 case 7): a dropped --max-steps is said as the epochs'
end, not as 0; a default run dir that cannot go on to another horizon says why in one line, each thing once; a
--max-steps past what the epochs hold is said once before training. World 1, in this process."""

from __future__ import annotations

import json

import pytest
import torch
from user_code import RegressionMLP, mse, regression_data

from ddpkit import TrainConfig, Trainer

# 70 samples, global batch 16: 4 steps an epoch (the last 6 samples dropped), 8 in the 2 epochs
BASE = dict(
    device="cpu",
    nproc="1",
    batch_size=16,
    epochs=2,
    lr=0.05,
    schedule="constant",
    dtype="float64",
    progress=False,
    num_workers=0,
    log_every=1,
    plots=False,
)


def fit(**config):
    torch.manual_seed(0)
    return Trainer(
        TrainConfig(**{**BASE, **config}),
        model=RegressionMLP(dtype=torch.float64),
        train_data=regression_data(70, 0, torch.float64),
        test_data=regression_data(16, 1, torch.float64),
        loss_fn=mse,
    ).fit()


def ddpkit_lines(out: str) -> list[str]:
    return [line for line in out.splitlines() if line.startswith("ddpkit: ")]


def test_dropping_max_steps_is_said_as_the_epochs_end(tmp_path, capsys):
    """A run with --max-steps 3 rerun without it trains on to the epochs' end; the line said "max_steps 3 -> 0"."""
    run = str(tmp_path / "r")
    fit(max_steps=3, run_dir=run)
    capsys.readouterr()
    result = fit(run_dir=run)
    assert result["steps"] == 8
    assert ddpkit_lines(capsys.readouterr().out) == [
        f"ddpkit: training {run} to another horizon (max_steps 3 -> none (the epochs' end)) from its last snapshot "
        f"(step 3); its lr policy does not depend on the total"
    ]


@pytest.mark.parametrize(
    "first, then, held",
    [
        # onecycle spans the total steps: the 1-epoch run's steps are not those of a 2-epoch run
        (
            dict(schedule="onecycle", epochs=1),
            dict(schedule="onecycle", epochs=2),
            "at another horizon (epochs 1 -> 2)",
        ),
        # a constant lr, but fewer epochs: the run may have trained past the new horizon
        (dict(epochs=2), dict(epochs=1), "with more epochs (epochs 2 -> 1)"),
    ],
)
def test_a_default_run_dir_that_cannot_go_on_says_why_once(tmp_path, monkeypatch, capsys, first, then, held):
    """The line said the run dir, its horizon and its refusal twice: "RUN holds this run at another horizon, not to
    be trained on (run dir RUN holds this run at another horizon (...), and it cannot be trained to it: ... Pass a
    new --run-dir ...); training in RUN-2". The run dir is named once, the reason given once, and no advice to pass
    a new --run-dir, which ddpkit is doing itself."""
    monkeypatch.chdir(tmp_path)
    base = str(fit(**first).run_dir)  # runs/NAME, relative
    capsys.readouterr()
    beside = fit(**then)
    assert str(beside.run_dir) == f"{base}-2"
    [line] = ddpkit_lines(capsys.readouterr().out)
    assert line.startswith(f"ddpkit: {base} holds this run {held}")
    assert line.endswith(f"; training in {base}-2")
    assert line.count(base) == 2 and line.count(" -> ") == 1 and "--run-dir" not in line, line


def test_max_steps_past_the_epochs_is_said_once_and_changes_nothing(tmp_path, capsys):
    """--max-steps 10 with 2 epochs of 4 steps stopped at step 8 without a word; now one line says so, and the
    run trains what it trained before. A --max-steps within the epochs says nothing."""
    result = fit(max_steps=10, run_dir=str(tmp_path / "past"))
    out = capsys.readouterr().out
    assert ddpkit_lines(out) == [
        "ddpkit: --max-steps 10 is past the 2 epochs' 8 steps: the run ends at step 8; raise --epochs to train longer"
    ]
    start = json.loads((result.run_dir / "metrics.jsonl").read_text().splitlines()[0])
    assert start["steps_per_epoch"] * 2 == 8 and result["steps"] == 8  # the count said is the engine's
    plain = fit(run_dir=str(tmp_path / "plain"))
    assert result["test_loss"] == plain["test_loss"]
    fit(max_steps=8, epochs=1, run_dir=str(tmp_path / "one"))
    assert ddpkit_lines(capsys.readouterr().out) == [
        "ddpkit: --max-steps 8 is past the 1 epoch's 4 steps: the run ends at step 4; raise --epochs to train longer"
    ]
    fit(max_steps=8, run_dir=str(tmp_path / "within"))
    assert ddpkit_lines(capsys.readouterr().out) == []
