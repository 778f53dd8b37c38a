"""ddpkit bench on gloo: the three files, the keys, the plot; comm hooks, ZeRO."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
from clirun import bench_finished, run_cli
from user_code import RegressionMLP, mse, regression_data

from ddpkit import TrainConfig, Trainer
from ddpkit.errors import ConfigError
from ddpkit.tools.check import FLOOR


@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.parametrize("strategy", ["ddp", "fsdp2"])
def test_bench_at_world_1_and_2_writes_json_table_and_plot(tmp_path, strategy):
    out = tmp_path / "bench"
    proc = run_cli(
        "bench",
        "--strategy",
        strategy,
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
    rep = bench_finished(proc, out / "bench.json")
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
    # the parameters each rank held: the whole at every world under DDP, a half at world 2 under FSDP2
    held = {n: rows[n]["memory"]["param_mb_per_rank"] for n in rows}
    assert {rows[n]["memory"]["strategy"] for n in rows} == {strategy} and held[1] > 0
    assert held[2] == pytest.approx(held[1] / (2 if strategy == "fsdp2" else 1), rel=0.01)
    assert f"Parameters held per rank ({strategy}): " in table
    png = (out / "scaling.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 20_000


COMMON = dict(
    device="cpu", batch_size=32, epochs=1, lr=0.05, progress=False, num_workers=0, dtype="float64", momentum=0.9
)


@pytest.mark.slow
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


@pytest.mark.slow
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
    from ddpkit.tools.bench import windows

    path = tmp_path / "metrics.jsonl"
    steps = [(5, 100.0), (10, 100.0), (12, 10.0), (17, 50.0), (22, 50.0)]  # 12: the end of a 12-step epoch
    path.write_text("".join(json.dumps({"event": "step", "step": s, "samples_per_s": r}) + "\n" for s, r in steps))
    assert windows(path, 64, 5) == [64 / 100.0, 64 / 50.0, 64 / 50.0]  # 4 whole windows, the first dropped
    path.write_text(json.dumps({"event": "step", "step": 3, "samples_per_s": 1.0}) + "\n")
    with pytest.raises(ConfigError, match="fewer steps than a window"):
        windows(path, 64, 5)


BENCH_MLP = (
    "bench",
    "--nproc",
    "1,2",
    "--model",
    "mlp",
    "--dataset",
    "synthetic",
    "--synthetic-shape",
    "1,8,8",
    "--synthetic-size",
    "4000",
    "--batch-size",
    "16",
    "--steps",
    "20",
    "--window",
    "5",
    "--device",
    "cpu",
)


@pytest.mark.slow
@pytest.mark.multiprocess
def test_bench_under_a_busy_loop_reports_the_load_and_marks_its_figures_invalid(tmp_path):
    """Under load the world-1 run's threads collapsed and bench printed 7.63x speedup, 381%
    efficiency as valid, exit 0: it did not look at the machine."""
    out = tmp_path / "bench"
    busy = subprocess.Popen([sys.executable, "-c", "while True: pass"])  # one core's worth, not bench's own
    try:
        proc = run_cli(*BENCH_MLP, "--out", str(out))
    finally:
        busy.kill()
        busy.wait()
    assert proc.returncode == 1, proc.stdout[-3000:] + proc.stderr[-3000:]
    rep = json.loads((out / "bench.json").read_text())
    assert not rep["valid"] and rep["conditions_before"]["other_processes_cores"] > 0.5
    for row in rep["rows"]:
        assert row["conditions"]["other_processes_cores"] > 0.5 and not row["valid"]
        assert row["conditions"]["threads_per_rank"] == max(1, os.sched_getaffinity(0).__len__() // row["world_size"])
    assert "other processes are using" in proc.stderr and "the results are not valid" in proc.stderr
    table = (out / "bench.md").read_text()
    assert "**NOT VALID**" in table and "INVALID" in table.split("| world |")[1]


def test_an_efficiency_above_100_percent_or_a_starved_world_1_run_is_never_valid():
    from ddpkit.tools.bench import judge

    def row(n, efficiency, busy):
        return {"world_size": n, "efficiency": efficiency, "conditions": {"other_processes_cores": busy}}

    rep = judge({"rows": [row(1, 1.0, 0.0), row(2, 3.81, 0.0)]})  # the reported 7.63x at world 2
    assert not rep["valid"] and rep["rows"][0]["valid"] and "381% is above 100%" in rep["rows"][1]["invalid"][0]
    rep = judge({"rows": [row(1, 1.0, 1.2), row(2, 0.9, 0.0)]})  # world 1 starved: world 2's speedup too
    assert [r["valid"] for r in rep["rows"]] == [False, False]
    assert "relative to the world-1 run" in rep["rows"][1]["invalid"][0]
    assert judge({"rows": [row(1, 1.0, 0.02), row(2, 0.93, None)]})["valid"]  # quiet, or unmeasured


@pytest.mark.multiprocess
@pytest.mark.parametrize(
    "flags,message",
    [
        (("--gpu-step-ms", "-1"), "--gpu-step-ms: expected a number > 0; got '-1'"),
        (("--gpu-step-ms", "nan"), "--gpu-step-ms: expected a number > 0; got 'nan'"),
        (("--steps", "0"), "--steps: expected an integer > 0; got '0'"),
        (("--latency-us", "-5"), "--latency-us: expected a number >= 0; got '-5'"),
    ],
)
def test_bench_refuses_a_bad_number_in_one_line(flags, message):
    proc = run_cli("bench", "--predict-only", "--gpu-step-ms", "5", *flags)
    assert proc.returncode == 2 and message in proc.stderr and "Traceback" not in proc.stderr, proc.stderr


@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.parametrize("command", ["bench", "check"])
def test_an_output_path_that_cannot_be_written_is_refused_before_any_run(tmp_path, command):
    """check --json and bench --out on a path that cannot be written ran everything, then ended in a
    30-line traceback."""
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    flag = "--out" if command == "bench" else "--json"
    args = BENCH_MLP if command == "bench" else ("check", "--model", "mlp", "--dataset", "synthetic", "--device", "cpu")
    proc = run_cli(*args, flag, str(blocker / "sub" / "out"))
    assert proc.returncode == 2, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert f"error: {flag} {blocker}/sub/out: {blocker} is a file, not a directory" in proc.stderr, proc.stderr
    assert "Traceback" not in proc.stderr and "[summary]" not in proc.stdout  # nothing ran


def test_the_report_names_the_model_it_measured():
    """A timm model benchmarked through the Python API was reported as the config's default, resnet18."""
    from ddpkit.tools.bench import predict_only

    rep = predict_only(TrainConfig(device="cpu", batch_size=32), 0.005, model=RegressionMLP())
    assert rep["config"]["model"] == "user_code.RegressionMLP"
    with pytest.raises(ConfigError, match="--gpu-step-ms must be a positive number"):
        predict_only(TrainConfig(device="cpu", batch_size=32), -0.001, model=RegressionMLP())
