"""One rank's training run: the loop, and the only training loop in ddpkit.

    with distributed(cfg.device, cfg.timeout_s) as ctx:
        summary = Engine(cfg, ctx, model, splits, task).fit()

The loop knows nothing of image classification: it asks ``task`` for the loss and the
metrics (see :mod:`ddpkit.train.task`). The step (:meth:`Engine._step`) is free of host syncs:
no ``.item()``, no print, no host copy. Metrics accumulate on the device and are
all-reduced every ``--log-every`` steps. The checkpointer, the logger and the run-dir
writers are called on every rank and decide themselves that only global rank 0 writes.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import os
import time
import warnings
from contextlib import nullcontext
from dataclasses import dataclass, field

import torch
from torch import nn

from ..config import POWERSGD_NO_RESUME, TrainConfig, parse_loggers
from ..data import DataSplits
from ..data.batch import leading_size
from ..data.loader import EvalSource, eval_source, make_sources, make_train_source
from ..data.seeds import DRAWS_NOTE, reseed, seed_rank
from ..errors import DataError, RunDirError
from ..models import uses_conv
from ..ranks import hangwatch
from ..ranks.context import DistContext, on_rank0, settle
from ..run.checkpoint import read_weights
from ..run.display import summary_fields
from ..run.paths import RunFiles
from ..run.plots import draw_run_plots
from ..run.recorder import MetricLogger
from ..run.rundir import launcher_owns, write_config, write_model, write_summary
from . import report
from .evaluate import evaluate
from .flops import peak_flops, step_flops
from .graph import GraphedSteps, decide, user_code
from .metrics import DIVERGED_RATIO, Accumulator, DivergenceWatch, peak_memory_mb
from .optim import (
    EMA,
    build_optimizer,
    build_schedule,
    changes,
    lr_policy,
    user_optimizer,
    user_schedule,
)
from .replicas import Replicas, SampleLog, ShareSources, replica_place
from .selection import from_state, to_state, watches
from .session import RESUME, Amp, Session, misfit
from .strategy import prepare, strategy_for
from .task import Task


@dataclass
class Position:
    """Where the run is; saved in every snapshot as ``position``."""

    epoch: int = 0
    step_in_epoch: int = 0  # optimizer steps done in this epoch
    global_step: int = 0  # optimizer steps done in all


@dataclass
class Timing:
    """Time spent so far (s); saved in every snapshot as ``timing``."""

    train_time_s: float = 0.0  # training steps only: no eval, snapshots or compilation
    compile_time_s: float = 0.0  # the first step of a compiled run
    epoch_elapsed_s: float = 0.0  # time already spent in the current epoch before a resume
    interval_elapsed_s: float = 0.0  # time already spent in the current log interval before a resume


@dataclass
class Interval:
    """Where the current log interval began; saved in every snapshot as ``interval``, so that the
    first step record after a mid-epoch resume covers the whole interval, as an uninterrupted
    run's record at that step does, not only the steps since the snapshot."""

    step_in_epoch: int = 0  # optimizer steps of the epoch done before the interval
    totals: list = field(default_factory=list)  # the epoch's [sums..., counts...] then, over every rank


class Engine:
    def __init__(
        self,
        cfg: TrainConfig,
        ctx: DistContext,
        model: nn.Module,
        splits: DataSplits,
        task: Task,
        optimizer=None,
        scheduler=None,
        static_graph: bool = False,
        t0: float | None = None,
        identity: dict | None = None,
        find_unused_parameters: bool | None = None,
        flops_sample=None,
    ):
        self.cfg, self.ctx, self.meta, self.task = cfg, ctx, splits.meta, task
        self.identity = identity  # written beside config.toml (RUN_DIR/identity.json)
        self.t0, self.first_step_at = t0, None  # launch and first step (wall clock): startup_s
        self.accum = cfg.grad_accum
        # --replicas R: this process is one of R groups, each reading one rank's share of the global batch as a DDP
        # run of R ranks reads it (train/replicas.py), and the share of any group that is gone
        self.place = replica_place(cfg)
        self.replicas: Replicas | None = None  # torchft's side, started in fit() once a resume has set the step
        self.sample_log: SampleLog | None = None  # --sample-log, with the replicas
        self.per_rank_batch = cfg.batch_size // (ctx.world_size * (self.place.count if self.place else 1))
        if self.place is None:
            self.train_src, self.eval_src = make_sources(splits, cfg, ctx)
        else:
            self.shares = ShareSources(
                lambda data_ctx: make_train_source(
                    splits, cfg, data_ctx, self.per_rank_batch // self.accum, group=self.accum
                ),
                ctx,
                self.place,
                self.accum,
            )
            self.train_src = self.shares.own
            # evaluation: the whole split in every group (each is a world of one), so each group's is exact
            self.eval_src = eval_source(splits.test, splits, cfg, ctx, getattr(self.train_src, "on_device", False))
        # The validation split (--val-fraction, val_data): evaluated at epoch ends and every --eval-every-steps,
        # and what --keep-best and --early-stop watch; the test set is then evaluated once, at the end.
        on_device = getattr(self.train_src, "on_device", False)
        self.val_src = eval_source(splits.val, splits, cfg, ctx, on_device) if splits.val is not None else None
        self.best, self.stopper = watches(cfg)
        self.last_val: tuple | None = None  # (global step, result) of the newest validation
        # Optimizer steps per epoch; with --join this rank may run fewer, and catches up after the Join.
        self.steps_per_epoch = (
            getattr(self.train_src, "max_steps_per_epoch", self.train_src.steps_per_epoch) // self.accum
        )
        # what ddpkit does to the draws of your __getitem__ and collate_fn, on the DataLoader path
        self.data_note = "; ".join(n for n in (splits.note, self.train_src.path == "dataloader" and DRAWS_NOTE) if n)
        if cfg.init_from:
            model.load_state_dict(read_weights(cfg.init_from))  # a resumed snapshot supersedes it
        # DDP's static graph records the first iteration; with no_sync micro-steps, keep it dynamic.
        self.find_unused = cfg.find_unused_parameters if find_unused_parameters is None else find_unused_parameters
        static = static_graph and self.accum == 1 and cfg.grad_sync
        # MFU: a step's FLOPs on this rank (per sample of ``flops_sample``, times this rank's samples per optimizer
        # step) against the device's dense peak for the run's dtype (train/flops.py). Counted here, not before
        # launch: FlopCounterMode's first use imports torch._dynamo (~1.7 s in a fresh launcher), which a worker
        # has imported already (DDP needs it; the forkserver preloads it), so here it costs ~0.02 s. On global
        # rank 0 only, whose records and summary report it: the user's loss runs once more (on meta tensors) there.
        counted = flops_sample is not None and ctx.is_main
        flops, self.flops_note = step_flops(model, task, flops_sample) if counted else (None, "")
        self.flops_per_step = flops / leading_size(flops_sample) * self.per_rank_batch if flops else None
        self.peak, self.peak_name = peak_flops(ctx.device, cfg)
        self.strategy = strategy_for(cfg.strategy)  # what depends on how the model is spread over the ranks
        self.raw, self.ddp, self.synced, self.model = prepare(
            model, cfg, ctx, self.strategy, static, bool(self.find_unused)
        )
        # torch's (dropout), numpy's and Python's: per rank, every rerun alike; a replica group's are those of the
        # rank whose share is its own, so that each group draws what that rank of a DDP run draws
        seed_rank(cfg.seed, ctx.rank if self.place is None else self.place.index)
        self.opt = (
            user_optimizer(optimizer, self.raw)
            if optimizer is not None
            else build_optimizer(self.raw, cfg, ctx.device, zero=cfg.zero)
        )
        self.strategy.check_optimizer(self.opt, "Trainer(optimizer=...)")
        self.total_steps = cfg.epochs * self.steps_per_epoch
        if cfg.max_steps:
            self.total_steps = min(self.total_steps, cfg.max_steps)
        self.sched = (
            user_schedule(scheduler, self.opt, self.total_steps)
            if scheduler is not None
            else build_schedule(self.opt, cfg, self.total_steps)
        )
        self.lr_policy = lr_policy(cfg, self.opt, optimizer is not None, self.sched, scheduler is not None)
        self._advance_lr = self.sched.step  # the graph's device lookup under --cuda-graph (train/graph.py)
        self.user_scheduler = scheduler is not None
        self.user_code = user_code(static_graph, optimizer is not None, task)  # what a replay would not run
        self.changes = changes(cfg, uses_conv(self.raw))
        self.amp = Amp(cfg.amp, ctx.device)
        self.scaler = self.amp.scaler
        self.ema = EMA(self.raw, cfg.ema) if cfg.ema else None
        self.autocast = self.amp.autocast()  # made once, entered at every micro-step
        extra = ("grad_norm",) if cfg.clip_grad_norm else ()  # per optimizer step, count 1
        self.acc = Accumulator(task.names + extra, ctx.device)
        self._no_metrics = [(0.0, 0.0)] * len(task.names)  # free: host numbers
        self._no_norm = [(0.0, 0.0)] * len(extra)
        self.log = MetricLogger(
            ctx,
            cfg.run_dir,
            self.total_steps,
            cfg.progress,
            cfg.quiet,
            loggers=parse_loggers(cfg.log),
            config=cfg.to_dict(),
            metric_names=task.names,
        )
        self.session = Session(
            ctx,
            cfg.run_dir,
            cfg,
            self.log,
            keep=cfg.keep_snapshots,
            every_steps=cfg.save_every_steps,
            background=cfg.async_snapshots,
            strategy=self.strategy,
        )
        self.pos, self.timing = Position(), Timing()  # part of every snapshot, under these names
        self.interval, self._t_last = Interval(totals=[0.0] * (2 * len(self.acc.names))), time.perf_counter()
        self._resumed_interval: Interval | None = None  # the snapshot's, for the first epoch after a resume
        self.watch = DivergenceWatch()  # in every snapshot as "divergence"
        self._epoch_t0 = 0.0
        self.final_train: dict = {}
        self.train_local: torch.Tensor | None = None  # this rank's own sums of the last epoch
        self._last_eval: tuple | None = None  # (global step, result, local sums) of the newest evaluation
        self._nan_warned = False
        self.graph_decision = decide(cfg, ctx, self)
        if self.graph_decision.use and ctx.device.type == "cuda":  # the fused kernels read a tensor lr as float32
            self.changes = ", ".join(c for c in (self.changes, "lr rounded to float32 (CUDA graph)") if c != "none")
        self.graph: GraphedSteps | None = None  # built in fit(), after a resume has set the lr and the step

    # ------------------------------------------------------------------ state
    def _stateful(self) -> dict:
        """The components that save and load their own state, by their key in the snapshot (the model and
        the optimizer: through the strategy, in :meth:`state_dict` and :meth:`load_state_dict`)."""
        return {
            "scheduler": self.sched,
            "scaler": self.scaler,
            "ema": self.ema,
        }

    def state_dict(self) -> dict:
        # The model's and the optimizer's through the strategy: under FSDP2 (and ZeRO, the optimizer's) a
        # collective that gathers the whole state, which rank 0 alone then holds
        state = {
            "model": self.strategy.snapshot_model(self.raw),
            "optimizer": self.strategy.snapshot_optimizer(self.opt, self.ctx),
            **{key: None if part is None else part.state_dict() for key, part in self._stateful().items()},
        }
        if self.graph is not None:  # its lrs are device tensors; a snapshot keeps plain floats
            state["optimizer"] = self.graph.optimizer_state(state["optimizer"])
        now, mid_epoch = time.perf_counter(), self.pos.step_in_epoch > 0
        timing = dataclasses.replace(
            self.timing,
            epoch_elapsed_s=now - self._epoch_t0 if mid_epoch else 0.0,
            interval_elapsed_s=now - self._t_last if mid_epoch else 0.0,
        )
        return {
            **state,
            "position": dataclasses.asdict(self.pos),
            "timing": dataclasses.asdict(timing),
            # The interval's start, summed over ranks already (the same on every rank): a plain
            # list of floats, valid at any world size
            "interval": dataclasses.asdict(self.interval),
            "divergence": dataclasses.asdict(self.watch),
            "selection": {"best": to_state(self.best), "early_stop": to_state(self.stopper)},
            # an IterableDataset's loader workers: its shards (data/stream.py), which a resume must keep
            "stream_workers": getattr(self.train_src, "workers", None) if self.train_src.path == "stream" else None,
            "final_train": self.final_train,
            # Plain floats: this travels through all_gather_object, which would rebuild a
            # device tensor on the sender's GPU in every receiver (float64 -> float is exact).
            "rank_state": {"acc": self.acc.state()},
        }

    def load_state_dict(self, state: dict) -> None:
        """What :meth:`state_dict` returned, as ``Checkpointer.restore`` gives it back (the RNG streams are
        ``Checkpointer.restore_rng``'s, after this)."""
        if self.cfg.comm_hook == "powersgd":  # a restart under torchrun's own agent found a snapshot
            raise RunDirError(f"{POWERSGD_NO_RESUME}; delete {self.cfg.run_dir} to train again from the start")
        self.strategy.load_model_state(self.raw, state["model"])
        self.strategy.load_optimizer_state(self.opt, state["optimizer"], [self.raw])
        for key, part in self._stateful().items():
            if part is not None:
                part.load_state_dict(state[key])
        self.pos, self.timing = Position(**state["position"]), Timing(**state["timing"])
        self.watch = DivergenceWatch(**state.get("divergence", {}))  # snapshots before 0.3 have none
        workers = state.get("stream_workers")
        if self.train_src.path == "stream" and workers is not None and workers != self.train_src.workers:
            raise DataError(
                f"this run read its IterableDataset with --num-workers {workers}, which splits it into other shards "
                f"than --num-workers {self.train_src.workers} does: resume it with --num-workers {workers}"
            )
        selection = state.get("selection") or {}  # snapshots before --keep-best have none
        from_state(self.best, selection.get("best"))
        from_state(self.stopper, selection.get("early_stop"))
        self.final_train = state["final_train"]
        # Older snapshots have none: the first step record after the resume then covers the steps since it
        self._resumed_interval = Interval(**state["interval"]) if state.get("interval") else None
        if state["same_world"]:
            self.acc.load(state["rank_state"]["acc"])
            return
        # Another world size (elastic resume). The position is in optimizer steps of a fixed global
        # batch, and the epoch order is a function of (seed, epoch), so the next step takes the same
        # samples. The epoch's metric sums so far are only ever summed over ranks: rank 0 takes all
        # of them. Per-rank random streams (dropout) cannot be continued: restore_rng() starts them afresh.
        merged = torch.tensor([r["acc"] for r in state["rank_states"]], dtype=torch.float64).sum(0)
        self.acc.load(merged if self.ctx.rank == 0 else torch.zeros_like(merged))

    def heal_state(self) -> dict:
        """What a group that is behind receives from this one (``--replicas``, torchft's heal): the state of a
        snapshot, at the start of the step the quorum is about to take, less this group's own metric sums."""
        state = self.state_dict()
        state["rank_state"] = None
        return state

    def load_heal(self, state: dict) -> None:
        """A live group's :meth:`heal_state`, loaded as a snapshot is; this group's metric sums start again from
        zero, and its random streams (its own, which no other group holds) start afresh from (seed, step, group),
        as a rank's do after a resume at another world size."""
        self.load_state_dict({**state, "same_world": True, "rank_state": {"acc": [0.0] * (2 * len(self.acc.names))}})
        reseed(self.cfg.seed, self.pos.global_step, self.place.index)

    # ------------------------------------------------------------------ loop
    def _fits(self, snap: dict) -> None:
        """Raise unless ``snap`` can be loaded into this run as it is: checked before anything is
        changed, so a damaged or foreign snapshot is skipped for the one before it."""
        state = snap["trainer"]
        problem = misfit(self.raw, state["model"])
        if problem:
            raise ValueError(f"its model weights are not this model's: {problem}")
        if misfit(self.opt, state["optimizer"]):
            raise ValueError("its optimizer state is for other parameters")
        for key in ("scheduler", "scaler", "position", "timing", "final_train"):
            if key not in state:
                raise ValueError(f"it has no {key!r}")
        if self.ema and set(state["ema"] or {}) != set(self.ema.state_dict()):
            raise ValueError("its EMA weights are not this model's")
        if any(len(r["rank_state"]["acc"]) != 2 * len(self.acc.names) for r in snap["ranks"]):
            raise ValueError("its per-rank state does not match this run's metrics")
        if state.get("interval") and len(state["interval"]["totals"]) != 2 * len(self.acc.names):
            raise ValueError("its log interval's sums do not match this run's metrics")

    def fit(self) -> dict:
        ok = False
        try:  # from here the --log loggers may be open and the bar running: both are closed however it ends
            snap = self.session.resume(self.load_state_dict, self.cfg.seed, self._fits, warn=self.log.print)
            if snap is not None:
                if snap["world_size"] != self.ctx.world_size:
                    self.log.print(report.elastic_line(self, snap["world_size"]))
                self._check_position()
                if self.pos.global_step < self.total_steps:
                    # A finished run trained longer: its summary.json is of the shorter horizon until this one ends
                    on_rank0(self.ctx, lambda: RunFiles(self.cfg.run_dir).summary.unlink(missing_ok=True))
            hangwatch.report_to(self.cfg.run_dir)  # a hang's report goes beside the run
            if self.graph_decision.use:
                self.graph = GraphedSteps(self)
            replicas = {}
            if self.place is not None:  # this group meets the others from its own resume's step (healed if behind)
                self.replicas = Replicas(
                    *(self.place, self.heal_state, self.load_heal, self.cfg.timeout_s, self.log.log),
                    first=lambda: self.session.first_quorum(self.pos.global_step, self.pos.epoch),
                )
                self.replicas.set_step(self.pos.global_step)
                replicas = {
                    "replicas": self.place.count,
                    "replica_group": self.place.index,
                    # the cores ddpkit's launcher gave this group (ranks/replicas.py), which its threads are sized to
                    "replica_cores": ",".join(map(str, sorted(os.sched_getaffinity(0)))),
                }
            # The steps after the snapshot (all of them, when starting over) run again: drop their records.
            self.session.begin(
                self.pos.global_step,
                self.pos.epoch,
                lambda: write_config(self.cfg, self.ctx, self.identity),
                [self.raw],
                replica=self.replicas is not None,
                **report.start_fields(self, snap),
                **replicas,
            )
            if self.replicas is not None and self.cfg.sample_log:
                self.sample_log = SampleLog(self.cfg.run_dir, self.shares.sources, self.accum)
            with self.session.signal:
                cut_short = self.pos.step_in_epoch and (self.pos.global_step >= self.total_steps or self.stopped_early)
                if snap is not None and cut_short:
                    self.session.first_quorum(self.pos.global_step, self.pos.epoch)  # (--replicas: no step to meet)
                    self._end_cut_epoch()  # killed after the snapshot of a cut-short epoch, before that epoch's end
                while (
                    self.pos.epoch < self.cfg.epochs
                    and self.pos.global_step < self.total_steps
                    and not self.stopped_early
                ):
                    self._run_epoch()
            self.session.finish()  # the last snapshot whole before model.pt and summary.json say the run ended
            self.session.first_quorum(self.pos.global_step, self.pos.epoch)  # (--replicas: none if no step was left)
            summary = self._finish()
            ok = True
            return summary
        finally:
            if self.replicas is not None:  # first: its watch must not end the process while the rest unwinds
                self.replicas.close()
            self.session.close()  # however it ends: the write in flight, if any, ends first
            if self.sample_log is not None:
                self.sample_log.close()
            self.log.close(ok)

    def _run_epoch(self) -> None:
        cfg = self.cfg
        self.model.train()
        self._epoch_t0 = time.perf_counter() - self.timing.epoch_elapsed_s
        self._begin_intervals()
        totals = self.interval.totals
        if self.graph is not None:
            micro = self.graph.epoch(self.pos.epoch, self.pos.step_in_epoch)
        elif self.replicas is not None:
            # Each step reads the batches of the groups it computes (_replica_step). No count: a heal there may move
            # this group to any step of any epoch, and the epoch's last step (``last`` below) ends the loop
            micro = itertools.repeat(None)
        else:
            micro = self.train_src.batches(self.pos.epoch, self.pos.step_in_epoch * self.accum)
        with self.strategy.join(self.ddp, self.opt) if cfg.join and self.ddp is not None else nullcontext():
            for group in zip(*[micro] * self.accum):  # grad_accum micro-batches per optimizer step
                if self.first_step_at is None:
                    self.first_step_at = time.time()
                if cfg.compile and self.pos.global_step == 0:
                    self._compile_step(group)
                    self._epoch_t0 += self.timing.compile_time_s
                    self._interval_start(time.perf_counter(), totals)
                elif self.graph is not None:
                    self.graph.step()  # gathers its own batch on the device
                elif self.replicas is not None:
                    self._replica_step()
                else:
                    self._step(group)
                self.pos.step_in_epoch += 1
                self.pos.global_step += 1
                self.log.progress(self.pos.global_step)  # the bar, if any, moves every step
                hangwatch.progress(self.pos.global_step)  # the heartbeat a hang in DDP's backward is seen by
                if cfg.join:
                    continue  # ranks run different step counts: no collective of ours until all have joined
                last = (
                    self.pos.step_in_epoch == self.steps_per_epoch or self.pos.global_step == self.total_steps
                )  # --max-steps
                if cfg.eval_every_steps and self.pos.global_step % cfg.eval_every_steps == 0:
                    self._validate()
                    last = last or self.stopped_early  # --early-stop: this step ends the epoch and the run
                if self.pos.step_in_epoch % cfg.log_every == 0 or last:
                    self._log_interval()
                if last:
                    break
                self.session.save_if_due(self.pos.global_step, self._checked_state)  # the epoch's last: after eval
        if cfg.join:
            self._rejoin()
        # An epoch cut short by --max-steps or --early-stop: the run's last snapshot is taken where it stopped,
        # mid-epoch, so that a longer horizon goes on with this epoch's next step, as a run started with it does.
        partial = self.pos.step_in_epoch < self.steps_per_epoch and not cfg.join
        if partial:
            self.session.save(self._checked_state, self.pos.global_step)
        # The epoch's last step always logs, and that all-reduce synced the device: reuse its totals.
        epoch_time = time.perf_counter() - self._epoch_t0
        self.timing.epoch_elapsed_s = 0.0
        self.timing.train_time_s += epoch_time
        self._end_epoch(
            self.acc.means(self.interval.totals, "train_"),
            epoch_time,
            self.pos.step_in_epoch * self.per_rank_batch * self.ctx.world_size,
            partial,
        )

    def _rejoin(self) -> None:
        """After an uneven epoch, make the ranks alike again: the Join gave every rank the last
        joiner's weights, but a rank that ran fewer steps skipped their schedule steps and
        optimizer updates. It steps its schedule up to rank 0's count (rank 0 always has the most
        batches) and takes rank 0's optimizer state; then the epoch's one log interval."""
        missing = self.steps_per_epoch - self.pos.step_in_epoch
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # "lr_scheduler.step() before optimizer.step()": on purpose
            for _ in range(missing):
                self.sched.step()
        self.pos.step_in_epoch += missing
        self.pos.global_step += missing
        self.strategy.rejoin(self.opt, self.ctx)
        self._log_interval()

    def _step(self, micro: tuple) -> None:
        """One optimisation step over ``grad_accum`` micro-batches. Hot path: no host sync of any kind."""
        self.opt.zero_grad(set_to_none=True)
        k = len(micro)
        for i, batch in enumerate(micro):
            # Every micro-step but the last skips DDP's all-reduce; the last one syncs the summed grads
            # (unless grad_sync is off: ddpkit bench's compute-only timing).
            skip = self.synced is not None and (i < k - 1 or not self.cfg.grad_sync)
            with self.strategy.no_sync(self.synced, skip) if skip else nullcontext():
                with self.autocast:
                    loss, outputs = self.task.loss(self.model, batch)
                self.scaler.scale(loss / k if k > 1 else loss).backward()
            self.acc.add(self.task.measure(loss, outputs, batch) + self._no_norm)
        self._optimizer_step()

    def _optimizer_step(self) -> None:
        """Once the step's gradients are whole: clipping (by the global norm), the optimizer, the scaler, lr, EMA."""
        if self.cfg.clip_grad_norm:
            self.scaler.unscale_(self.opt)  # clip the true gradients, not the fp16-scaled ones
            norm = self.strategy.clip_grad_norm_(self.raw, self.cfg.clip_grad_norm, foreach=True)
            self.acc.add(self._no_metrics + [(norm, 1)])
        self.scaler.step(self.opt)
        self.scaler.update()
        self._advance_lr()
        if self.ema is not None:
            self.ema.update(self.raw)

    def _replica_step(self) -> None:
        """One optimizer step of a replica group (``--replicas``, train/replicas.py): ``Replicas.step`` runs the
        quorum, the shares, the all-reduce and the commit, attempt after attempt; this recipe's part is a share's
        batches and their loss, each micro-batch's a share of the global batch's mean."""
        scale = 1.0 / (self.accum * self.replicas.place.count)

        def compute(share: int) -> list:
            measures = []
            for batch in self.shares.batches(share, self.pos.epoch, self.pos.step_in_epoch):
                with self.autocast:
                    loss, outputs = self.task.loss(self.model, batch)
                self.scaler.scale(loss * scale).backward()
                measures.append(self.task.measure(loss, outputs, batch) + self._no_norm)
            return measures

        computed, measures = self.replicas.step(self.raw, lambda: self.pos.global_step, compute, self._healed)
        if self.sample_log is not None:
            self.sample_log.write(self.pos.epoch, self.pos.step_in_epoch, self.pos.global_step, computed)
        for m in measures:  # the committed attempt's only: a step computed again is counted once
            self.acc.add(m)
        self._optimizer_step()

    def _healed(self) -> None:
        """After a heal (:meth:`load_heal`, at the start of a step): this group is now at a live group's position,
        which may be in a later epoch than the one :meth:`_run_epoch` began, or earlier in it. Its metric sums start
        again from zero there, so its log interval starts at this step, and its epoch clock is the live group's."""
        now = time.perf_counter()
        self._epoch_t0 = now - self.timing.epoch_elapsed_s
        self._resumed_interval = None  # the live group's interval: its sums, not this group's
        self._interval_start(now, [0.0] * (2 * len(self.acc.names)))

    def _compile_step(self, micro: tuple) -> None:
        """The first step of a compiled run, timed apart: it includes compilation."""
        t = time.perf_counter()
        self._step(micro)
        self._sync()
        self.timing.compile_time_s = time.perf_counter() - t

    def _interval_start(self, now: float, totals: list[float]) -> None:
        self._t_last, self.interval = now, Interval(self.pos.step_in_epoch, totals)

    def _begin_intervals(self) -> None:
        """The epoch's first log interval. After a mid-epoch resume the restored accumulator holds
        the epoch's earlier samples: the interval continues from the snapshot's start of it (its
        samples/s over the training time before the snapshot and after the resume, the restart
        left out); a snapshot without one starts it here. (Same branch on every rank.)"""
        resumed, self._resumed_interval = self._resumed_interval, None
        if not self.pos.step_in_epoch:
            self._interval_start(time.perf_counter(), [0.0] * (2 * len(self.acc.names)))
        elif resumed is not None:
            self._t_last, self.interval = time.perf_counter() - self.timing.interval_elapsed_s, resumed
        else:
            self._interval_start(time.perf_counter(), self._sync()[0])

    def _sync(self, check_weights: bool = False) -> tuple[list[float], bool, bool]:
        """At log intervals and snapshots only (``sync_interval``, one all-reduce): this epoch's metric
        totals ([sums..., counts...]), whether any rank was sent SIGTERM, and (if asked) whether any
        rank holds a non-finite weight. A NaN loss on one rank makes the summed loss NaN."""
        synced = self.session.sync(
            self.acc, self.strategy.weights_to_check(self.raw, self.ctx) if check_weights else None
        )
        return synced.totals, synced.stop, synced.bad_weights

    def _check_finite(self, loss_sum: float, bad_weights: bool = False) -> None:
        """``--on-nan``: stop (same decision on every rank: the inputs are all-reduced), or warn once."""
        if math.isfinite(loss_sum) and not bad_weights:
            return
        what = "the weights" if bad_weights else "the training loss"
        msg = f"{what} became NaN or Inf by step {self.pos.global_step} (epoch {self.pos.epoch})"
        if self.cfg.on_nan == "warn":
            if not self._nan_warned:
                self.log.print(f"ddpkit: warning: {msg}; training on (--on-nan warn)")
                self._nan_warned = True
            return
        self.session.stop_non_finite(msg, self.pos.global_step)

    def _checked_state(self) -> dict:
        """The state to snapshot, after checking (on every rank: a collective) there is nothing non-finite in it."""
        totals, _, bad = self._sync(check_weights=True)
        self._check_finite(totals[0], bad)
        return self.state_dict()

    def _log_interval(self) -> None:
        totals, stop, _ = self._sync()
        now = time.perf_counter()
        interval = [a - b for a, b in zip(totals, self.interval.totals)]
        n = (self.pos.step_in_epoch - self.interval.step_in_epoch) * self.per_rank_batch * self.ctx.world_size
        means = self.acc.means(interval)
        rate = n / max(1e-9, now - self._t_last)
        self.log.log(
            "step",
            epoch=self.pos.epoch,
            step=self.pos.global_step,
            **means,
            lr=self.sched.get_last_lr()[0],
            samples_per_s=rate,
            **report.utilisation(self, rate),
            **self.session.interval_figures(),
        )
        self.log.interval(self.pos.global_step, self.pos.epoch, means.get("loss"), rate)
        self._interval_start(now, totals)
        self._check_finite(totals[0])
        if self.watch.check(means.get("loss"), self.pos.global_step):
            self.log.print(f"ddpkit: warning: {report.divergence_line(self, means['loss'])}")
        if stop:
            powersgd = "a --comm-hook powersgd run cannot resume (see docs/fault-tolerance.md)"
            again = powersgd if self.cfg.comm_hook == "powersgd" else RESUME
            self.session.stop(self.pos.global_step, self.pos.epoch, self._checked_state, again)

    def _check_position(self) -> None:
        """A snapshot's position must be where its step is. ddpkit before 0.4 took a --max-steps run's last
        snapshot after its cut-short epoch had ended (epoch + 1, step 0): trained on to a longer horizon, the
        rest of that epoch would be skipped. (Every rank decides alike: the snapshot is the same.)"""
        pos, k = self.pos, self.steps_per_epoch
        # (--join: ranks' epochs differ in steps; a stream's steps an epoch follow the world size: neither is checked)
        if self.cfg.join or self.train_src.path == "stream" or pos.global_step >= self.total_steps:
            return
        if pos.global_step == pos.epoch * k + pos.step_in_epoch:
            return
        raise RunDirError(
            f"{self.cfg.run_dir}'s last snapshot (step {pos.global_step}) was taken by an older ddpkit after its "
            f"last epoch was cut short by --max-steps: training it on would skip the rest of that epoch. Pass a "
            f"new --run-dir to train the longer run from the start"
        )

    def _end_cut_epoch(self) -> None:
        """The end of an epoch cut short by --max-steps or --early-stop, for a run whose snapshot was taken
        mid-epoch there and which was killed before that epoch's end was written: its train figures, the
        validation (report only) and the epoch record, as the run would have written them."""
        totals = self._sync()[0]
        seen = self.pos.step_in_epoch * self.per_rank_batch * self.ctx.world_size
        self._end_epoch(self.acc.means(totals, "train_"), self.timing.epoch_elapsed_s, seen, partial=True)

    def _end_epoch(self, train: dict, epoch_time: float, seen: int, partial: bool = False) -> None:
        if self.val_src is not None:  # the validation split; the test set waits for the end
            val = self.last_val
            if val is not None and val[0] == self.pos.global_step:
                result = val[1]  # this step's, from the cadence
            else:  # at epoch ends only when there is no step cadence; an epoch cut short by --max-steps reports it
                # without choosing by it: a longer run, or this run trained on, makes no evaluation at that step
                result = self._validate(select=not partial) if not self.cfg.eval_every_steps else {}
        else:
            result, local = self._evaluate()
            self._last_eval = (self.pos.global_step, result, local)
        self.log.log(
            "epoch",
            epoch=self.pos.epoch,
            step=self.pos.global_step,
            **train,
            **result,
            epoch_time_s=epoch_time,
            samples_per_s=seen / max(1e-9, epoch_time),
            peak_memory_mb=peak_memory_mb(self.ctx),
        )
        self.final_train = train
        self.train_local = self.acc.local()
        self.pos.epoch += 1
        self.pos.step_in_epoch = 0
        self.acc.reset()
        if not partial:  # (a partial epoch's snapshot was taken mid-epoch, before this)
            self.session.save_if_due(self.pos.global_step, self._checked_state, epoch_end=True)

    def _evaluate(self, source: EvalSource | None = None, prefix: str = "test_") -> tuple[dict, torch.Tensor]:
        hangwatch.idle()  # no steps until the next epoch's first: its collectives are still watched
        model = self.ema.module if self.ema is not None else self.raw
        # (with rank 0's buffers, as model.pt holds them: DDP's per-forward broadcast is off for BatchNorm-only
        # models, so the engine's ranks' differ until an evaluation: evaluate_split)
        with self.strategy.evaluating(model):  # FSDP2: the whole weights gathered once, for any count of batches
            return evaluate(model, source or self.eval_src, self.task, self.cfg, self.ctx, prefix)

    @property
    def stopped_early(self) -> bool:
        return self.stopper is not None and self.stopper.exhausted

    def _validate(self, select: bool = True) -> dict:
        """Evaluate the validation split now: an ``eval`` record by step, a new best written to best.pt
        (--keep-best), the patience counted (--early-stop). Every rank decides alike on the all-reduced
        result. Its time is left out of the epoch's and the interval's training time."""
        t = time.perf_counter()
        step = self.pos.global_step
        result, _ = self._evaluate(self.val_src, "val_")
        self.last_val = (step, result)
        if select and self.best is not None:
            self.session.keep_best(
                self.best, result, step, {"model": self.ema.module if self.ema is not None else self.raw}
            )
        if select and self.stopper is not None:
            self.stopper.update(result, step)
        self.log.log("eval", epoch=self.pos.epoch, step=step, **result)
        if self.stopped_early:
            s = self.stopper
            self.log.print(
                f"ddpkit: early stop at step {step}: {s.metric} has not improved for {s.patience} evaluations "
                f"(best {s.value:.6g} at step {s.step})"
                if s.value is not None
                else f"ddpkit: early stop at step {step}: {s.metric} was never finite in {s.patience} evaluations"
            )
        spent = time.perf_counter() - t
        self._epoch_t0 += spent
        self._t_last += spent
        return result

    def _finish(self) -> dict:
        cfg, ctx = self.cfg, self.ctx
        if self._last_eval is not None and self._last_eval[0] == self.pos.global_step:
            _, result, test_local = self._last_eval  # the weights have not changed since the last epoch's
        else:
            result, test_local = self._evaluate()  # with a validation split: the test set's one evaluation
        per_rank = report.per_rank(self, test_local)
        model = self.ema.module if self.ema is not None else self.raw
        write_model(cfg.run_dir, self.strategy.model_state(model), ctx)
        summary = report.summary(self, result, per_rank)
        write_summary(cfg.run_dir, summary, ctx)
        # as a Loop's end is marked
        self.session.mark_finished(
            self.pos.global_step,
            self.pos.epoch,
            "--reuse-finished (reuse_finished=True) with the same settings returns its result",
        )
        # The run's last collective: rank 0's last record, plots (if it draws them) and loggers' close keep no rank
        # waiting in a collective that --timeout-s would end (exit 3 after a finished run).
        settle(ctx)
        self.log.log("summary", step=self.pos.global_step, **summary_fields(summary))
        if self.watch.diverged_at_step is not None:
            self.log.print(
                f"ddpkit: warning: this run diverged at step {self.watch.diverged_at_step} (its loss rose over "
                f"{DIVERGED_RATIO:g}x its start); its figures are not those of a converged model"
            )
        if ctx.is_main and cfg.plots and not launcher_owns(cfg.run_dir):  # else the launcher draws them, after us
            draw_run_plots(cfg.run_dir, warn=self.log.print)
        return summary
