"""metrics.jsonl after a resume (the steps that run again are not recorded twice), and the live display."""

from types import SimpleNamespace

import pytest
from clirun import WAIT_S, read_jsonl

from ddpkit.run.recorder import MetricLogger


def test_rewind_drops_records_after_the_snapshot(tmp_path):
    ctx = SimpleNamespace(is_main=True)
    log = MetricLogger(ctx, tmp_path, total_steps=40, progress=False)
    log.log("start", resumed_at_step=None)
    for step in range(1, 31):
        log.log("step", epoch=(step - 1) // 20, step=step)
        if step == 20:
            log.log("epoch", epoch=0)
    with open(tmp_path / "metrics.jsonl", "a") as fh:
        fh.write('{"event": "step", "ep')  # the line a SIGKILL cut short
    log.rewind(global_step=25, epoch=1)
    records = read_jsonl(tmp_path / "metrics.jsonl")
    assert [r["step"] for r in records if r["event"] == "step"] == list(range(1, 26))
    assert [r["epoch"] for r in records if r["event"] == "epoch"] == [0]
    assert records[0]["event"] == "start"


def test_rewind_into_an_earlier_epoch_drops_that_epochs_record(tmp_path):
    ctx = SimpleNamespace(is_main=True)
    log = MetricLogger(ctx, tmp_path, total_steps=40, progress=False)
    log.log("step", epoch=0, step=20)
    log.log("epoch", epoch=0)
    log.rewind(global_step=15, epoch=0)
    assert read_jsonl(tmp_path / "metrics.jsonl") == []


def test_other_ranks_never_touch_the_file(tmp_path):
    (tmp_path / "metrics.jsonl").write_text('{"event": "step", "step": 99}\n')
    MetricLogger(SimpleNamespace(is_main=False), tmp_path, 10, False).rewind(1, 0)
    assert read_jsonl(tmp_path / "metrics.jsonl") == [{"event": "step", "step": 99}]


@pytest.mark.slow
@pytest.mark.multiprocess
def test_the_progress_bar_under_a_terminal_moves_every_step_and_keeps_the_tags(tmp_path):
    """Under a pseudo-terminal: the bar passes through step counts between log intervals (it only
    moved at log intervals before), and "[start]"/"[epoch]" lines are printed whole (rich parsed them
    as markup and swallowed them)."""
    import os
    import pty
    import re
    import subprocess
    import sys

    from clirun import cli_env

    # convnet: its 40 steps take seconds, so rich's 10 Hz redraws land between log intervals
    primary, secondary = pty.openpty()
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "ddpkit",
            "train",
            "--dataset",
            "mnist",
            "--recipe",
            "mnist",
            "--model",
            "convnet",
            "--limit-train",
            "4000",
            "--limit-test",
            "100",
            "--batch-size",
            "100",
            "--epochs",
            "1",
            "--nproc",
            "1",
            "--device",
            "cpu",
            "--log-every",
            "1000",
            "--run-dir",
            str(tmp_path / "r"),
        ],
        stdin=secondary,
        stdout=secondary,
        stderr=secondary,
        env=cli_env(COLUMNS="120"),
    )
    os.close(secondary)
    chunks = []
    while True:
        try:
            data = os.read(primary, 65536)
        except OSError:  # the child closed the terminal
            break
        if not data:
            break
        chunks.append(data)
    assert proc.wait(timeout=WAIT_S) == 0
    out = re.sub(r"\x1b\[[0-9;?]*[A-Za-z]", "", b"".join(chunks).decode(errors="replace"))  # colours and cursor moves
    assert "[start] world_size=1" in out and "[epoch] epoch=0" in out
    counts = {int(k) for k in re.findall(r"\b(\d+)/40\b", out)}
    assert counts - {0, 40}, f"the bar only showed {sorted(counts)}"  # one log interval: 0 and 40 before
    assert re.search(r"40/40 epoch 0 loss \d\.\d{4} [\d,]+ samples/s ETA", out), out[-3000:]
    table = out[out.index("ddpkit: run finished") :]  # the summary table replaces the bar at the end
    assert re.search(r"test accuracy\W+\d+\.\d\d%", table) and "optimizer steps" in table and "run dir" in table


def test_plain_lines_keep_one_key_value_per_field():
    from ddpkit.run.display import format_record

    line = format_record(
        {
            "event": "start",
            "time": 1.0,
            "data": "train in memory; test in memory",
            "resumed_at_step": None,
            "samples_per_s": 51790.3,
            "lr": 1e-5,
            "task": {"nested": 1},
        }
    )
    assert line == '[start] data="train in memory; test in memory" samples_per_s=51790 lr=1e-05'


def test_quiet_prints_the_summary_line_alone(capsys):
    from ddpkit.run.display import Display

    display = Display(10, progress=False, quiet=True)
    for event in ("start", "step", "epoch"):
        display.event({"event": event, "step": 1})
    display.event({"event": "summary", "test_accuracy": 0.99, "run_dir": "runs/x"})
    assert capsys.readouterr().out == "[summary] test_accuracy=0.99 run_dir=runs/x\n"
