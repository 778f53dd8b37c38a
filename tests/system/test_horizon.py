"""Training a run longer (issue 35): raising --max-steps or --epochs on a finished run goes on from its last
snapshot and ends bitwise as a run started with the longer horizon, where the lr policy does not depend on the
total; otherwise one line says why not. A run dir is named without its horizon."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch
from user_code import RegressionMLP, mse, regression_data

from ddpkit import TrainConfig, Trainer
from ddpkit.errors import RunDirError

# 64 samples, global batch 16: 4 steps an epoch. float64, a constant lr: the lr at a step does not depend on the total
BASE = dict(
    device="cpu",
    batch_size=16,
    epochs=10,
    lr=0.05,
    schedule="constant",
    dtype="float64",
    progress=False,
    num_workers=0,
    log_every=1,
    plots=False,
)


def fit(cfg: TrainConfig, **kw):
    torch.manual_seed(0)
    return Trainer(
        cfg,
        model=RegressionMLP(dtype=torch.float64),
        train_data=regression_data(64, 0, torch.float64),
        test_data=regression_data(16, 1, torch.float64),
        loss_fn=mse,
        **kw,
    ).fit()


def weights(result) -> dict:
    return torch.load(result.run_dir / "model.pt", weights_only=True)


def assert_same(a: dict, b: dict) -> None:
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.slow
@pytest.mark.multiprocess
def test_raising_max_steps_on_a_finished_run_equals_a_run_started_with_it(tmp_path, capsys):
    """6 steps (the run stops in its second epoch), then --max-steps 14 on the same run dir: it goes on from
    step 6 in the middle of that epoch, and its weights are the 14-step run's, bit for bit, at world 2."""
    longer = fit(TrainConfig(**BASE, nproc="2", max_steps=14, run_dir=str(tmp_path / "straight")))
    run = str(tmp_path / "grown")
    first = fit(TrainConfig(**BASE, nproc="2", max_steps=6, run_dir=run))
    assert first["steps"] == 6
    capsys.readouterr()
    grown = fit(TrainConfig(**BASE, nproc="2", max_steps=14, run_dir=run))
    out = capsys.readouterr().out
    assert f"ddpkit: training {run} to another horizon (max_steps 6 -> 14) from its last snapshot (step 6)" in out
    starts = [json.loads(line) for line in (grown.run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["resumed_at_step"] for r in starts if r["event"] == "start"] == [None, 6]
    assert grown["steps"] == 14 and grown["test_loss"] == longer["test_loss"]
    assert_same(weights(grown), weights(longer))
    summary = json.loads((grown.run_dir / "summary.json").read_text())
    assert summary["steps"] == 14


def test_raising_epochs_in_a_default_run_dir_goes_on_there(tmp_path, monkeypatch, capsys):
    """The default run dir is named without the horizon: --epochs 1 then 2 is one run dir, trained on, with
    the weights of a 2-epoch run (world 1, in this process)."""
    monkeypatch.chdir(tmp_path)
    cfg = dict(BASE, nproc="1")
    one = fit(TrainConfig(**{**cfg, "epochs": 1}))
    two = fit(TrainConfig(**{**cfg, "epochs": 2}))
    assert one.run_dir == two.run_dir and two["steps"] == 8
    straight = fit(TrainConfig(**{**cfg, "epochs": 2}, run_dir=str(tmp_path / "straight")))
    assert_same(weights(two), weights(straight))


def test_a_longer_horizon_is_refused_where_the_lr_spans_the_total(tmp_path):
    """onecycle (and a scheduler factory given the total steps) spreads its lr over the run's steps: steps
    0-6 of a 14-step run are not those of a 6-step run, so training longer is refused, nothing touched."""
    run = str(tmp_path / "r")
    cfg = dict(BASE, nproc="1", run_dir=run)
    fit(TrainConfig(**{**cfg, "schedule": "onecycle", "max_steps": 6}))
    before = (tmp_path / "r" / "model.pt").read_bytes()
    with pytest.raises(RunDirError, match=r"max_steps 6 -> 14\), and it cannot be trained to it: the onecycle lr "):
        fit(TrainConfig(**{**cfg, "schedule": "onecycle", "max_steps": 14}))
    assert (tmp_path / "r" / "model.pt").read_bytes() == before

    def factory(opt, total_steps):
        return torch.optim.lr_scheduler.LinearLR(opt, 1.0, 0.1, total_iters=total_steps)

    own = dict(cfg, run_dir=str(tmp_path / "own"))
    del own["lr"], own["schedule"]
    fit(TrainConfig(**{**own, "max_steps": 6}), scheduler=factory)
    with pytest.raises(RunDirError, match="your scheduler factory takes the total steps"):
        fit(TrainConfig(**{**own, "max_steps": 14}), scheduler=factory)
    const = dict(cfg, run_dir=str(tmp_path / "const"))
    fit(TrainConfig(**{**const, "max_steps": 6}))
    with pytest.raises(
        RunDirError, match=r"trained 6 steps, past the new horizon \(max_steps 6 -> 3\); keep --max-steps"
    ):
        fit(TrainConfig(**{**const, "max_steps": 3}))


def test_a_default_run_dir_that_cannot_go_on_leaves_a_new_run_beside_it(tmp_path, monkeypatch, capsys):
    """Review finding: with the recipes' onecycle, --epochs 1 then 2 in a default run dir was refused, where
    a run dir named by its horizon had trained a new run beside it; now the next free one trains it."""
    monkeypatch.chdir(tmp_path)
    cfg = {**BASE, "nproc": "1", "schedule": "onecycle"}
    one = fit(TrainConfig(**{**cfg, "epochs": 1}))
    capsys.readouterr()
    two = fit(TrainConfig(**{**cfg, "epochs": 2}))
    assert two.run_dir == one.run_dir.with_name(one.run_dir.name + "-2") and two["steps"] == 8
    assert "holds this run at another horizon (epochs 1 -> 2), and it cannot be trained to" in capsys.readouterr().out


def test_a_run_dir_named_with_its_horizon_by_an_older_ddpkit_is_still_found(tmp_path, monkeypatch):
    """Before 0.4 the default name's hash covered epochs and max_steps; a rerun after the upgrade finds that
    run dir (here: --reuse-finished returns its result) instead of starting a new run beside it."""
    a = TrainConfig(dataset="mnist", epochs=1).filled()
    b = dataclasses.replace(a, epochs=5, max_steps=7)
    assert a.named().run_dir == b.named().run_dir  # the name now: without the horizon
    assert a.named(horizon=True).run_dir != b.named(horizon=True).run_dir  # the older name: with it

    monkeypatch.chdir(tmp_path)
    cfg = TrainConfig(**{**BASE, "epochs": 1}, nproc="1", reuse_finished=True)
    first = fit(cfg)
    older = first.run_dir.with_name(first.run_dir.name + "-older")
    first.run_dir.rename(older)  # where an older ddpkit left it (the fallback computes the name; redirected here)
    real = TrainConfig.named
    monkeypatch.setattr(
        TrainConfig,
        "named",
        lambda self, horizon=False: dataclasses.replace(self, run_dir=str(older)) if horizon else real(self, horizon),
    )
    again = fit(cfg)
    assert again.run_dir == older and again.summary == first.summary


def test_a_run_killed_after_its_cut_short_epochs_snapshot_ends_it_as_it_would_have(tmp_path):
    """Review finding: a --max-steps run's last snapshot is taken mid-epoch, before the epoch's end; killed
    between the two (here: summary.json and model.pt removed, as a kill in the final evaluation leaves it),
    the rerun went straight to the end, with no train figures for the epoch. It now ends that epoch first."""
    run = tmp_path / "r"
    cfg = TrainConfig(**BASE, nproc="1", max_steps=6, run_dir=str(run))
    first = fit(cfg)
    for name in ("summary.json", "model.pt"):
        (run / name).unlink()
    again = fit(cfg)
    for key in ("steps", "final_train_loss", "test_loss"):
        assert again[key] == first[key], key
    epochs = [r for r in map(json.loads, (run / "metrics.jsonl").read_text().splitlines()) if r["event"] == "epoch"]
    assert [r["epoch"] for r in epochs] == [0, 1]  # the cut-short epoch's record, once
