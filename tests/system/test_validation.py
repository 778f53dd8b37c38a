"""A validation split, evaluation every N steps, the best checkpoint and early stopping (issue 35), on
``Trainer`` and the CLI: the split and its cadence, what is refused before launch, and a char-GPT-style
script killed twice that ends as an uninterrupted run does."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from clirun import ROOT, WAIT_S, read_jsonl, run_python, start_python
from user_code import RegressionMLP, mse, regression_data
from zygote import Started

from ddpkit import TrainConfig, Trainer
from ddpkit.config import early_stop_rule, watched_metric
from ddpkit.data.datasets import hold_out
from ddpkit.data.types import DataSplits, TensorData
from ddpkit.errors import ConfigError, DataError
from ddpkit.train.selection import Watch

SCRIPT = str(ROOT / "tests" / "helpers" / "gpt_trainer.py")
SMALL = dict(device="cpu", batch_size=16, epochs=2, lr=0.05, progress=False, num_workers=0, plots=False)


# ---------------------------------------------------------------- the parts, in one process
def test_the_held_out_split_is_seeded_disjoint_and_keeps_the_order():
    data = TensorData([torch.arange(100.0), torch.arange(100)])
    splits = hold_out(DataSplits(data, data, None), TrainConfig(val_fraction=0.2, seed=3))
    train, val = splits.train.tree[1].tolist(), splits.val.tree[1].tolist()
    assert len(val) == 20 and len(train) == 80 and sorted(train + val) == list(range(100))
    assert train == sorted(train) and val == sorted(val)  # each in the data's own order
    again = hold_out(DataSplits(data, data, None), TrainConfig(val_fraction=0.2, seed=3))
    assert again.val.tree[1].tolist() == val  # the same at every call: it depends on (seed, fraction) alone
    other = hold_out(DataSplits(data, data, None), TrainConfig(val_fraction=0.2, seed=4))
    assert other.val.tree[1].tolist() != val
    assert hold_out(DataSplits(data, data, None), TrainConfig()).val is None
    with pytest.raises(DataError, match="val_data is passed and --val-fraction"):
        hold_out(DataSplits(data, data, None, val=data), TrainConfig(val_fraction=0.2))
    with pytest.raises(DataError, match="holds out 0: it must leave at least one sample on each side"):
        hold_out(DataSplits(TensorData([torch.arange(3.0)]), data, None), TrainConfig(val_fraction=0.1))


def test_a_watch_keeps_the_best_by_its_direction_and_counts_its_patience():
    low = Watch("val_loss", "min", patience=2)
    assert low.update({"val_loss": 2.0}, 1) and low.update({"val_loss": 1.0}, 2)
    assert not low.update({"val_loss": 1.0}, 3)  # equal is no improvement
    assert not low.update({"val_loss": float("nan")}, 4)  # a NaN is never a best, and counts
    assert (low.value, low.step, low.since, low.exhausted) == (1.0, 2, 2, True)
    high = Watch("val_accuracy", "max")
    assert high.update({"val_accuracy": 0.5}, 1) and not high.update({"val_accuracy": 0.4}, 2)
    assert not high.exhausted  # patience 0: never stops
    assert watched_metric("val_loss", "--keep-best") == ("val_loss", "min")
    assert watched_metric("val_accuracy", "--keep-best") == ("val_accuracy", "max")
    assert watched_metric("val_accuracy:min", "--keep-best") == ("val_accuracy", "min")
    assert early_stop_rule("val_loss:5") == ("val_loss", "min", 5)
    assert early_stop_rule("val_f1:3:max") == ("val_f1", "max", 3)
    with pytest.raises(ConfigError, match="the test set only reports, once, at the end; it never chooses"):
        TrainConfig(keep_best="test_accuracy").resolved()
    with pytest.raises(ConfigError, match="give METRIC:PATIENCE, e.g. val_loss:5"):
        TrainConfig(early_stop="val_loss").resolved()


def test_choosing_without_a_validation_split_is_one_line_before_launch(tmp_path):
    args = dict(model=RegressionMLP(), train_data=regression_data(64, 0), test_data=regression_data(16, 1), loss_fn=mse)
    with pytest.raises(ConfigError, match=r"^--eval-every-steps, --keep-best need a validation split.*--val-fraction"):
        Trainer(
            TrainConfig(**SMALL, eval_every_steps=2, keep_best="val_loss", run_dir=str(tmp_path / "a")), **args
        ).fit()
    with pytest.raises(ConfigError, match="this run's validation metrics are val_loss; name one of them"):
        Trainer(
            TrainConfig(**SMALL, val_fraction=0.25, keep_best="val_accuracy", run_dir=str(tmp_path / "b")), **args
        ).fit()
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()


def test_join_and_a_step_cadence_are_refused_together():
    """Review finding: under --join the step loop skips every collective of its own until all ranks have
    joined, so --eval-every-steps never evaluated and --keep-best/--early-stop did nothing, silently."""
    with pytest.raises(ConfigError, match="--join cannot be combined with --eval-every-steps"):
        TrainConfig(join=True, eval_every_steps=5).resolved()


def test_a_validation_split_is_evaluated_by_step_and_the_test_set_once(tmp_path):
    """val_data from Python; every 3 steps: eval records by step, the epoch records carry the validation
    figures of their step when it has one, summary.json the test set's (evaluated once, at the end)."""
    torch.manual_seed(0)
    run_dir = str(tmp_path / "r")
    cfg = TrainConfig(
        **SMALL, nproc="1", eval_every_steps=3, keep_best="val_loss", log="csv,tensorboard", run_dir=run_dir
    )
    result = Trainer(
        cfg,
        model=RegressionMLP(),
        train_data=regression_data(64, 0),
        test_data=regression_data(16, 1),
        val_data=regression_data(24, 2),
        loss_fn=mse,
    ).fit()
    records = read_jsonl(result.run_dir / "metrics.jsonl")
    evals = [r for r in records if r["event"] == "eval"]
    assert [r["step"] for r in evals] == [3, 6]  # 8 steps: every 3rd, not at the epoch ends (4, 8)
    assert all(r["val_samples"] == 24 and "test_loss" not in r for r in evals)
    assert not any("test_loss" in r for r in records if r["event"] == "epoch")
    best = torch.load(result.run_dir / "best.pt", weights_only=True)
    chosen = min(evals, key=lambda r: r["val_loss"])
    assert (best["metric"], best["value"], best["step"]) == ("val_loss", chosen["val_loss"], chosen["step"])
    assert result["best"] == {"metric": "val_loss", "value": chosen["val_loss"], "step": chosen["step"]}
    assert result["test_samples"] == 16 and result["final_val_loss"] == evals[-1]["val_loss"]
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator  # TensorBoard's reader

    tb = EventAccumulator(str(result.run_dir / "tensorboard"), size_guidance={"scalars": 0})
    tb.Reload()
    logged = [(e.step, e.value) for e in tb.Scalars("eval/val_loss")]
    assert logged == [(r["step"], pytest.approx(r["val_loss"])) for r in evals]
    header = (result.run_dir / "metrics.csv").read_text().splitlines()[0].split(",")
    assert "val_loss" in header


# ---------------------------------------------------------------- a GPT-style script, killed twice
def gpt_spec(tmp_path: Path, run: str, **config) -> dict:
    base = dict(
        nproc="2",
        device="cpu",
        batch_size=64,
        epochs=3,
        dtype="float64",
        progress=False,
        num_workers=0,
        log_every=1,
        val_fraction=0.1,
        eval_every_steps=3,
        keep_best="val_loss",
        early_stop="val_loss:3",
        plots=False,
    )
    return {
        "run_dir": str(tmp_path / run),
        "tokens": str(tmp_path / "tokens.bin"),
        "flat_after": 12,
        "sleep_s": 0.05,
        "config": {**base, **config},
    }


def start(spec: dict) -> Started:
    return start_python(SCRIPT, json.dumps(spec))


def signal_at(spec: dict, step: int, sig: int) -> subprocess.Popen:
    """Start the script and send ``sig`` to its process group once a step record reaches ``step``."""
    proc, path = start(spec), Path(spec["run_dir"]) / "metrics.jsonl"
    deadline = time.monotonic() + 120
    try:
        while time.monotonic() < deadline:
            assert proc.poll() is None, f"run ended early: {proc.communicate()}"
            steps = [r["step"] for r in read_jsonl(path) if r["event"] == "step"] if path.exists() else []
            if steps and steps[-1] >= step:
                (os.kill(proc.pid, sig) if sig == signal.SIGTERM else os.killpg(proc.pid, sig))
                proc.communicate(timeout=WAIT_S)
                return proc
            time.sleep(0.02)
        raise AssertionError("the awaited step never came")
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)


def finish(spec: dict) -> dict:
    done = run_python(SCRIPT, json.dumps(spec))
    assert done.returncode == 0, done.stderr[-3000:]
    run = Path(spec["run_dir"])
    return {
        "summary": json.loads((run / "summary.json").read_text()),
        "evals": [
            {k: v for k, v in r.items() if k != "time"}
            for r in read_jsonl(run / "metrics.jsonl")
            if r["event"] == "eval"
        ],
        "best": torch.load(run / "best.pt", weights_only=True),
        "model": torch.load(run / "model.pt", weights_only=True),
        "output": done.stdout + done.stderr,
    }


@pytest.mark.slow
@pytest.mark.multiprocess
def test_a_gpt_script_on_trainer_keeps_its_best_and_patience_across_sigterm_and_sigkill(tmp_path):
    """Issue 35's done-when: evaluation every 3 steps on a held-out split, the best checkpoint, and an early
    stop on the plateau (the script's lr is 0 after step 12). Stopped by SIGTERM at step 13 (patience
    partly counted) and, in another run, SIGKILLed at step 16 (a snapshot every 5 steps: it resumes at 15),
    each rerun ends where the uninterrupted run ends: the same early stop, best (value, step and weights),
    validation records and final weights, bit for bit, at world 2."""
    tokens = (np.arange(20000) * 7 + np.random.default_rng(0).integers(0, 3, 20000)) % 32  # learnable, noisy
    tokens.astype(np.uint16).tofile(tmp_path / "tokens.bin")
    whole = finish(gpt_spec(tmp_path, "whole"))
    s = whole["summary"]
    assert s["early_stopped_at_step"] is not None and s["steps"] == s["early_stopped_at_step"] < 3 * 35
    assert f"ddpkit: early stop at step {s['steps']}: val_loss has not improved for 3 evaluations" in whole["output"]
    assert s["best"]["step"] <= 12 < s["steps"]  # the best before the plateau, the stop on it

    runs = {}
    term = gpt_spec(tmp_path, "term")
    assert signal_at(term, 13, signal.SIGTERM).returncode == 128 + signal.SIGTERM
    runs["SIGTERM"] = finish(term)
    kill = gpt_spec(tmp_path, "kill", save_every_steps=5)
    assert signal_at(kill, 16, signal.SIGKILL).returncode == -signal.SIGKILL
    runs["SIGKILL"] = finish(kill)
    for how, run in runs.items():
        assert "resumed_at_step=" in run["output"], how
        for key in ("steps", "early_stopped_at_step", "best", "final_val_loss", "test_loss"):
            assert run["summary"][key] == s[key], (how, key)
        assert run["evals"] == whole["evals"], how
        assert (run["best"]["value"], run["best"]["step"]) == (whole["best"]["value"], whole["best"]["step"])
        for name, tensor in whole["best"]["weights"]["model"].items():
            assert torch.equal(run["best"]["weights"]["model"][name], tensor), (how, name)
        for name, tensor in whole["model"].items():
            assert torch.equal(run["model"][name], tensor), (how, name)
