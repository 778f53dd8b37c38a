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
  ``keep_snapshots``; by default copied aside at the step and written by a thread, ``async_snapshots``):
  what ``resume()`` names, every rank's RNG states (torch, CUDA, numpy, random) and each ``data()``
  loader's position, at every ``save_every_steps``-th step, at each ``epochs()`` end, at the end, and
  at the next log interval after SIGTERM/SIGUSR1/Ctrl-C (then :class:`ddpkit.errors.Stopped`).
  Rerunning the same command resumes there, bitwise at the same world size; at another, the RNG
  streams are reseeded from (seed, step, rank), said in one line.
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

import dataclasses
import json
import multiprocessing
import re
import sys
import time
from contextlib import ExitStack
from typing import Any, Callable, Iterator

import torch
import torch.distributed as dist
from torch import nn
from torch.optim.lr_scheduler import LRScheduler
from torch.utils.data import DataLoader, Dataset, DistributedSampler

from .config import LoopConfig, keywords_checked
from .data.batch import leading_size
from .data.loader import rank_share
from .data.seeds import reseed
from .data.shard import ShardedLoader
from .errors import ConfigError, DdpkitError
from .files import atomic_write
from .identity import loop_code, running_code
from .ranks import hangwatch, scriptend
from .ranks.context import DistContext, adopt, deterministic, distributed, on_rank0
from .ranks.env import under_launcher
from .ranks.failures import exit_status
from .ranks.replicas import group_dir
from .run.recorder import MetricLogger
from .run.rundir import note_for_restarts, rank0_locks, refuse_a_restart_into
from .run.runkey import CodeKey
from .train import report
from .train.evaluate import evaluate_split
from .train.metrics import Accumulator, add_named, as_f64, means, reduce_means
from .train.replicas import LoaderShares, Place, Replicas, ShareChecks, script_place
from .train.selection import Watch
from .train.session import Amp, Session, check_plain, load_named, named_state
from .train.signals import StopSignal
from .train.strategy import refuse_wrapped, strategy_for
from .train.syncbn import convert_sync_batchnorm, per_rank_batchnorm

STOP_CHECK = 50  # steps between reads of the stop flag when log_every=0 (one all-reduce each)


class State(dict):
    """What :meth:`Loop.resume` was given, by name, as a snapshot holds it; after a resume, its plain
    values are the snapshot's. ``step`` and ``epoch``: the loop's position (steps and epochs done)."""

    step: int = 0
    epoch: int = 0


class Loop:
    """See the module docstring. Every method that says "every rank" is a collective: call it on all."""

    @keywords_checked
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
        async_snapshots: bool = True,
        log_every: int = 50,
        timeout_s: float = 600.0,
        check_code: bool = True,
        strategy: str = "auto",
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
            async_snapshots,
            log_every,
            timeout_s,
            check_code,
            strategy,
        )
        # An error a restart would only meet again, noted by this job's attempt that met it (run/rundir.py): a
        # restart stops here, before anything, instead of training into it again and saying it again
        self._note_dir = _note_dir(str(run_dir))
        refuse_a_restart_into(self._note_dir)
        # (An uncaught Stopped ends the script with 143, and a bad setting, checked here, with one line and 2, not a
        # traceback per rank and 1: import ddpkit installed the hook that says them, ranks.failures)
        self.config.validate()
        # the run identity reads the loop's own code: the frame above keywords_checked's wrapper, which called this
        self._maker = running_code(sys._getframe(2))
        self.ctx: DistContext | None = None
        self._stack = ExitStack()
        # the run dir's lock (resume() takes it), let go after everything in _stack: a background write ends first
        self._lock = ExitStack()
        self._owns_group = False
        self.state: State | None = None
        self._models: list[nn.Module] = []
        self._loaders: list[ShardedLoader] = []
        self._pending_loaders: list[dict] = []  # positions from a snapshot, for loaders made after resume()
        self.strategy = strategy_for(self.config.strategy)  # how wrap() spreads a model (train/strategy.py)
        self._acc: Accumulator | None = None
        self._changes: list[str] = []
        self._best: dict = {}
        # {name: [sum, count]} over every rank since the epoch began (the reduced records' totals, on the host): an
        # epoch record gives the epoch's means, not its last interval's (the porter's seed 002)
        self._epoch_sums: dict[str, list[float]] = {}
        self._reset: list[str] = []  # per-rank values an elastic resume left as resume() gave them
        self._said_no_step = False  # an epoch that read batches with no loop.step(): said once
        self._said_no_loader = False  # an epoch that stepped with no loop.data() loader: said once
        # the last record's means (an epoch record's: the epoch's), the same on every rank
        self.metrics: dict[str, float | None] = {}
        # ddpkit run --replicas R (train/replicas.py): this process is one group, reading share `index` of each step
        self._place: Place | None = None
        self._replicas: Replicas | None = None  # torchft's side, started by resume()
        # Under --replicas, where the step is: "opened" (steps() formed its quorum), "reading" (shares() gives its
        # batches), "" (shares() summed and committed them, or no step is open)
        self._phase = ""
        self._opt_steps = 0  # optimizer steps of the optimizers resume() names (a break after one counts the step)
        self._yielded = (-1, 0)  # (the step steps() gave last, _opt_steps then)
        self._feeds: LoaderShares | None = None  # shares(): the loaders read a step at a time (made with the ctx)
        self._checks: ShareChecks | None = None  # --replicas: what a step does with those batches, checked

    # ------------------------------------------------------------------ 1. the process group
    def __enter__(self) -> "Loop":
        try:
            if dist.is_available() and dist.is_initialized():
                self.ctx = adopt(self.config.device)
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
            self._place = script_place()
            if self._place is not None:  # one group of ddpkit run --replicas: its own run dir, as ddpkit train's
                if self.config.strategy == "fsdp2":
                    raise ConfigError(
                        "ddpkit run --replicas cannot be combined with Loop(strategy='fsdp2') yet: each group is "
                        "one process, and all-reduces its whole gradient through torchft (docs/fault-tolerance.md)"
                    )
                self.config = dataclasses.replace(
                    self.config, run_dir=group_dir(self.config.run_dir, self._place.index)
                )
            self._feeds = LoaderShares(self.ctx, self._place)
            self._stack.callback(self._feeds.close)  # its passes in progress, ended while their modules are alive
            # the script's own destroy_process_group() closes this Loop first (in its with-block too), then the group
            scriptend.closes_at_destroy(self, sys._getframe(1).f_globals)
            stop = self._stack.enter_context(StopSignal())  # first: a signal while the rest is set up waits for it
            cfg = self.config
            self.key = CodeKey(cfg, loop_code(self.ctx, self._maker), LoopConfig.HASHED, cfg.check_code)
            quiet = self._place is not None and self._place.index > 0  # the console: group 0's records
            self.log_writer = MetricLogger(self.ctx, cfg.run_dir, 0, False, quiet, config=self.key.to_dict())
            self._stack.callback(self.log_writer.close)
            self.session = Session(
                self.ctx,
                cfg.run_dir,
                self.key,
                self.log_writer,
                keep=cfg.keep_snapshots,
                every_steps=cfg.save_every_steps,
                new_run="pass another run_dir to Loop",
                signal=stop,
                background=cfg.async_snapshots,
                strategy=self.strategy,
            )
            self._stack.callback(self.session.close)  # however the loop ends: the write in flight ends first
            self.files = self.session.files
            hangwatch.report_to(cfg.run_dir)
            self.amp = Amp(cfg.amp, self.ctx.device)
        except BaseException:
            self._exited = True  # never open: the script's destroy_process_group() has nothing of it to close
            self._stack.__exit__(*sys.exc_info())
            raise
        return self

    def __exit__(self, exc_type, exc, tb) -> bool:
        if getattr(self, "_exited", False):  # ended inside its with-block already: the script's own destroy closed it
            return False
        self._exited = True
        raised_here = None  # an error of the final save or of the teardown, raised instead of nothing
        if exc_type is None and self.state is not None:
            try:
                self._count_broken_step()  # (an iterator of steps() held by the script is closed after this)
                if self.session.last_saved != self.state.step:
                    self.session.save(self._snapshot(finished=True), self.state.step)  # a rerun resumes here
                self.session.finish()  # whole on disk before the "end" record says so
                self.session.first_quorum(self.state.step, self.state.epoch)  # (--replicas: none if no step was left)
                self.log_writer.log(
                    "end", step=self.state.step, epoch=self.state.epoch, **self.session.snapshot_figures()
                )
                # The snapshot of this step is the run's end (saved here, or at the epoch's end): a rerun says so
                self.session.mark_finished(self.state.step, self.state.epoch, "a rerun resumes at its end and says so")
            except BaseException as error:  # noqa: BLE001 - said below as any error in the loop is
                exc_type, exc, tb = type(error), error, error.__traceback__
                raised_here = error
        try:
            if self._stack.__exit__(exc_type, exc, tb):
                return True
        except DdpkitError as error:  # the group's teardown names the failure (a lost peer, a timeout)
            exc = raised_here = error
        finally:
            self._lock.close()
            scriptend.group_gone(self._owns_group)
        if isinstance(exc, DdpkitError) and self._owns_group and under_launcher():
            # A script under torchrun (or srun), where nothing above catches it: one line, once, and its exit
            # status (143 on a stop), not one traceback per rank. Elsewhere the error is raised as it is. Only an
            # error that ends the process is noted for the job's restarts (one a script catches is not)
            note_for_restarts(self._note_dir, exc)
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
        loop._maker = running_code(sys._getframe(1))  # the script's code, not this method's
        loop.__enter__()
        scriptend.end_with_script(loop, sys._getframe(1).f_globals)  # ranks/scriptend.py
        return loop

    def close(self) -> None:
        """End a :meth:`start`-ed Loop now, as leaving a ``with`` block does with no error: the final
        snapshot and record, then the group's teardown. Every rank. Closing twice does nothing."""
        if self.ctx is not None and not getattr(self, "_closed", False):
            self._closed = True
            self.__exit__(None, None, None)

    def _teardown(self, exc: BaseException) -> None:
        """The group's teardown alone, after ``exc`` ended a started script (no save after an error), noted for the
        job's restarts where a restart would meet it again."""
        note_for_restarts(self._note_dir, exc)
        try:
            self._stack.__exit__(type(exc), exc, exc.__traceback__)
        finally:
            self._lock.close()

    @property
    def rank(self) -> int:
        """This rank's; under ``ddpkit run --replicas R``, the group's index, the rank whose share it reads."""
        return self.ctx.rank if self._place is None else self._place.index

    @property
    def world_size(self) -> int:
        """The ranks'; under ``ddpkit run --replicas R``, R: the groups are the ranks a step's batch is read by."""
        return self.ctx.world_size if self._place is None else self._place.count

    @property
    def device(self) -> torch.device:
        return self.ctx.device

    @property
    def is_main(self) -> bool:
        """Global rank 0 (of replica group 0 under ``--replicas``)."""
        return self.ctx.is_main and (self._place is None or self._place.index == 0)

    def print(self, *args, **kwargs) -> None:
        """``print`` on global rank 0 only (of replica group 0 under ``--replicas``)."""
        if self.is_main:
            print(*args, **kwargs, flush=True)

    # ------------------------------------------------------------------ 2. the model
    def wrap(
        self,
        model: nn.Module,
        *,
        find_unused_parameters: bool = False,
        broadcast_buffers: bool = True,
        static_graph: bool = False,
        shard: Callable[[nn.Module], bool] | None = None,
    ) -> nn.Module:
        """``model`` on this rank's device (SyncBatchNorm first if ``Loop(sync_bn=True)``), wrapped in
        DDP as ``DDP(model)`` wraps it (its defaults; ``.module`` is your model). Every rank.

        Under ``Loop(strategy="fsdp2")`` it is sharded in place instead (``fully_shard``, train/fsdp2.py):
        ``shard(module)`` says which submodules are units of their own (default: each holding 1M parameters
        or more); build the optimizer after this, over the returned model's parameters."""
        refuse_wrapped(model, "Loop.wrap()")
        if shard is not None and self.strategy.name != "fsdp2":
            raise ConfigError("Loop.wrap(shard=...) is FSDP2's sharding policy: pass Loop(strategy='fsdp2')")
        if self.strategy.name == "fsdp2" and not broadcast_buffers and any(True for _ in model.buffers()):
            raise ConfigError(
                "Loop.wrap(broadcast_buffers=False) under FSDP2: its snapshots hold rank 0's buffers alone (a "
                "sharded model's state is not saved per rank), so each rank's own would not resume; keep "
                "broadcast_buffers=True, or use strategy='ddp'"
            )
        raw = model.to(self.ctx.device)
        if self.config.sync_bn:
            raw = convert_sync_batchnorm(raw, self.ctx.device)
            self._said("SyncBatchNorm")
        wrapped = self.strategy.wrap(
            raw,
            self.ctx,
            static_graph=static_graph,
            find_unused_parameters=find_unused_parameters,
            sync_buffers=broadcast_buffers,
            **({"policy": shard} if shard is not None else {}),
        )
        self._models.append(wrapped)
        return wrapped

    def no_sync(self, model: nn.Module, enabled: bool = True):
        """Gradient accumulation: no all-reduce in this backward (DDP's ``no_sync``) while ``enabled``."""
        return self.strategy.no_sync(model, enabled)

    def autocast(self):
        """``torch.autocast`` in ``Loop(amp=...)``'s dtype on this device, or nothing when amp is off."""
        return self.amp.autocast()

    def backward(self, loss: torch.Tensor) -> None:
        """``loss.backward()``, scaled by the GradScaler under ``amp="fp16"``."""
        self.amp.backward(loss)

    def clip_grad_norm_(self, model: nn.Module, max_norm: float, optimizer=None) -> torch.Tensor:
        """Clip by the global gradient norm; unscaled first under fp16 (pass the ``optimizer``)."""
        if self.amp.scaling:
            if optimizer is None:
                raise ConfigError("Loop.clip_grad_norm_() under amp='fp16' needs optimizer= (to unscale first)")
            self.amp.unscale_(optimizer)
        return self.strategy.clip_grad_norm_(model, max_norm)

    def optimizer_step(self, optimizer: torch.optim.Optimizer) -> None:
        """``optimizer.step()``; through the GradScaler under ``amp="fp16"``."""
        stepped = self._opt_steps
        self.amp.step(optimizer)
        if self._opt_steps == stepped:  # skipped on an inf gradient: the loop's step is done all the same
            self._opt_steps += 1

    # ------------------------------------------------------------------ 3. the data
    def data(
        self, data: DataLoader | Dataset, *, batch_size: int | None = None, to_device: bool = True, **settings: Any
    ) -> ShardedLoader:
        """This rank's share of ``data`` (a DataLoader, or a dataset with ``batch_size=``: each rank's),
        in ``DistributedSampler``'s order, the next epoch's order at each pass; its position is in every
        snapshot. A DataLoader keeps its batch size, shuffle, collate_fn, workers and drop_last."""
        if not (isinstance(data, DataLoader) and isinstance(data.sampler, DistributedSampler)):
            settings.setdefault("seed", self.config.seed)  # DistributedSampler's default is 0, as Loop's
        if not isinstance(data, DataLoader) and batch_size is None:
            raise ConfigError("Loop.data(dataset) needs batch_size= (each rank's), or pass a DataLoader")

        def make(ctx: DistContext) -> ShardedLoader:
            if isinstance(data, DataLoader):
                sized = {"batch_size": batch_size} if batch_size else {}
                return ShardedLoader.from_dataloader(data, ctx, to_device=to_device, **sized, **settings)
            return ShardedLoader(data, ctx, batch_size=batch_size, to_device=to_device, **settings)

        # Under --replicas, a group reads as rank `index` of a DDP run of R ranks (and a lost group's share as its rank)
        loader = make(self._feeds.context())
        self._feeds.add(loader, make)
        if loader.num_workers:
            self._said(
                "DataLoader workers draw per sample, seeded from (seed, epoch, sample), and collate per batch, "
                "from (seed, epoch, rank, batch)"
            )
        if len(self._pending_loaders) > len(self._loaders):  # made after resume(): its position is waiting
            self._load_position(loader, len(self._loaders), self._pending_loaders[len(self._loaders)])
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
            if isinstance(value, torch.optim.Optimizer):
                self.strategy.check_optimizer(value, f"Loop.resume({name}=...)")
            elif not hasattr(value, "state_dict"):
                check_plain(name, value, "Loop.resume()")
        # One run in a run dir at a time, held by global rank 0 from here (its first read of the run dir) until the
        # Loop ends: two jobs (or two processes mp.spawn made, each a world of 1 of its own: the porter's seed 003)
        # trained in one run dir, the second "resuming" what the first had saved
        how = {"other": _another_run_dir(self.ctx.world_size), "flag": "Loop(run_dir=...)"}
        self._lock.enter_context(rank0_locks(self.config.run_dir, self.ctx, **how))
        self.state = State(state)
        self._unnamed_schedules()
        optimizers = [v for v in state.values() if isinstance(v, torch.optim.Optimizer)]
        for opt in optimizers:  # a break after the step's optimizer.step() still counts the step (steps())
            self._stack.callback(opt.register_step_post_hook(self._stepped).remove)  # the optimizer outlives us
        snap = self.session.resume(self._load, self.config.seed, warn=self.print)
        if snap is not None:
            before = ((snap.get("config") or {}).get("code") or {}).get("environ") or {}
            now = self.key.code.get("environ") or {}
            for line in report.environ_lines(before, now, self.state.step):
                self.print(line, file=sys.stderr)
            # The run's values, as its first attempt read them, go on into its snapshots: every later resume compares
            # with those, not with the last attempt's (a review finding: a second rerun at the new value said nothing)
            self.key.code["environ"] = {**now, **before}
        resumed_from = snap["world_size"] if snap is not None and snap["world_size"] != self.ctx.world_size else None
        self.session.begin(
            self.state.step,
            self.state.epoch,
            lambda: on_rank0(self.ctx, self._write_config, "writing loop.json"),
            self._models,
            replica=self._place is not None,
            run_dir=self.config.run_dir,
            resumed_at_step=self.state.step if snap is not None else None,
            resumed_from_world=resumed_from,
            reset_per_rank=self._reset or None,  # at another world size: each rank's own values, as given
            changes="; ".join(self._changes) or "none",
            not_read="; ".join(self.key.code.get("unproven", []) + environ_note(self.key.code)) or None,
            **({"replicas": self._place.count, "replica_group": self._place.index} if self._place else {}),
        )
        self._t_interval, self._steps_interval, self._samples_at = time.perf_counter(), 0, self._samples_read()
        return self.state

    def _unnamed_schedules(self) -> None:
        """A learning-rate schedule attached to a named optimizer (torch marks the optimizer's ``step`` it wraps)
        while no schedule of that optimizer is named: a resume starts its count again (the porter's finding: under
        --replicas, a healed group's schedule was its own, and the groups drifted apart with no word). One line;
        under --replicas, an error."""
        schedules = [v for v in self.state.values() if isinstance(v, LRScheduler)]
        for name, opt in self.state.items():
            if not isinstance(opt, torch.optim.Optimizer) or not hasattr(opt.step, "_wrapped_by_lr_sched"):
                continue
            if any(getattr(s, "optimizer", None) is opt for s in schedules):
                continue
            said = (
                f"a learning-rate schedule steps the optimizer resume() names {name!r} but resume() names no "
                f"schedule of it: a {'heal' if self._place is not None else 'resume'} would start its count "
                f"again; name it: loop.resume(..., scheduler=your_schedule)"
            )
            if self._place is not None:
                raise ConfigError(f"under ddpkit run --replicas, {said}")
            self.print(f"ddpkit: warning: {said}", file=sys.stderr)
            return

    def _stepped(self, *_args) -> None:
        self._opt_steps += 1

    def _count_broken_step(self) -> None:
        """A ``steps()`` loop left by a break after its body's optimizer step: that step is done (the final
        snapshot's; before, a rerun trained its batch again). Once: the step count moves on."""
        at, stepped = self._yielded
        if self._opt_steps > stepped and self.state.step == at and not self._phase:
            self.state.step += 1
            self._steps_interval += 1

    def _load(self, saved: dict) -> None:
        """A snapshot's state into what resume() named (``Session.resume`` restores the RNG streams after)."""
        per_rank = saved.get("per_rank", [])  # names saved per rank (a snapshot before 0.4: none)
        # Each rank's own values go back to the rank that had them; at another world size a rank's value
        # cannot follow its rank, and keeps what this resume() was given (said below).
        mine = (saved["rank_state"] or {}).get("state", {}) if saved["same_world"] else {}
        models = [self.strategy.unwrap(m) for m in self._models]
        load_named(self.state, saved["state"], per_rank, mine, self.strategy, self.config.run_dir, models)
        self.state.step, self.state.epoch = saved["loop"]["step"], saved["loop"]["epoch"]
        self._best = saved["loop"]["best"]
        # the epoch's sums so far (a snapshot older than them has none: its epoch's means start at the resume)
        self._epoch_sums = {k: list(v) for k, v in saved["loop"].get("epoch_sums", {}).items()}
        if self.amp.scaling and saved.get("scaler"):
            self.amp.scaler.load_state_dict(saved["scaler"])
        if self.ctx.is_main and self._finished_at() == self.state.step:
            # A rerun of a finished run: without this line a loop to the same end ran no step and said nothing
            self.print(report.finished_line(self.state.step, self.state.epoch), file=sys.stderr)
        self._pending_loaders = list(saved["loaders"])
        for index, (loader, position) in enumerate(zip(self._loaders, self._pending_loaders)):
            self._load_position(loader, index, position)
        if saved["same_world"]:
            self._restore_metrics(saved["rank_state"] or {})
            return
        self._reset = list(per_rank)
        plain_bn = per_rank_batchnorm(models)  # a wrapped model's BatchNorm, not synced: said, with its cost
        self.print(
            report.loop_elastic_line(self.state.step, saved["world_size"], self.ctx.world_size, per_rank, plain_bn),
            file=sys.stderr,
        )

    def _finished_at(self) -> int | None:
        """The step the run last finished at (``checkpoints/finished``), or None."""
        try:
            return int(self.files.finished.read_text())
        except (OSError, ValueError):
            return None

    def _load_position(self, loader: ShardedLoader, index: int, position: dict) -> None:
        """A loader's saved position, and one line if its global batch is not the snapshot's: a script that
        fixes each rank's batch reads another number of samples per step at another world size, which
        changes how it trains (its learning rate per sample, its steps per epoch). Said, not changed."""
        was = loader.load_state_dict(position)
        if was is not None:
            self.print(
                report.global_batch_line(index, was, (loader.ctx.world_size, loader.batch_size)), file=sys.stderr
            )

    # ------------------------------------------------------------------ 5. safe points
    def steps(self, total: int) -> Iterator[int]:
        """``range(state.step, total)``: between two steps is a safe point (:meth:`step`)."""
        self._require_state()
        if self._place is not None and self._replicas is None:
            # This group meets the others from its own resume's step (healed if behind), at its first step: a
            # script refused before it (its epochs(), say) is said once, by group 0, before the others start
            self._replicas = Replicas(
                *(self._place, self._heal_state, self._load_heal, self.config.timeout_s, self.log_writer.log),
                first=lambda: self.session.first_quorum(self.state.step, self.state.epoch),
            )
            self._stack.callback(self._replicas.close)  # first at the end: its watch must not end the unwinding
            self._replicas.set_step(self.state.step)
            modules = [self.strategy.unwrap(m) for m in self._models]
            params = [p for m in modules for p in m.parameters() if p.requires_grad]
            optimizers = [v for v in self.state.values() if isinstance(v, torch.optim.Optimizer)]
            self._checks = ShareChecks(params, optimizers, lambda what: self._said_by_group_0(ConfigError(what)))
            self._stack.callback(self._checks.remove)
        while self.state.step < total:
            if self._replicas is not None:  # the step's quorum first: a heal there moves the step the body reads
                self._phase = "opened"
                self._replicas.open([self.strategy.unwrap(m) for m in self._models], self._at, self._healed)
            self._yielded = (self.state.step, self._opt_steps)
            at = self.state.step
            try:
                yield at
            except GeneratorExit:  # a break (the Loop's end counts it too, for an iterator held past the end)
                self._count_broken_step()
                raise
            if self._phase:
                said = {
                    "opened": "each step reads its batches through 'for batch in loop.shares(loader)' (once a "
                    "step): a lost group's share is computed there too",
                    "reading": "the step left 'for batch in loop.shares(loader)' before its end (a break?): its "
                    "gradient is summed over the groups and committed there, after the last batch",
                }[self._phase]
                raise self._said_by_group_0(ConfigError(f"under ddpkit run --replicas, {said}"))
            if self.state.step != at:
                raise ConfigError(
                    f"loop.step() was called inside 'for ... in loop.steps({total})', which calls it for you (step "
                    f"{at} counted twice): remove your loop.step(), or keep it and loop over range() or loop.epochs()"
                )
            self.step()

    def shares(self, loader: ShardedLoader) -> Iterator:
        """This step's batch of ``loader`` (a :meth:`data` loader, read on from pass to pass: each pass is
        the next epoch's order). Under ``ddpkit run --replicas R``, also the batch of each group that is gone
        (read as its rank reads it): run your forward and backward on each, and the gradients add up; when
        the loop asks for the next, the step's gradient is summed over the groups present (each divided by
        R, as DDP divides by its world size) and committed, or, where a group left in the middle, the step's
        batches come again for the groups then present (what ``log()`` was given of the attempt dropped).
        Inside ``for step in loop.steps(n)``, once a step::

            opt.zero_grad()
            for x, y in loop.shares(loader):
                loss = F.cross_entropy(model(x), y)
                loss.backward()
                loop.log(loss=loss)
            opt.step()
        """
        self._require_state()
        if not any(loader is mine for mine in self._loaders):
            raise ConfigError("loop.shares() takes a loader that loop.data() returned")
        if self._place is None:
            yield self._feeds.next(loader)
            return
        if self._phase != "opened":
            raise self._said_by_group_0(
                ConfigError(
                    "under ddpkit run --replicas, loop.shares() is read once a step, inside 'for step in "
                    "loop.steps(n)', which opens each step's quorum"
                )
            )
        self._phase, place, checks = "reading", self._place, self._checks
        batches: dict[int, Any] = {}  # share -> its batch, the same at every attempt
        # what log() had before the shares, names too (an attempt may log a name for the first time); on the device
        kept = None if self._acc is None else self._acc.copy()

        def restart() -> None:  # at each attempt: log() as it was before the first
            self._acc = None if kept is None else kept.copy()

        checks.reading = True
        try:
            for g in self._replicas.shares_of(self._at, self._healed, restart, grad_scale=1.0 / place.count):
                if g not in batches:
                    if g == place.index:  # always the first share: the position the others are read at is its
                        batches[g] = self._feeds.next(loader)
                        position = (loader.epoch, loader.batch - 1)
                    else:
                        batches[g] = self._feeds.other(loader, g, *position)
                count = checks.backwards
                yield batches[g]
                checks.backward_since(count)
            self._phase = ""
        finally:  # (a break closes this generator: steps() then says so, not an optimizer step after the loop)
            checks.reading = False

    def _said_by_group_0(self, error: DdpkitError) -> DdpkitError:
        """``error``, met by this replica group in the script's own code (its step), said once: group 0 says it,
        and another group whose error group 0 said too files its own quiet (it ends with its status). One that
        group 0 did not meet (a decision on a group's own metrics) is said by the group that met it."""
        if self._replicas is not None:
            error.quiet = self._replicas.said_by_group_0(str(error))
        return error

    def _at(self) -> int:
        """The step the loop is at (a heal moves it): the replicas' protocol asks."""
        return self.state.step

    def _heal_state(self) -> dict:
        """What a group that is behind receives from this one (torchft's heal): this Loop's snapshot at the start
        of the step the quorum is about to take, less its metric sums."""
        snap = self._snapshot()
        snap["rank_state"] = None
        return snap

    def _load_heal(self, saved: dict) -> None:
        """A live group's :meth:`_heal_state`, loaded as a snapshot is (each group is a world of 1: every value
        resume() names is the live group's); its metric sums start again, and its random streams start afresh from
        (seed, step, group), as a rank's do after a resume at another world size."""
        self._load({**saved, "same_world": True, "rank_state": {"state": {}}})
        reseed(self.config.seed, self.state.step, self._place.index)

    def _healed(self) -> None:
        """After a heal, at a step's start: the loaders' passes start again from the healed positions, and the log
        interval from here."""
        self._feeds.restart()
        if self._acc is not None:
            self._acc.reset()
        self._t_interval, self._steps_interval, self._samples_at = time.perf_counter(), 0, self._samples_read()

    def epochs(self, total: int) -> Iterator[int]:
        """``range(state.epoch, total)``, each ``data()`` loader set to that epoch; a snapshot at each end."""
        self._require_state()
        if self._place is not None:
            raise ConfigError(
                "under ddpkit run --replicas, loop over 'for step in loop.steps(n)' and read each step's batches "
                "with 'for batch in loop.shares(loader)': a group healed from another may land in another epoch"
            )
        while self.state.epoch < total:
            for loader in self._loaders:
                loader.set_epoch(self.state.epoch)
            step, read = self.state.step, sum(loader.yielded for loader in self._loaders)
            yield self.state.epoch
            read = sum(loader.yielded for loader in self._loaders) - read
            if read and self.state.step == step and not self._said_no_step:
                # An epoch loop with no loop.step() trains, but its snapshots, records and stops come at epoch ends
                # alone: said once (the porter's seed-001 port forgot it, and a stop waited for the epoch's end)
                self._said_no_step = True
                self.print(report.no_step_line(self.state.epoch, read), file=sys.stderr)
            if not self._loaders and self.state.step > step and self.ctx.world_size > 1 and not self._said_no_loader:
                self._said_no_loader = True
                self.print(report.no_loader_line(self.state.epoch, self.ctx.world_size), file=sys.stderr)
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
        due_save = self.session.snapshot_due(s, epoch_end)
        # A stop signal is read with the records; with no records (log_every=0), every STOP_CHECK steps
        due_check = not cfg.log_every and s % STOP_CHECK == 0
        if not (due_log or due_save or due_check or epoch_end):
            return
        synced = self.session.sync(self._acc)
        if due_log or epoch_end:
            self._record("epoch" if epoch_end else "step", synced.totals, self._names())
        if synced.stop:
            self.session.stop(s, self.state.epoch, self._snapshot)
        if due_save:
            self.session.save(self._snapshot, s)

    def _record(self, event: str, totals: list[float], names: tuple[str, ...]) -> None:
        now = time.perf_counter()
        elapsed, steps = now - self._t_interval, self._steps_interval
        k = len(names)
        for i, name in enumerate(names):
            sums = self._epoch_sums.setdefault(name, [0.0, 0.0])
            sums[0] += totals[i]
            sums[1] += totals[k + i]
        if event == "epoch":  # the epoch's means, over every interval of it
            self.metrics = {n: (s / c if c else None) for n, (s, c) in sorted(self._epoch_sums.items())}
            self._epoch_sums = {}
        else:
            self.metrics = means(names, totals)
        # an epoch record names the epoch that ended (state.epoch counts it already); a step record the current one
        epoch = self.state.epoch - 1 if event == "epoch" else self.state.epoch
        record = {"step": self.state.step, "epoch": epoch, **self.metrics}
        if steps and elapsed > 0:
            record["steps_per_s"] = round(steps / elapsed, 3)
        read = self._samples_read()
        if read > self._samples_at and elapsed > 0:
            # Every rank reads as many samples a step (DistributedSampler's equal shares): this rank's, times the
            # world size, is the job's
            record["samples_per_s"] = round((read - self._samples_at) * self.world_size / elapsed, 3)
        self._samples_at = read
        self.log_writer.log(event, **record, **self.session.interval_figures())
        if self._acc is not None:
            self._acc.reset()
        self._t_interval, self._steps_interval = now, 0

    def _samples_read(self) -> int:
        """The samples this rank's ``data()`` loaders have given out (a loader made later starts at 0)."""
        return sum(loader.samples for loader in self._loaders)

    def _snapshot(self, finished: bool = False) -> dict:
        """What a snapshot of this Loop holds (every rank: what differs by rank is found by one collective)."""
        state = self.state
        shared, per_rank = named_state(
            self.ctx, self.strategy, state, self._models, f"the loop's state at step {state.step}"
        )
        return {
            "loop": {
                "step": state.step,
                "epoch": state.epoch,
                "best": self._best,
                "finished": finished,
                "epoch_sums": self._epoch_sums,
            },
            "state": shared,
            "per_rank": sorted(per_rank),
            "scaler": self.amp.scaler.state_dict() if self.amp.scaling else None,
            "loaders": [loader.state_dict() for loader in self._loaders],
            "rank_state": {
                "metrics": self._acc.state() if self._acc is not None else [],
                "names": list(self._names()),
                "state": per_rank,
            },
        }

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
        self._acc = add_named(self._acc, values, self.ctx.device)

    def reduce(self, **values: Any) -> dict[str, float]:
        """Now, over every rank (one all-reduce and a host copy): each value's mean, a ``(sum, count)``
        pair's sum/count. Every rank, with the same names."""
        if self._place is not None:  # the groups' collectives are torchft's, inside a step's quorum only
            raise self._said_by_group_0(
                ConfigError(
                    "loop.reduce() under ddpkit run --replicas: not yet (it would be this group's alone, and a "
                    "decision made on it could differ between the groups); log it with loop.log"
                )
            )
        reduced = reduce_means(self.ctx, values)
        if reduced is None:
            raise ConfigError(
                f"loop.reduce() was given different names on different ranks (this rank: "
                f"{', '.join(sorted(values)) or 'none'}): pass the same names on every rank"
            )
        return reduced

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
        one all-reduce adds them up. ``model`` runs unwrapped, in eval mode, with rank 0's buffers (BatchNorm's
        statistics) on every rank where its wrapper broadcasts them (``broadcast_buffers``). Every rank."""
        dev = self.ctx.device
        raw = self.strategy.unwrap(model)
        wrapper = next((m for m in self._models if self.strategy.unwrap(m) is raw), model)

        def measure(model, batch):
            out, n = fn(model, batch), leading_size(batch)
            return {k: v if isinstance(v, tuple) else (as_f64(v, dev) * n, n) for k, v in out.items()}

        batches = rank_share(data, self.ctx, batch_size)
        with self.strategy.evaluating(model):  # FSDP2: the whole weights gathered once, for any count of batches
            names, totals, _ = evaluate_split(
                raw, batches, measure, self.ctx, self.amp, rank0_buffers=self.strategy.shares_buffers(wrapper)
            )
        return means(names, totals[:-1])

    def best(self, metric: str, value: float, mode: str = "min") -> bool:
        """Keep the best weights by ``metric``: when ``value`` beats the best so far (``mode`` min or
        max), rank 0 writes ``best.pt`` (every module named in resume(), the step and the value). The
        best so far is snapshot state. Every rank; rank 0's value decides. True when this is the best."""
        self._require_state()
        if mode not in ("min", "max"):
            raise ConfigError(f"Loop.best(mode={mode!r}): choose min or max")
        v = self.ctx.broadcast(torch.tensor([float(value)], dtype=torch.float64, device=self.ctx.device)).item()
        old = self._best.get(metric) or {}
        watch = Watch(metric, mode, value=old.get("value"), step=old.get("step"))
        modules = {name: m for name, obj in self.state.items() if isinstance(m := self.strategy.unwrap(obj), nn.Module)}
        if not self.session.keep_best(watch, {metric: v}, self.state.step, modules):
            return False
        self._best[metric] = {"value": watch.value, "step": watch.step}
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

    def _write_config(self) -> None:
        atomic_write(self.files.root / "loop.json", json.dumps(self.key.to_dict(), indent=1, default=str).encode())


# ---------------------------------------------------------------------- module helpers
def _note_dir(run_dir: str) -> str:
    """Where this process's Loop notes an error for its job's restarts: its run dir (a replica group's own)."""
    place = script_place()
    return group_dir(run_dir, place.index) if place is not None else run_dir


def _another_run_dir(world_size: int) -> str:
    """How to name another run dir, said where a Loop's is in use; and for a world of 1 in a process that
    multiprocessing started (as mp.spawn starts them), that each such process is a world of its own."""
    said = "pass another run_dir to Loop"
    if world_size == 1 and multiprocessing.parent_process() is not None and not under_launcher():
        said += (
            " (this process was started by multiprocessing, as mp.spawn starts them, with no rank of its own: each "
            "is a world of 1; start the ranks of one job with ddpkit.launch(main, nproc=N) instead)"
        )
    return said


def environ_note(code: dict) -> list[str]:
    """The environment variables the loop's code reads, in one entry of the start line's ``not_read`` (one per
    variable made the line unreadable: the porter's seed-000 port read four)."""
    names = [re.sub(r"^os\.environ\[(.*)\]$", r"\1", label) for label in code.get("environ") or {}]
    return (
        [f"the environment the loop reads ({', '.join(names)}): not compared on a resume; a change is said"]
        if names
        else []
    )
