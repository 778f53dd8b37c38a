"""ddpkit bench on gloo: the three files, the keys, the plot; comm hooks, ZeRO."""

from __future__ import annotations

import json

import pytest
import torch
from clirun import run_cli
from user_code import RegressionMLP, mse, regression_data

from ddpkit import TrainConfig, Trainer
from ddpkit.tools.check import FLOOR


@pytest.mark.multiprocess
def test_bench_at_world_1_and_2_writes_json_table_and_plot(tmp_path):
    out = tmp_path / "bench"
    proc = run_cli(
        "bench",
        "--nproc",
        "1,2",
        "--model",
        "mlp",
        "--dataset",
        "synthetic",
        "--synthetic-shape",
        "1,16,16",
        "--synthetic-size",
        "4000",
        "--batch-size",
        "32",
        "--steps",
        "40",
        "--window",
        "5",
        "--device",
        "cpu",
        "--gpu-step-ms",
        "6.7",
        "--out",
        str(out),
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rep = json.loads((out / "bench.json").read_text())
    rows = {r["world_size"]: r for r in rep["rows"]}
    assert set(rows) == {1, 2} and rows[2]["global_batch"] == 64  # weak scaling: per-rank batch kept
    for key in ("samples_per_s", "step_s", "speedup", "efficiency", "predicted", "prediction_error"):
        assert key in rows[2], key
    assert rows[2]["step_s"]["windows"] == 7  # 8 windows, the first (20% rounded down, at least 1) dropped
    assert "compute_step_s" in rows[2] and rows[2]["comm_s"] >= 0
    assert rows[1]["speedup"] == 1.0 and rep["link"]["busbw"] > 0
    assert [p["world"] for p in rep["predictions"]["h100-nvlink"]] == [1, 2, 4, 8]
    table = (out / "bench.md").read_text()
    assert "| world | global batch | samples/s" in table and "Predicted from the world-1 step with h100-nvlink" in table
    png = (out / "scaling.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 20_000


COMMON = dict(
    device="cpu", batch_size=32, epochs=1, lr=0.05, progress=False, num_workers=0, dtype="float64", momentum=0.9
)


@pytest.mark.multiprocess
@pytest.mark.parametrize("hook", ["bf16", "fp16", "powersgd"])
def test_each_comm_hook_trains(tmp_path, hook):
    torch.manual_seed(0)
    result = Trainer(
        TrainConfig(nproc="2", comm_hook=hook, run_dir=str(tmp_path / hook), **COMMON),
        model=RegressionMLP(hidden=64),
        train_data=regression_data(512, 0),
        test_data=regression_data(64, 1),
        loss_fn=mse,
    ).fit()
    assert result["test_loss"] < 3.0  # the targets' variance is ~14: it learned through compressed gradients


@pytest.mark.multiprocess
def test_zero_matches_the_plain_optimizer_within_the_checks_tolerance(tmp_path):
    states = {}
    for zero in (False, True):
        torch.manual_seed(0)
        result = Trainer(
            TrainConfig(nproc="2", zero=zero, save_every_steps=3, run_dir=str(tmp_path / str(zero)), **COMMON),
            model=RegressionMLP(dtype=torch.float64),
            train_data=regression_data(256, 0, torch.float64),
            test_data=regression_data(64, 1, torch.float64),
            loss_fn=mse,
        ).fit()
        states[zero] = torch.load(result.run_dir / "model.pt", weights_only=True)
    for name, ref in states[False].items():
        diff = (ref - states[True][name]).abs().max().item() / ref.abs().max().item()
        assert diff <= FLOOR["float64"], name


def test_windows_cut_short_by_an_epoch_end_are_left_out(tmp_path):
    """Regression: an epoch's last step logs too, and its short window (1-2 steps) counted as a
    window, so bench.md's "windows of N" was not what was timed."""
    from ddpkit.errors import ConfigError
    from ddpkit.tools.bench import windows

    path = tmp_path / "metrics.jsonl"
    steps = [(5, 100.0), (10, 100.0), (12, 10.0), (17, 50.0), (22, 50.0)]  # 12: the end of a 12-step epoch
    path.write_text("".join(json.dumps({"event": "step", "step": s, "samples_per_s": r}) + "\n" for s, r in steps))
    assert windows(path, 64, 5) == [64 / 100.0, 64 / 50.0, 64 / 50.0]  # 4 whole windows, the first dropped
    path.write_text(json.dumps({"event": "step", "step": 3, "samples_per_s": 1.0}) + "\n")
    with pytest.raises(ConfigError, match="fewer steps than a window"):
        windows(path, 64, 5)
