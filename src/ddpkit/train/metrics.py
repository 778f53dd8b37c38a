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

from ..ranks.context import DistContext


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
        # one 0-d view per slot, for the parts added one by one (reset and load keep them: in place)
        self._sum_slots, self._count_slots = self.sums.unbind(0), self.counts.unbind(0)

    def add(self, values: list[tuple]) -> None:
        """``values``: one (sum, count) per name, each a tensor or a number. No host sync."""
        self._add(self.sums, self._sum_slots, self.host_sums, [v[0] for v in values])
        self._add(self.counts, self._count_slots, self.host_counts, [v[1] for v in values])

    @staticmethod
    def _add(dev: torch.Tensor, slots: tuple, host: list, parts: list) -> None:
        """Each part added in float64, as ``part.to(float64)`` rounds it: exact for float64 parts, and
        the same bits whether the parts go through one stack or one by one. No autograd: a part that
        requires grad is detached (the common ones, a detached loss and a count, do not)."""
        where, dtype = dev.device, None
        for part in parts:  # the common case: 0-d tensors of one dtype on this device, none needing grad
            if (
                not isinstance(part, torch.Tensor)
                or part.ndim
                or part.requires_grad
                or (dtype is not None and part.dtype != dtype)
                or part.device != where
            ):
                break
            dtype = part.dtype
        else:
            if parts:
                stacked = torch.stack(parts)
                dev += stacked if dtype == torch.float64 else stacked.to(torch.float64)
            return
        for i, part in enumerate(parts):  # numbers on the host, tensors one by one
            if isinstance(part, torch.Tensor):
                if part.requires_grad:
                    part = part.detach()
                if part.device != where or part.is_complex():  # the in-place add casts a real part to float64
                    part = part.to(device=where, dtype=torch.float64)
                slots[i].add_(part.reshape(()) if part.ndim else part)
            else:
                host[i] += float(part)

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
