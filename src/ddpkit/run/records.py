"""metrics.jsonl, read back: one JSON record per line, as :class:`ddpkit.run.recorder.MetricLogger` appends them.

    records = read_records(RunFiles(run_dir).metrics)   # [{"event": "step", "step": 50, ...}, ...]
    scan = scan_records(path)                           # the same, with the lines skipped counted
    if scan.skipped: print(scan.warning(path, "skipped"))

Used by the CSV logger, the plots, the resume rewind and ``ddpkit bench``. Torch-free, so
``ddpkit plot`` starts at once.

A line is a record when it is a JSON object with a string ``"event"`` and the fields that plots,
loggers and resume read have their types (:func:`record_problem`):

- ``step`` and ``epoch``, where present, are whole numbers; a ``step`` record has ``step``, an
  ``epoch`` record has ``epoch``;
- every other field of a ``step`` or ``epoch`` record (loss, lr, samples/s, the metrics, ``time``)
  is a number or null. NaN and Infinity are numbers here: the recorder writes them, under
  ``--on-nan warn``, for a loss that became non-finite, and they are the run's true record;
- ``time`` (seconds since the epoch) and a ``start`` record's ``world_size`` are numbers or null.

Other lines (valid JSON that is not an object, ``[1, 2, 3]``; a field of the wrong type; text that
is not JSON or not UTF-8) are skipped and counted; the first of them is named by line number.
A last line without its newline that does not parse is what a kill during an append leaves (or
a line being written while ``ddpkit plot`` reads a live run): it is skipped without a word.
Blank lines are skipped without a word too.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

NUMERIC_EVENTS = ("step", "epoch")  # records whose every field is a number (or null)
REQUIRED = {"step": "step", "epoch": "epoch"}  # event -> the field it cannot lack


@dataclass
class RecordScan:
    """A metrics.jsonl read back: its valid records in order, and what was skipped."""

    records: list[dict] = field(default_factory=list)
    skipped: int = 0  # lines that are not records (a cut-short last line and blank lines not counted)
    first_bad: tuple[int, str] | None = None  # (1-based line number, why) of the first skipped line

    def warning(self, path: Path, done: str) -> str:
        """The one line saying what was skipped; ``done`` says what became of those lines."""
        line, why = self.first_bad or (0, "")
        lines = "line" if self.skipped == 1 else "lines"
        return (
            f"ddpkit: warning: {path}: {self.skipped} {lines} that are not ddpkit records {done} "
            f"(the first, line {line}: {why})"
        )


def scan_records(path: Path) -> RecordScan:
    """The file's valid records in order, and the lines skipped (no file: no records)."""
    scan = RecordScan()
    try:
        data = Path(path).read_bytes()
    except FileNotFoundError:
        return scan
    lines = data.split(b"\n")
    for number, raw in enumerate(lines, 1):
        if not raw.strip():
            continue
        cut_short = number == len(lines)  # no newline after it: the recorder writes line and newline at once
        try:
            obj = json.loads(raw.decode("utf-8"))
        except UnicodeDecodeError:
            why = "not UTF-8 text"
        except (ValueError, RecursionError):  # JSONDecodeError; a nesting too deep for the parser
            if cut_short:
                continue
            why = "not JSON"
        else:
            why = record_problem(obj)
            if why is None:
                scan.records.append(obj)
                continue
        scan.skipped += 1
        if scan.first_bad is None:
            scan.first_bad = (number, why)
    return scan


def read_records(path: Path) -> list[dict]:
    """The file's valid records in order (:func:`scan_records` says what was skipped)."""
    return scan_records(path).records


def record_problem(obj) -> str | None:
    """Why ``obj`` (a parsed line) is not a record that plots, loggers and resume can read; None if it is."""
    if not isinstance(obj, dict):
        return f"a JSON {_json_kind(obj)}, not an object"
    event = obj.get("event")
    if not isinstance(event, str):
        return 'no "event" string'
    need = REQUIRED.get(event)
    if need and need not in obj:
        return f'a "{event}" record without "{need}"'
    for key in ("step", "epoch"):
        if key in obj and not (obj[key] is None and key != need or _whole(obj[key])):
            return f'"{key}" is {json.dumps(obj[key])[:40]}, not a whole number'
    numbers = [k for k in obj if k not in ("event", "step", "epoch")] if event in NUMERIC_EVENTS else []
    if event == "start":
        numbers = ["world_size"]
    for key in ["time", *numbers]:
        if key in obj and not (obj[key] is None or _number(obj[key])):
            return f'"{key}" is {json.dumps(obj[key])[:40]}, not a number'
    return None


def _whole(value) -> bool:
    return type(value) is int  # bool is an int subclass, and 5.0 is not a step


def _number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _json_kind(obj) -> str:
    kinds = ((list, "array"), (str, "string"), (bool, "boolean"), ((int, float), "number"), (type(None), "null"))
    return next((name for kind, name in kinds if isinstance(obj, kind)), type(obj).__name__)
