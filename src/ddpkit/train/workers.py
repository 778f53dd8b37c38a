"""The functions the launcher runs on every rank: train (start to finish, the process group destroyed
even on error) and evaluate. What each needs travels as one :class:`Job`.

    run_workers(train_worker, (Job(cfg, task, model, splits),), spec)     # ddpkit.dist.launcher
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any, Optional

import torch
import torch.distributed as dist
from torch import nn

from ..config import TrainConfig
from ..data import DataSplits, load_dataset
from ..data.loader import EvalSource, Preprocess
from ..dist import env
from ..dist.context import DistContext, distributed
from ..errors import AlreadyReported, ConfigError, DataError, TaskError
from ..models import model_for
from ..run.rundir import load_trained_model, rank0_owns, read_fatal, record_fatal
from .engine import Engine
from .evaluate import evaluate
from .task import Task


@dataclass
class Job:
    """What one worker needs. Model and splits are None when they come from the registries."""

    cfg: TrainConfig
    task: Task
    model: Optional[nn.Module] = None
    splits: Optional[DataSplits] = None
    optimizer: Any = None  # None: built from the config; else a factory or an optimizer on ``model``
    scheduler: Any = None
    t0: float | None = None  # when the user launched the run (wall clock), for summary.json's startup_s
    identity: Optional[dict] = None  # what was read of what was passed in, for RUN_DIR/identity.json


def train_worker(job: Job) -> dict:
    """One rank, start to finish; the process group is destroyed even on error."""
    cfg = job.cfg
    with distributed(cfg.device, cfg.timeout_s, cfg.deterministic) as ctx:
        same_identity(cfg, ctx)  # before anything uses the run dir, which the identity may name
        with rank0_owns(cfg, ctx):
            fatal = read_fatal(cfg.run_dir) if env.restart_count() > 0 else None
            if fatal is not None:  # the last attempt met an error a restart cannot fix; it was reported then
                raise AlreadyReported(fatal["message"], fatal["exit_code"])
            try:
                return _train(job, ctx)
            except (DataError, TaskError) as exc:  # deterministic: every restart would meet it again
                if env.restarts_left():
                    record_fatal(cfg.run_dir, exc)
                raise


def same_identity(cfg: TrainConfig, ctx: DistContext) -> None:
    """Raise on every rank unless every rank computed the same run identity. Under torchrun each rank
    reads its own inputs (a copy of the data per node, say, whose files' mtimes differ), and ranks that
    disagree would name different run dirs or refuse each other's snapshots. One all_gather_object."""
    if ctx.world_size == 1:
        return
    mine = (cfg.hash(), cfg.run_dir, cfg.identity())
    gathered = [None] * ctx.world_size
    dist.all_gather_object(gathered, mine)  # a collective: on every rank
    first = gathered[0]
    for rank, other in enumerate(gathered):
        if other[:2] != first[:2]:
            keys = sorted(k for k in first[2].keys() | other[2].keys() if first[2].get(k) != other[2].get(k))
            raise ConfigError(
                f"rank {rank} computed another run identity than rank 0 (differs in "
                f"{', '.join(keys) or 'run_dir'}): every rank must see the same data, weights and code. "
                f"Copies of the data on each node must be identical, modification times included "
                f"(rsync -a, cp -p), or keep one copy on a filesystem every node sees"
            )


def _train(job: Job, ctx: DistContext) -> dict:
    cfg = job.cfg
    splits = job.splits or load_dataset(cfg, download=False)
    torch.manual_seed(cfg.seed)  # identical initial weights on every rank
    # One deep copy of model, optimizer and scheduler together keeps the optimizer pointing at
    # this copy's parameters. Without a copy, spawned ranks on a node would share the
    # tensors torch.multiprocessing put in shared memory, and an in-process run would
    # train the caller's object in place.
    model, optimizer, scheduler = copy.deepcopy((job.model, job.optimizer, job.scheduler))
    if model is None:
        model = model_for(cfg, splits.meta)
    # Registry models use every parameter every step, so DDP may assume a static graph.
    return Engine(
        cfg,
        ctx,
        model,
        splits,
        job.task,
        optimizer,
        scheduler,
        static_graph=job.model is None,
        t0=job.t0,
        identity=job.identity,
    ).fit()


def eval_worker(job: Job) -> dict:
    """Evaluate ``job.model`` (or the run dir's model.pt in a registry model) on every rank's test shard."""
    cfg = job.cfg
    with distributed(cfg.device, cfg.timeout_s, cfg.deterministic) as ctx:
        splits = job.splits or load_dataset(cfg, download=False)
        if job.model is not None:
            model = copy.deepcopy(job.model)
            if cfg.dtype == "float64":
                model.double()
        else:
            model = load_trained_model(cfg, splits.meta, cfg.run_dir)
        model.to(ctx.device)
        source = EvalSource(
            splits.test, Preprocess.for_config(splits.meta, ctx.device, cfg), cfg, ctx, 256, splits.collate_fn
        )
        result, _ = evaluate(model, source, job.task, cfg, ctx)
        return {**result, "world_size": ctx.world_size, "run_dir": cfg.run_dir}
