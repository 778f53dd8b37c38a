"""The pipelines harness runs end to end in a tiny configuration (its figures are not asserted)."""

import json
import re

import pytest
from clirun import ROOT, run_python

pytestmark = pytest.mark.multiprocess  # every test here starts processes


@pytest.mark.slow
def test_pipelines_harness_runs(tmp_path):
    out = tmp_path / "figures.json"
    proc = run_python(
        str(ROOT / "benchmarks" / "pipelines.py"),
        "--limit-train",
        "800",
        "--batch-size",
        "100",
        "--json",
        str(out),
    )
    assert proc.returncode == 0, proc.stderr
    figures = json.loads(out.read_text())
    for key in (
        "seed_samples_per_s",
        "ddpkit_samples_per_s",
        "speedup",
        "world1_ddp_samples_per_s",
        "world1_no_ddp_samples_per_s",
        "ddp_wrapper_overhead",
    ):
        assert figures[key] == figures[key] and key in figures  # present and not NaN
    assert figures["seed_samples_per_s"] > 0 and figures["ddpkit_samples_per_s"] > 0
    assert "(a) seed-style pipeline" in proc.stdout and "ratio" in proc.stdout


@pytest.mark.slow
def test_gpu_acceptance_runs_its_cpu_rehearsal(tmp_path):
    """benchmarks/gpu_acceptance.py --tiny: every procedure runs on CPU, CUDA-only checks are skipped,
    and the CPU kill-and-resume under --deterministic is bitwise exact."""
    proc = run_python(
        str(ROOT / "benchmarks" / "gpu_acceptance.py"),
        "--tiny",
        "--out",
        str(tmp_path),
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = json.loads((tmp_path / "acceptance.json").read_text())
    verdicts = {c["name"].split(",")[0]: c["verdict"] for c in report["checks"]}
    assert len(verdicts) == 12 and not [v for v in verdicts.values() if v.startswith(("error", "skipped: out"))]
    assert verdicts["SIGKILL mid-epoch"] == "met"
    assert sum(v.startswith("skipped: needs") for v in verdicts.values()) == 6  # the CUDA-only ones
    assert "| check | target | measured | verdict |" in (tmp_path / "acceptance.md").read_text()


@pytest.mark.slow
def test_walltime_harness_runs_in_its_tiny_mode(tmp_path):
    """benchmarks/walltime.py --tiny: every workload runs and reports (figures are not judged here; the 1-step
    run, an MNIST epoch too, stands for the MNIST-epoch workload in tiny mode)."""
    out = tmp_path / "walltime.json"
    proc = run_python(
        str(ROOT / "benchmarks" / "walltime.py"),
        "--tiny",
        "--json",
        str(out),
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    side = json.loads(out.read_text())["sides"]["ddpkit"]
    for key in (
        "mnist_epoch_overhead_s",
        "one_step_wall_s",
        "toy_api_wall_s",
        "imagefolder_wall_over_train",
        "imagefolder_second_load_s",
    ):
        assert side[key] is not None and side[key] > 0, key
    assert side["runs"]["one_step"]["startup_s"] > 0 and side["runs"]["one_step"]["teardown_s"] >= 0
    assert "| 1-step run: wall |" in proc.stdout


@pytest.mark.slow
def test_lazy_windows_benchmark_runs_in_both_modes_at_a_small_size(tmp_path):
    """benchmarks/lazy_windows.py with 3,000 windows: quick to read, so held in memory (the decision for a
    large one is tests/data/test_materialize.py's); it trains and reports. (Its "old" mode differs by one
    module constant: at this size both hold the data, so one run covers the script.)"""
    for mode in ([],):
        proc = run_python(
            str(ROOT / "benchmarks" / "lazy_windows.py"),
            str(tmp_path / f"r{len(mode)}"),
            "3000",
            *mode,
        )
        assert proc.returncode == 0, proc.stderr[-3000:]
        assert re.search(r"wall [\d.]+ startup_s [\d.]+ path in-memory", proc.stdout), proc.stdout[-2000:]


@pytest.mark.slow
def test_host_cost_benchmark_runs_in_its_quick_mode(tmp_path):
    """benchmarks/host_cost.py --quick: every cut's row, old and new side by side, with the same results
    (its figures are not judged here)."""
    out = tmp_path / "host_cost.json"
    proc = run_python(
        str(ROOT / "benchmarks" / "host_cost.py"),
        "--quick",
        "--out",
        str(out),
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(out.read_text())
    assert report["environment"]["quick"] is True and report["environment"]["device"] == "cpu"
    rows = report["rows"]
    assert [r["cut"] for r in rows] == ["a", "a", "b", "b", "c", "d", "d", "e"]
    for row in rows:
        assert len(row["old_runs_us"]) == len(row["new_runs_us"]) == row["repeats"] == 3, row["name"]
        assert row["old_us"] > 0 and row["new_us"] > 0 and row["new_over_old"] > 0, row["name"]
        assert row.get("same_result", True) is True, row["name"]  # the new piece computed what the old one did
    assert "| cut | what | old µs | new µs | new/old | saved µs |" in proc.stdout


@pytest.mark.slow
def test_the_world_two_on_one_gpu_script_runs_its_cpu_mode(tmp_path):
    """benchmarks/world2_one_gpu.py --device cpu, its quickest check: two ranks with --sync-bn give
    step 1's loss of one rank with BatchNorm over the same global batch (the GPU run shares cuda:0)."""
    proc = run_python(
        str(ROOT / "benchmarks" / "world2_one_gpu.py"),
        "--device",
        "cpu",
        "--only",
        "syncbn",
        "--out",
        str(tmp_path),
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads((tmp_path / "world2.json").read_text())["checks"]["syncbn"]
    assert result["passed"] and result["relative_difference"] <= 1e-5
    assert "| syncbn | passed |" in (tmp_path / "world2.md").read_text()
