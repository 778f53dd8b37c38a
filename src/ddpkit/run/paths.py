"""The files of a run directory, named once.

files = RunFiles(run_dir)
files.config, files.metrics, files.summary, files.model, files.checkpoints

RUN_DIR/config.toml      the resolved config (identical keys on resume, or the run is refused)
RUN_DIR/identity.json    what ddpkit read of the model, data, optimizer... passed in (ddpkit.identity), by config field
RUN_DIR/metrics.jsonl    one JSON record per event (start, step, epoch, stopped, summary)
RUN_DIR/summary.json     final figures
RUN_DIR/model.pt         final weights: a plain state_dict without "module." prefixes
RUN_DIR/best.pt          --keep-best: {"metric", "value", "step", "weights": {"model": state_dict}} (a Loop's too)
RUN_DIR/checkpoints/     snapshots (run/checkpoint.py); unreadable or damaged ones go to checkpoints/corrupt/;
                         checkpoints/finished: the step the run finished at (a Loop's rerun says so)
RUN_DIR/plots/           loss, metric and samples/s PNGs (run/plots.py)
RUN_DIR/.lock            held (flock) by the one process that owns the run while it runs
RUN_DIR/.fatal.json      an error a restart would only meet again, for restarted workers to report
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

CONFIG, IDENTITY, METRICS, SUMMARY, MODEL, BEST, CHECKPOINTS, PLOTS = (
    "config.toml",
    "identity.json",
    "metrics.jsonl",
    "summary.json",
    "model.pt",
    "best.pt",
    "checkpoints",
    "plots",
)
# What ddpkit keeps in a run dir, each as a file or a directory; another kind of entry there is refused.
EXPECTED = {
    CONFIG: "file",
    IDENTITY: "file",
    METRICS: "file",
    SUMMARY: "file",
    MODEL: "file",
    BEST: "file",
    CHECKPOINTS: "directory",
}


@dataclass(frozen=True)
class RunFiles:
    root: Path

    def __init__(self, root: str | Path):
        object.__setattr__(self, "root", Path(root))

    @property
    def config(self) -> Path:
        return self.root / CONFIG

    @property
    def identity(self) -> Path:
        return self.root / IDENTITY

    @property
    def metrics(self) -> Path:
        return self.root / METRICS

    @property
    def summary(self) -> Path:
        return self.root / SUMMARY

    @property
    def model(self) -> Path:
        return self.root / MODEL

    @property
    def best(self) -> Path:
        return self.root / BEST

    @property
    def checkpoints(self) -> Path:
        return self.root / CHECKPOINTS

    @property
    def finished(self) -> Path:
        """The step the run (a ``Loop``'s or the engine's) last finished at, as text (``Session.mark_finished``)."""
        return self.root / CHECKPOINTS / "finished"

    @property
    def plots(self) -> Path:
        return self.root / PLOTS

    @property
    def lock(self) -> Path:
        return self.root / ".lock"

    @property
    def fatal(self) -> Path:
        return self.root / ".fatal.json"
