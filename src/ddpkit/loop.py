"""Your own loop, with ddpkit's guarantees: the DDP tutorial's five changes, one call each.

    with ddpkit.Loop("runs/gpt", log_every=50, save_every_steps=100) as loop:   # 1. the process group
        model = loop.wrap(GPT(cfg))                          # 2. to the rank's device, DDP-wrapped
        opt = torch.optim.AdamW(model.parameters(), lr=6e-4)  #    (your optimizer, as you wrote it)
        loader = loop.data(train_loader)                     # 3. this rank's share, position saved
        state = loop.resume(model=model, optimizer=opt, best=1e9)   # 4. what a snapshot holds; reloaded
        for step in loop.steps(5000):                        # 5. safe points: snapshots, stop, records
            ...your step, as written...
            loop.log(loss=loss)                              #    a tensor: no host sync

Under ``torchrun``, ``ddpkit.launch(main)``, SLURM or plain ``python``: where a process group exists
already (``ddpkit.launch``, or your own ``init_process_group``) the Loop uses it and leaves it to its
owner; otherwise it makes one (:func:`ddpkit.ranks.context.distributed`) and destroys it on exit.

What it adds, and the parts it is built from (the same ones ``Trainer`` uses):

- **snapshots** (``run/checkpoint.py``'s ``Checkpointer``: rank 0 writes, checksummed, pruned to
  ``keep_snapshots``): what ``resume()`` names, every rank's RNG states (torch, CUDA, numpy,
  random) and each ``data()`` loader's position, at every ``save_every_steps``-th step, at each
  ``epochs()`` end, at the end, and at the next log interval after SIGTERM/SIGUSR1/Ctrl-C (then
  :class:`ddpkit.errors.Stopped`). Rerunning the same command resumes there, bitwise at the same
  world size; at another, the RNG streams are reseeded from (seed, step, rank), said in one line.
- **metrics** (``train/metrics.py``'s ``Accumulator``): ``log()`` adds (sum, count) pairs on the
  device; every ``log_every`` steps one all-reduce makes exact means over ranks, written by rank 0
  to ``metrics.jsonl`` (``run/recorder.py``) and shown on the console. ``evaluate()`` runs over a
  whole split with no padded duplicates. ``best()`` keeps the best weights by a metric.
- **the hang report**: each safe point is the heartbeat the hang watch (``ranks/hangwatch.py``)
  judges a rank late by, with the line it waits at.
- **the run identity** (``identity.py``): the code of the function that made the Loop, read as a
  loss function is read for ``Trainer``; a snapshot made by other code is refused in one line.

Nothing else changes: your optimizer, schedule, loss, dtype, batch size and data are used as
given; what ddpkit changes when asked (SyncBatchNorm, autocast) is said on the ``[start]`` line.
"""

from __future__ import annotations

import atexit
import collections
import hashlib
import json
import math
import os
import sys
import time
import traceback
import types
from contextlib import ExitStack, contextmanager, nullcontext
from dataclasses import asdict, dataclass
from typing import Any, Callable, Iterator

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, DistributedSampler, Subset

from .config import check_timeout_s
from .data.batch import leading_size, tree_map
from .data.shard import ShardedLoader
from .device import resolve_device_type
from .errors import ConfigError, DdpkitError, RunDirError, Stopped
from .files import atomic_write, torch_bytes
from .identity import Script, code_fingerprint, script_at
from .ranks import env, hangwatch
from .ranks.context import DistContext, deterministic, distributed, on_rank0
from .ranks.env import under_launcher
from .ranks.failures import exit_status, stop_exits_with_its_status
from .run.checkpoint import Checkpointer, split_by_rank, weights_mismatch
from .run.paths import RunFiles
from .run.recorder import MetricLogger
from .run.rundir import describe_difference
from .train.ddp import make_ddp
from .train.metrics import Accumulator, framed_sums, sync_interval
from .train.signals import StopSignal
from .train.syncbn import convert_sync_batchnorm

AMP = {"off": None, "bf16": torch.bfloat16, "fp16": torch.float16}
PLAIN = (int, float, bool, str, type(None))  # what a snapshot holds besides tensors (torch.load weights_only)
STOP_CHECK = 50  # steps between reads of the stop flag when log_every=0 (one all-reduce each)


@dataclass(frozen=True)
class LoopConfig:
    """What the user asked of a :class:`Loop`; saved as ``loop.json`` in the run dir."""

    run_dir: str = "runs/loop"
    device: str = "auto"  # auto (cuda when there is a GPU), cpu, cuda
    seed: int = 0  # the reseed at another world size, and the per-batch draws of DataLoader workers
    amp: str = "off"  # off, bf16, fp16 (fp16 adds a GradScaler, used by backward/optimizer_step)
    sync_bn: bool = False  # every BatchNorm made synchronised across ranks by wrap()
    deterministic: bool = False  # torch.use_deterministic_algorithms, cuDNN deterministic
    save_every_steps: int = 0  # 0: snapshots at each epochs() end, at the end, and on a stop only
    keep_snapshots: int = 2
    log_every: int = 50  # steps per record; a stop signal is acted on at the next one
    timeout_s: float = 600.0  # collectives and the hang watch (seconds)
    check_code: bool = True  # refuse a snapshot that other code (the loop function's) made

    # What a snapshot is matched on, with the loop's code: the rest may differ between runs.
    HASHED = ("seed", "amp", "sync_bn", "deterministic")

    def validate(self) -> None:
        if self.amp not in AMP:
            raise ConfigError(f"Loop(amp={self.amp!r}): choose one of {', '.join(AMP)}")
        if self.device not in ("auto", "cpu", "cuda"):
            raise ConfigError(f"Loop(device={self.device!r}): choose auto, cpu or cuda")
        for name in ("save_every_steps", "log_every", "keep_snapshots"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < (1 if name == "keep_snapshots" else 0):
                raise ConfigError(f"Loop({name}={value!r}): expected an int >= {int(name == 'keep_snapshots')}")
        if not isinstance(self.seed, int) or isinstance(self.seed, bool):
            raise ConfigError(f"Loop(seed={self.seed!r}): expected an int")
        check_timeout_s(self.timeout_s, "Loop(timeout_s=...)")


class _RunKey:
    """What a snapshot's ``config`` is matched on (the duck type ``Checkpointer`` reads of a config):
    the hashed fields of :class:`LoopConfig` and the loop's code."""

    join = False  # Trainer's --join; a Loop's data split is its own

    def __init__(self, config: LoopConfig, code: dict):
        self.config, self.code = config, code

    def to_dict(self) -> dict:
        return {**asdict(self.config), "code": self.code}

    def _keyed(self, d: dict) -> dict:
        keyed = {k: d.get(k) for k in LoopConfig.HASHED}
        if self.config.check_code:
            keyed["code"] = d.get("code")
        return keyed

    def hash(self) -> str:
        return hashlib.sha256(json.dumps(self._keyed(self.to_dict()), sort_keys=True).encode()).hexdigest()[:16]

    def differing_keys(self, other: dict) -> list[str]:
        """What differs from a snapshot's config, in words: the loop's code by the parts that differ, as
        Trainer's identity names them (``global learning_rate 0.0006 -> 0.001``). The code compares on what
        was read: a snapshot whose code was not read (an older ddpkit's Loop made at a script's top level)
        matches on the rest, as it did then."""
        mine, theirs = self._keyed(self.to_dict()), self._keyed(other)
        keys = [k for k in mine if k != "code" and mine[k] != theirs.get(k)]
        now, before = mine.get("code") or {}, theirs.get("code") or {}
        if "code" in mine and before.get("parts") and now.get("parts") != before.get("parts"):
            key = "the loop's code in"  # said as "the loop's code in train.py: global learning_rate 0.0006 -> 0.001"
            said = describe_difference(key, None, None, {key: before}, {key: now})
            keys.append(f"{said} (Loop(check_code=False) resumes anyway)")
        return keys


class State(dict):
    """What :meth:`Loop.resume` was given, by name, as a snapshot holds it; after a resume, its plain
    values are the snapshot's. ``step`` and ``epoch``: the loop's position (steps and epochs done)."""

    step: int = 0
    epoch: int = 0


class Loop:
    """See the module docstring. Every method that says "every rank" is a collective: call it on all."""

    def __init__(
        self,
        run_dir: str = "runs/loop",
        *,
        device: str = "auto",
        seed: int = 0,
        amp: str = "off",
        sync_bn: bool = False,
        deterministic: bool = False,
        save_every_steps: int = 0,
        keep_snapshots: int = 2,
        log_every: int = 50,
        timeout_s: float = 600.0,
        check_code: bool = True,
    ):
        self.config = LoopConfig(
            str(run_dir),
            device,
            seed,
            amp,
            sync_bn,
            deterministic,
            save_every_steps,
            keep_snapshots,
            log_every,
            timeout_s,
            check_code,
        )
        self.config.validate()
        stop_exits_with_its_status()  # an uncaught Stopped ends the script with 143, not a traceback and 1
        self._maker = _caller_function(sys._getframe(1))  # the run identity reads the loop's own code
        self.ctx: DistContext | None = None
        self._stack = ExitStack()
        self._owns_group = False
        self.state: State | None = None
        self._models: list[nn.Module] = []
        self._loaders: list[ShardedLoader] = []
        self._pending_loaders: list[dict] = []  # positions from a snapshot, for loaders made after resume()
        self._scaler = None
        self._acc: Accumulator | None = None
        self._changes: list[str] = []
        self._best: dict = {}
        self._last_saved = -1
        self._reset: list[str] = []  # per-rank values an elastic resume left as resume() gave them
        self.metrics: dict[str, float | None] = {}  # the last record's means, the same on every rank

    # ------------------------------------------------------------------ 1. the process group
    def __enter__(self) -> "Loop":
        try:
            if dist.is_available() and dist.is_initialized():
                self.ctx = _adopted_context(self.config.device)
                self._stack.enter_context(deterministic(self.config.deterministic))  # the group's owner's timeout
            else:
                # The process's intra-op threads as it has them (torchrun's OMP_NUM_THREADS=1, or yours):
                # distributed() would set cores / ranks, and CPU kernels' results depend on the thread count.
                threads = torch.get_num_threads()
                self.ctx = self._stack.enter_context(
                    distributed(self.config.device, self.config.timeout_s, self.config.deterministic)
                )
                torch.set_num_threads(threads)
                self._owns_group = True
            self._stop = self._stack.enter_context(StopSignal())
            self.files = RunFiles(self.config.run_dir)
            code = self._identity()
            self.key = _RunKey(self.config, code)
            self.ckpt = Checkpointer(
                self.config.run_dir,
                self.ctx,
                self.key,
                keep=self.config.keep_snapshots,
                every_steps=self.config.save_every_steps,
                new_run="pass another run_dir to Loop",
            )
            self.log_writer = MetricLogger(self.ctx, self.files.root, 0, progress=False, config=self.key.to_dict())
            self._stack.callback(self.log_writer.close)
            on_rank0(self.ctx, lambda: self.files.checkpoints.mkdir(parents=True, exist_ok=True), "making the run dir")
            hangwatch.report_to(self.config.run_dir)
            if AMP[self.config.amp] is torch.float16:
                self._scaler = torch.amp.GradScaler(self.ctx.device.type)
        except BaseException:
            self._stack.__exit__(*sys.exc_info())
            raise
        return self

    def __exit__(self, exc_type, exc, tb) -> bool:
        raised_here = None  # an error of the final save or of the teardown, raised instead of nothing
        if exc_type is None and self.state is not None:
            try:
                if self._last_saved != self.state.step:
                    self._save(finished=True)  # a rerun resumes here: at the end
                self.log_writer.log("end", step=self.state.step, epoch=self.state.epoch)
            except BaseException as error:  # noqa: BLE001 - said below as any error in the loop is
                exc_type, exc, tb = type(error), error, error.__traceback__
                raised_here = error
        try:
            if self._stack.__exit__(exc_type, exc, tb):
                return True
        except DdpkitError as error:  # the group's teardown names the failure (a lost peer, a timeout)
            exc = raised_here = error
        if isinstance(exc, DdpkitError) and self._owns_group and under_launcher():
            # A script under torchrun (or srun), where nothing above catches it: one line, once, and its exit
            # status (143 on a stop), not one traceback per rank. Elsewhere the error is raised as it is.
            raise SystemExit(exit_status(exc)) from None
        if raised_here is not None:
            raise raised_here
        return False  # the loop's own exception, if any, goes on as it was

    @classmethod
    def start(cls, run_dir: str = "runs/loop", **settings: Any) -> "Loop":
        """A Loop for a script's top level, with no ``with`` and so no re-indent of the script below it::

            loop = ddpkit.Loop.start("out", save_every_steps=100)   # the process group, run dir, stop signals
            ...the rest of the script, as written...

        It is closed when the script ends (``atexit``), as the ``with`` block's end closes it: the final
        snapshot and record on success, the group torn down either way; or earlier by :meth:`close`. An
        error the script does not catch is said as the ``with`` form says it (one line, its exit status)."""
        loop = cls(run_dir, **settings)
        loop._maker = _caller_function(sys._getframe(1))  # the script's code, not this method's
        loop.__enter__()
        loop._uncaught = None
        previous = sys.excepthook

        def seen(kind, exc, tb):  # the script's uncaught error: close() must not save after it
            loop._uncaught = exc
            previous(kind, exc, tb)

        sys.excepthook = seen
        atexit.register(loop._close_at_exit)
        return loop

    def close(self) -> None:
        """End a :meth:`start`-ed Loop now, as leaving a ``with`` block does with no error: the final
        snapshot and record, then the group's teardown. Every rank. Closing twice does nothing."""
        if self.ctx is not None and not getattr(self, "_closed", False):
            self._closed = True
            self.__exit__(None, None, None)

    def _close_at_exit(self) -> None:
        if self.ctx is None or getattr(self, "_closed", False):
            return
        self._closed = True
        exc = getattr(self, "_uncaught", None)
        if exc is not None:  # said already, by the excepthook, with its status: the teardown is all that is left
            exc.already_said = True  # its line or traceback: the teardown notes the cause, prints it no more
            try:
                self._stack.__exit__(type(exc), exc, exc.__traceback__)
            except Exception:  # noqa: BLE001 - a teardown after a failure fails too (a lost peer); said already
                pass
            return
        try:
            self.__exit__(None, None, None)
        except SystemExit as done:  # a launcher's one line, printed by __exit__: its status is the process's
            _exit_now(done.code if isinstance(done.code, int) else 1)
        except DdpkitError as error:  # the final save or the teardown failed after the script ended
            _exit_now(exit_status(error))
        except BaseException:  # noqa: BLE001 - a bug there: its traceback, and a failed status, not 0
            traceback.print_exc()
            _exit_now(1)

    @property
    def rank(self) -> int:
        return self.ctx.rank

    @property
    def world_size(self) -> int:
        return self.ctx.world_size

    @property
    def device(self) -> torch.device:
        return self.ctx.device

    @property
    def is_main(self) -> bool:
        return self.ctx.is_main

    def print(self, *args, **kwargs) -> None:
        """``print`` on global rank 0 only."""
        if self.ctx.is_main:
            print(*args, **kwargs, flush=True)

    # ------------------------------------------------------------------ 2. the model
    def wrap(
        self,
        model: nn.Module,
        *,
        find_unused_parameters: bool = False,
        broadcast_buffers: bool = True,
        static_graph: bool = False,
    ) -> nn.Module:
        """``model`` on this rank's device (SyncBatchNorm first if ``Loop(sync_bn=True)``), wrapped in
        DDP as ``DDP(model)`` wraps it (its defaults; ``.module`` is your model). Every rank."""
        raw = model.to(self.ctx.device)
        if self.config.sync_bn:
            raw = convert_sync_batchnorm(raw, self.ctx.device)
            self._said("SyncBatchNorm")
        wrapped = make_ddp(
            raw,
            self.ctx,
            static_graph=static_graph,
            find_unused_parameters=find_unused_parameters,
            sync_buffers=broadcast_buffers,
        )
        self._models.append(wrapped)
        return wrapped

    @contextmanager
    def no_sync(self, model: nn.Module, enabled: bool = True) -> Iterator[None]:
        """Gradient accumulation: no all-reduce in this backward (DDP's ``no_sync``) while ``enabled``."""
        with model.no_sync() if enabled and isinstance(model, DDP) else nullcontext():
            yield

    def autocast(self):
        """``torch.autocast`` in ``Loop(amp=...)``'s dtype on this device, or nothing when amp is off."""
        dtype = AMP[self.config.amp]
        return torch.autocast(self.ctx.device.type, dtype=dtype) if dtype is not None else nullcontext()

    def backward(self, loss: torch.Tensor) -> None:
        """``loss.backward()``, scaled by the GradScaler under ``amp="fp16"``."""
        (self._scaler.scale(loss) if self._scaler is not None else loss).backward()

    def clip_grad_norm_(self, model: nn.Module, max_norm: float, optimizer=None) -> torch.Tensor:
        """Clip by the global gradient norm (after DDP's all-reduce each rank holds the same gradients,
        so its own norm is the global one); unscaled first under fp16 (pass the ``optimizer``)."""
        if self._scaler is not None:
            if optimizer is None:
                raise ConfigError("Loop.clip_grad_norm_() under amp='fp16' needs optimizer= (to unscale first)")
            self._scaler.unscale_(optimizer)
        return torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)

    def optimizer_step(self, optimizer: torch.optim.Optimizer) -> None:
        """``optimizer.step()``; through the GradScaler under ``amp="fp16"``."""
        if self._scaler is not None:
            self._scaler.step(optimizer)
            self._scaler.update()
        else:
            optimizer.step()

    # ------------------------------------------------------------------ 3. the data
    def data(
        self, data: DataLoader | Dataset, *, batch_size: int | None = None, to_device: bool = True, **settings: Any
    ) -> ShardedLoader:
        """This rank's share of ``data`` (a DataLoader, or a dataset with ``batch_size=``: each rank's),
        in ``DistributedSampler``'s order, the next epoch's order at each pass; its position is in every
        snapshot. A DataLoader keeps its batch size, shuffle, collate_fn, workers and drop_last."""
        if not (isinstance(data, DataLoader) and isinstance(data.sampler, DistributedSampler)):
            settings.setdefault("seed", self.config.seed)  # DistributedSampler's default is 0, as Loop's
        if isinstance(data, DataLoader):
            loader = ShardedLoader.from_dataloader(
                data, self.ctx, to_device=to_device, **({"batch_size": batch_size} if batch_size else {}), **settings
            )
        else:
            if batch_size is None:
                raise ConfigError("Loop.data(dataset) needs batch_size= (each rank's), or pass a DataLoader")
            loader = ShardedLoader(data, self.ctx, batch_size=batch_size, to_device=to_device, **settings)
        if loader.num_workers:
            self._said("DataLoader workers draw per batch, seeded from (seed, epoch, rank, batch)")
        if len(self._pending_loaders) > len(self._loaders):  # made after resume(): its position is waiting
            loader.load_state_dict(self._pending_loaders[len(self._loaders)])
        self._loaders.append(loader)
        return loader

    # ------------------------------------------------------------------ 4. what a snapshot holds
    def resume(self, **state: Any) -> State:
        """Name the loop's state: modules, optimizers, schedulers, anything with ``state_dict``, and plain
        values (numbers, strings, tensors, lists and dicts of them). From the newest snapshot in the run
        dir, if there is one, every object is loaded in place and every plain value replaced in the
        returned :class:`State`, with each rank's RNG states and each loader's position. Every rank."""
        if self.state is not None:
            raise ConfigError("Loop.resume() was called twice: call it once, after building what it names")
        for name, value in state.items():
            if not hasattr(value, "state_dict"):
                _check_plain(name, value)
        self.state = State(state)
        snap = self.ckpt.load_latest(warn=self.print)
        resumed_from = None
        if snap is not None:
            resumed_from = self._load(snap)
        self.log_writer.begin(self.state.step, self.state.epoch)
        on_rank0(self.ctx, self._write_config, "writing loop.json")
        start = {
            "world_size": self.ctx.world_size,
            "backend": self.ctx.backend,
            "device": str(self.ctx.device),
            "run_dir": self.config.run_dir,
            "resumed_at_step": self.state.step if snap is not None else None,
            "resumed_from_world": resumed_from,
            "reset_per_rank": self._reset or None,  # at another world size: each rank's own values, as given
            "changes": "; ".join(self._changes) or "none",
            "not_read": "; ".join(self.key.code.get("unproven", [])) or None,
        }
        self.log_writer.log("start", **start)
        self._t_interval, self._steps_interval = time.perf_counter(), 0
        return self.state

    def _load(self, snap: dict) -> int | None:
        per_rank = snap["trainer"].get("per_rank", [])  # names saved per rank (a snapshot before 0.4: none)
        names = [*snap["trainer"]["state"], *per_rank]
        extra, missing = [n for n in names if n not in self.state], [n for n in self.state if n not in names]
        if extra or missing:  # checked before anything is loaded: nothing half-resumed
            what = f"holds {', '.join(map(repr, extra))}, which this resume() was not given" if extra else ""
            what += ("; " if extra and missing else "") + (
                f"holds no {', '.join(map(repr, missing))}" if missing else ""
            )
            raise RunDirError(
                f"the snapshot in {self.config.run_dir} {what}: name the same state as the run that made it, "
                f"or pass another run_dir to Loop"
            )
        saved = self.ckpt.restore(snap)
        # Each rank's own values go back to the rank that had them; at another world size a rank's value
        # cannot follow its rank, and keeps what this resume() was given (said below).
        mine = (saved["rank_state"] or {}).get("state", {}) if saved["same_world"] else {}
        values = {**saved["state"], **mine}
        for name, value in values.items():  # checked before anything is loaded: nothing half-resumed
            problem = _misfit(self.state[name], value)
            if problem:
                raise RunDirError(
                    f"the snapshot in {self.config.run_dir} does not fit {name!r}: {problem}; build it as the run "
                    f"that made the snapshot did, or pass another run_dir to Loop"
                )
        for name, value in values.items():
            target = self.state[name]
            if hasattr(target, "load_state_dict"):
                _unwrapped(target).load_state_dict(value)
            else:
                self.state[name] = value
        self.state.step, self.state.epoch = saved["loop"]["step"], saved["loop"]["epoch"]
        self._best = saved["loop"]["best"]
        if self._scaler is not None and saved.get("scaler"):
            self._scaler.load_state_dict(saved["scaler"])
        self._pending_loaders = list(saved["loaders"])
        for loader, position in zip(self._loaders, self._pending_loaders):
            loader.load_state_dict(position)
        self._last_saved = self.state.step
        self.ckpt.restore_rng(snap, self.config.seed)  # last: a load_state_dict of the user's that draws moves nothing
        if saved["same_world"]:
            self._restore_metrics(saved["rank_state"] or {})
            return None
        old_world = snap["world_size"]
        self._reset = list(per_rank)
        reset = (
            f"; {', '.join(map(repr, per_rank))} (different on every rank) as this resume() was given them"
            if per_rank
            else ""
        )
        self.print(
            f"ddpkit: resumed at step {self.state.step} from a snapshot made at world size {old_world}, now "
            f"{self.ctx.world_size}: weights, optimizer and named state exactly; each rank's random streams anew "
            f"from (seed, step, rank), and each loader's split is the new world's from the same place in its "
            f"epoch{reset}",
            file=sys.stderr,
        )
        return old_world

    # ------------------------------------------------------------------ 5. safe points
    def steps(self, total: int) -> Iterator[int]:
        """``range(state.step, total)``: between two steps is a safe point (:meth:`step`)."""
        self._require_state()
        while self.state.step < total:
            at = self.state.step
            yield at
            if self.state.step != at:
                raise ConfigError(
                    f"loop.step() was called inside 'for ... in loop.steps({total})', which calls it for you (step "
                    f"{at} counted twice): remove your loop.step(), or keep it and loop over range() or loop.epochs()"
                )
            self.step()

    def epochs(self, total: int) -> Iterator[int]:
        """``range(state.epoch, total)``, each ``data()`` loader set to that epoch; a snapshot at each end."""
        self._require_state()
        while self.state.epoch < total:
            for loader in self._loaders:
                loader.set_epoch(self.state.epoch)
            yield self.state.epoch
            self.state.epoch += 1
            self._safe_point(epoch_end=True)

    def step(self) -> None:
        """One optimizer step is done: a safe point (called by :meth:`steps`; call it yourself after
        ``optimizer.step()`` in an epoch loop). Host work only, except every ``log_every`` steps (one
        all-reduce: the records and the stop flag) and at snapshots."""
        self._require_state()
        self.state.step += 1
        self._steps_interval += 1
        self._safe_point()

    def _safe_point(self, epoch_end: bool = False) -> None:
        s, cfg = self.state.step, self.config
        hangwatch.progress(s)  # the heartbeat a rank late in the user's code is seen by
        due_log = not epoch_end and cfg.log_every and s % cfg.log_every == 0
        due_save = epoch_end or (cfg.save_every_steps and s % cfg.save_every_steps == 0)
        # A stop signal is read with the records; with no records (log_every=0), every STOP_CHECK steps
        due_check = not cfg.log_every and s % STOP_CHECK == 0
        if not (due_log or due_save or due_check):
            return
        totals, names, stop = self._sync()
        if due_log or epoch_end:
            self._record("epoch" if epoch_end else "step", totals, names)
        if (due_save or stop) and self._last_saved != s:
            path = self._save()
        elif stop:
            path = self.ckpt.snapshots()[0]
        if stop:
            self.log_writer.log("stopped", reason=stop, step=s)
            raise Stopped(
                f"stopped on {stop} at step {s} (epoch {self.state.epoch}); saved {path}; run the same command "
                f"again to resume from it",
                stop,
            )

    def _sync(self) -> tuple[list[float], tuple[str, ...], str | None]:
        """One all-reduce and one host copy (``sync_interval``, the engine's too): every rank's metric sums
        and counts, the stop flag, and a check that every rank logged the same names."""
        synced = sync_interval(
            self.ctx, self._acc, stop=self._stop.received is not None, log_error=self.log_writer.error
        )
        stop = (self._stop.received or "a stop signal") if synced.stop else None
        return synced.totals, self._names(), stop

    def _record(self, event: str, totals: list[float], names: tuple[str, ...]) -> None:
        now = time.perf_counter()
        elapsed, steps = now - self._t_interval, self._steps_interval
        means = _means(names, totals)
        self.metrics = means
        # an epoch record names the epoch that ended (state.epoch counts it already); a step record the current one
        epoch = self.state.epoch - 1 if event == "epoch" else self.state.epoch
        record = {"step": self.state.step, "epoch": epoch, **means}
        if steps and elapsed > 0:
            record["steps_per_s"] = round(steps / elapsed, 3)
        self.log_writer.log(event, **record)
        if self._acc is not None:
            self._acc.reset()
        self._t_interval, self._steps_interval = now, 0

    def _save(self, finished: bool = False):
        state = self.state
        values = {
            name: _to_host(_unwrapped(v).state_dict() if hasattr(v, "state_dict") else v) for name, v in state.items()
        }
        for name, value in values.items():  # what torch.load(weights_only=True) can read back, before any write
            _check_plain(name, value, f"the loop's state at step {state.step}")
        shared, per_rank = split_by_rank(self.ctx, values, self._replicated())
        trainer = {
            "loop": {"step": state.step, "epoch": state.epoch, "best": self._best, "finished": finished},
            "state": shared,
            "per_rank": sorted(per_rank),
            "scaler": self._scaler.state_dict() if self._scaler is not None else None,
            "loaders": [loader.state_dict() for loader in self._loaders],
            "rank_state": {
                "metrics": self._acc.state() if self._acc is not None else [],
                "names": list(self._names()),
                "state": per_rank,
            },
        }
        path = self.ckpt.save(trainer, state.step)
        self._last_saved = state.step
        return path

    def _replicated(self) -> frozenset:
        """Names of modules DDP keeps equal on every rank (wrap() with broadcast_buffers): not hashed at snapshots."""
        kept = {id(_unwrapped(m)) for m in self._models if isinstance(m, DDP) and m.broadcast_buffers}
        return frozenset(name for name, v in self.state.items() if id(_unwrapped(v)) in kept)

    def _names(self) -> tuple[str, ...]:
        return self._acc.names if self._acc is not None else ()

    def _restore_metrics(self, rank_state: dict) -> None:
        names = tuple(rank_state.get("names") or ())
        if names:
            self._acc = Accumulator(names, self.ctx.device)
            self._acc.load(rank_state["metrics"])

    # ------------------------------------------------------------------ metrics
    def log(self, **values: Any) -> None:
        """Add to this interval's metrics, on the device (no host sync): a tensor or number is one value
        (its mean is over the calls), a ``(sum, count)`` pair adds both. Reduced over ranks, exactly,
        every ``log_every`` steps."""
        names = self._names()
        if not set(values) <= set(names):  # a new name: a wider accumulator, carrying what was added so far
            grown = Accumulator(tuple(sorted(set(names) | set(values))), self.ctx.device)
            if self._acc is not None:
                k, totals = len(names), self._acc.local()  # on the device: no host sync
                grown.add(
                    [
                        (totals[names.index(n)], totals[k + names.index(n)]) if n in names else (0, 0)
                        for n in grown.names
                    ]
                )
            self._acc = grown
        pairs = []
        for name in self._acc.names:
            if name not in values:
                pairs.append((0, 0))
                continue
            v = values[name]
            if isinstance(v, tuple):
                pairs.append((v[0].detach() if isinstance(v[0], torch.Tensor) else v[0], v[1]))
            elif isinstance(v, torch.Tensor):
                v = v.detach()
                pairs.append((v if v.ndim == 0 else v.sum(), 1 if v.ndim == 0 else v.numel()))
            else:
                pairs.append((v, 1))
        self._acc.add(pairs)

    def reduce(self, **values: Any) -> dict[str, float]:
        """Now, over every rank (one all-reduce and a host copy): each value's mean, a ``(sum, count)``
        pair's sum/count. Every rank, with the same names."""
        names = tuple(sorted(values))
        pairs = [values[n] if isinstance(values[n], tuple) else (values[n], 1) for n in names]
        dev = self.ctx.device
        local = torch.stack([_f64(p[0], dev) for p in pairs] + [_f64(p[1], dev) for p in pairs]) if pairs else None
        none = torch.zeros(0, dtype=torch.float64, device=dev)
        totals, _ = framed_sums(self.ctx, "reduce", names, none if local is None else local, none)
        if totals is None:
            raise ConfigError(
                f"loop.reduce() was given different names on different ranks (this rank: {', '.join(names) or 'none'}):"
                f" pass the same names on every rank"
            )
        return _means(names, totals)

    @torch.no_grad()
    def evaluate(
        self,
        model: nn.Module,
        data: DataLoader | Dataset,
        fn: Callable[[nn.Module, Any], dict],
        *,
        batch_size: int | None = None,
    ) -> dict[str, float | None]:
        """Exact means over the whole of ``data``: each rank reads every world_size-th sample (no padded
        repeats, no shuffle), ``fn(model, batch)`` returns {name: (sum, count)} or {name: batch mean}, and
        one all-reduce adds them up. ``model`` runs unwrapped, in eval mode. Every rank."""
        dataset = data.dataset if isinstance(data, DataLoader) else data
        bs = batch_size or (data.batch_size if isinstance(data, DataLoader) else None)
        if not bs:
            raise ConfigError("Loop.evaluate(dataset, ...) needs batch_size= (or pass a DataLoader)")
        collate = {"collate_fn": data.collate_fn} if isinstance(data, DataLoader) else {}
        if len(dataset) < self.ctx.world_size:
            raise ConfigError(
                f"Loop.evaluate(): {len(dataset)} samples for {self.ctx.world_size} ranks; each rank needs one"
            )
        share = Subset(dataset, range(self.ctx.rank, len(dataset), self.ctx.world_size))
        raw = _unwrapped(model)
        was_training = raw.training
        raw.eval()
        acc = None
        try:
            for batch in DataLoader(share, batch_size=bs, shuffle=False, **collate):
                batch = tree_map(lambda t: t.to(self.ctx.device, non_blocking=True), batch)
                with self.autocast():
                    out = fn(raw, batch)
                n = leading_size(batch)
                pairs = {k: v if isinstance(v, tuple) else (_f64(v, self.ctx.device) * n, n) for k, v in out.items()}
                if acc is None:
                    acc = Accumulator(tuple(sorted(pairs)), self.ctx.device)
                if set(pairs) != set(acc.names):
                    raise ConfigError(
                        f"Loop.evaluate(): fn returned {sorted(pairs)} for one batch and {list(acc.names)} for the "
                        f"first: return the same names for every batch"
                    )
                acc.add([pairs[name] for name in acc.names])
        finally:
            raw.train(was_training)
        local = acc.local().tolist()
        k = len(acc.names)
        return self.reduce(**{n: (local[i], local[k + i]) for i, n in enumerate(acc.names)})

    def best(self, metric: str, value: float, mode: str = "min") -> bool:
        """Keep the best weights by ``metric``: when ``value`` beats the best so far (``mode`` min or
        max), rank 0 writes ``best.pt`` (every module named in resume(), the step and the value). The
        best so far is snapshot state. Every rank; rank 0's value decides. True when this is the best."""
        self._require_state()
        if mode not in ("min", "max"):
            raise ConfigError(f"Loop.best(mode={mode!r}): choose min or max")
        v = self.ctx.broadcast(torch.tensor([float(value)], dtype=torch.float64, device=self.ctx.device)).item()
        if not math.isfinite(v):
            return False  # a NaN would stay the best for ever: no later value compares better
        old = self._best.get(metric)
        better = old is None or (v < old["value"] if mode == "min" else v > old["value"])
        if not better:
            return False
        self._best[metric] = {"value": v, "step": self.state.step}
        weights = {
            name: _to_host(_unwrapped(obj).state_dict())
            for name, obj in self.state.items()
            if isinstance(_unwrapped(obj), nn.Module)
        }
        blob = {"metric": metric, "value": v, "step": self.state.step, "weights": weights}
        on_rank0(self.ctx, lambda: atomic_write(self.files.root / "best.pt", torch_bytes(blob)), "writing best.pt")
        return True

    @property
    def best_so_far(self) -> dict:
        """{metric: {"value": v, "step": s}} of :meth:`best`."""
        return dict(self._best)

    # ------------------------------------------------------------------ helpers
    def _require_state(self) -> None:
        if self.ctx is None:
            raise ConfigError(
                "use the Loop in a with-statement (with ddpkit.Loop(...) as loop: ...), or start it with "
                "loop = ddpkit.Loop.start(...)"
            )
        if self.state is None:
            raise ConfigError(
                "call loop.resume(model=..., optimizer=..., ...) before the first step: it names what a snapshot "
                "saves and reloads it when the run dir holds one"
            )

    def _said(self, change: str) -> None:
        if change not in self._changes:
            self._changes.append(change)

    def _identity(self) -> dict:
        """The loop's code as rank 0 read it (every rank uses rank 0's, so they decide alike): the function's
        or the script's that made the Loop (``identity.script_at``: its code and settings). An environment
        variable it reads is listed under ``unproven``, not compared (``SAVE``, a test's ``DIE_AT``)."""
        mine = None
        if self.ctx.is_main or self.ctx.world_size == 1:
            name = self._maker.name if isinstance(self._maker, Script) else self._maker.__qualname__
            mine = code_fingerprint(name, {"loop": self._maker}, read_environ=False).to_json()
        if self.ctx.world_size > 1:
            box = [mine]
            dist.broadcast_object_list(box, src=0)
            mine = box[0]
        return mine

    def _write_config(self) -> None:
        atomic_write(self.files.root / "loop.json", json.dumps(self.key.to_dict(), indent=1, default=str).encode())


# ---------------------------------------------------------------------- module helpers
def _caller_function(frame) -> Callable | Script:
    """What is running ``frame`` (what the run identity reads): a function, rebuilt from its code, globals
    and closure; or a script's top level (``<module>``: nanoGPT's train.py), its code and the settings it
    has set by this line, copied now (``identity.script_at``)."""
    code = frame.f_code
    if code.co_name == "<module>":
        return script_at(frame)
    cells = tuple(types.CellType(frame.f_locals.get(name)) for name in code.co_freevars)
    return types.FunctionType(code, frame.f_globals, code.co_name, None, cells or None)


def _exit_now(code: int) -> None:
    """End the process with ``code`` from an ``atexit`` handler, where an exception would be printed as a
    traceback and leave the status the script's (0): its output flushed first."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def _adopted_context(device: str) -> DistContext:
    """The process group already made (by ``ddpkit.launch`` or the user): this rank's place in it."""
    rank, world = dist.get_rank(), dist.get_world_size()
    local_rank = int(os.environ.get(env.LOCAL_RANK, rank))
    local_world = int(os.environ.get(env.LOCAL_WORLD_SIZE, world))
    backend = str(dist.get_backend())
    # The group's backend says where its ranks run: gloo on the CPU (unless device="cuda" asks for CUDA tensors
    # over gloo, every rank on its current device), NCCL on the rank's GPU.
    if backend == "nccl":
        where = torch.device("cuda", local_rank)
    elif device == "cuda" and resolve_device_type(device) == "cuda":
        where = torch.device("cuda", torch.cuda.current_device())
    else:
        where = torch.device("cpu")
    return DistContext(rank, local_rank, world, local_world, where, backend)


def _unwrapped(obj: Any) -> Any:
    """A module out of its DDP and torch.compile wrappers (its state_dict has no ``module.`` prefix)."""
    while True:
        if isinstance(obj, DDP):
            obj = obj.module
        elif hasattr(obj, "_orig_mod") and isinstance(obj, nn.Module):
            obj = obj._orig_mod
        else:
            return obj


def _check_plain(name: str, value: Any, where: str = "Loop.resume()") -> None:
    """Raise unless ``value`` is what ``torch.load(weights_only=True)`` reads back; ``where`` names the call (a
    value given to resume(), or one the loop put into its state later, found when a snapshot is due)."""
    if type(value) in PLAIN or isinstance(value, torch.Tensor):  # exact types: numpy's float64 is a float too,
        return  # and torch.load(weights_only=True) refuses it
    if type(value) in (list, tuple):
        for v in value:
            _check_plain(name, v, where)
        return
    if type(value) in (dict, collections.OrderedDict):
        for k, v in value.items():
            _check_plain(name, k, where)
            _check_plain(name, v, where)
        return
    raise ConfigError(
        f"{where}: {name!r} holds {type(value).__module__}.{type(value).__qualname__}, which a snapshot "
        f"cannot hold: pass an object with state_dict(), or plain values (numbers, strings, tensors, lists, "
        f"dicts); convert numpy values with float() or torch.as_tensor()"
    )


def _misfit(target: Any, saved: Any) -> str:
    """How a snapshot's ``saved`` state fails to fit ``target`` as resume() names it ("" if it loads): a
    module's tensors by name and shape, an optimizer's parameter groups by size. Found before anything is
    loaded, where ``load_state_dict`` would fail half-way with a traceback per rank."""
    target = _unwrapped(target)
    if isinstance(target, nn.Module):
        if not isinstance(saved, dict):
            return "the snapshot holds no module weights there"
        tensors = lambda sd: {k: v for k, v in sd.items() if isinstance(v, torch.Tensor)}  # noqa: E731 - not extra state
        return weights_mismatch(tensors(target.state_dict()), tensors(saved))
    if isinstance(target, torch.optim.Optimizer):
        groups = saved.get("param_groups") if isinstance(saved, dict) else None
        if not isinstance(groups, list):
            return "the snapshot holds no optimizer state there"
        mine = [len(g["params"]) for g in target.param_groups]
        theirs = [len(g.get("params", ())) for g in groups]
        return "" if mine == theirs else f"parameters per group {theirs} in the snapshot, {mine} here"
    return ""


def _f64(x: Any, device: torch.device) -> torch.Tensor:
    """``x`` (a tensor or a number) as a 0-d float64 tensor on ``device``, detached."""
    return torch.as_tensor(
        x.detach() if isinstance(x, torch.Tensor) else x, dtype=torch.float64, device=device
    ).reshape(())


def _to_host(tree: Any) -> Any:
    if isinstance(tree, torch.Tensor):
        return tree.detach().cpu()
    if isinstance(tree, dict):
        return {k: _to_host(v) for k, v in tree.items()}
    if isinstance(tree, (list, tuple)):
        return type(tree)(_to_host(v) for v in tree)
    return tree


def _means(names: tuple[str, ...], totals: list[float]) -> dict[str, float | None]:
    k = len(names)
    return {n: (totals[i] / totals[k + i] if totals[k + i] else None) for i, n in enumerate(names)}
