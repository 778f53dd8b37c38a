"""The protocol between a training loop and the parts, written once: ``Trainer``'s engine and ``ddpkit.Loop``
are two faces over it.

    session = Session(ctx, run_dir, key, log, keep=2, every_steps=100)
    with session.signal:                                   # SIGTERM, SIGUSR1, Ctrl-C: a stop at a safe point
        snap = session.resume(load, seed, fits)            # the state, the loaders, then the RNG streams
        session.begin(step, epoch, write_record, **start)  # the records of steps run again dropped; "start"
        ...each step...
        synced = session.sync(acc)                         # a safe point's one collective
        if synced.stop:
            session.stop(step, epoch, state)               # save, record, and raise Stopped
        session.save_if_due(step, state)                   # every ``every_steps``, and at epoch ends
        session.write_best({"model": model}, metric, value, step)   # best.pt

What a face adds is its own: the engine's built-in recipe (sources, optimizer and schedule, the step,
``--cuda-graph``, ``--join``), the Loop's user-facing calls. What the session decides is decided here alone:
when a snapshot is due and that a step is saved once, that a stop saves, records and raises (the one
``raise Stopped`` in ddpkit), the one ``best.pt`` writer, the restore order, and autocast with its scaler
(:class:`Amp`). Every method is called on every rank: the collectives are inside, and what only global
rank 0 writes, it writes inside the method that decides it (``ranks.context.on_rank0``).

A snapshot's own parts are checked here too, before anything is loaded (:func:`misfit`), and held to what
``torch.load(weights_only=True)`` reads back (:func:`check_plain`).
"""

from __future__ import annotations

import collections
import statistics
import time
from contextlib import nullcontext
from pathlib import Path
from typing import Any, Callable, NoReturn

import torch
from torch import nn

from ..errors import ConfigError, NonFiniteLoss, RunDirError, Stopped
from ..files import atomic_write, torch_bytes
from ..ranks import env
from ..ranks.context import DistContext, on_rank0
from ..ranks.endnotes import note_run_end
from ..run import shards
from ..run.checkpoint import Checkpointer, split_by_rank, weights_mismatch
from ..run.paths import RunFiles
from ..run.recorder import MetricLogger
from ..run.runkey import RunKey
from .ddp import DDPStrategy
from .metrics import Accumulator, Synced, sync_interval
from .optim import NoAutocast
from .selection import Watch
from .signals import StopSignal

RESUME = "run the same command again to resume from it"
PLAIN = (int, float, bool, str, type(None))  # what a snapshot holds besides tensors (torch.load weights_only)
AMP_DTYPES = {None: None, "none": None, "off": None, "bf16": torch.bfloat16, "fp16": torch.float16}


class Session:
    """One rank's side of a run: its snapshots, stop signals, records and best weights. See the module docstring."""

    def __init__(
        self,
        ctx: DistContext,
        run_dir: str | Path,
        key: RunKey,
        log: MetricLogger,
        *,
        keep: int = 2,
        every_steps: int = 0,
        new_run: str = "pass a new --run-dir",
        signal: StopSignal | None = None,
        background: bool = False,
        strategy: Any = None,
    ):
        self.ctx, self.log, self.every_steps = ctx, log, every_steps
        # how the models are spread over the ranks (train/strategy.py): best.pt asks it for their weights
        self.strategy = strategy if strategy is not None else DDPStrategy()
        self.files = RunFiles(run_dir)
        # background: a snapshot is copied aside and written by a thread on rank 0 while the steps go on
        self.ckpt = Checkpointer(run_dir, ctx, key, keep=keep, new_run=new_run, background=background)
        # Entered by the face around its steps; a face may enter its own earlier (Loop: before anything else)
        self.signal = signal if signal is not None else StopSignal()
        self.last_saved = -1  # the step of the newest snapshot this rank saved or resumed from
        self.blocked_s: list[float] = []  # per snapshot, the seconds it held this rank's step (state, checks, save)
        self._told = (0, 0)  # how many held times (above) and write times (the checkpointer's) records gave
        self._pending: tuple[int, int] | None = None  # a replica group's begin, until its first quorum (begin)

    # ------------------------------------------------------------------ snapshots
    def snapshot_due(self, step: int, epoch_end: bool = False) -> bool:
        """A snapshot is due at every epoch's end and every ``every_steps`` steps, once per step."""
        due = epoch_end or bool(self.every_steps and step % self.every_steps == 0)
        return due and step != self.last_saved

    def save(self, state: dict | Callable[[], dict], step: int) -> Path:
        """Snapshot ``state`` (or what the callable returns) at ``step``: every rank; rank 0 writes."""
        t0 = time.perf_counter()
        path = self.ckpt.save(state() if callable(state) else state, step)
        self.last_saved = step
        self.blocked_s.append(time.perf_counter() - t0)
        return path

    def save_if_due(self, step: int, state: Callable[[], dict], epoch_end: bool = False) -> Path | None:
        return self.save(state, step) if self.snapshot_due(step, epoch_end) else None

    def resume(
        self, load: Callable[[dict], None], seed: int, fits: Callable[[dict], None] = lambda snap: None, warn=print
    ) -> dict | None:
        """The newest snapshot that fits, loaded in the one order that keeps a resume bitwise: ``load`` gets
        what ``Checkpointer.restore`` gives back (the state, then it sets the loaders' positions), and the RNG
        streams come last, so nothing a ``load_state_dict`` draws moves them. None: nothing to resume."""
        snap = self.ckpt.load_latest(fits, warn=warn)
        if snap is None:
            return None
        load(self.ckpt.restore(snap))
        self.ckpt.restore_rng(snap, seed)
        self.last_saved = snap["global_step"]
        return snap

    # ------------------------------------------------------------------ the safe point
    def sync(self, acc: Accumulator | None, weights: list[torch.Tensor] | None = None) -> Synced:
        """The safe point's one collective (``metrics.sync_interval``): the metric totals, the stop flag of
        every rank, and (``weights`` given) whether any rank holds a non-finite weight."""
        # rank 0's failed write, of the records or of a snapshot written in the background: every rank stops here
        error = self.log.error or self.ckpt.write_error()
        return sync_interval(self.ctx, acc, stop=self.signal.received is not None, log_error=error, weights=weights)

    def stop(self, step: int, epoch: int, state: Callable[[], dict], again: str = RESUME) -> NoReturn:
        """Every rank, once the all-reduced flag says a rank was signalled: the snapshot (unless this step's
        is saved already), the ``stopped`` record, and :class:`ddpkit.errors.Stopped` with the signal's exit
        status. A rank told only through the flag stops as for SIGTERM."""
        path = self.save(state, step) if step != self.last_saved else self.ckpt.path_of(step)
        self.ckpt.wait()  # the process ends next: the snapshot it names is whole first
        name = self.signal.received or "SIGTERM"
        self.log.log("stopped", reason="signal", signal=name, step=step)
        raise Stopped(f"stopped on {name} at step {step} (epoch {epoch}); saved {path}; {again}", name)

    def stop_non_finite(self, what: str, step: int) -> NoReturn:
        """Every rank, once the all-reduced metrics say ``what`` became NaN or Inf (``--on-nan stop``): the
        ``stopped`` record and :class:`ddpkit.errors.NonFiniteLoss`, naming the last good snapshot; nothing is
        saved (a snapshot of non-finite weights would be resumed into the same NaN)."""
        self.ckpt.wait()  # the write in flight, if any, is of good weights (the check runs before each snapshot)
        last = self.ckpt.snapshots()
        self.log.log("stopped", reason="non-finite", step=step)
        raise NonFiniteLoss(
            f"{what}. Stopped without saving it: the last good snapshot is "
            f"{last[0] if last else '(none yet)'}, and model.pt was not written. Lower --lr, check "
            f"the data, or prefer --amp bf16 to fp16; --on-nan warn trains on regardless."
        )

    def snapshot_figures(self) -> dict:
        """How long this attempt's snapshots held the step, on this rank (rank 0's, which writes, is the one
        summary.json and a Loop's ``end`` record give): in the background the gather and the copy aside,
        in the step the whole write."""
        held = self.blocked_s
        return {
            "snapshots": "background" if self.ckpt.background else "in the step",
            "snapshots_saved": len(held),
            "snapshot_blocked_ms_median": round(1e3 * statistics.median(held), 3) if held else None,
            "snapshot_blocked_s_total": round(sum(held), 4),
            # host memory held for the copy aside (this rank's; background only): the snapshot's state, once, on
            # rank 0 (whose figures are written); under FSDP2 each rank also holds its own shards'
            "snapshot_staging_mb": round(self.ckpt.staging_bytes / 2**20, 1),
        }

    def interval_figures(self) -> dict:
        """For a step record (rank 0's is written): the seconds snapshots held the steps since the last record
        (``snapshot_blocked_s``) and the seconds of the background writes that ended meanwhile
        (``snapshot_write_s``: a record's samples/s beside it shows what a write running on a core of its own
        costs the steps, on a machine with no core to spare). Empty when no snapshot was taken or written."""
        held, wrote = self.blocked_s[self._told[0] :], self.ckpt.write_s[self._told[1] :]
        self._told = (self._told[0] + len(held), self._told[1] + len(wrote))
        out = {}
        if held:
            out["snapshot_blocked_s"] = round(sum(held), 4)
        if wrote:
            out["snapshot_write_s"] = round(sum(wrote), 4)
        return out

    def finish(self) -> None:
        """Every rank, at the end of the steps: the snapshot write in flight, if any, whole (or its failure
        raised on every rank) before the run's last files are written."""
        self.ckpt.wait()

    def mark_finished(self, step: int, epoch: int, rerun: str) -> None:
        """Every rank, once the run's last files are whole: global rank 0 writes ``checkpoints/finished`` (the
        step; a rerun of a Loop says that it resumed a finished run) and leaves its launcher a note
        (ranks/endnotes.py), so that a stop signal from now on is not said as an interruption of the run;
        ``rerun``: what running the same command again does, in the launcher's line then."""

        def write():
            atomic_write(self.files.finished, str(step).encode())
            note_run_end(self.files.root, step, epoch, rerun)

        on_rank0(self.ctx, write, "writing checkpoints/finished")

    def close(self) -> None:
        """This rank, however the run ends (an error included): the write in flight ended, with no collective."""
        self.ckpt.close()

    # ------------------------------------------------------------------ the run record
    def begin(
        self,
        step: int,
        epoch: int,
        write_record: Callable[[], None],
        models: list[nn.Module] = (),
        replica: bool = False,
        **start: Any,
    ) -> None:
        """The start of an attempt: the records of the steps that run again dropped (rank 0), the run's
        config written (``write_record``, which writes on rank 0 itself), and the ``start`` record, which
        names the strategy and the parameter bytes each rank holds of ``models`` (its shards under FSDP2;
        the gradients take as many again, and the optimizer state its own multiple: Adam's two moments).

        ``replica``: a replica group (``--replicas``), whose records are dropped, and loggers opened, at
        :meth:`first_quorum` instead: a group restarted from its own snapshot heals there to the step the
        others are at, and the steps it committed between that snapshot and its loss are the run's, not steps
        run again (before, they were dropped, and the group's records had a hole from its snapshot to its heal)."""
        self._pending = (step, epoch) if replica else None
        if not replica:
            on_rank0(self.ctx, lambda: self.log.begin(step, epoch))
        write_record()
        ctx = self.ctx
        # How snapshots are written: in the background (copied aside at the step, then written by a thread on
        # rank 0), or in the step (every rank waits while rank 0 writes)
        snapshots = "background" if self.ckpt.background else "in the step"
        self.log.log(
            "start",
            world_size=ctx.world_size,
            backend=ctx.backend,
            device=str(ctx.device),
            **start,
            restart_count=env.restart_count(),  # the elastic agent's restarts of this job so far (either face's)
            strategy=self.strategy.name,
            param_mb_per_rank=round(
                sum(t.numel() * t.element_size() for m in models for t in self.strategy.local_parameters(m)) / 2**20, 3
            ),
            snapshots=snapshots,
        )

    def first_quorum(self, step: int, epoch: int) -> None:
        """A replica group's first quorum has formed, a heal included: it trains from ``step`` on. The records
        of later steps run again (dropped), and its loggers start there. Called too by a face about to write
        records with no quorum before them (an attempt with no step left: a cut-short epoch's end, the run's);
        once an attempt, after :meth:`begin` said ``replica``."""
        if self._pending is None:
            return
        self._pending = None
        on_rank0(self.ctx, lambda: self.log.begin(step, epoch))

    # ------------------------------------------------------------------ best.pt
    def keep_best(self, watch: Watch, result: dict, step: int, modules: dict[str, nn.Module]) -> bool:
        """``--keep-best`` and ``Loop.best`` alike: when ``result`` (the same on every rank) holds a new best
        of ``watch``'s metric (``selection.Watch``: a NaN never is one), ``best.pt`` is written. True then."""
        if not watch.update(result, step):
            return False
        self.write_best(modules, watch.metric, watch.value, step)
        return True

    def write_best(self, modules: dict[str, nn.Module], metric: str, value: float, step: int) -> None:
        """The one ``best.pt`` writer, for ``--keep-best`` and ``Loop.best`` alike: each module's weights (the
        whole ``state_dict``, as the strategy gathers it) by name, with the metric, its value and the step.
        Rank 0 writes; ``torch.load(path)["weights"]["model"]`` loads with ``load_state_dict``."""

        # Every rank: under a sharded strategy gathering the weights is a collective (rank 0 gets them)
        states = {name: self.strategy.model_state(m) for name, m in modules.items()}

        def write():
            weights = {name: to_host(state) for name, state in states.items()}
            blob = {"metric": metric, "value": value, "step": step, "weights": weights}
            atomic_write(self.files.best, torch_bytes(blob))

        on_rank0(self.ctx, write, "writing best.pt")


class Amp:
    """Autocast and its grad scaler, for ``--amp`` / ``Loop(amp=...)``: ``none`` or ``off``, ``bf16``,
    ``fp16``. Only fp16 scales the loss: bf16 has float32's exponent range. The scaler always exists
    (disabled, it passes everything through), so a face calls it the same way at every setting.

    The two names of "no autocast" differ inside an autocast of the caller's: ``--amp none`` promises
    float32 and turns it off; ``Loop(amp="off")`` adds nothing and leaves the user's own as it is."""

    def __init__(self, amp: str | None, device: torch.device):
        if amp not in AMP_DTYPES:
            raise ConfigError(f"amp {amp!r}: choose none, bf16 or fp16")
        self.name, self.dtype, self.device_type = amp, AMP_DTYPES[amp], device.type
        self.scaler = torch.amp.GradScaler(device.type, enabled=self.dtype is torch.float16)

    def autocast(self):
        """The context a forward runs in. Amp off: :class:`optim.NoAutocast`, not a disabled
        ``torch.autocast`` (which costs host time at every entry, BENCHMARKS.md)."""
        if self.dtype is None:
            return nullcontext() if self.name == "off" else NoAutocast(self.device_type)
        return torch.autocast(self.device_type, dtype=self.dtype)

    @property
    def scaling(self) -> bool:
        return self.scaler.is_enabled()

    def backward(self, loss: torch.Tensor) -> None:
        self.scaler.scale(loss).backward()

    def unscale_(self, optimizer: torch.optim.Optimizer) -> None:
        """Before clipping: the true gradients, not the fp16-scaled ones."""
        self.scaler.unscale_(optimizer)

    def step(self, optimizer: torch.optim.Optimizer) -> None:
        self.scaler.step(optimizer)
        self.scaler.update()


# ---------------------------------------------------------------------- a snapshot's parts
def misfit(target: Any, saved: Any) -> str:
    """How a snapshot's ``saved`` state fails to fit ``target`` ("" if it loads): a module's tensors by name
    and shape, an optimizer's parameter groups by size. Found before anything is loaded, where
    ``load_state_dict`` would fail half-way with a traceback per rank. ``target`` is unwrapped already."""
    if isinstance(target, nn.Module):
        if not isinstance(saved, dict):
            return "the snapshot holds no module weights there"
        tensors = lambda sd: {k: v for k, v in sd.items() if isinstance(v, torch.Tensor)}  # noqa: E731 - not extra state
        if shards.is_ref(saved):  # sharded: the names and whole shapes DCP's metadata records
            found = shards.saved_shapes(Path(saved["folder"]), saved["key"])
            saved = {name: torch.empty(shape, device="meta") for name, shape in found.items()}
        return weights_mismatch(tensors(target.state_dict()), tensors(saved))
    if shards.is_ref(saved):
        return ""  # a sharded optimizer state, keyed by parameter names: DCP matches them as it loads
    if isinstance(target, torch.optim.Optimizer):
        groups = saved.get("param_groups") if isinstance(saved, dict) else None
        if not isinstance(groups, list):
            return "the snapshot holds no optimizer state there"
        mine = [len(g["params"]) for g in target.param_groups]
        theirs = [len(g.get("params", ())) for g in groups]
        return "" if mine == theirs else f"parameters per group {theirs} in the snapshot, {mine} here"
    return ""


def named_state(ctx: DistContext, strategy: Any, state: dict, models: list, where: str) -> tuple[dict, dict]:
    """A named state (``Loop.resume``'s) as a snapshot holds it, split into (shared, per_rank) by one collective
    (``run/checkpoint.split_by_rank``): each object's ``state_dict`` (the strategy's module unwrapped) or plain
    value, on the host, checked readable by ``torch.load(weights_only=True)`` before anything is written. The
    ``models`` the strategy keeps equal on every rank (DDP with broadcast_buffers) are not hashed. Every rank."""
    values = {name: to_host(state_of(strategy, v, ctx)) for name, v in state.items()}
    for name, value in values.items():
        check_plain(name, value, where)
    kept = {id(strategy.unwrap(m)) for m in models if strategy.replicated(m)}
    replicated = frozenset(
        name
        for name, v in state.items()
        if id(strategy.unwrap(v)) in kept or (isinstance(v, torch.optim.Optimizer) and strategy.replicated(v))
    )
    return split_by_rank(ctx, values, replicated)


def state_of(strategy: Any, obj: Any, ctx: DistContext) -> Any:
    """What a snapshot holds of one named object: a model's and an optimizer's state as the strategy gives
    it (under FSDP2 each rank's shards, which it writes itself: run/shards.py), another object's
    ``state_dict``, or the plain value."""
    if isinstance(strategy.unwrap(obj), nn.Module):
        return strategy.snapshot_model(obj)
    if isinstance(obj, torch.optim.Optimizer):
        return strategy.snapshot_optimizer(obj, ctx)
    return obj.state_dict() if hasattr(obj, "state_dict") else obj


def load_state(strategy: Any, obj: Any, value: Any, models: list) -> None:
    """:func:`state_of`'s value back into ``obj``, through the strategy for models and optimizers."""
    if isinstance(strategy.unwrap(obj), nn.Module):
        strategy.load_model_state(obj, value)
    elif isinstance(obj, torch.optim.Optimizer):
        strategy.load_optimizer_state(obj, value, models)
    else:
        obj.load_state_dict(value)


def load_named(
    state: dict, shared: dict, per_rank: list, mine: dict, strategy: Any, run_dir: str, models: list = ()
) -> None:
    """A snapshot's named state into ``state`` (what :func:`named_state` saved: ``shared``, the names saved
    ``per_rank``, and this rank's own values ``mine``): objects loaded in place, plain values replaced. Every
    name and every part is checked (:func:`misfit`) before anything is loaded: nothing half-resumed."""
    names = [*shared, *per_rank]
    extra, missing = [n for n in names if n not in state], [n for n in state if n not in names]
    if extra or missing:
        what = f"holds {', '.join(map(repr, extra))}, which this resume() was not given" if extra else ""
        what += ("; " if extra and missing else "") + (f"holds no {', '.join(map(repr, missing))}" if missing else "")
        raise RunDirError(
            f"the snapshot in {run_dir} {what}: name the same state as the run that made it, "
            f"or pass another run_dir to Loop"
        )
    values = {**shared, **mine}
    for name, value in values.items():
        problem = misfit(strategy.unwrap(state[name]), value)
        if problem:
            raise RunDirError(
                f"the snapshot in {run_dir} does not fit {name!r}: {problem}; build it as the run "
                f"that made the snapshot did, or pass another run_dir to Loop"
            )
    for name, value in values.items():
        if hasattr(state[name], "load_state_dict"):
            load_state(strategy, state[name], value, models)
        else:
            state[name] = value


def check_plain(name: str, value: Any, where: str) -> None:
    """Raise unless ``value`` is what ``torch.load(weights_only=True)`` reads back; ``where`` names the call."""
    if type(value) in PLAIN or isinstance(value, (torch.Tensor, shards.Sharded)):  # exact types: numpy's
        return  # float64 is a float too, and torch.load(weights_only=True) refuses it; shards are DCP's to write
    if type(value) in (list, tuple):
        for v in value:
            check_plain(name, v, where)
        return
    if type(value) in (dict, collections.OrderedDict):
        for k, v in value.items():
            check_plain(name, k, where)
            check_plain(name, v, where)
        return
    raise ConfigError(
        f"{where}: {name!r} holds {type(value).__module__}.{type(value).__qualname__}, which a snapshot "
        f"cannot hold: pass an object with state_dict(), or plain values (numbers, strings, tensors, lists, "
        f"dicts); convert numpy values with float() or torch.as_tensor()"
    )


def to_host(tree: Any) -> Any:
    """``tree`` with every tensor detached and on the CPU (what a snapshot or best.pt holds)."""
    if isinstance(tree, torch.Tensor):
        return tree.detach().cpu()
    if isinstance(tree, dict):
        return {k: to_host(v) for k, v in tree.items()}
    if isinstance(tree, (list, tuple)):
        return type(tree)(to_host(v) for v in tree)
    return tree
