"""Metrics: device-side accumulation, interval all-reduces, and rank-0 output.

The step only adds to a device tensor (:class:`Accumulator`); the loop reads it every
``--log-every`` steps through one all-reduce and one host copy. :class:`MetricLogger`
is called on every rank and decides itself that only global rank 0 writes
``metrics.jsonl``, prints, and feeds the ``--log`` loggers.
"""

from __future__ import annotations

import json
import resource
import time
from pathlib import Path

import torch

from .display import Display
from .dist import DistContext
from .errors import RunDirError
from .loggers import LOGGERS, open_loggers
from .records import read_records
from .rundir import atomic_write, describe_io_error


class Accumulator:
    """This rank's running (sum, count) per metric: tensors add up on the device, numbers on the host.

    A metric's sum is usually a device tensor (a loss times its batch size, a correct count)
    and its count a Python int (the batch size), so a step costs one stack and one add on
    the device and nothing on the host. :meth:`local` joins both halves, at intervals only.
    """

    def __init__(self, names: tuple[str, ...], device: torch.device):
        self.names, self.device = tuple(names), device
        k = len(self.names)
        self.sums = torch.zeros(k, dtype=torch.float64, device=device)
        self.counts = torch.zeros(k, dtype=torch.float64, device=device)
        self.host_sums, self.host_counts = [0.0] * k, [0.0] * k
        self._index: dict[tuple, torch.Tensor] = {}

    @torch.no_grad()
    def add(self, values: list[tuple]) -> None:
        """``values``: one (sum, count) per name, each a tensor or a number. No host sync."""
        self._add(self.sums, self.host_sums, [v[0] for v in values])
        self._add(self.counts, self.host_counts, [v[1] for v in values])

    def _add(self, dev: torch.Tensor, host: list, parts: list) -> None:
        tensors, where = [], []
        for i, part in enumerate(parts):
            if isinstance(part, torch.Tensor):
                tensors.append(part.detach().to(device=self.device, dtype=torch.float64).reshape(()))
                where.append(i)
            else:
                host[i] += float(part)
        if len(tensors) == len(parts):
            dev += torch.stack(tensors)
        elif tensors:
            key = tuple(where)
            if key not in self._index:
                self._index[key] = torch.tensor(where, device=self.device)
            dev.index_add_(0, self._index[key], torch.stack(tensors))

    def local(self) -> torch.Tensor:
        """[sums..., counts...] of this rank, on the device: one small host-to-device copy."""
        host = torch.tensor(self.host_sums + self.host_counts, dtype=torch.float64).to(self.device)
        return torch.cat([self.sums, self.counts]) + host

    def reset(self) -> None:
        self.sums.zero_()
        self.counts.zero_()
        self.host_sums, self.host_counts = [0.0] * len(self.names), [0.0] * len(self.names)

    def state(self) -> list[float]:
        """For a snapshot: plain floats (float64 -> Python float is exact)."""
        return self.local().tolist()

    def load(self, values) -> None:
        values = torch.as_tensor(values, dtype=torch.float64)
        k = len(self.names)
        self.reset()
        self.sums.copy_(values[:k])
        self.counts.copy_(values[k:])

    def means(self, totals: list[float], prefix: str = "") -> dict[str, float | None]:
        return means(self.names, totals, prefix)


def means(names: tuple[str, ...], totals: list[float], prefix: str = "") -> dict[str, float | None]:
    """{prefix+name: sum/count} from a [sums..., counts...] list (None where nothing was counted)."""
    k = len(names)
    return {prefix + name: (totals[i] / totals[k + i] if totals[k + i] else None) for i, name in enumerate(names)}


def peak_memory_mb(ctx: DistContext) -> float:
    """Peak over ranks: CUDA max allocated, or the process's peak RSS on CPU (MiB). A collective."""
    if ctx.device.type == "cuda":
        mine = torch.cuda.max_memory_allocated(ctx.device) / 2**20
    else:
        mine = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux reports KiB
    t = torch.tensor([mine], dtype=torch.float64, device=ctx.device)
    return ctx.all_reduce(t, op=torch.distributed.ReduceOp.MAX).item()


class MetricLogger:
    """The run's records (start, step, epoch, stopped, summary): called on every rank; global rank 0
    alone appends them to metrics.jsonl, shows them on the console (:mod:`ddpkit.display`) and
    hands them to the loggers chosen with ``--log`` (:mod:`ddpkit.loggers`)."""

    def __init__(self, ctx: DistContext, run_dir: Path, total_steps: int, progress: bool = True,
                 quiet: bool = False, *, loggers: tuple[str, ...] = (), config: dict | None = None,
                 metric_names: tuple[str, ...] = ()):
        self.main = ctx.is_main
        self.run_dir, self.path = Path(run_dir), Path(run_dir) / "metrics.jsonl"
        self.loggers, self.config, self.metric_names = tuple(loggers), config or {}, tuple(metric_names)
        self.error: RunDirError | None = None  # a failed append; the engine's next all-reduce stops every rank
        self.sinks: list = []
        self.display = Display(total_steps, progress, quiet) if self.main else None

    def begin(self, global_step: int, epoch: int) -> None:
        """Rank 0, before the first record of an attempt: drop the records of steps that run again
        (:meth:`rewind`), then open the loggers, which start from there too."""
        if not self.main:
            return
        self.rewind(global_step, epoch)
        self.sinks = open_loggers(self.loggers, self.run_dir, self.config, global_step, self.metric_names,
                                  warn=self.print)

    def log(self, event: str, **values) -> None:
        if not self.main:
            return
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
        """On resume: drop the records of steps and epochs after the snapshot, which run again.

        Without this a resumed run's metrics.jsonl would hold those steps twice. Other
        events (each attempt's ``start``, ``stopped``) stay, as the run's history.
        """
        if not self.main or not self.path.exists():
            return
        kept = [r for r in read_records(self.path)  # a line cut short by the kill is dropped too
                if not (r.get("event") == "step" and r.get("step", 0) > global_step)
                and not (r.get("event") == "epoch" and r.get("epoch", 0) >= epoch)]
        atomic_write(self.path, "".join(json.dumps(r) + "\n" for r in kept).encode())

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
        self.print(f"ddpkit: warning: --log {_name(sink)} failed ({type(exc).__name__}: {str(exc)[:200]}); "
                   f"training on without it (metrics.jsonl has every record)")


def _name(sink) -> str:
    return next((name for name, cls in LOGGERS.items() if isinstance(sink, cls)), type(sink).__name__)
