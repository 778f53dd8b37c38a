"""Metrics on one rank: device-side accumulation between log intervals, and peak memory.

The step only adds to a device tensor (:class:`Accumulator`); the loop reads it every
``--log-every`` steps through one all-reduce and one host copy. Metrics are (sum, count)
pairs, so the cross-rank reduction is exact by construction.
"""

from __future__ import annotations

import math
import resource
from dataclasses import dataclass
from typing import Optional

import torch

from ..dist.context import DistContext


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


# A loss this many times its first logged value, and this much above it (loss units: a loss near 0
# that rises tenfold is usually noise), is diverging.
DIVERGED_RATIO, DIVERGED_MARGIN = 10.0, 1.0


@dataclass
class DivergenceWatch:
    """Watches the loss at log intervals (values every rank already holds: the same verdict on every
    rank, no extra sync); saved in every snapshot as ``divergence``."""

    first_loss: Optional[float] = None  # the first logged interval's mean loss
    diverged_at_step: Optional[int] = None

    def check(self, loss: Optional[float], step: int) -> bool:
        """True the first time ``loss`` (finite) is far above the first logged loss."""
        if loss is None or not math.isfinite(loss):
            return False  # non-finite: --on-nan's business
        if self.first_loss is None:
            self.first_loss = loss
            return False
        if self.diverged_at_step is None and self.diverged(loss):
            self.diverged_at_step = step
            return True
        return False

    def diverged(self, loss: float) -> bool:
        first = self.first_loss
        return first is not None and first > 0 and loss > DIVERGED_RATIO * first and loss > first + DIVERGED_MARGIN
