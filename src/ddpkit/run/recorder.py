"""The run's records, written once: :class:`MetricLogger` is called on every rank and decides
itself that only global rank 0 appends to ``metrics.jsonl``, prints, and feeds the ``--log`` loggers.

    log = MetricLogger(ctx, run_dir, total_steps, loggers=("csv",), config=cfg.to_dict())
    log.log("step", epoch=0, step=50, loss=0.31)      # every rank calls; rank 0 writes
"""

from __future__ import annotations

import json
import time
from pathlib import Path

from ..errors import RunDirError
from ..files import atomic_write, describe_io_error
from ..ranks import hangwatch
from ..ranks.context import DistContext
from .display import Display
from .loggers import LOGGERS, open_loggers
from .paths import RunFiles
from .records import scan_records


class MetricLogger:
    """The run's records (start, step, epoch, stopped, summary): called on every rank; global rank 0
    alone appends them to metrics.jsonl, shows them on the console (:mod:`ddpkit.run.display`) and
    hands them to the loggers chosen with ``--log`` (:mod:`ddpkit.run.loggers`)."""

    def __init__(
        self,
        ctx: DistContext,
        run_dir: Path,
        total_steps: int,
        progress: bool = True,
        quiet: bool = False,
        *,
        loggers: tuple[str, ...] = (),
        config: dict | None = None,
        metric_names: tuple[str, ...] = (),
    ):
        self.main = ctx.is_main
        self.run_dir, self.path = Path(run_dir), RunFiles(run_dir).metrics
        self.loggers, self.config, self.metric_names = tuple(loggers), config or {}, tuple(metric_names)
        self.error: RunDirError | None = None  # a failed append; the engine's next all-reduce stops every rank
        self.sinks: list = []
        self.display = Display(total_steps, progress, quiet) if self.main else None

    def begin(self, global_step: int, epoch: int) -> None:
        """Rank 0, before the first record of an attempt's steps: drop the records of steps that run again
        (:meth:`rewind`), then open the loggers, which start from there too."""
        if not self.main:
            return
        self.rewind(global_step, epoch)
        self.sinks = open_loggers(
            self.loggers, self.run_dir, self.config, global_step, self.metric_names, warn=self.print
        )

    def log(self, event: str, **values) -> None:
        if not self.main:
            return
        with hangwatch.busy("writing the records"):  # the loggers may be slow; the others wait meanwhile
            self._write(event, values)

    def _write(self, event: str, values: dict) -> None:
        record = {"event": event, "time": round(time.time(), 3), **values}
        if self.error is None:
            try:
                with open(self.path, "a") as fh:
                    fh.write(json.dumps(record) + "\n")
            except OSError as exc:
                self.error = RunDirError(describe_io_error(exc, self.path))
        for sink in list(self.sinks):
            try:
                sink.write(record)
            except Exception as exc:  # noqa: BLE001 - a third-party logger must not end the run
                self._drop(sink, exc)
        self.display.event(record)

    def rewind(self, global_step: int, epoch: int) -> None:
        """On resume: drop the records of steps and epochs after the snapshot, which run again, and
        the lines that are not records (:mod:`ddpkit.run.records`), said in one warning.

        Without this a resumed run's metrics.jsonl would hold those steps twice. Other
        events (each attempt's ``start``, ``stopped``) stay, as the run's history.
        """
        if not self.main or not self.path.exists():
            return
        scan = scan_records(self.path)  # a line cut short by the kill is dropped too, silently
        kept = [
            r
            for r in scan.records
            if not (r["event"] in ("step", "eval") and r["step"] > global_step)
            and not (r["event"] == "epoch" and r["epoch"] >= epoch)
        ]
        atomic_write(self.path, "".join(json.dumps(r) + "\n" for r in kept).encode())
        if scan.skipped:
            self.print(scan.warning(self.path, "dropped on resume; the file is rewritten without them"))

    def progress(self, global_step: int) -> None:
        """Every step: move the live display (a host counter, no device sync)."""
        if self.display is not None:
            self.display.advance(global_step)

    def interval(self, global_step: int, epoch: int, loss: float | None, samples_per_s: float) -> None:
        """At a log interval: the live display shows what the interval measured."""
        if self.display is not None:
            self.display.interval(global_step, epoch, loss, samples_per_s)

    def print(self, line: str) -> None:
        if self.display is not None:
            self.display.print(line)

    def close(self, ok: bool = True) -> None:
        """Stop the live display and close the loggers (idempotent); ``ok=False`` after an error."""
        if self.display is not None:
            self.display.close()
        for sink in self.sinks:
            try:
                sink.close(ok)
            except Exception as exc:  # noqa: BLE001
                self.print(f"ddpkit: warning: closing --log {_name(sink)} failed ({type(exc).__name__}: {exc})")
        self.sinks = []

    def _drop(self, sink, exc: Exception) -> None:
        self.sinks.remove(sink)
        try:
            sink.close(False)  # its writer thread or wandb run, released
        except Exception:  # noqa: BLE001 - it failed already; the warning below says so
            pass
        self.print(
            f"ddpkit: warning: --log {_name(sink)} failed ({type(exc).__name__}: {str(exc)[:200]}); "
            f"training on without it (metrics.jsonl has every record)"
        )


def _name(sink) -> str:
    return next((name for name, cls in LOGGERS.items() if isinstance(sink, cls)), type(sink).__name__)
