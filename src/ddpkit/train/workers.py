"""The functions the launcher runs on every rank: train (start to finish, the process group destroyed
even on error) and evaluate. What each needs travels as one :class:`Job`.

    run_workers(train_worker, (Job(cfg, task, model, splits),), spec)     # ddpkit.ranks.launcher
"""

from __future__ import annotations

import copy
import sys
from dataclasses import dataclass
from typing import Any, Iterable, Optional

import torch
import torch.distributed as dist
from torch import nn

from ..config import TrainConfig
from ..data import DataSplits, load_dataset
from ..data.loader import EvalSource, Preprocess
from ..data.seeds import seed_weights
from ..errors import ConfigError
from ..models import model_for
from ..ranks.context import DistContext, distributed
from ..run.rundir import load_trained_model, note_for_restarts, rank0_owns, refuse_a_restart_into
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
    # DDP's search for unused parameters, as preflight decided it (None: the config's, off by default)
    find_unused_parameters: Optional[bool] = None
    sample: Any = None  # preflight's batch of two training samples (CPU): the engine counts a step's FLOPs on it


def train_worker(job: Job) -> dict:
    """One rank, start to finish; the process group is destroyed even on error."""
    cfg = job.cfg
    with distributed(cfg.device, cfg.timeout_s, cfg.deterministic) as ctx:
        same_identity(cfg, ctx)  # before anything uses the run dir, which the identity may name
        with rank0_owns(cfg, ctx):
            refuse_a_restart_into(cfg.run_dir)  # the last attempt met an error a restart cannot fix
            try:
                return _train(job, ctx)
            except Exception as exc:  # deterministic ones (bad data, a task mismatch): every restart would meet them
                note_for_restarts(cfg.run_dir, exc)
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
    seed_weights(cfg.seed)  # identical initial weights on every rank
    # One deep copy of model, optimizer and scheduler together keeps the optimizer pointing at
    # this copy's parameters. Without a copy, spawned ranks on a node would share the
    # tensors torch.multiprocessing put in shared memory, and an in-process run would
    # train the caller's object in place.
    model, optimizer, scheduler = own_copy(ctx, (job.model, job.optimizer, job.scheduler))
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
        find_unused_parameters=job.find_unused_parameters,
        flops_sample=job.sample,
        t0=job.t0,
        identity=job.identity,
    ).fit()


def eval_worker(job: Job) -> dict:
    """Evaluate ``job.model`` (or the run dir's model.pt in a registry model) on every rank's test shard."""
    cfg = job.cfg
    with distributed(cfg.device, cfg.timeout_s, cfg.deterministic) as ctx:
        splits = job.splits or load_dataset(cfg, download=False)
        if job.model is not None:
            (model,) = own_copy(ctx, (job.model,))
            if cfg.dtype == "float64":
                model.double()
        else:
            model = load_trained_model(cfg, splits.meta, cfg.run_dir)
        model.to(ctx.device)
        source = EvalSource(
            splits.test,
            Preprocess.for_config(splits.meta, ctx.device, cfg),
            cfg,
            ctx,
            256,
            splits.collate_fn,
            splits.worker_init_fn,
        )
        result, _ = evaluate(model, source, job.task, cfg, ctx)
        return {**result, "world_size": ctx.world_size, "run_dir": cfg.run_dir}


# ---------------------------------------------------------------------- the user's model, copied per rank
def user_tensors(model: nn.Module | None, optimizer: Any = None) -> list[torch.Tensor]:
    """The tensors of a user's model (parameters, buffers) and optimizer (its state), each once."""
    found: dict[int, torch.Tensor] = {}
    if model is not None:
        for t in [*model.parameters(), *model.buffers()]:
            found.setdefault(id(t), t)
    if isinstance(optimizer, torch.optim.Optimizer):  # not a factory: an optimizer with its state
        settings = [v for group in optimizer.param_groups for k, v in group.items() if k != "params"]  # a tensor lr
        for value in [*settings, *(v for state in optimizer.state.values() for v in state.values())]:
            if isinstance(value, torch.Tensor):
                found.setdefault(id(value), value)
    return list(found.values())


def foreign_devices(devices: Iterable[torch.device], mine: torch.device) -> list[torch.device]:
    """The CUDA devices among ``devices`` other than this rank's ``mine``, in order: where a deep copy
    would put a second copy on another rank's GPU. Pure."""
    return sorted({d for d in devices if d.type == "cuda" and d != mine}, key=lambda d: d.index or 0)


def copy_onto(objects: tuple, staged: Iterable[torch.Tensor], device: torch.device) -> tuple:
    """A deep copy of ``objects`` in which each tensor of ``staged`` comes out on ``device``, copied
    through host memory: never a second copy where it lives. The originals are not touched. The
    copies take the others' places in the one deep copy (its memo), so the copied optimizer's
    parameters and state are the copied model's, as in a plain deep copy."""
    memo: dict[int, Any] = {}
    for t in staged:
        if isinstance(t, nn.parameter.UninitializedTensorMixin) or type(t) not in (torch.Tensor, nn.Parameter):
            continue  # a lazy or subclassed tensor: copied where it is, as before
        moved = t.detach().to("cpu", copy=True).to(device)  # always a new tensor, never one on the GPU it was on
        memo[id(t)] = type(t)(moved, t.requires_grad) if isinstance(t, nn.Parameter) else moved
    return copy.deepcopy(objects, memo)


def own_copy(ctx: DistContext, objects: tuple) -> tuple:
    """This rank's deep copy of the user's (model, optimizer, scheduler), on its own device.

    Under torchrun every rank's script builds the model itself, typically with ``.to("cuda")``:
    cuda:0 in every rank. A deep copy there would put one more model per rank on GPU 0 (then
    DDP's copy on the rank's own GPU): those tensors go through host memory to this rank's
    device instead. Said once for the job (one all-reduce, every rank), by global rank 0.
    """
    model, optimizer = objects[0], objects[1] if len(objects) > 1 else None
    tensors = user_tensors(model, optimizer)
    foreign = foreign_devices((t.device for t in tensors), ctx.device)
    flag = ctx.all_reduce(torch.tensor([float(bool(foreign))], device=ctx.device), op=dist.ReduceOp.MAX)
    if flag.item() > 0 and ctx.is_main:  # once per run, at start-up
        where = ", ".join(map(str, foreign_devices((t.device for t in tensors), torch.device("cpu")))) or "a GPU"
        print(
            f"ddpkit: warning: the model passed in is on {where}, not on the own device of some ranks: each of "
            f"those copied it to its own device through host memory, but keeps a CUDA context on {where} (a few "
            f"hundred MiB per process); build the model on the CPU, or on cuda:LOCAL_RANK "
            f"(torch.cuda.set_device(int(os.environ['LOCAL_RANK'])) before building it)",
            file=sys.stderr,
            flush=True,
        )
    staged = [t for t in tensors if t.device in foreign]
    return copy_onto(objects, staged, ctx.device)
