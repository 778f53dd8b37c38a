"""The console: a live progress display on a terminal, plain lines otherwise, from global rank 0 only.

    display = Display(total_steps=468, progress=True, quiet=False)   # built by MetricLogger on rank 0
    display.advance(step)                      # every step: a host counter, no device sync
    display.interval(step, epoch, loss, rate)  # at log intervals: what the last interval measured
    display.event(record)                      # [start], [epoch], [summary] ... lines
    display.close()

On a terminal (stderr is a TTY) and without ``--quiet`` it is a rich progress bar with the
step count, epoch, loss and samples/s of the last log interval and ETA, and a summary table
at the end. Elsewhere (CI logs, pipes, files) every record is one plain line,
never parsed as markup, so ddpkit's own ``[start]``/``[epoch]`` tags survive.
"""

from __future__ import annotations

import json
import sys

# summary.json keys shown in the end-of-run table, in order, with their labels (units in the label)
SUMMARY_ROWS = (
    ("world_size", "processes", "{}"),
    ("steps", "optimizer steps", "{:,}"),
    ("train_time_s", "train time (s)", "{:,.2f}"),
    ("samples_per_s", "samples/s", "{:,.0f}"),
    ("peak_memory_mb", "peak memory, largest rank (MiB)", "{:,.0f}"),
    ("startup_s", "launch to first step (s)", "{:,.2f}"),
)


def summary_fields(summary: dict) -> dict:
    """What the console's summary line or table shows of summary.json: the test metrics, then SUMMARY_ROWS."""
    return {
        **{k: v for k, v in summary.items() if k.startswith("test_") and v is not None},
        **{key: summary.get(key) for key, _, _ in SUMMARY_ROWS},
        "run_dir": summary.get("run_dir"),
    }


class Display:
    def __init__(self, total_steps: int, progress: bool = True, quiet: bool = False):
        self.quiet = quiet
        self.bar = None
        if progress and not quiet and sys.stderr.isatty():
            from rich.progress import (
                BarColumn,
                MofNCompleteColumn,
                Progress,
                TextColumn,
                TimeRemainingColumn,
            )

            # about 80 columns in all: an 80-column terminal keeps the ETA (rich shrinks the bar first)
            self.bar = Progress(
                TextColumn("[bold]train"),
                BarColumn(bar_width=16),
                MofNCompleteColumn(),
                TextColumn("{task.fields[info]}"),
                TextColumn("ETA"),
                TimeRemainingColumn(),
                transient=True,
            )
            self.task = self.bar.add_task("train", total=total_steps, info="")
            self.console = self.bar.console  # for the summary table, after the bar has stopped
            self.bar.start()

    def advance(self, step: int) -> None:
        if self.bar is not None:  # rich redraws at its own rate (10 Hz), not per call
            self.bar.update(self.task, completed=step)

    def interval(self, step: int, epoch: int, loss: float | None, samples_per_s: float) -> None:
        info = f"epoch {epoch}" + (f" loss {loss:.4f}" if loss is not None else "") + f" {samples_per_s:,.0f} samples/s"
        if self.bar is not None:
            self.bar.update(self.task, completed=step, info=info)

    def event(self, record: dict) -> None:
        """A record as the console shows it: step records only without a bar (the bar carries them);
        with ``--quiet`` the summary line alone (the result, and where it was written)."""
        if (self.quiet and record["event"] != "summary") or (record["event"] == "step" and self.bar is not None):
            return
        if record["event"] == "summary" and self.bar is not None:
            self.close()  # the table replaces the bar
            self._summary_table(record)
            return
        self.print(format_record(record))

    def print(self, line: str) -> None:
        if self.bar is not None:
            # markup=False: ddpkit's own "[start]"/"[epoch]" tags are text, not rich markup to swallow
            self.bar.console.print(line, highlight=False, markup=False)
        else:
            sys.stdout.write(line + "\n")  # one write (see ranks.failures.say): no other line glued to it
            sys.stdout.flush()

    def close(self) -> None:
        if self.bar is not None:
            self.bar.stop()
            self.bar = None

    def _summary_table(self, record: dict) -> None:
        from rich.table import Table

        table = Table(title="ddpkit: run finished", title_justify="left", show_header=False)
        table.add_column(style="bold")
        table.add_column(justify="right")
        for key, value in record.items():
            if key.startswith("test_") and value is not None:
                shown = f"{100 * value:.2f}%" if key == "test_accuracy" else _number(value)
                table.add_row(key.replace("_", " "), shown)
        for key, label, form in SUMMARY_ROWS:
            if record.get(key) is not None:
                table.add_row(label, form.format(record[key]))
        table.add_row("run dir", str(record.get("run_dir", "")))
        self.console.print(table)


def _number(value) -> str:
    if isinstance(value, float):
        return f"{value:,.4g}" if abs(value) < 1e4 else f"{value:,.0f}"
    return str(value)


def format_record(record: dict) -> str:
    """``[event] key=value ...``: floats to 4 significant digits; time and nested values left out."""
    parts = []
    for key, value in record.items():
        if key in ("event", "time") or value is None or isinstance(value, (dict, list)):
            continue
        if isinstance(value, float):
            value = _plain(value)
        elif isinstance(value, str) and (" " in value or not value):
            value = json.dumps(value)  # one key=value per field, for anyone parsing the log
        parts.append(f"{key}={value}")
    return f"[{record['event']}] " + " ".join(parts)


def _plain(value: float) -> str:
    """4 significant digits, never an exponent for the sizes a run logs (samples_per_s=51790, not 5.179e+04)."""
    return f"{value:.0f}" if 1e4 <= abs(value) < 1e15 else f"{value:.4g}"
