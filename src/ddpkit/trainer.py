"""The public API: ``Trainer(config, model=..., train_data=..., test_data=...).fit()``.

    from ddpkit import Trainer, TrainConfig
    result = Trainer(TrainConfig(dataset="mnist", nproc="2", epochs=2)).fit()
    result.summary["test_accuracy"], result.per_rank, result.run_dir

    # your own model, data, loss and metrics (see ddpkit.train.task for the contract):
    Trainer(TrainConfig(nproc="2"), model=net, train_data=train, test_data=test,
            loss_fn=lambda model, batch: F.mse_loss(model(batch[0]), batch[1]),
            metrics={"mae": lambda out, batch: ((out - batch[1]).abs().sum(), batch[1].numel())}).fit()

``fit`` checks everything it can before any worker starts (config values, world size,
batch divisibility, dataset files, one real batch through the model and the task, the
run directory), so a mistake is reported once, then hands the run to
:func:`ddpkit.ranks.launcher.run_workers`. Each worker builds an :class:`ddpkit.train.engine.Engine`
and trains. Afterwards the model object passed in holds the trained weights
(``model.pt``). With N > 1 processes the model and datasets are pickled to the workers,
so a script that passes its own must guard its entry point with
``if __name__ == "__main__":`` (a notebook needs nothing: its workers are forked).
"""

from __future__ import annotations

import dataclasses
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Mapping

import torch
from torch import nn
from torch.utils.data import BatchSampler, DataLoader, Dataset, IterableDataset, default_collate

from .config import TrainConfig, keywords_checked
from .data import DataSplits, Meta, load_dataset
from .data.materialize import materialize
from .data.stream import check_stream
from .data.types import infer_meta
from .errors import ConfigError, DataError, article
from .identity import (
    Fingerprint,
    code_fingerprint,
    data_fingerprint,
    model_fingerprint,
    optimizer_fingerprint,
    probe_optimizer,
    scheduler_fingerprint,
    with_code,
)
from .importpath import is_import_path, resolve
from .models import own_model
from .preflight import (
    available_memory_bytes,
    move_to_cpu,
    preflight,
    task_for,
)
from .ranks import env
from .ranks.launcher import LaunchSpec, refuse_if_importing_main, refuse_unguarded_main, run_workers
from .run.checkpoint import read_weights
from .run.display import format_record, summary_fields
from .run.paths import RunFiles
from .run.plots import draw_run_plots, import_matplotlib
from .run.rundir import matched_on, owning_run_dir, record_teardown
from .train.optim import check_owned
from .train.replicas import replica_place
from .train.task import Task
from .train.workers import Job, eval_worker, train_worker


@dataclass(frozen=True)
class FitResult:
    """What ``fit`` returns: ``summary`` (summary.json), ``per_rank`` (each rank's own train
    figures of the last epoch and test figures on its shard) and ``run_dir``.
    ``result["test_accuracy"]`` reads the summary."""

    summary: dict
    per_rank: list
    run_dir: Path

    def __getitem__(self, key: str) -> Any:
        return self.summary[key]

    def keys(self):
        return self.summary.keys()


class Trainer:
    """Train (and evaluate) a model with DDP; see the module docstring and docs/python-api.md.

    ``loss_fn(model, batch) -> loss | (loss, outputs)`` and ``metrics={name: fn(outputs, batch)
    -> (sum, count)}`` define the workload (default: classification). ``optimizer`` is a factory
    ``fn(model)`` or an optimizer built on ``model.parameters()``; ``scheduler`` a factory
    ``fn(optimizer[, total_steps])`` or a scheduler on that optimizer, stepped every optimizer step.
    ``collate_fn`` is given to the DataLoader for ``train_data`` and ``test_data``.
    """

    @keywords_checked
    def __init__(
        self,
        config: TrainConfig | None = None,
        model: nn.Module | None = None,
        train_data: Dataset | None = None,
        test_data: Dataset | None = None,
        meta: Meta | None = None,
        *,
        loss_fn: Callable | None = None,
        metrics: Mapping[str, Callable] | None = None,
        optimizer: Any = None,
        scheduler: Any = None,
        collate_fn: Callable | None = None,
        val_data: Dataset | None = None,
    ):
        # (A bad argument met here, a ConfigError, ends an uncaught script in one line and exit 2, as the same error
        # does in fit(): import ddpkit installed the hook that says it. The porter's seed-004 port met a traceback)
        if isinstance(model, type):  # the class, not a model: its state_dict() failed deep in the identity's read
            raise ConfigError(
                f"model= is the class {model.__qualname__}, not a model: pass an instance, {model.__qualname__}(...)"
            )
        cfg = config or TrainConfig()
        model, train_data, test_data, meta, collate_fn = by_import_path(
            cfg, model, train_data, test_data, meta, collate_fn
        )
        train_data, test_data, cfg, collate_fn, worker_init_fn = from_loaders(train_data, test_data, cfg, collate_fn)
        self.model, self.loss_fn, self.metrics = model, loss_fn, dict(metrics or {})
        self.optimizer, self.scheduler = optimizer, scheduler
        self.splits = None
        # What the run identity reads of each thing passed in, by config field (ddpkit.identity);
        # kept in RUN_DIR/identity.json so a refusal can say which part differs.
        prints: dict[str, Fingerprint] = {}
        if val_data is not None:
            _map_style(val_data, "val_data")
            if train_data is None:
                raise ConfigError("val_data is a validation split of train_data: pass train_data too")
        if train_data is not None or test_data is not None:
            given = meta  # read when given; one inferred from the data is a function of what is read
            meta = meta or infer_meta(train_data if train_data is not None else test_data)
            self.splits = DataSplits(
                train_data, test_data, meta, collate_fn, worker_init_fn=worker_init_fn, val=val_data
            )
            if not is_import_path(cfg.dataset):  # by import path: read as data_digest, as the built-in data
                prints["dataset"] = data_fingerprint(
                    train_data, test_data, collate_fn, given, worker_init_fn, val=val_data
                )
        if model is not None:
            # By import path the config keeps the path (so every command can build it again) and the
            # fingerprint goes to model_digest; a model passed in is named by its fingerprint.
            if is_import_path(cfg.model):  # what it built, and the function that built it
                prints["model_digest"] = with_code(model_fingerprint(model), "factory", resolve(cfg.model, "--model"))
            else:
                prints["model"] = model_fingerprint(model)
        opt = None
        for given, what, unused in (
            (optimizer, "optimizer", ("optimizer", "lr", "momentum", "beta2", "nesterov", "weight_decay")),
            (scheduler, "schedule", ("schedule", "warmup_frac")),
        ):
            if given is None:
                continue
            clash = [k for k in unused if getattr(cfg, k) is not None]
            if clash:
                raise ConfigError(
                    f"you pass your own {what}, so the config's {', '.join(clash)} would be ignored; "
                    f"leave {'it' if len(clash) == 1 else 'them'} unset"
                )
            if what == "optimizer":
                if isinstance(given, torch.optim.Optimizer) and model is not None:
                    check_owned(given, model)  # here, once, not in every worker
                prints[what], opt = optimizer_fingerprint(given, model)
            else:
                prints[what] = scheduler_fingerprint(given, opt if opt is not None else probe_optimizer(model))
        if loss_fn is not None or self.metrics:
            prints["task"] = code_fingerprint("task", {"loss_fn": loss_fn, **self.metrics} if loss_fn else self.metrics)
        cfg = dataclasses.replace(
            cfg,
            **{k: fp.tag if k.endswith("_digest") else f"custom:{fp.tag}" for k, fp in prints.items() if k != "task"},
        )
        self.fingerprints = {k: fp.to_json() for k, fp in prints.items()}
        self.config = dataclasses.replace(cfg, task=self._task(cfg).identity)

    def _task(self, cfg: TrainConfig) -> Task:
        return task_for(cfg, self.splits, self.loss_fn, self.metrics)

    # ------------------------------------------------------------------ fit
    def fit(self) -> FitResult:
        """Train (resuming from the run dir when it holds a snapshot); afterwards the model object
        passed in holds the trained weights."""
        refuse_if_importing_main()
        # The CLI's launch time belongs to the first run it starts; check and bench start several,
        # and each later one is timed from its own fit() (all were once timed from the CLI's start).
        t0 = float(os.environ.pop(env.T0, time.time()))
        if self.splits is not None and self.splits.train is None:
            raise ConfigError("fit() needs train_data (test_data alone is enough for evaluate())")
        replica_place(self.config)  # --replicas from Python, not a group of ddpkit train's: refused before launch
        plan = preflight(
            self.config, self.splits, self.model, self._task, self.optimizer, self.fingerprints, self.scheduler
        )
        cfg = plan.config
        if not plan.spec.in_process:
            refuse_unguarded_main()  # before the run dir is touched
        if plan.finished is not None:
            print(
                f"ddpkit: {cfg.run_dir} already holds this finished run, and "
                + ("--reuse-finished asks for it" if cfg.reuse_finished else "torchrun restarted the job after it")
                + f" (matched on {matched_on(plan.identity)}); returning its result without training"
                + (f". --log {cfg.log} applies to runs that train" if cfg.log else "")
            )
            print(format_record({"event": "summary", **summary_fields(plan.finished)}))
            summary = plan.finished
        else:
            # The workers get the data loaded here (tensors travel through shared memory), never
            # loading it again per rank.
            job = Job(
                cfg,
                plan.task,
                self.model,
                plan.splits,
                self.optimizer,
                self.scheduler,
                t0,
                plan.identity,
                plan.find_unused_parameters,
                plan.sample,
            )
            home = None if plan.spec.in_process else move_to_cpu(self.model)
            try:
                with owning_run_dir(cfg, plan.spec) as owner:
                    if owner and cfg.plots:  # the owner draws them after the run (run/plots.py)
                        import_matplotlib()  # here, while the workers' forkserver still imports torch
                    summary = run_workers(train_worker, (job,), plan.spec)
                    if owner:
                        summary = record_teardown(cfg, summary)
                        if cfg.plots:
                            draw_run_plots(cfg.run_dir)
            finally:
                if home is not None:
                    self.model.to(home)
        if self.model is not None:
            self.model.load_state_dict(read_weights(RunFiles(cfg.run_dir).model))
        return FitResult(summary, summary.get("per_rank", []), Path(cfg.run_dir))

    # ------------------------------------------------------------------ evaluate
    def evaluate(self) -> dict:
        """Evaluate the model as it is now (after ``fit``: the trained weights) on the test set,
        with the same task and metrics, distributed over ``nproc`` processes; returns
        ``{test_<metric>: mean, test_samples: n, world_size}``."""
        refuse_if_importing_main()
        if self.model is None:
            raise ConfigError("evaluate() needs model=...; to re-evaluate a CLI run, use `ddpkit eval RUN_DIR`")
        cfg = self.config.resolved()
        splits = materialize(
            self.splits if self.splits is not None else load_dataset(cfg), cfg, available_memory_bytes()
        )
        if splits.test is None or len(splits.test) == 0:
            raise DataError("evaluate() needs a non-empty test_data")
        result = run_evaluation(cfg, self._task(cfg), splits, self.model)
        return {k: v for k, v in result.items() if k != "run_dir"}  # nothing was written there


def by_import_path(cfg: TrainConfig, model, train, test, meta, collate_fn):
    """The model and data a config names by import path (``model="pkg.module:function"``), built
    here as if passed in: the same checks, fingerprints and hand-off to the workers. Naming one both
    ways is a one-line ConfigError."""
    if is_import_path(cfg.dataset):
        if train is not None or test is not None:
            raise ConfigError(
                f"the config's dataset is {cfg.dataset} and train_data/test_data are passed too; give one of them"
            )
        own = load_dataset(cfg)
        train, test, meta, collate_fn = own.train, own.test, meta or own.meta, collate_fn or own.collate_fn
    if is_import_path(cfg.model):
        if model is not None:
            raise ConfigError(f"the config's model is {cfg.model} and model=... is passed too; give one of them")
        model = own_model(cfg)
    return model, train, test, meta, collate_fn


def as_objects(cfg: TrainConfig, model=None, train=None, test=None, meta=None, collate_fn=None):
    """:func:`by_import_path` for a tool that runs the workload several times (``ddpkit check``): the
    objects built once, and a config that names them as passed in (``custom:``), not by path."""
    model, train, test, meta, collate_fn = by_import_path(cfg, model, train, test, meta, collate_fn)
    named = {
        field: f"custom:{getattr(cfg, field).rpartition(':')[2]}"
        for field in ("model", "dataset")
        if is_import_path(getattr(cfg, field))
    }
    if named:
        cfg = dataclasses.replace(cfg, **named, model_args="", dataset_args="", model_digest="", data_digest="")
    return cfg, model, train, test, meta, collate_fn


def from_loaders(train, test, cfg: TrainConfig, collate_fn):
    """``train_data``/``test_data`` as the map-style datasets ddpkit shards by index. A DataLoader gives its
    dataset, its ``collate_fn``, its ``worker_init_fn``, its ``num_workers`` and (for train, when ``batch_size``
    is unset) its batch size, or its plain ``BatchSampler``'s, as the global batch, so a ported single-process
    script keeps its maths; its sampler and shuffling are replaced by DistributedSampler's order, its last partial batch
    dropped, and that is said in one line. An IterableDataset, anything without ``__len__`` and
    ``__getitem__``, a DataLoader with ``batch_size=None`` or with a batch sampler of its own is a one-line
    DataError."""
    out, worker_init_fn = [], None
    for data, which in ((train, "train_data"), (test, "test_data")):
        if isinstance(data, DataLoader):
            loader, data = data, data.dataset
            _map_style(data, which)
            batches = _batch_sampler(loader, which)
            kept = ["its dataset"]
            if loader.collate_fn is not default_collate and collate_fn is None:
                collate_fn, kept = loader.collate_fn, [*kept, "collate_fn"]
            if which == "train_data" and cfg.num_workers is None and loader.num_workers:
                cfg, kept = dataclasses.replace(cfg, num_workers=loader.num_workers), [*kept, "num_workers"]
            if loader.worker_init_fn is not None and worker_init_fn is None:  # one for both: the train loader's
                worker_init_fn, kept = loader.worker_init_fn, [*kept, "worker_init_fn"]
            if which == "train_data" and cfg.batch_size is None:
                cfg = dataclasses.replace(cfg, batch_size=batches.batch_size)
                whose = "its batch_sampler's " if loader.batch_size is None else ""
                kept.append(f"{whose}batch_size {batches.batch_size} as the global batch (split over the ranks)")
            dropped = ""
            partial = len(data) % cfg.batch_size if which == "train_data" and cfg.batch_size else 0
            if partial and not batches.drop_last and not cfg.join:  # the loader kept it; ddpkit's steps are whole
                dropped = f"; the last partial batch of each epoch ({partial} samples) is dropped (--join keeps it)"
            print(
                f"ddpkit: {which} is a DataLoader: ddpkit uses {', '.join(kept)}; its sampler "
                f"({type(batches.sampler).__name__}) is replaced by DistributedSampler's order (seeded with --seed)"
                + dropped
            )
        if data is None:
            out.append(None)
            continue
        if which == "train_data" and isinstance(data, IterableDataset):  # a stream: each rank reads its shard
            check_stream(data, which)
        else:
            _map_style(data, which)
        out.append(data)
    return out[0], out[1], cfg, collate_fn, worker_init_fn


def _map_style(data, which: str) -> None:
    """A one-line DataError unless ``data`` can be split among ranks by index."""
    if isinstance(data, IterableDataset) or not (hasattr(data, "__len__") and hasattr(data, "__getitem__")):
        kind = "an IterableDataset" if isinstance(data, IterableDataset) else article(type(data).__name__)
        stream = " (an IterableDataset trains as train_data; evaluation needs each sample once, by index)"
        raise DataError(
            f"{which} is {kind}, which ddpkit cannot split among ranks by index: pass a map-style dataset "
            f"(with __len__ and __getitem__), e.g. your samples in a list or a TensorDataset"
            + (stream if isinstance(data, IterableDataset) else "")
        )


def _batch_sampler(loader, which: str):
    """The loader's ``BatchSampler``: its own (made from ``batch_size``) or a plain one passed as ``batch_sampler``,
    whose batch size and sampler ddpkit can honour. ddpkit batches single samples by index, so a loader without
    automatic batching (``batch_size=None``: each dataset item is already a batch, and its collate_fn is
    ``default_convert``, not a collate) or with a batch sampler of the user's own (batches ddpkit cannot make
    on each rank) is a one-line DataError."""
    bs = loader.batch_sampler
    instead = "pass DataLoader(dataset, batch_size=N, ...) or the dataset itself" + (
        " with batch_size=N (--batch-size N)" if which == "train_data" else ""
    )
    if bs is None:
        raise DataError(
            f"{which} is a DataLoader with batch_size=None (automatic batching off: each item of its dataset is "
            f"taken as a whole batch); ddpkit batches single samples by index: {instead}"
        )
    if type(bs) is not BatchSampler:  # a subclass may choose its batches in its own __iter__
        raise DataError(
            f"{which} is a DataLoader with its own batch_sampler ({type(bs).__name__}), which ddpkit cannot follow: "
            f"it makes each rank's batches itself, by index, in DistributedSampler's order; {instead}"
        )
    return bs


def run_evaluation(cfg: TrainConfig, task: Task, splits: DataSplits, model: nn.Module | None = None) -> dict:
    """Evaluate ``model`` (or, when None, the run dir's model.pt in its registry model) on ``splits.test``,
    distributed as ``cfg`` asks; the one evaluation behind ``Trainer.evaluate`` and ``ddpkit eval``."""
    spec = LaunchSpec.from_config(cfg, resumable=False)
    home = None if spec.in_process else move_to_cpu(model)
    try:
        # The workers get the data loaded here through shared memory, never loading it again per rank.
        return run_workers(eval_worker, (Job(cfg, task, model, splits),), spec)
    finally:
        if home is not None:
            model.to(home)
