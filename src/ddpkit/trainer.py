"""The public API: ``Trainer(config, model=..., train_data=..., test_data=...).fit()``.

    from ddpkit import Trainer, TrainConfig
    summary = Trainer(TrainConfig(dataset="mnist", nproc="2", epochs=2)).fit()

``fit`` checks everything it can before any worker starts (config values, world size,
batch divisibility, dataset files, the run directory), so a mistake is reported once,
then hands the run to :func:`ddpkit.launch.launch`. Each worker builds an
:class:`ddpkit.engine.Engine` and trains. With N > 1 processes the model and datasets
are pickled to the workers, so a script that passes its own must guard its entry point
with ``if __name__ == "__main__":``.
"""

from __future__ import annotations

import copy
import dataclasses
import os
from dataclasses import dataclass
from typing import Optional

import torch
from torch import nn
from torch.utils.data import Dataset

from .config import TrainConfig
from .data import DataSplits, ImageData, Meta, load_dataset
from .dist import distributed
from .engine import Engine
from .errors import ConfigError
from .launch import LaunchSpec, launch
from .models import build_model
from .rundir import check_run_dir


@dataclass
class Job:
    """What one worker needs. Model and splits are None when they come from the registries."""

    cfg: TrainConfig
    model: Optional[nn.Module] = None
    splits: Optional[DataSplits] = None


class Trainer:
    def __init__(self, config: TrainConfig | None = None, model: nn.Module | None = None,
                 train_data: Dataset | None = None, test_data: Dataset | None = None, meta: Meta | None = None):
        self.config = config or TrainConfig()
        self.model = model
        if (train_data is None) != (test_data is None):
            raise ConfigError("pass both train_data and test_data, or neither")
        self.splits = DataSplits(train_data, test_data, meta or infer_meta(train_data)) if train_data is not None else None
        if model is not None:
            self.config = dataclasses.replace(self.config, model=f"custom:{type(model).__name__}")
        if self.splits is not None:
            self.config = dataclasses.replace(self.config, dataset=f"custom:{type(train_data).__name__}")

    def fit(self) -> dict:
        """Train (resuming from the run dir when it holds a snapshot); return rank 0's summary."""
        cfg, spec, splits, finished = preflight(self.config, self.splits, self.model is not None)
        if finished is not None:
            print(f"ddpkit: {cfg.run_dir} already holds this finished run; pass a new --run-dir to train again")
            return finished
        # Spawned workers load the registry data themselves rather than receive it pickled.
        job_splits = self.splits if self.splits is not None else (splits if spec.in_process else None)
        home = None if spec.in_process else move_to_cpu(self.model)
        try:
            return launch(train_worker, (Job(cfg, self.model, job_splits),), spec)
        finally:
            if home is not None:
                self.model.to(home)


def move_to_cpu(model: nn.Module | None) -> torch.device | None:
    """Move a model that is on a GPU to the CPU, returning where it was (None if it was on the CPU).

    Spawned workers receive the model pickled; CUDA tensors travel as CUDA IPC handles and
    are rebuilt on the parent's GPU in every worker, opening a context there per rank
    (and failing outright in EXCLUSIVE_PROCESS mode). Each worker moves its copy to its
    own GPU anyway.
    """
    if model is None:
        return None
    devices = {t.device for t in [*model.parameters(), *model.buffers()]}
    home = next((d for d in devices if d.type != "cpu"), None)
    if home is not None:
        model.to("cpu")
    return home


def preflight(config: TrainConfig, splits: DataSplits | None, custom_model: bool):
    """Every check that can fail before launch. Returns (cfg, launch spec, splits, finished summary)."""
    cfg = config.resolved()
    spec = LaunchSpec.from_config(cfg)
    world = spec.world_size
    if not cfg.ddp and world > 1:
        raise ConfigError(f"--no-ddp only makes sense with one process; this run has {world}")
    if cfg.batch_size % world:
        lo, hi = (cfg.batch_size // world) * world, (cfg.batch_size // world + 1) * world
        near = " or ".join(str(v) for v in (lo, hi) if v > 0)
        raise ConfigError(f"--batch-size {cfg.batch_size} (global) is not divisible by the world size {world}; "
                          f"use {near}")
    if splits is None:
        splits = load_dataset(cfg, download=os.environ.get("LOCAL_RANK", "0") == "0")
    if splits.meta is None and not custom_model:
        raise ConfigError("pass model=... (or meta=...) with a Dataset that is not an ImageData")
    per_rank = len(splits.train) // world
    if per_rank < cfg.batch_size // world:
        raise ConfigError(f"--batch-size {cfg.batch_size} is larger than the {len(splits.train)} training samples "
                          f"allow at world size {world}")
    return cfg, spec, splits, check_run_dir(cfg)


def infer_meta(data: Dataset) -> Meta | None:
    """Meta for an in-memory ImageData passed without one: shape, class count, and channel statistics."""
    if not isinstance(data, ImageData):
        return None
    x = data.images[:10000].float() / 255
    dims = (0, 2, 3)
    _, c, h, w = data.images.shape
    return Meta(c, h, w, int(data.labels.max()) + 1, tuple(x.mean(dims).tolist()), tuple(x.std(dims).clamp_min(1e-3).tolist()))


def train_worker(job: Job) -> dict:
    """One rank, start to finish; the process group is destroyed even on error."""
    cfg = job.cfg
    with distributed(cfg.device, cfg.timeout_s, cfg.deterministic) as ctx:
        splits = job.splits or load_dataset(cfg, download=False)
        torch.manual_seed(cfg.seed)  # identical initial weights on every rank
        # torch.multiprocessing hands tensors to spawned workers in shared memory, so every
        # rank on the node would otherwise train the very same parameter and buffer storage.
        model = copy.deepcopy(job.model)
        if model is None:
            m = splits.meta
            model = build_model(cfg.model, m.channels, m.height, m.width, m.classes)
        # Registry models use every parameter every step, so DDP may assume a static graph.
        return Engine(cfg, ctx, model, splits, static_graph=job.model is None).fit()


def eval_worker(cfg: TrainConfig) -> dict:
    """Re-evaluate ``cfg.run_dir``/model.pt on every rank's slice of the test set."""
    from pathlib import Path

    from .data.loader import Preprocess
    from .evaluate import evaluate

    with distributed(cfg.device, cfg.timeout_s, cfg.deterministic) as ctx:
        splits = load_dataset(cfg, download=False)
        m = splits.meta
        model = build_model(cfg.model, m.channels, m.height, m.width, m.classes)
        state = torch.load(Path(cfg.run_dir) / "model.pt", map_location=ctx.device, weights_only=True)
        model.load_state_dict(state)
        model.to(ctx.device)
        pre = Preprocess(m, ctx.device, bool(cfg.channels_last))
        result = evaluate(model, splits.test, pre, cfg, ctx, batch=256)
        return {**result, "world_size": ctx.world_size, "run_dir": cfg.run_dir}
