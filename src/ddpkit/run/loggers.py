"""Experiment loggers chosen with ``--log tensorboard,wandb,csv``: sinks for the engine's records.

    sinks = open_loggers(("tensorboard", "csv"), run_dir, config, start_step=0, metric_names=("loss", "accuracy"))
    for sink in sinks:
        sink.write({"event": "step", "step": 50, "epoch": 0, "loss": 0.31, "lr": 0.1, "samples_per_s": 5120.0})
        sink.close(ok=True)

:class:`ddpkit.run.recorder.MetricLogger` owns them and calls them on global rank 0 only; every
record they get was already appended to ``metrics.jsonl``, which is always written and is the
run's record of truth. A logger is a plain class in the ``LOGGERS`` dict with ``write(record)``
and ``close(ok)``. Each gets the same scalars (loss, lr, samples/s, the epoch metrics including
the user's, memory) and the resolved config as hyperparameters.

Where they write, inside the run dir:
- tensorboard: ``tensorboard/`` (``tensorboard --logdir RUN``). A resumed run purges the steps
  after its snapshot, which run again, as metrics.jsonl drops their lines.
- wandb: ``wandb/``; one run per job however many ranks (only rank 0 calls ``wandb.init``),
  resumed under the same id (kept in ``wandb-id``) after a restart. ``WANDB_MODE=offline``
  and the other ``WANDB_*`` variables are honoured by wandb itself; ``WANDB_PROJECT`` defaults to ddpkit.
- csv: ``metrics.csv``, one row per record, rebuilt from metrics.jsonl whenever a record
  brings a new column (and on resume), so the two always agree.
"""

from __future__ import annotations

import csv
import io
import json
import os
import secrets
from pathlib import Path

from ..errors import ConfigError
from ..files import atomic_write
from .paths import RunFiles
from .records import read_records

BOOKKEEPING = ("event", "time", "epoch", "step")  # in every record; not plotted as a scalar
# record event -> scalar tag prefix ("eval": the validation split's, by step)
GROUPS = {"step": "train", "eval": "eval", "epoch": "epoch", "summary": "summary"}


def scalars(record: dict) -> dict[str, float]:
    """The numeric values of a record, by key (bools and bookkeeping left out)."""
    return {
        k: float(v)
        for k, v in record.items()
        if k not in BOOKKEEPING and isinstance(v, (int, float)) and not isinstance(v, bool)
    }


def hyperparameters(config: dict) -> dict:
    """The resolved config as flat hyperparameters: unset (None) fields left out."""
    return {k: v for k, v in config.items() if v is not None}


class TensorBoardLogger:
    """Scalars under ``train/`` (every log interval), ``epoch/`` and ``summary/``, at the optimizer
    step; the config as hyperparameters (the HPARAMS tab, with the test metrics) and as text."""

    def __init__(self, run_dir: Path, config: dict, start_step: int, metric_names: tuple[str, ...]):
        from torch.utils.tensorboard import SummaryWriter
        from torch.utils.tensorboard.summary import hparams

        # purge_step: an earlier attempt's events at or after it are hidden; the steps after the
        # snapshot (start_step; 0 when starting over) run again
        self.writer = SummaryWriter(log_dir=str(run_dir / "tensorboard"), purge_step=start_step + 1)
        metrics = {f"epoch/test_{name}": 0.0 for name in metric_names}
        hp = {k: v if isinstance(v, (int, float, str, bool)) else str(v) for k, v in hyperparameters(config).items()}
        exp, ssi, self._sei = hparams(hp, metrics)
        self.writer.file_writer.add_summary(exp)
        self.writer.file_writer.add_summary(ssi)
        text = "\n".join(f"    {k} = {json.dumps(v)}" for k, v in hyperparameters(config).items())
        self.writer.add_text("config", text, global_step=start_step)

    def write(self, record: dict) -> None:
        group = GROUPS.get(record["event"])
        if group is None or "step" not in record:
            return
        for key, value in scalars(record).items():
            self.writer.add_scalar(f"{group}/{key}", value, global_step=record["step"], walltime=record.get("time"))

    def close(self, ok: bool) -> None:
        if not ok:  # torch's hparams() always says STATUS_SUCCESS
            from tensorboard.plugins.hparams import api_pb2, plugin_data_pb2

            value = self._sei.value[0]
            data = plugin_data_pb2.HParamsPluginData.FromString(value.metadata.plugin_data.content)
            data.session_end_info.status = api_pb2.Status.Value("STATUS_FAILURE")
            value.metadata.plugin_data.content = data.SerializeToString()
        self.writer.file_writer.add_summary(self._sei)  # the session's end, with its status
        self.writer.close()


class WandbLogger:
    """One wandb run per job, named after the run dir; records logged at the optimizer step."""

    def __init__(self, run_dir: Path, config: dict, start_step: int, metric_names: tuple[str, ...]):
        import wandb

        id_file = run_dir / "wandb-id"  # the same wandb run across resumes and restarts
        run_id = id_file.read_text().strip() if id_file.exists() else ""
        if not run_id:
            run_id = secrets.token_hex(4)
            atomic_write(id_file, run_id.encode())
        # quiet: wandb's banner and end-of-run history would bury ddpkit's own lines and summary table;
        # where the run went (and, offline, how to sync it) is still printed
        # init_timeout: the other ranks wait in a collective meanwhile, for at most --timeout-s
        timeout = max(1.0, min(90.0, float(config.get("timeout_s") or 600.0) / 2))
        self.run = wandb.init(
            project=os.environ.get("WANDB_PROJECT", "ddpkit"),
            name=run_dir.name,
            id=run_id,
            resume="allow",
            dir=str(run_dir),
            config=hyperparameters(config),
            settings=wandb.Settings(quiet=True, init_timeout=timeout),
        )

    def write(self, record: dict) -> None:
        group = GROUPS.get(record["event"])
        if group is None or "step" not in record:
            return
        values = {f"{group}/{k}": v for k, v in scalars(record).items()}
        if values:
            self.run.log({**values, "epoch": record.get("epoch")}, step=record["step"])

    def close(self, ok: bool) -> None:
        self.run.finish(exit_code=0 if ok else 1)


class CsvLogger:
    """``metrics.csv``: one row per record of metrics.jsonl, with the union of their keys as columns.

    A row with a key the header lacks (the first epoch record, the summary) rewrites the file
    from metrics.jsonl: a few kB, a few times per run."""

    def __init__(self, run_dir: Path, config: dict, start_step: int, metric_names: tuple[str, ...]):
        self.jsonl, self.path = RunFiles(run_dir).metrics, run_dir / "metrics.csv"
        self.columns: list[str] = []
        self._rebuild()  # after a resume, metrics.jsonl has already dropped the steps that run again

    def write(self, record: dict) -> None:
        row = csv_row(record)
        if not set(row) <= set(self.columns):
            self._rebuild()  # metrics.jsonl already holds this record
            return
        with open(self.path, "a", newline="") as fh:
            csv.DictWriter(fh, self.columns).writerow(row)

    def _rebuild(self) -> None:
        rows = [csv_row(r) for r in read_records(self.jsonl)]
        self.columns = list(BOOKKEEPING) + sorted({k for row in rows for k in row} - set(BOOKKEEPING))
        buf = io.StringIO()
        writer = csv.DictWriter(buf, self.columns)
        writer.writeheader()
        writer.writerows(rows)
        atomic_write(self.path, buf.getvalue().encode())

    def close(self, ok: bool) -> None:
        pass


def csv_row(record: dict) -> dict:
    """A record's plain values (nested ones, such as the start record's task, as JSON text)."""
    return {k: json.dumps(v) if isinstance(v, (dict, list)) else v for k, v in record.items()}


LOGGERS = {"tensorboard": TensorBoardLogger, "wandb": WandbLogger, "csv": CsvLogger}
PACKAGES = ("tensorboard", "wandb")  # loggers needing a package of their name, installed by the extra of that name


def check_installed(names: tuple[str, ...]) -> None:
    """Before launch: every chosen logger's package imports, or a one-line error naming the extra."""
    import importlib.util

    for name in (n for n in names if n in PACKAGES):
        try:  # found, not imported: the launcher does not pay the import (about 1 s) that rank 0 will
            found = importlib.util.find_spec(name) is not None
        except ValueError:  # sys.modules[name] is None: its import is blocked
            found = False
        if not found:
            raise ConfigError(
                f"--log {name} needs the {name} package, which is not installed: "
                f"pip install 'ddpkit[{name}]' (or pip install {name})"
            ) from None


def open_loggers(
    names: tuple[str, ...], run_dir: Path, config: dict, start_step: int, metric_names: tuple[str, ...], warn=print
) -> list:
    """The chosen loggers, opened. One that fails to open is left out with a warning: a dashboard
    is not worth a training run, and metrics.jsonl keeps every record regardless."""
    sinks = []
    for name in names:
        try:
            sinks.append(LOGGERS[name](Path(run_dir), config, start_step, metric_names))
        except Exception as exc:  # noqa: BLE001 - any failure of a third-party logger
            warn(
                f"ddpkit: warning: --log {name} could not start ({type(exc).__name__}: {str(exc)[:200]}); "
                f"training on without it (metrics.jsonl has every record)"
            )
    return sinks
