"""metrics.jsonl read back: lines that are not records are skipped and counted (plot, resume),
and the plots drawn from the records: atomic files, one file per panel, honest ticks and hints."""

from __future__ import annotations

import errno
import io
import json
import math
import os
from pathlib import Path
from types import SimpleNamespace

import pytest
from clirun import read_jsonl
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

from ddpkit.cli import main
from ddpkit.errors import RunDirError
from ddpkit.run.plots import training_plots
from ddpkit.run.recorder import MetricLogger
from ddpkit.run.records import read_records, record_problem, scan_records

START = {"event": "start", "world_size": 2}


def step(n: int, **values) -> dict:
    return {
        "event": "step",
        "time": 1.5,
        "epoch": 0,
        "step": n,
        "loss": 2.0 / n,
        "lr": 0.1,
        "samples_per_s": 900.0,
        **values,
    }


# Each line of metrics.jsonl that is not a record, and the first words of why
BAD_LINES = [
    ("[1, 2, 3]", "a JSON array, not an object"),
    ('"step"', "a JSON string, not an object"),
    ('{"step": 3}', 'no "event" string'),
    ('{"event": 7, "step": 3}', 'no "event" string'),
    ('{"event": "step", "epoch": 0}', 'a "step" record without "step"'),
    ('{"event": "step", "step": "5"}', '"step" is "5", not a whole number'),
    ('{"event": "step", "step": 5.0}', '"step" is 5.0, not a whole number'),
    ('{"event": "step", "step": true}', '"step" is true, not a whole number'),
    ('{"event": "epoch", "epoch": [0], "step": 4}', '"epoch" is [0], not a whole number'),
    ('{"event": "step", "step": 4, "loss": "0.3"}', '"loss" is "0.3", not a number'),
    ('{"event": "epoch", "epoch": 0, "test_loss": {"a": 1}}', '"test_loss" is {"a": 1}, not a number'),
    ('{"event": "stopped", "step": 4, "time": "now"}', '"time" is "now", not a number'),
    ('{"event": "start", "world_size": "two"}', '"world_size" is "two", not a number'),
]


@pytest.mark.parametrize("line,why", BAD_LINES, ids=[w for _, w in BAD_LINES])
def test_a_line_that_is_not_a_record_is_named(line, why):
    assert record_problem(json.loads(line)) == why


def test_what_the_recorder_writes_is_a_record(tmp_path):
    """Every record the engine writes passes, NaN included (--on-nan warn logs it as the loss)."""
    log = MetricLogger(SimpleNamespace(is_main=True), tmp_path, total_steps=8, progress=False, quiet=True)
    log.log("start", world_size=1, device="cpu", task={"kind": "classification"}, resumed_at_step=None)
    log.log("step", **{k: v for k, v in step(4, loss=math.nan, accuracy=None).items() if k not in ("event", "time")})
    log.log("epoch", epoch=0, step=8, train_loss=0.5, test_loss=math.inf, test_samples=10, peak_memory_mb=3.5)
    log.log("stopped", reason="signal", signal="SIGTERM", step=8)
    log.log("summary", step=8, run_dir=str(tmp_path), world_size=1, steps=8)
    scan = scan_records(tmp_path / "metrics.jsonl")
    assert [r["event"] for r in scan.records] == ["start", "step", "epoch", "stopped", "summary"]
    assert scan.skipped == 0 and math.isnan(scan.records[1]["loss"])


def write_run(run_dir: Path, lines: list[str], end: str = "\n") -> Path:
    run_dir.mkdir(parents=True, exist_ok=True)
    path = run_dir / "metrics.jsonl"
    path.write_bytes(("\n".join(lines) + end).encode("utf-8", "surrogateescape"))
    return path


def damaged_lines() -> list[str]:
    """A run's records with every kind of bad line among them, and a last line cut short by a kill."""
    good = [json.dumps(START), *(json.dumps(step(n)) for n in (4, 8, 12))]
    return [good[0], good[1], *(line for line, _ in BAD_LINES), "", good[2], "\udcff\udcfe", good[3]]


def test_scan_keeps_the_records_counts_the_rest_and_names_the_first(tmp_path):
    lines = damaged_lines()
    path = write_run(tmp_path, [*lines, '{"event": "step", "step": 16, "lo'], end="")
    scan = scan_records(path)
    assert [r.get("step") for r in scan.records] == [None, 4, 8, 12]
    assert scan.skipped == len(BAD_LINES) + 1  # the bad lines, and the bytes that are not UTF-8
    assert scan.first_bad == (3, "a JSON array, not an object")  # blank line and cut-short last line: silent
    assert read_records(path) == scan.records
    assert scan_records(tmp_path / "absent.jsonl").records == []
    # A line not JSON before the last is counted (nested deeper than the parser recurses, too);
    # only the last one, without its newline, is a kill's
    mid = scan_records(write_run(tmp_path / "mid", ['{"event": "step", "st', "[" * 100_000, json.dumps(step(4))]))
    assert mid.skipped == 2 and mid.first_bad == (1, "not JSON") and len(mid.records) == 1


def test_ddpkit_plot_skips_bad_lines_with_one_warning(tmp_path, capsys):
    """Regression: one line [1, 2, 3] in metrics.jsonl made `ddpkit plot` end in a traceback."""
    write_run(tmp_path / "run", damaged_lines())
    assert main(["plot", str(tmp_path / "run")]) == 0
    out, err = capsys.readouterr()
    warnings = [line for line in err.splitlines() if "warning" in line]
    assert warnings == [
        f"ddpkit: warning: {tmp_path / 'run' / 'metrics.jsonl'}: {len(BAD_LINES) + 1} lines that are not ddpkit "
        f"records skipped (the first, line 3: a JSON array, not an object)"
    ], err
    assert "Traceback" not in err
    assert {Path(p).name for p in out.split()} == {"loss.png", "throughput.png"}


def test_resume_rewrites_the_file_without_bad_lines_and_says_so_once(tmp_path, capsys):
    """Regression: the same line stopped every resume of the run (the rewind read every line as a dict)."""
    path = write_run(tmp_path, damaged_lines())
    log = MetricLogger(SimpleNamespace(is_main=True), tmp_path, total_steps=20, progress=False)
    log.rewind(global_step=8, epoch=0)
    assert [r["event"] for r in read_jsonl(path)] == ["start", "step", "step"]
    assert [r["step"] for r in read_jsonl(path)[1:]] == [4, 8]
    said = [line for line in capsys.readouterr().out.splitlines() if "warning" in line]
    assert len(said) == 1 and f"{path}: {len(BAD_LINES) + 1} lines" in said[0], said
    assert "dropped on resume; the file is rewritten without them" in said[0]
    log.rewind(global_step=8, epoch=0)  # a second resume finds nothing more to say
    assert "warning" not in capsys.readouterr().out


def drawn_figures(monkeypatch) -> list:
    """The figures ``training_plots`` saves, drawn (their ticks placed)."""
    figures, save = [], Figure.savefig

    def spy(fig, fname, *args, **kwargs):
        FigureCanvasAgg(fig).draw()
        figures.append(fig)
        return save(fig, fname, *args, **kwargs)

    monkeypatch.setattr(Figure, "savefig", spy)
    return figures


@pytest.mark.slow
def test_a_metric_named_throughput_keeps_its_own_file(tmp_path):
    """Regression: the samples/s panel was written over the user's metric ``throughput``."""
    write_run(tmp_path / "run", [json.dumps(step(n, throughput=0.5 * n, **{"top/1": 0.1})) for n in (4, 8)])
    written = training_plots([tmp_path / "run"], tmp_path / "plots")
    names = [p.name for p in written]
    assert len(set(names)) == len(names) == 4, names
    assert set(names) == {"loss.png", "throughput.png", "metric-throughput.png", "top_1.png"}


def test_a_one_point_x_axis_ticks_its_step_once(tmp_path, monkeypatch):
    """Regression: a run of one logged step ticked its x axis 8, 8, 8, ... (integer labels of 7.6, 7.7, ...)."""
    write_run(tmp_path / "run", [json.dumps(START), json.dumps(step(8))])
    figures = drawn_figures(monkeypatch)
    training_plots([tmp_path / "run"], tmp_path / "plots")
    assert len(figures) == 2  # loss, throughput
    for fig in figures:
        ax = fig.axes[0]
        lo, hi = ax.get_xlim()
        shown = [t.get_text() for t in ax.get_xticklabels() if lo <= t.get_position()[0] <= hi]
        assert shown == ["8"], (ax.get_title(), shown)


def test_a_loops_run_gets_its_steps_per_second_drawn_as_its_throughput(tmp_path, monkeypatch):
    """Regression (the porter's seed-000 port): a Loop's step records give steps/s, not samples/s, and `ddpkit
    plot` drew an empty samples/s panel (ticks "1 1 1 0 0 0") and steps/s as a metric of its own."""
    loop_steps = [{"event": "step", "step": n, "epoch": 0, "loss": 1.0 / n, "steps_per_s": 0.5 * n} for n in (5, 10)]
    write_run(tmp_path / "run", [json.dumps(START)] + [json.dumps(r) for r in loop_steps])
    figures = drawn_figures(monkeypatch)
    written = training_plots([tmp_path / "run"], tmp_path / "plots")
    assert [p.name for p in written] == ["loss.png", "throughput.png"]
    ax = figures[1].axes[0]
    assert ax.get_ylabel() == "optimizer steps/s"
    assert [list(line.get_ydata()) for line in ax.get_lines()] == [[2.5, 5.0]]
    shown = [t.get_text() for t in ax.get_yticklabels()]
    assert len(set(shown)) == len(shown), shown  # no tick label repeated
    # A Trainer's run beside it: the panel is samples/s, the Loop's run has none to draw in it
    write_run(tmp_path / "trainer", [json.dumps(START), json.dumps(step(5)), json.dumps(step(10))])
    written = training_plots([tmp_path / "trainer", tmp_path / "run"], tmp_path / "both")
    assert figures[-1].axes[0].get_ylabel() == "samples/s" and "steps_per_s.png" not in [p.name for p in written]


def test_a_plot_killed_mid_write_leaves_the_previous_png_whole(tmp_path, monkeypatch):
    """Regression: savefig wrote into the PNG itself, so a kill or a full disk mid-write left half a PNG."""
    write_run(tmp_path / "run", [json.dumps(step(n)) for n in (4, 8)])
    out = tmp_path / "plots"
    training_plots([tmp_path / "run"], out)
    before = (out / "loss.png").read_bytes()
    save = Figure.savefig

    def dies_half_way(fig, fname, *args, **kwargs):
        buf = io.BytesIO()
        save(fig, buf, format="png")
        data = buf.getvalue()
        if hasattr(fname, "write"):
            fname.write(data[: len(data) // 2])
        else:
            Path(fname).write_bytes(data[: len(data) // 2])
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(Figure, "savefig", dies_half_way)
    write_run(tmp_path / "run", [json.dumps(step(n)) for n in (4, 8, 12)])
    with pytest.raises((OSError, RunDirError)):
        training_plots([tmp_path / "run"], out)
    assert (out / "loss.png").read_bytes() == before


def test_plot_write_errors_name_plots_own_flag(tmp_path, monkeypatch, capsys):
    """Regression: `ddpkit plot` with a full disk said "point --run-dir elsewhere", a flag plot does not have."""
    write_run(tmp_path / "run", [json.dumps(step(n)) for n in (4, 8)])
    mkdir = Path.mkdir

    def full(self, *args, **kwargs):
        if self.name == "plots":
            raise OSError(errno.ENOSPC, "No space left on device", str(self))
        return mkdir(self, *args, **kwargs)

    monkeypatch.setattr(Path, "mkdir", full)
    assert main(["plot", str(tmp_path / "run")]) != 0
    err = capsys.readouterr().err
    assert "no space left" in err and "--out" in err and "--run-dir" not in err, err


def test_a_restart_stops_on_its_own_jobs_note_alone_and_no_earlier_jobs(tmp_path, monkeypatch):
    """A note of an error a restart cannot fix (.fatal.json) stops a restarted attempt of the job that wrote it;
    an earlier job's, in a run dir used again, does not (before: a job whose first attempt failed for another
    reason, before its Loop, had its restarts stopped by the last job's note, and the job ended with no line)."""
    from ddpkit.errors import AlreadyReported, ConfigError, Stopped
    from ddpkit.ranks import env
    from ddpkit.run.paths import RunFiles
    from ddpkit.run.rundir import note_for_restarts, refuse_a_restart_into

    run = tmp_path / "run"
    run.mkdir()
    # a worker of a launcher (this process, started before the notes below) at its first restart of 2
    monkeypatch.setenv(env.LAUNCHER_PID, str(os.getpid()))
    monkeypatch.setenv(env.RESTART_COUNT, "1")
    monkeypatch.setenv(env.MAX_RESTARTS, "2")
    for var in env.LAUNCH_VARS:
        monkeypatch.setenv(var, os.environ.get(var, "0"))
    RunFiles(run).fatal.write_text(json.dumps({"message": "the last job's", "exit_code": 2, "at": 1.0}))
    refuse_a_restart_into(run)  # an earlier job's: no refusal
    note_for_restarts(run, Stopped("a stop, which a restart resumes"))  # not one a restart cannot fix: not noted
    refuse_a_restart_into(run)
    note_for_restarts(run, ConfigError("this job's: fix the setting"))
    with pytest.raises(AlreadyReported, match="this job's: fix the setting"):
        refuse_a_restart_into(run)
    assert [p.name for p in run.iterdir()] == [".fatal.json"]  # no temporary file left
