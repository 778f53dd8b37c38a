"""Every example runs as a user would run it (``python examples/NAME.py``), and does what it says."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest
from clirun import ROOT, cli_env

pytestmark = pytest.mark.multiprocess  # every test here starts processes


def run_example(name: str, tmp_path, *args: str) -> str:
    proc = subprocess.run(
        [sys.executable, str(ROOT / "examples" / f"{name}.py"), *args],
        cwd=tmp_path,
        env=cli_env(),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr
    return proc.stdout


def number(pattern: str, text: str) -> float:
    match = re.search(pattern, text)
    assert match, f"{pattern!r} not in output:\n{text[-2000:]}"
    return float(match.group(1))


def test_toy_mlp_prints_per_rank_and_exact_global_accuracy(tmp_path):
    out = run_example("toy_mlp", tmp_path)
    assert re.search(r"rank 0: train accuracy [\d.]+ .* test accuracy 1\.00 \(1 of 2 test samples\)", out)
    assert re.search(r"rank 1: train accuracy [\d.]+ .* test accuracy 1\.00 \(1 of 2 test samples\)", out)
    assert number(r"global: train accuracy ([\d.]+) over all 5 training samples", out) >= 0.8
    assert number(r"test accuracy ([\d.]+) over 2 test samples", out) == 1.0


def test_regression_beats_the_mean_predictor_by_far(tmp_path):
    out = run_example("regression", tmp_path)
    mse, baseline = number(r"test MSE ([\d.]+)", out), number(r"training mean: ([\d.]+)", out)
    assert mse < 0.01 * baseline
    assert 0 < number(r"test MAE ([\d.]+) over 1000 samples", out) < 0.3


def test_char_gpt_ends_well_below_the_unigram_baseline_and_writes_text(tmp_path):
    out = run_example("char_gpt", tmp_path, "--amp", "none")  # fp32: the same maths on every CPU kind
    loss, unigram = number(r"test loss ([\d.]+) nats/char", out), number(r"unigram baseline ([\d.]+)", out)
    assert loss < unigram - 0.5, out[-1000:]
    assert re.search(r"sample: 'The .{150,}'", out)
    assert "grad_accum=2" in out  # two micro-batches per step


def test_custom_images_learns_the_generated_image_folder(tmp_path):
    out = run_example("custom_images", tmp_path, str(tmp_path / "stripes"))
    assert sorted(p.name for p in (tmp_path / "stripes" / "train").iterdir()) == ["diagonal", "horizontal", "vertical"]
    assert number(r"test accuracy ([\d.]+) over 150 images", out) > 0.7
