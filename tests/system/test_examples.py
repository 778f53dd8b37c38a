"""Every example runs as a user would run it (``python examples/NAME.py``), and does what it says."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import time
from pathlib import Path

import pytest
import torch
from clirun import ROOT, run_cli, run_python, start_python
from once import once

pytestmark = pytest.mark.multiprocess  # every test here starts processes


def run_example(name: str, tmp_path, *args: str) -> str:
    proc = run_python(ROOT / "examples" / f"{name}.py", *args, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr
    return proc.stdout


def number(pattern: str, text: str) -> float:
    match = re.search(pattern, text)
    assert match, f"{pattern!r} not in output:\n{text[-2000:]}"
    return float(match.group(1))


@pytest.mark.slow
def test_toy_mlp_prints_per_rank_and_exact_global_accuracy(tmp_path):
    out = run_example("toy_mlp", tmp_path)
    assert re.search(r"rank 0: train accuracy [\d.]+ .* test accuracy 1\.00 \(1 of 2 test samples\)", out)
    assert re.search(r"rank 1: train accuracy [\d.]+ .* test accuracy 1\.00 \(1 of 2 test samples\)", out)
    assert number(r"global: train accuracy ([\d.]+) over all 5 training samples", out) >= 0.8
    assert number(r"test accuracy ([\d.]+) over 2 test samples", out) == 1.0


@pytest.mark.slow
def test_regression_beats_the_mean_predictor_by_far(tmp_path):
    out = run_example("regression", tmp_path)
    mse, baseline = number(r"test MSE ([\d.]+)", out), number(r"training mean: ([\d.]+)", out)
    assert mse < 0.01 * baseline
    assert 0 < number(r"test MAE ([\d.]+) over 1000 samples", out) < 0.3


@pytest.mark.slow
def test_char_gpt_ends_well_below_the_unigram_baseline_and_writes_text(tmp_path):
    out = run_example("char_gpt", tmp_path, "--amp", "none")  # fp32: the same maths on every CPU kind
    loss, unigram = number(r"test loss ([\d.]+) nats/char", out), number(r"unigram baseline ([\d.]+)", out)
    assert loss < unigram - 0.5, out[-1000:]
    assert re.search(r"sample: 'The .{150,}'", out)
    assert "grad_accum=2" in out  # two micro-batches per step


@pytest.mark.slow
def test_custom_images_learns_the_generated_image_folder(tmp_path):
    out = run_example("custom_images", tmp_path, str(tmp_path / "stripes"))
    assert sorted(p.name for p in (tmp_path / "stripes" / "train").iterdir()) == ["diagonal", "horizontal", "vertical"]
    assert number(r"test accuracy ([\d.]+) over 150 images", out) > 0.7


@pytest.mark.slow
def test_tutorial_trainer_trains_prints_its_epochs_and_resumes_by_rerunning(tmp_path):
    whole, split = tmp_path / "whole", tmp_path / "split"
    whole.mkdir(), split.mkdir()
    out = run_example("tutorial_trainer", whole, "3", "1")
    for epoch in range(3):
        for rank in range(2):
            assert f"[rank{rank}] Epoch {epoch} | Batchsize: 32 | Steps: 32" in out  # 2048 samples, 2 ranks, 32 each
        assert f"Epoch {epoch} | Training snapshot saved at its end in runs/tutorial/checkpoints" in out
    losses = [float(x) for x in re.findall(r"\[epoch\] step=\d+ epoch=\d+ loss=([\d.]+)", out)]
    assert len(losses) == 3 and losses[2] < losses[0], out  # MSE falls (the tutorial's cross-entropy stays 0)
    final = number(r"final loss ([\d.]+) \(epoch 2, mean over both ranks\)", out)
    assert abs(final - losses[2]) < 1e-3
    assert "run dir: runs/tutorial" in out
    assert (whole / "runs/tutorial/checkpoints/snapshot-000000096.pt").is_file()

    # Two epochs, then the same script asked for three: it resumes at the snapshot and ends where the
    # uninterrupted run ended (the loss printed to 6 digits; the GAN's test below compares weights).
    first = run_example("tutorial_trainer", split, "2", "1")
    assert "Epoch 2" not in first and "final loss" in first
    second = run_example("tutorial_trainer", split, "3", "1")
    assert "resumed_at_step=64" in second and "Epoch 0" not in second and "Epoch 1" not in second
    assert re.search(r"final loss [\d.]+ .*", second).group(0) == re.search(r"final loss [\d.]+ .*", out).group(0)


GAN_RUN = ("--steps", "600", "--save-every", "100")  # the example's defaults, spelled out: the kill test needs them


@pytest.fixture(scope="module")
def gan_uninterrupted(tmp_path_factory):
    """One uninterrupted GAN run, shared by the tests below on any worker (once per pytest run:
    tests/helpers/once.py): its output and rank 0's final weights."""

    def make(where: Path) -> None:
        (where / "stdout.txt").write_text(run_example("gan", where, *GAN_RUN, "--save-weights", "final.pt"))

    where = once(tmp_path_factory, "gan", make)
    return (where / "stdout.txt").read_text(), torch.load(where / "final.pt")


@pytest.mark.slow
def test_gan_trains_both_models_and_gets_near_the_ring(gan_uninterrupted):
    out, weights = gan_uninterrupted
    assert len(re.findall(r"\[step\] step=\d+ epoch=0 loss_d=[\d.]+ loss_g=[\d.]+", out)) == 6  # log_every 100
    # Near an equilibrium D cannot tell real from fake: its loss near 2 ln 2, G's near ln 2 (not collapsed).
    assert 0.8 < number(r"step 600: loss_d ([\d.]+)", out) < 1.6
    assert 0.4 < number(r"loss_g ([\d.]+)", out) < 1.5
    assert 1.5 < number(r"generated radius ([\d.]+) \(target 2\.0\)", out) < 2.5
    assert 0.0 < number(r"spread ([\d.]+)", out) < 0.6
    assert "run dir: runs/gan" in out
    assert set(weights) == {"G", "D"} and weights["G"]["4.weight"].shape == (2, 32)


@pytest.mark.slow
def test_gan_sigkilled_mid_run_then_rerun_ends_with_the_uninterrupted_weights_bitwise(tmp_path, gan_uninterrupted):
    _, expected = gan_uninterrupted
    command = [str(ROOT / "examples" / "gan.py"), *GAN_RUN, "--save-weights", "final.pt"]
    snapshots = tmp_path / "runs" / "gan" / "checkpoints"
    # Its own session: the launcher, its forkserver and both workers are one process group, killed at once.
    proc = start_python(*command, cwd=tmp_path, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 120
        while not list(snapshots.glob("snapshot-*.pt")) and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.02)
        assert proc.poll() is None, f"the run ended before it could be killed:\n{proc.stdout.read()[-2000:]!r}"
        assert list(snapshots.glob("snapshot-*.pt")), "no snapshot within 120 s"
        os.killpg(proc.pid, signal.SIGKILL)
        assert proc.wait(timeout=30) == -signal.SIGKILL
        gone = time.monotonic() + 30
        while time.monotonic() < gone:  # the workers too, before the rerun reads the run dir
            try:
                os.killpg(proc.pid, 0)
            except ProcessLookupError:
                break
            time.sleep(0.05)
        else:
            raise AssertionError("a process of the killed run outlived SIGKILL")
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        proc.stdout.close()
    left = sorted(int(p.stem.split("-")[1]) for p in snapshots.glob("snapshot-*.pt"))
    assert left and left[-1] < 600 and not (tmp_path / "final.pt").exists()

    out = run_example("gan", tmp_path, *GAN_RUN, "--save-weights", "final.pt")
    assert f"resumed_at_step={left[-1]}" in out
    got = torch.load(tmp_path / "final.pt")
    for model in ("G", "D"):
        assert expected[model].keys() == got[model].keys()
        for name, tensor in expected[model].items():
            assert torch.equal(got[model][name], tensor), f"{model}.{name} differs from the uninterrupted run's"


@pytest.mark.slow
def test_live_recovery_trains_as_replica_groups_to_what_plain_ddp_trains(tmp_path):
    """examples/live_recovery.py under ``ddpkit run --replicas 2`` and ``--nproc 2``: the same test accuracy
    (tests/system/test_loop_replicas.py kills a group and compares weights bitwise). To the digit: under DDP rank 1's
    BatchNorm statistics are its own after the last step's forward (DDP broadcasts rank 0's at the start of each),
    and ``loop.evaluate`` evaluates with rank 0's on every rank, as each replica group holds share 0's (regression:
    rank 1 evaluated its half of the test set with its own, and the accuracies were held only within 2e-4)."""
    script = [str(ROOT / "examples" / "live_recovery.py"), "--steps", "40"]
    said = []
    for launch in (["--replicas", "2"], ["--nproc", "2"]):
        where = tmp_path / launch[0].strip("-")  # each its own runs/live-loop
        where.mkdir()
        done = run_cli("run", *launch, *script, cwd=where)
        assert done.returncode == 0 and "Traceback" not in done.stderr, done.stderr[-3000:]
        said.append(re.search(r"step 40: test accuracy ([\d.]+)", done.stdout).group(1))
    assert said[0] == said[1] and float(said[0]) > 0.8, said  # 10,000 test images
