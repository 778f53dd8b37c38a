"""--log tensorboard,wandb,csv: read back with each tool's own reader, against metrics.jsonl."""

import csv
import struct
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
from clirun import read_jsonl, run_cli, run_python
from once import once

from ddpkit.config import parse_loggers
from ddpkit.errors import ConfigError
from ddpkit.run.loggers import check_installed
from ddpkit.run.recorder import MetricLogger
from ddpkit.run.records import read_records


def event_scalars(folder: Path) -> dict[str, list[tuple[int, float]]]:
    """{tag: [(step, value), ...]} through TensorBoard's own reader."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(folder), size_guidance={"scalars": 0})
    acc.Reload()
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


def png_size(path: Path) -> tuple[int, int]:
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n", f"{path} is not a PNG"
    return struct.unpack(">II", data[16:24])


@pytest.fixture(scope="module")
def logged_run(tmp_path_factory):
    """One 2-process CLI run with every logger, wandb offline: once per pytest run, for this module's tests on
    any worker (tests/helpers/once.py)."""
    return once(tmp_path_factory, "logged", _log_everything) / "run"


def _log_everything(tmp: Path) -> None:
    wandb = dict(
        WANDB_MODE="offline",
        WANDB_SILENT="true",
        WANDB_CONFIG_DIR=str(tmp / "wbconfig"),
        WANDB_CACHE_DIR=str(tmp / "wbcache"),
        WANDB_DATA_DIR=str(tmp / "wbdata"),
    )
    run_dir = tmp / "run"
    proc = run_cli(
        "train",
        "--dataset",
        "mnist",
        "--recipe",
        "mnist",
        "--model",
        "mlp",
        "--nproc",
        "2",
        "--device",
        "cpu",
        "--epochs",
        "2",
        "--limit-train",
        "1024",
        "--limit-test",
        "256",
        "--batch-size",
        "64",
        "--log-every",
        "4",
        "--log",
        "tensorboard,wandb,csv",
        "--run-dir",
        str(run_dir),
        **wandb,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]


@pytest.mark.slow
@pytest.mark.multiprocess
def test_tensorboard_has_every_logged_scalar_at_its_step(logged_run):
    run_dir = logged_run
    records = read_jsonl(run_dir / "metrics.jsonl")
    steps = [r for r in records if r["event"] == "step"]
    epochs = [r for r in records if r["event"] == "epoch"]
    tb = event_scalars(run_dir / "tensorboard")
    assert [s for s, _ in tb["train/loss"]] == [r["step"] for r in steps] == [4, 8, 12, 16, 20, 24, 28, 32] * 1
    assert [v for _, v in tb["train/loss"]] == pytest.approx([r["loss"] for r in steps], rel=1e-6)  # float32 in TB
    for key in ("lr", "samples_per_s", "accuracy"):
        assert len(tb[f"train/{key}"]) == len(steps)
    assert [s for s, _ in tb["epoch/test_accuracy"]] == [r["step"] for r in epochs] == [16, 32]
    assert tb["epoch/test_accuracy"][-1][1] == pytest.approx(epochs[-1]["test_accuracy"], rel=1e-6)
    assert "epoch/peak_memory_mb" in tb and "summary/samples_per_s" in tb


@pytest.mark.slow
@pytest.mark.multiprocess
def test_tensorboard_records_the_config_as_hyperparameters(logged_run):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from tensorboard.plugins.hparams import plugin_data_pb2

    run_dir = logged_run
    acc = EventAccumulator(str(run_dir / "tensorboard"))
    acc.Reload()
    content = acc.PluginTagToContent("hparams")
    session = plugin_data_pb2.HParamsPluginData.FromString(content["_hparams_/session_start_info"]).session_start_info
    assert session.hparams["model"].string_value == "mlp"
    assert session.hparams["batch_size"].number_value == 64
    experiment = plugin_data_pb2.HParamsPluginData.FromString(content["_hparams_/experiment"]).experiment
    assert {m.name.tag for m in experiment.metric_infos} == {"epoch/test_loss", "epoch/test_accuracy"}


@pytest.mark.slow
@pytest.mark.multiprocess
def test_csv_rows_are_the_jsonl_records(logged_run):
    run_dir = logged_run
    records = read_jsonl(run_dir / "metrics.jsonl")
    with open(run_dir / "metrics.csv", newline="") as fh:
        rows = list(csv.DictReader(fh))
    assert len(rows) == len(records)
    for row, record in zip(rows, records):
        assert row["event"] == record["event"]
        for key, value in record.items():
            if isinstance(value, float):
                assert float(row[key]) == value, key  # repr round-trips a float exactly
            elif isinstance(value, (int, str)) and not isinstance(value, bool):
                assert row[key] == str(value), key


@pytest.mark.slow
@pytest.mark.multiprocess
def test_wandb_offline_makes_one_run_for_a_two_process_job(logged_run):
    run_dir = logged_run
    runs = sorted((run_dir / "wandb").glob("offline-run-*"))
    assert len(runs) == 1, runs
    run_id = (run_dir / "wandb-id").read_text().strip()
    assert runs[0].name.endswith(run_id) and list(runs[0].glob("*.wandb"))


@pytest.mark.slow
@pytest.mark.multiprocess
def test_plots_are_pngs_of_sensible_size(logged_run):
    run_dir = logged_run
    names = sorted(p.name for p in (run_dir / "plots").iterdir())
    assert names == ["accuracy.png", "loss.png", "throughput.png"]
    for name in names:
        width, height = png_size(run_dir / "plots" / name)
        assert 600 <= width <= 1600 and 400 <= height <= 1000
        assert (run_dir / "plots" / name).stat().st_size > 10_000  # curves drawn, not an empty frame


@pytest.mark.slow
@pytest.mark.multiprocess
def test_plot_command_overlays_runs_and_redraws_one(logged_run, tmp_path):
    import shutil

    from clirun import run_cli

    # a copy: the redraw below writes into RUN_DIR/plots, which the other worker's tests may be reading
    run_dir = Path(shutil.copytree(logged_run, tmp_path / "run"))
    proc = run_cli("plot", str(run_dir), str(run_dir), "--out", str(tmp_path / "cmp"))
    assert proc.returncode == 0, proc.stderr
    assert sorted(p.name for p in (tmp_path / "cmp").iterdir()) == ["accuracy.png", "loss.png", "throughput.png"]
    proc = run_cli("plot", str(run_dir), str(tmp_path))
    assert proc.returncode == 2 and "--out DIR" in proc.stderr and "Traceback" not in proc.stderr
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "loss.png").write_text("my notes, not a PNG")
    proc = run_cli("plot", str(run_dir), "--out", str(tmp_path / "mine"))
    assert proc.returncode != 0 and "is not a PNG" in proc.stderr and "Traceback" not in proc.stderr
    assert (tmp_path / "mine" / "loss.png").read_text() == "my notes, not a PNG"
    before = (run_dir / "plots" / "loss.png").stat().st_mtime_ns
    proc = run_cli("plot", str(run_dir))  # one run: redrawn into RUN_DIR/plots
    assert proc.returncode == 0 and (run_dir / "plots" / "loss.png").stat().st_mtime_ns > before
    proc = run_cli("plot", str(tmp_path / "nothing"))
    assert proc.returncode != 0 and "metrics.jsonl not found" in proc.stderr and "Traceback" not in proc.stderr


# ---------------------------------------------------------------------- resume, failures, missing packages
def test_after_a_resume_csv_and_tensorboard_hold_each_step_once(tmp_path):
    ctx = SimpleNamespace(is_main=True)
    config = {"model": "mlp", "lr": 0.1}

    def attempt(start: int, stop: int) -> None:
        log = MetricLogger(
            ctx,
            tmp_path,
            40,
            progress=False,
            quiet=True,
            loggers=("csv", "tensorboard"),
            config=config,
            metric_names=("loss",),
        )
        log.begin(global_step=start, epoch=0)
        for step in range(start + 1, stop + 1):
            log.log("step", epoch=0, step=step, loss=1.0 / step + (0.5 if start else 0.0))
        log.close(ok=stop == 40)

    attempt(0, 5)  # killed before its first snapshot: the next attempt starts over
    attempt(0, 30)  # killed after step 30; the snapshot was at step 20
    attempt(20, 40)
    records = read_records(tmp_path / "metrics.jsonl")
    assert [r["step"] for r in records] == list(range(1, 41))
    with open(tmp_path / "metrics.csv", newline="") as fh:
        assert [int(r["step"]) for r in csv.DictReader(fh)] == list(range(1, 41))
    tb = event_scalars(tmp_path / "tensorboard")["train/loss"]
    assert [s for s, _ in tb] == list(range(1, 41))  # the first attempt's steps 1-5 once (they were kept twice)
    assert tb[25][1] == pytest.approx(1 / 26 + 0.5)  # the second attempt's value, not the first's
    assert session_statuses(tmp_path / "tensorboard") == ["STATUS_FAILURE", "STATUS_FAILURE", "STATUS_SUCCESS"]


def session_statuses(folder: Path) -> list[str]:
    """Each attempt's hparams session-end status, in order, read from the raw event files."""
    from tensorboard.backend.event_processing.event_file_loader import EventFileLoader
    from tensorboard.plugins.hparams import api_pb2, plugin_data_pb2

    out = []
    for path in sorted(folder.glob("events.out.tfevents.*"), key=lambda p: (p.stat().st_mtime, p.name)):
        for event in EventFileLoader(str(path)).Load():
            for value in event.summary.value:
                if value.tag == "_hparams_/session_end_info":
                    data = plugin_data_pb2.HParamsPluginData.FromString(value.metadata.plugin_data.content)
                    out.append(api_pb2.Status.Name(data.session_end_info.status))
    return out


def test_a_failing_logger_is_dropped_with_a_warning_and_the_run_goes_on(tmp_path, capsys, monkeypatch):
    from ddpkit.run import loggers

    class Broken:
        def __init__(self, *args):
            pass

        def write(self, record):
            raise OSError("dashboard unreachable")

        def close(self, ok):
            pass

    monkeypatch.setitem(loggers.LOGGERS, "csv", Broken)
    log = MetricLogger(SimpleNamespace(is_main=True), tmp_path, 10, progress=False, loggers=("csv",))
    log.begin(0, 0)
    log.log("step", epoch=0, step=1, loss=1.0)
    log.log("step", epoch=0, step=2, loss=0.5)
    log.close()
    out = capsys.readouterr().out
    assert out.count("warning: --log csv failed (OSError: dashboard unreachable)") == 1
    assert len(read_records(tmp_path / "metrics.jsonl")) == 2


def test_other_ranks_open_no_logger(tmp_path):
    log = MetricLogger(SimpleNamespace(is_main=False), tmp_path, 10, loggers=("csv", "tensorboard"))
    log.begin(0, 0)
    log.log("step", epoch=0, step=1, loss=1.0)
    log.close()
    assert list(tmp_path.iterdir()) == []


def test_unknown_and_missing_loggers_are_one_line_errors(monkeypatch):
    assert parse_loggers("csv, tensorboard,csv") == ("csv", "tensorboard")
    with pytest.raises(ConfigError, match="unknown logger.*mlflow.*choose from tensorboard, wandb, csv"):
        parse_loggers("csv,mlflow")
    monkeypatch.setitem(sys.modules, "wandb", None)  # as if not installed
    with pytest.raises(ConfigError, match=r"--log wandb needs the wandb package.*pip install 'ddpkit\[wandb\]'"):
        check_installed(("csv", "wandb"))


@pytest.mark.multiprocess
def test_the_cli_names_the_extra_when_tensorboard_is_missing(tmp_path):
    code = (
        "import sys; sys.modules['tensorboard'] = None; from ddpkit.cli import main; "
        f"sys.exit(main(['train', '--log', 'tensorboard', '--run-dir', {str(tmp_path / 'r')!r}]))"
    )
    proc = run_python("-c", code)
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.strip().splitlines() == [
        "ddpkit: error: --log tensorboard needs the tensorboard package, which is not installed: "
        "pip install 'ddpkit[tensorboard]' (or pip install tensorboard)"
    ]
    assert not (tmp_path / "r").exists()
