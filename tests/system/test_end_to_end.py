"""Real multi-process training on real MNIST through the CLI, ddpkit's launcher and torchrun."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest
import torch
from clirun import read_jsonl, run_cli, start_python

pytestmark = pytest.mark.multiprocess  # every test here starts processes

# Tiny runs (40 steps an epoch) want a gentler peak lr than the full-MNIST recipe.
SMALL = [
    "--dataset",
    "mnist",
    "--recipe",
    "mnist",
    "--limit-train",
    "4000",
    "--batch-size",
    "100",
    "--lr",
    "0.05",
    "--log-every",
    "10",
    "--no-progress",
    "--no-plots",
]  # plots are tested in test_loggers.py; here they would add 1.5 s a run


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("e2e") / "run"
    proc = run_cli("train", *SMALL, "--nproc", "2", "--epochs", "2", "--run-dir", str(run_dir))
    assert proc.returncode == 0, proc.stderr
    return run_dir, proc


@pytest.mark.slow
def test_two_process_gloo_train_writes_a_complete_run_dir(trained):
    run_dir, proc = trained
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["world_size"] == 2 and summary["backend"] == "gloo" and summary["device_type"] == "cpu"
    assert summary["test_samples"] == 10000 and summary["global_batch_size"] == 100
    assert summary["steps"] == 2 * (4000 // 2 // 50)
    assert summary["test_accuracy"] > 0.9
    for key in (
        "epochs",
        "train_time_s",
        "samples_per_s",
        "final_train_loss",
        "test_loss",
        "peak_memory_mb",
        "dataset",
        "model",
    ):
        assert key in summary
    # launch to first step, and rank 0's last write to the launcher regaining control (written by the launcher)
    assert 0 < summary["startup_s"] < 60 and 0 <= summary["teardown_s"] < 10
    assert "[start] world_size=2" in proc.stdout and proc.stdout.count("[summary]") == 1  # rank 0 only
    state = torch.load(run_dir / "model.pt", weights_only=True)
    assert not any(k.startswith("module.") for k in state) and "fc.weight" in state
    events = read_jsonl(run_dir / "metrics.jsonl")
    assert [e["epoch"] for e in events if e["event"] == "epoch"] == [0, 1]
    steps = [e for e in events if e["event"] == "step"]
    assert steps and all(e["loss"] > 0 and e["samples_per_s"] > 0 for e in steps)
    assert len(list((run_dir / "checkpoints").glob("snapshot-*.pt"))) >= 1
    assert "[optim]" in (run_dir / "config.toml").read_text()


@pytest.mark.slow
def test_eval_recomputes_the_same_accuracy_with_another_world_size(trained):
    run_dir, _ = trained
    proc = run_cli("eval", str(run_dir), "--nproc", "3")
    assert proc.returncode == 0, proc.stderr
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    summary = json.loads((run_dir / "summary.json").read_text())
    assert result["world_size"] == 3 and result["test_samples"] == 10000
    assert result["test_accuracy"] == summary["test_accuracy"]


@pytest.mark.slow
def test_rerunning_a_finished_run_overwrites_nothing(trained):
    run_dir, _ = trained
    before = (run_dir / "summary.json").read_text()
    refused = run_cli("train", *SMALL, "--nproc", "2", "--epochs", "2", "--run-dir", str(run_dir))
    assert refused.returncode != 0 and "holds a finished run, left as it is" in refused.stderr
    assert len(refused.stderr.strip().splitlines()) == 1 and (run_dir / "summary.json").read_text() == before
    proc = run_cli(
        "train", *SMALL, "--nproc", "2", "--epochs", "2", "--run-dir", str(run_dir), "--log", "csv", "--reuse-finished"
    )
    assert proc.returncode == 0 and "already holds this finished run" in proc.stdout
    assert "--log csv applies to runs that train" in proc.stdout  # --log alone does not make a new run
    accuracy = json.loads(before)["test_accuracy"]
    summary_line = next(line for line in proc.stdout.splitlines() if line.startswith("[summary]"))
    assert f"test_accuracy={accuracy:.4g}" in summary_line  # the result it returns, shown (it was not)
    assert (run_dir / "summary.json").read_text() == before and not (run_dir / "metrics.csv").exists()


@pytest.mark.slow
def test_a_different_config_is_refused_and_nothing_changes(trained):
    run_dir, _ = trained
    before = (run_dir / "config.toml").read_text()
    proc = run_cli("train", *SMALL, "--nproc", "2", "--epochs", "2", "--seed", "7", "--run-dir", str(run_dir))
    assert proc.returncode == 2 and "different config (seed: 0 -> 7)" in proc.stderr, proc.stderr
    assert (run_dir / "config.toml").read_text() == before
    # a longer horizon under the recipe's onecycle schedule: refused too, saying why (tests/system/test_horizon.py)
    proc = run_cli("train", *SMALL, "--nproc", "2", "--epochs", "3", "--run-dir", str(run_dir))
    assert proc.returncode == 2 and "it cannot be trained to it: the onecycle lr schedule spans" in proc.stderr
    assert (run_dir / "config.toml").read_text() == before


@pytest.mark.slow
def test_under_real_torchrun_with_sync_bn(tmp_path):
    run_dir = tmp_path / "run"
    proc = run_cli(
        "--nproc-per-node",
        "2",
        "-m",
        "ddpkit",
        "train",
        *SMALL,
        "--epochs",
        "1",
        "--sync-bn",
        "--run-dir",
        str(run_dir),
        module="torch.distributed.run",
    )
    assert proc.returncode == 0, proc.stderr
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["world_size"] == 2 and summary["test_samples"] == 10000 and summary["test_accuracy"] > 0.5
    assert proc.stdout.count("[summary]") == 1


@pytest.mark.slow
def test_a_stopped_run_continues_at_the_next_epoch(tmp_path):
    run_dir = tmp_path / "run"
    args = [sys.executable, "-m", "ddpkit", "train", *SMALL, "--nproc", "2", "--epochs", "3", "--run-dir", str(run_dir)]
    proc = start_python(*args[1:], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.time() + 120
    while not list((run_dir / "checkpoints").glob("snapshot-*.pt")) and time.time() < deadline:
        time.sleep(0.05)
    os.killpg(proc.pid, signal.SIGKILL)  # the whole job: launcher and workers
    proc.wait()
    assert not (run_dir / "summary.json").exists(), "the run finished before it could be stopped"
    again = run_cli(*args[3:])  # args: python -m ddpkit ...
    assert again.returncode == 0, again.stderr
    events = read_jsonl(run_dir / "metrics.jsonl")
    starts = [e for e in events if e["event"] == "start"]
    assert starts[-1]["resumed_at_step"] == starts[0]["steps_per_epoch"]  # right after epoch 0
    epochs = [e["epoch"] for e in events if e["event"] == "epoch"]
    assert epochs[0] == 0 and epochs[-2:] == [1, 2]
    assert json.loads((run_dir / "summary.json").read_text())["steps"] == 3 * starts[0]["steps_per_epoch"]
