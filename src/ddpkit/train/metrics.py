"""Metrics on one rank: device-side accumulation between log intervals, and peak memory.

The step only adds to a device tensor (:class:`Accumulator`); the loop reads it every
``--log-every`` steps through one all-reduce and one host copy. Metrics are (sum, count)
pairs, so the cross-rank reduction is exact by construction.
"""

from __future__ import annotations

import math
import resource
import zlib
from dataclasses import dataclass
from typing import Iterable, Optional

import torch

from ..errors import ConfigError, DdpkitError, RunDirError
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

    def copy(self) -> "Accumulator":
        """Another with these names and sums, on the device (no host copy): what a step computed again under
        --replicas goes back to."""
        other = Accumulator(self.names, self.device)
        other.sums.copy_(self.sums)
        other.counts.copy_(self.counts)
        other.host_sums, other.host_counts = list(self.host_sums), list(self.host_counts)
        return other

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


@dataclass(frozen=True)
class Synced:
    """What :func:`sync_interval` learned from every rank."""

    totals: list[float]  # [sums..., counts...] of the accumulator, summed over ranks (exact in float64)
    stop: bool  # some rank was sent a stop signal (SIGTERM, SIGUSR1, Ctrl-C)
    bad_weights: bool  # some rank holds a non-finite weight (only when asked: ``weights``)


# Every ddpkit all-reduce of sums sends a frame of one size on every rank: a header (which call it is, a hash
# of the names, flags) and FRAME metric slots. Ranks that reach different calls, or log a different number of
# names, then meet in a collective of equal size and learn it from the header, where tensors of unequal sizes
# abort inside gloo (``gloo::EnforceNotMet``, exit -6) and the peers blame a lost rank. More than FRAME names
# take a second all-reduce, of a size every rank then knows to be the same.
FRAME = 32  # metric names in the first all-reduce: 2 * 32 float64 (512 bytes) beside the header
HEAD = 7  # which call (and its square), the names' hash, their count (each with its square), past FRAME or not
FLAGS = 3  # flag slots in every frame (a safe point's stop, bad weights, failed write; reduce() sends zeros)
_CALLS = {"safe point": 1.0, "reduce": 2.0, "evaluate": 3.0}  # which collective a rank is in
_WHERE = {
    "safe point": "a safe point (loop.step(), a log interval)",
    "reduce": "loop.reduce()",
    "evaluate": "an evaluation (loop.evaluate(), or Trainer's of a split)",
}


def _agree(total: float, total_square: float, world_size: int) -> bool:
    """Every rank sent the same value x: sum(x)^2 == world * sum(x^2), equality in Cauchy-Schwarz (exact
    in float64 for the 16-bit values here)."""
    return total * total == world_size * total_square


def framed_sums(
    ctx: DistContext, call: str, names: tuple[str, ...], local: torch.Tensor, flags: torch.Tensor
) -> tuple[list[float] | None, list[float]]:
    """Sum ``local`` ([sums..., counts...] of ``names``, float64 on the device) and ``flags`` (float64 on
    the device) over every rank in one all-reduce and one host copy (two past FRAME names): (totals, flags),
    totals None where the ranks hold different names (the caller says so in its own words). Raises on every
    rank alike when the ranks are in different calls."""
    code = _CALLS[call]
    crc = float(zlib.crc32(",".join(names).encode()) & 0xFFFF)
    inline, n = len(names) <= FRAME, float(len(names))
    # The count agreed on its own: name sets whose 16-bit hashes collide, one past FRAME, would take other branches
    head = torch.tensor([code, code * code, crc, crc * crc, n, n * n, float(not inline)], dtype=torch.float64)
    assert head.numel() == HEAD
    body = local if inline else local.new_zeros(0)
    # [head, flags padded to FLAGS, body padded to 2 * FRAME]: the same size on every rank, whatever it sums
    frame = torch.cat(
        [
            head.to(ctx.device),
            flags,
            body.new_zeros(FLAGS - flags.numel()),
            body,
            body.new_zeros(2 * FRAME - body.numel()),
        ]
    )
    values = ctx.all_reduce(frame).tolist()
    codes, code_squares, crcs, crc_squares, counts, count_squares, overflow = values[:HEAD]
    summed_flags = values[HEAD : HEAD + flags.numel()]
    if not _agree(codes, code_squares, ctx.world_size):
        raise ConfigError(
            f"the ranks reached different ddpkit collectives (this rank: {_WHERE[call]}): call loop.reduce(), "
            f"loop.evaluate() and loop.best() on every rank, at the same place in the loop"
        )
    if not (_agree(crcs, crc_squares, ctx.world_size) and _agree(counts, count_squares, ctx.world_size)):
        return None, summed_flags
    if overflow:  # every rank holds the same names here: equal sizes
        return ctx.all_reduce(local).tolist(), summed_flags
    return values[HEAD + FLAGS : HEAD + FLAGS + 2 * len(names)], summed_flags


def sync_interval(
    ctx: DistContext,
    acc: Accumulator | None,
    *,
    stop: bool,
    log_error: DdpkitError | None,
    weights: Iterable[torch.Tensor] | None = None,
) -> Synced:
    """The one collective of a safe point (a log interval, a snapshot), for the engine and ``Loop`` alike: one
    all-reduce and one host copy of every rank's metric totals with its flags (:func:`framed_sums`), so a stop,
    a failed write and a bad weight are known to every rank at the same step, and every rank then decides
    the same.

    Raised on every rank together: rank 0's error writing ``metrics.jsonl`` or a snapshot in the background
    (``log_error``, the message printed there), ranks that accumulated different metric names (a 16-bit hash
    of the names, any number of them), and ranks in different collectives (one in ``loop.reduce()`` while
    another is here)."""
    names = acc.names if acc is not None else ()
    local = acc.local() if acc is not None else torch.zeros(0, dtype=torch.float64, device=ctx.device)
    flags = torch.tensor([float(stop), 0.0, float(log_error is not None)], dtype=torch.float64).to(ctx.device)
    if weights is not None:
        # Each tensor's least and greatest value: NaN propagates into both, an infinity shows in one. One pass
        # with no tensor of flags (isfinite().all() made one per weight: 20-30 ms for ResNet-9 on one CPU
        # thread, 3 ms so), in float64, which holds every float type's values and infinities exactly
        ends = [torch.stack(torch.aminmax(w.detach())).double() for w in weights if w.numel()]
        if ends:
            flags[1] = ~torch.cat(ends).isfinite().all()
    totals, (stopping, bad, failed) = framed_sums(ctx, "safe point", names, local, flags)
    if failed > 0:
        raise log_error or RunDirError(
            "global rank 0 could not write to the run directory (metrics.jsonl or a snapshot; its message is the "
            "one printed)"
        )
    if totals is None:
        raise ConfigError(
            f"the ranks logged different metric names (this rank: {', '.join(names) or 'none'}): log the same "
            f"names on every rank (loop.log(), or your task's metrics)"
        )
    return Synced(totals, stopping > 0, bad > 0)


def means(names: tuple[str, ...], totals: list[float], prefix: str = "") -> dict[str, float | None]:
    """{prefix+name: sum/count} from a [sums..., counts...] list (None where nothing was counted)."""
    k = len(names)
    return {prefix + name: (totals[i] / totals[k + i] if totals[k + i] else None) for i, name in enumerate(names)}


def add_named(acc: Accumulator | None, values: dict, device: torch.device) -> Accumulator:
    """``values`` added to ``acc`` by name, on the device (no host sync): a tensor or number is one value (its
    mean is over the calls; a tensor with elements adds each), a ``(sum, count)`` pair adds both. A new name
    makes a wider accumulator, carrying what was added so far; the one returned is the one to keep."""
    names = acc.names if acc is not None else ()
    if not set(values) <= set(names):
        wider = Accumulator(tuple(sorted(set(names) | set(values))), device)
        if acc is not None:
            k, totals = len(names), acc.local()  # on the device: no host sync
            at = {n: i for i, n in enumerate(names)}
            wider.add([(totals[at[n]], totals[k + at[n]]) if n in at else (0, 0) for n in wider.names])
        acc = wider
    pairs = []
    for name in acc.names:
        v = values.get(name)
        if name not in values:
            pairs.append((0, 0))
        elif isinstance(v, tuple):
            pairs.append((v[0].detach() if isinstance(v[0], torch.Tensor) else v[0], v[1]))
        elif isinstance(v, torch.Tensor):
            v = v.detach()
            pairs.append((v if v.ndim == 0 else v.sum(), 1 if v.ndim == 0 else v.numel()))
        else:
            pairs.append((v, 1))
    acc.add(pairs)
    return acc


def reduce_means(ctx: DistContext, values: dict) -> dict[str, float | None] | None:
    """Each value's mean over every rank now, a ``(sum, count)`` pair's sum/count (one all-reduce and a host
    copy); None where the ranks passed different names."""
    names = tuple(sorted(values))
    pairs = [values[n] if isinstance(values[n], tuple) else (values[n], 1) for n in names]
    dev = ctx.device
    none = torch.zeros(0, dtype=torch.float64, device=dev)
    local = torch.stack([as_f64(p[0], dev) for p in pairs] + [as_f64(p[1], dev) for p in pairs]) if pairs else none
    totals, _ = framed_sums(ctx, "reduce", names, local, none)
    return None if totals is None else means(names, totals)


def as_f64(x, device: torch.device) -> torch.Tensor:
    """``x`` (a tensor or a number) as a 0-d float64 tensor on ``device``, detached."""
    return torch.as_tensor(
        x.detach() if isinstance(x, torch.Tensor) else x, dtype=torch.float64, device=device
    ).reshape(())


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
