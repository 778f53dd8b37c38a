"""The public API: ``Trainer(config, model=..., train_data=..., test_data=...).fit()``.

    from ddpkit import Trainer, TrainConfig
    result = Trainer(TrainConfig(dataset="mnist", nproc="2", epochs=2)).fit()
    result.summary["test_accuracy"], result.per_rank, result.run_dir

    # your own model, data, loss and metrics (see ddpkit.task for the contract):
    Trainer(TrainConfig(nproc="2"), model=net, train_data=train, test_data=test,
            loss_fn=lambda model, batch: F.mse_loss(model(batch[0]), batch[1]),
            metrics={"mae": lambda out, batch: ((out - batch[1]).abs().sum(), batch[1].numel())}).fit()

``fit`` checks everything it can before any worker starts (config values, world size,
batch divisibility, dataset files, one real batch through the model and the task, the
run directory), so a mistake is reported once, then hands the run to
:func:`ddpkit.launcher.run_workers`. Each worker builds an :class:`ddpkit.engine.Engine`
and trains. Afterwards the model object passed in holds the trained weights
(``model.pt``). With N > 1 processes the model and datasets are pickled to the workers,
so a script that passes its own must guard its entry point with
``if __name__ == "__main__":`` (a notebook needs nothing: its workers are forked).
"""

from __future__ import annotations

import copy
import dataclasses
import os
import sys
import time
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator, Mapping, Optional

import torch
from torch import nn
from torch.utils.data import Dataset, default_collate

from .checkpoint import read_weights, weights_mismatch
from .config import TrainConfig
from .data import DataSplits, ImageData, Meta, TensorData, load_dataset
from .data.batch import first_tensor
from .data.materialize import materialize
from .data.loader import EvalSource, Preprocess, float_dtype
from .display import format_record, summary_fields
from .dist import cpu_cores, distributed, under_launcher
from .engine import Engine
from .errors import AlreadyReported, ConfigError, DataError, DdpkitError, RunDirError, TaskError
from .evaluate import evaluate
from .identity import code_name, data_fingerprint, model_fingerprint
from .launcher import LaunchSpec, refuse_if_importing_main, run_workers
from .loggers import check_installed, parse_loggers
from .models import model_for
from .rundir import (LOCK_ENV, agree, atomic_write, check_run_dir, fatal_path, read_fatal, record_fatal,
                     run_lock, summary_bytes)
from .task import Classification, Task, resolve_task


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


class Trainer:
    """Train (and evaluate) a model with DDP; see the module docstring and README's "Python API".

    ``loss_fn(model, batch) -> loss | (loss, outputs)`` and ``metrics={name: fn(outputs, batch)
    -> (sum, count)}`` define the workload (default: classification). ``optimizer`` is a factory
    ``fn(model)`` or an optimizer built on ``model.parameters()``; ``scheduler`` a factory
    ``fn(optimizer[, total_steps])`` or a scheduler on that optimizer, stepped every optimizer step.
    ``collate_fn`` is given to the DataLoader for ``train_data`` and ``test_data``.
    """

    def __init__(self, config: TrainConfig | None = None, model: nn.Module | None = None,
                 train_data: Dataset | None = None, test_data: Dataset | None = None, meta: Meta | None = None, *,
                 loss_fn: Callable | None = None, metrics: Mapping[str, Callable] | None = None,
                 optimizer: Any = None, scheduler: Any = None, collate_fn: Callable | None = None):
        cfg = config or TrainConfig()
        self.model, self.loss_fn, self.metrics = model, loss_fn, dict(metrics or {})
        self.optimizer, self.scheduler = optimizer, scheduler
        self.splits = None
        if train_data is not None or test_data is not None:
            meta = meta or infer_meta(train_data if train_data is not None else test_data)
            self.splits = DataSplits(train_data, test_data, meta, collate_fn)
            cfg = dataclasses.replace(cfg, dataset=f"custom:{data_fingerprint(train_data, test_data)}")
        if model is not None:
            cfg = dataclasses.replace(cfg, model=f"custom:{model_fingerprint(model)}")
        for given, what, unused in ((optimizer, "optimizer", ("optimizer", "lr", "momentum", "nesterov", "weight_decay")),
                                    (scheduler, "schedule", ("schedule", "warmup_frac"))):
            if given is None:
                continue
            clash = [k for k in unused if getattr(cfg, k) is not None]
            if clash:
                raise ConfigError(f"you pass your own {what}, so the config's {', '.join(clash)} would be ignored; "
                                  f"leave {'it' if len(clash) == 1 else 'them'} unset")
            cfg = dataclasses.replace(cfg, **{what: f"custom:{code_name(given)}"})
        self.config = dataclasses.replace(cfg, task=self._task(cfg).identity)

    def _task(self, cfg: TrainConfig) -> Task:
        sample = None
        if self.splits is not None:
            data = self.splits.train if self.splits.train is not None else self.splits.test
            sample = data[0] if data is not None and len(data) else None
        classes = self.splits.meta.classes if self.splits is not None and self.splits.meta else None
        least = infer_classes(self.splits.train) if self.splits is not None and classes is None else None
        return resolve_task(cfg, self.loss_fn, self.metrics, sample, classes, least)

    # ------------------------------------------------------------------ fit
    def fit(self) -> FitResult:
        """Train (resuming from the run dir when it holds a snapshot); afterwards the model object
        passed in holds the trained weights."""
        refuse_if_importing_main()
        t0 = float(os.environ.get("DDPKIT_T0", time.time()))  # the CLI's launch time, or this call's
        if self.splits is not None and self.splits.train is None:
            raise ConfigError("fit() needs train_data (test_data alone is enough for evaluate())")
        cfg, spec, splits, task = preflight(self.config, self.splits, self.model, self._task, self.optimizer)
        finished = check_run_dir(cfg)
        if finished is not None:
            print(f"ddpkit: {cfg.run_dir} already holds this finished run (the same settings, model code and data); "
                  f"returning its result. To train again, pass a new run_dir (--run-dir), or delete {cfg.run_dir}"
                  + (f". --log {cfg.log} applies to runs that train" if cfg.log else ""))
            print(format_record({"event": "summary", **summary_fields(finished)}))
            summary = finished
        else:
            # The workers get the data loaded here (tensors travel through shared memory), never
            # loading it again per rank.
            job = Job(cfg, task, self.model, splits, self.optimizer, self.scheduler, t0)
            home = None if spec.in_process else move_to_cpu(self.model)
            try:
                with owning_run_dir(cfg, spec) as owner:
                    summary = run_workers(train_worker, (job,), spec)
                    if owner:
                        summary = record_teardown(cfg, summary)
            finally:
                if home is not None:
                    self.model.to(home)
        if self.model is not None:
            self.model.load_state_dict(read_weights(Path(cfg.run_dir) / "model.pt"))
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
        splits = materialize(self.splits if self.splits is not None else load_dataset(cfg), cfg,
                             available_memory_bytes())
        if splits.test is None or len(splits.test) == 0:
            raise DataError("evaluate() needs a non-empty test_data")
        spec = LaunchSpec.from_config(cfg, resumable=False)
        home = None if spec.in_process else move_to_cpu(self.model)
        try:
            result = run_workers(eval_worker, (Job(cfg, self._task(cfg), self.model, splits),), spec)
            return {k: v for k, v in result.items() if k != "run_dir"}  # nothing was written there
        finally:
            if home is not None:
                self.model.to(home)


# ---------------------------------------------------------------------- preflight
def preflight(config: TrainConfig, splits: DataSplits | None, model: nn.Module | None, task_for: Callable,
              optimizer: Any = None):
    """Every check that can fail before launch, said once. Returns (cfg, launch spec, splits, task)."""
    cfg = config.resolved()
    spec = LaunchSpec.from_config(cfg)
    world = spec.world_size
    if cfg.ddp is False and world > 1:
        raise ConfigError(f"--no-ddp only makes sense with one process; this run has {world}")
    if cfg.batch_size % world:
        lo, hi = (cfg.batch_size // world) * world, (cfg.batch_size // world + 1) * world
        near = " or ".join(str(v) for v in (lo, hi) if v > 0)
        raise ConfigError(f"--batch-size {cfg.batch_size} (global) is not divisible by the world size {world}; "
                          f"use {near}")
    per_rank_batch = cfg.batch_size // world
    if per_rank_batch % cfg.grad_accum:
        raise ConfigError(f"--grad-accum {cfg.grad_accum} does not divide the per-rank batch {per_rank_batch} "
                          f"(--batch-size {cfg.batch_size} over {world} ranks)")
    check_installed(parse_loggers(cfg.log))  # before the data loads: a missing package is a quick error
    if isinstance(optimizer, torch.optim.Optimizer) and model is None:
        raise ConfigError("an optimizer object needs the model it was built on: pass model=... too, or a factory "
                          "optimizer=lambda model: ...")
    if splits is None:
        splits = load_dataset(cfg, download=os.environ.get("LOCAL_RANK", "0") == "0")
    if splits.meta is None and model is None:
        raise ConfigError("pass model=... (or meta=...) with a Dataset that is not an ImageData")
    if splits.test is None or len(splits.test) == 0:
        raise DataError(f"the test set of {cfg.dataset} is empty: there is nothing to evaluate on. Give at least "
                        f"one test sample (check --limit-test, or pass test_data)")
    if len(splits.train) // world < per_rank_batch:
        raise ConfigError(f"--batch-size {cfg.batch_size} is larger than the {len(splits.train)} training samples "
                          f"allow at world size {world}")
    # Held in memory where it fits (once per node: the workers receive it through shared memory).
    splits = materialize(splits, cfg, available_memory_bytes())
    if cfg.data_path in ("device", "host") and not isinstance(splits.train, (ImageData, TensorData)):
        raise ConfigError(f"--data-path {cfg.data_path} needs a dataset held in memory, and {cfg.dataset} is not "
                          f"({splits.note}); use --data-path loader or auto")
    task = task_for(cfg)
    if model is None:
        model = model_for(cfg, splits.meta)
    if cfg.init_from:
        check_weights_fit(model, cfg.init_from)
    check_one_batch(model, splits, task, cfg)
    if cfg.resume == "never" and Path(cfg.run_dir).exists() and any(Path(cfg.run_dir).iterdir()):
        raise RunDirError(f"--resume never: {cfg.run_dir} already holds a run; pass a new --run-dir, or "
                          f"--resume auto to continue it")
    check_processes(spec, splits, model)
    return cfg, spec, splits, task


def check_processes(spec: LaunchSpec, splits: DataSplits, model: nn.Module) -> None:
    """More processes than the node can hold: a warning past the core count (on CPU), an error
    past the memory. Each spawned rank holds what this process holds now (torch, the data)
    plus its model, gradients and optimizer state (about 4 copies of the weights)."""
    if spec.in_process or spec.device_type != "cpu":
        return
    cores = cpu_cores()
    if spec.nproc > cores:
        print(f"ddpkit: warning: --nproc {spec.nproc} runs {spec.nproc} processes on {cores} core(s); each gets one "
              f"thread and they take turns, which is slower than --nproc {cores}", file=sys.stderr)
    weights = sum(t.numel() * t.element_size() for t in model.state_dict().values())
    per_rank = rss_bytes() + 4 * weights
    available = available_memory_bytes()
    if available is not None and spec.nproc * per_rank > available:
        raise ConfigError(f"--nproc {spec.nproc} needs about {spec.nproc * per_rank / 2**30:.1f} GiB ({spec.nproc} x "
                          f"{per_rank / 2**30:.2f} GiB per process: torch, the data and the model), but "
                          f"{available / 2**30:.1f} GiB are available; lower --nproc")


def check_weights_fit(model: nn.Module, path: str | Path, what: str = "--init-from") -> None:
    """The file's tensors must be the model's, name for name and shape for shape."""
    problem = weights_mismatch(model.state_dict(), read_weights(path, what))
    if problem:
        raise ConfigError(f"{what} {path} does not fit the model: {problem}")


def sample_batch(splits: DataSplits, n: int = 2) -> Any:
    """A batch of the first ``n`` training samples, shaped as the training loop will see it, on the CPU."""
    data = splits.train
    if isinstance(data, ImageData):
        x, y = data.images[:n], data.labels[:n]
    else:
        items = [data[i] for i in range(min(n, len(data)))]
        batch = (splits.collate_fn or default_collate)(items)
        if splits.meta is None:
            return batch
        x, y = batch
    return Preprocess(splits.meta, torch.device("cpu"), False).eval(x), y


def check_one_batch(model: nn.Module, splits: DataSplits, task: Task, cfg: TrainConfig) -> None:
    """Run the task on a real batch of two samples, in eval mode, before any worker starts.

    A model that rejects the input shape, outputs that do not fit the task, or a metric that
    breaks the contract are then one line, said once. Skipped for a model on a GPU (it would
    need a GPU copy of the batch here, in the launcher).
    """
    if any(p.device.type != "cpu" for p in model.parameters()):
        return
    batch = sample_batch(splits)
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            task.evaluate(model, batch)
    except DdpkitError:
        raise
    except Exception as exc:
        x = first_tensor(batch)
        shape = list(x.shape) if x is not None else "?"
        first = str(exc).strip().splitlines()[0][:300] if str(exc).strip() else ""
        step = "model" if isinstance(task, Classification) else f"{task.identity} step with model"
        raise ConfigError(f"{step} {cfg.model} fails on a batch of {cfg.dataset} (input {shape}): "
                          f"{type(exc).__name__}: {first}") from None
    finally:
        model.train(was_training)


def infer_classes(data: Dataset | None) -> int | None:
    """The class count an integer-labelled dataset needs at least: max label + 1, read from where
    common datasets keep their labels (a TensorDataset's second tensor, ``.targets``)."""
    labels = None
    if isinstance(data, torch.utils.data.TensorDataset) and len(data.tensors) == 2:
        labels = data.tensors[1]
    elif hasattr(data, "targets"):
        labels = torch.as_tensor(data.targets)
    if labels is None or labels.is_floating_point() or labels.dim() != 1 or not len(labels):
        return None
    return int(labels.max()) + 1


def infer_meta(data: Dataset | None) -> Meta | None:
    """Meta for an in-memory ImageData passed without one: shape, class count, and channel statistics."""
    if not isinstance(data, ImageData):
        return None
    x = data.images[:10000].float() / 255
    dims = (0, 2, 3)
    _, c, h, w = data.images.shape
    return Meta(c, h, w, int(data.labels.max()) + 1, tuple(x.mean(dims).tolist()), tuple(x.std(dims).clamp_min(1e-3).tolist()))


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


def rss_bytes() -> int:
    """This process's resident memory now (Linux /proc; 0 where unknown)."""
    try:
        return int(Path("/proc/self/statm").read_text().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return 0


def available_memory_bytes() -> int | None:
    """MemAvailable (Linux), or None where unknown."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError):
        pass
    return None


# ---------------------------------------------------------------------- who owns the run dir
@contextmanager
def owning_run_dir(cfg: TrainConfig, spec: LaunchSpec) -> Iterator[bool]:
    """On one node, the launcher holds the run dir's lock for the whole job, its workers (which
    die with it) included. Across nodes or under torchrun no launcher sees the whole job, and
    global rank 0 holds it instead (:func:`_rank0_owns`)."""
    if under_launcher() or spec.nnodes > 1:
        yield False
        return
    with run_lock(cfg.run_dir):
        fatal_path(cfg.run_dir).unlink(missing_ok=True)  # a new launch: forget the last one's fatal error
        os.environ[LOCK_ENV] = str(Path(cfg.run_dir).resolve())
        try:
            yield True
        finally:
            os.environ.pop(LOCK_ENV, None)


def record_teardown(cfg: TrainConfig, summary: dict) -> dict:
    """Add ``teardown_s`` to summary.json: from rank 0 writing it to this launcher regaining control
    (process-group teardown, the agent's exit barrier, joining the workers). Written by the launcher,
    which holds the run dir's lock; the workers are gone."""
    if summary.get("finished_at") is None:
        return summary
    summary = {**summary, "teardown_s": round(time.time() - summary["finished_at"], 3)}
    atomic_write(Path(cfg.run_dir) / "summary.json", summary_bytes(summary))
    return summary


@contextmanager
def _rank0_owns(cfg: TrainConfig, ctx) -> Iterator[None]:
    """Global rank 0 takes the lock when no launcher holds it; every rank learns whether it could."""
    held = os.environ.get(LOCK_ENV) == str(Path(cfg.run_dir).resolve())
    with ExitStack() as stack:
        error = None
        if ctx.is_main and not held:
            try:
                stack.enter_context(run_lock(cfg.run_dir))
                if restart_count() == 0:
                    fatal_path(cfg.run_dir).unlink(missing_ok=True)
            except (RunDirError, OSError) as exc:
                error = exc if isinstance(exc, RunDirError) else RunDirError(f"cannot lock {cfg.run_dir}: {exc}")
        agree(ctx, error)
        yield


def restart_count() -> int:
    """How many times the elastic agent has restarted this job's workers (0 on a fresh launch)."""
    return int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))


def restarts_left() -> bool:
    return int(os.environ.get("TORCHELASTIC_MAX_RESTARTS", "0")) > restart_count()


# ---------------------------------------------------------------------- workers
def train_worker(job: Job) -> dict:
    """One rank, start to finish; the process group is destroyed even on error."""
    cfg = job.cfg
    with distributed(cfg.device, cfg.timeout_s, cfg.deterministic) as ctx, _rank0_owns(cfg, ctx):
        fatal = read_fatal(cfg.run_dir) if restart_count() > 0 else None
        if fatal is not None:  # the last attempt met an error a restart cannot fix; it was reported then
            raise AlreadyReported(fatal["message"], fatal["exit_code"])
        try:
            return _train(job, ctx)
        except (DataError, TaskError) as exc:  # deterministic: every restart would meet it again
            if restarts_left():
                record_fatal(cfg.run_dir, exc)
            raise


def _train(job: Job, ctx) -> dict:
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
    return Engine(cfg, ctx, model, splits, job.task, optimizer, scheduler, static_graph=job.model is None,
                  t0=job.t0).fit()


def eval_worker(job: Job) -> dict:
    """Evaluate ``job.model`` (or the run dir's model.pt in a registry model) on every rank's test shard."""
    cfg = job.cfg
    with distributed(cfg.device, cfg.timeout_s, cfg.deterministic) as ctx:
        splits = job.splits or load_dataset(cfg, download=False)
        model = copy.deepcopy(job.model) if job.model is not None else model_for(cfg, splits.meta)
        if cfg.dtype == "float64":
            model.double()  # before loading: float64 weights would be rounded into float32 ones
        if job.model is None:
            model.load_state_dict(read_weights(Path(cfg.run_dir) / "model.pt"))
        model.to(ctx.device)
        source = EvalSource(splits.test, Preprocess(splits.meta, ctx.device, bool(cfg.channels_last), float_dtype(cfg)),
                            cfg, ctx, 256, splits.collate_fn)
        result, _ = evaluate(model, source, job.task, cfg, ctx)
        return {**result, "world_size": ctx.world_size, "run_dir": cfg.run_dir}
