"""Every check that can fail before launch, said once, in the launcher: config values, world size,
batch divisibility, the loggers' packages, the dataset, one real batch through the model and the task,
the run directory's state, and whether the node can hold the processes asked for. What it decides on
the way is one immutable :class:`Plan`, made once per fit.

    plan = preflight(config, splits, model, task_for, optimizer, fingerprints)
    run_workers(train_worker, (Job(plan.config, plan.task, ...),), plan.spec)
"""

from __future__ import annotations

import dataclasses
import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Optional

import torch
from torch import nn
from torch.utils.data import Dataset, IterableDataset, default_collate

from .config import TrainConfig, parse_loggers, watched_metric
from .data import DataSplits, ImageData, TensorData, load_dataset
from .data.batch import first_tensor
from .data.datasets import hold_out
from .data.loader import Preprocess
from .data.materialize import materialize
from .data.stream import first_items
from .errors import ConfigError, DataError, DdpkitError, RunDirError, TaskError, raised_at
from .identity import Fingerprint, data_fingerprint, file_fingerprint, with_code
from .importpath import generators_kept, is_import_path, resolve
from .models import model_for
from .ranks import env
from .ranks.context import cpu_cores
from .ranks.launcher import LaunchSpec, prestart_for
from .run.checkpoint import check_weights_fit
from .run.loggers import check_installed
from .run.paths import RunFiles
from .run.rundir import HorizonRefused, check_run_dir, unproven
from .train.fsdp2 import available as fsdp2_available
from .train.graph import blockers
from .train.optim import lr_depends_on_total
from .train.task import Classification, Task, resolve_task


@dataclass(frozen=True)
class Plan:
    """What ddpkit decided before launch, made once by :func:`preflight` and never changed after.

    ``config`` is what the user asked with the recipe filled in, the content fingerprints recorded and the
    run dir named (as ``config.toml`` holds it); nothing ddpkit decides is written back into it. The
    decisions sit beside it: the launch (``spec``, built once: it may read SLURM's variables into
    ``os.environ`` and print the cluster lines), the task, the run identity, DDP's search for unused
    parameters, and a finished run to return instead of training."""

    config: TrainConfig
    spec: LaunchSpec
    splits: DataSplits
    task: Task
    identity: dict  # what was read of what was passed in, by config field (RUN_DIR/identity.json)
    # DDP's find_unused_parameters: the user's ask, or what the trial step found (None: the config's, off)
    find_unused_parameters: Optional[bool] = None
    finished: Optional[dict] = None  # a finished run's summary, returned without training
    sample: Any = None  # two training samples as a batch, on the CPU: each worker counts a step's FLOPs on it


def preflight(
    config: TrainConfig,
    splits: DataSplits | None,
    model: nn.Module | None,
    task_for: Callable,
    optimizer: Any = None,
    fingerprints: dict | None = None,
    scheduler: Any = None,
) -> Plan:
    """Every check that can fail before launch, said once; the :class:`Plan` of the run.
    ``fingerprints``: what the Trainer read of the objects passed in (by config field, as JSON)."""
    cfg = config.filled()
    spec = LaunchSpec.from_config(cfg)
    prestart_for(spec)  # the workers' forkserver imports torch while the checks below run
    world = spec.world_size
    if cfg.ddp is False and world > 1:
        raise ConfigError(f"--no-ddp only makes sense with one process; this run has {world}")
    if cfg.batch_size % world:
        lo, hi = (cfg.batch_size // world) * world, (cfg.batch_size // world + 1) * world
        near = " or ".join(str(v) for v in (lo, hi) if v > 0)
        raise ConfigError(
            f"--batch-size {cfg.batch_size} (global) is not divisible by the world size {world}; use {near}"
        )
    per_rank_batch = cfg.batch_size // world
    if per_rank_batch % cfg.grad_accum:
        raise ConfigError(
            f"--grad-accum {cfg.grad_accum} does not divide the per-rank batch {per_rank_batch} "
            f"(--batch-size {cfg.batch_size} over {world} ranks)"
        )
    check_installed(parse_loggers(cfg.log))  # before the data loads: a missing package is a quick error
    cant_capture = blockers(cfg, spec.device_type, spec.world_size) if cfg.cuda_graph == "on" else []
    if cant_capture:  # what only a rank knows (its data path, a user scheduler) is checked there, alike
        raise ConfigError(
            f"--cuda-graph on cannot capture this run: {'; '.join(cant_capture)}. Use --cuda-graph auto "
            f"(it says why it stays off) or off"
        )
    if cfg.strategy == "fsdp2":
        check_fsdp2(optimizer)
    if isinstance(optimizer, torch.optim.Optimizer) and model is None:
        raise ConfigError(
            "an optimizer object needs the model it was built on: pass model=... too, or a factory "
            "optimizer=lambda model: ..."
        )
    if splits is None:
        splits = load_dataset(cfg, download=os.environ.get(env.LOCAL_RANK, "0") == "0")  # --val-fraction held out
    else:
        splits = hold_out(splits, cfg)
    check_validation(cfg, splits)
    found = content_fingerprints(cfg, splits)
    # Recorded in the config, and the default run dir's name covers them: the data's content and the starting weights
    cfg = dataclasses.replace(cfg, **{k: fp.tag for k, fp in found.items()}).named()
    if splits.meta is None and model is None:
        raise ConfigError("pass model=... (or meta=...) with a Dataset that is not an ImageData")
    if splits.test is None:  # (not "empty": the split is missing, the porter's seed-004 port read it as emptied)
        raise ConfigError(
            f"{cfg.dataset} has no test split: pass test_data= to Trainer (each epoch ends with its evaluation, and "
            f"its accuracy is the run's result)"
        )
    if len(splits.test) == 0:
        raise DataError(
            f"the test set of {cfg.dataset} is empty: there is nothing to evaluate on. Give at least "
            f"one test sample (check --limit-test, or pass test_data)"
        )
    if len(splits.train) // world < per_rank_batch:
        raise ConfigError(
            f"--batch-size {cfg.batch_size} is larger than the {len(splits.train)} training samples "
            f"allow at world size {world}"
        )
    # Held in memory where it fits (once per node: the workers receive it through shared memory).
    splits = materialize(splits, cfg, available_memory_bytes())
    held = isinstance(splits.train, (ImageData, TensorData)) and splits.collate_fn is None
    if cfg.data_path in ("device", "host") and not held:
        raise ConfigError(
            f"--data-path {cfg.data_path} needs a dataset held in memory, and {cfg.dataset} is not "
            f"({splits.note}); use --data-path loader or auto"
        )
    task = task_for(cfg)
    check_watched(cfg, task)
    own_model = model is not None  # the registry models use every parameter in every step (DDP's static graph)
    if model is None:
        model = model_for(cfg, splits.meta)
    if not any(p.requires_grad for p in model.parameters()):  # else the optimizer's own traceback, or at world 2
        count = sum(1 for _ in model.parameters())  # the trial step's "loss cut off the graph", which it is not
        why = f"all {count} are frozen: requires_grad=False" if count else "it has none"
        raise ConfigError(
            f"the model has no trainable parameters ({why}): "
            f"there is nothing to train; unfreeze some (requires_grad_(True)), or call Trainer.evaluate() to "
            f"evaluate it as it is"
        )
    if cfg.init_from:
        check_weights_fit(model, cfg.init_from)
    check_one_batch(model, splits, task, cfg)
    batch = sample_batch(splits)  # the workers count a step's FLOPs on it (train/flops.py)
    find_unused = unused_parameters(model, splits, task, cfg, spec, own_model)
    if cfg.resume == "never" and Path(cfg.run_dir).exists() and any(Path(cfg.run_dir).iterdir()):
        raise RunDirError(
            f"--resume never: {cfg.run_dir} already holds a run; pass a new --run-dir, or --resume auto to continue it"
        )
    check_processes(spec, splits, model, cfg.async_snapshots, cfg.strategy == "fsdp2")
    identity = {**(fingerprints or {}), **{k: fp.to_json() for k, fp in found.items()}}
    cfg, finished = settle_run_dir(
        cfg, identity, named=bool(config.run_dir), lr_total=lr_depends_on_total(cfg, scheduler)
    )
    cap = past_the_epochs(cfg, splits, world)
    if cap and finished is None and env.env_rank() == 0 and env.restart_count() == 0:
        print(f"ddpkit: {cap}")  # the launcher's, or global rank 0's under torchrun, before its first start
    return Plan(cfg, spec, splits, task, identity, find_unused, finished, batch)


def unused_parameters(
    model: nn.Module, splits: DataSplits, task: Task, cfg: TrainConfig, spec: LaunchSpec, own_model: bool
) -> bool | None:
    """DDP's ``find_unused_parameters`` for this run: the user's ask, or (for a model of their own, wrapped
    in DDP) whether the trial step left a parameter without a gradient, said in one line.

    Your model or loss: one training step here says what would fail only in the workers. The registry
    models with the built-in task are known: every parameter used (DDP's static graph). In one process
    (world 1, no restarts) the step itself runs right here, and its errors are said once anyway: no
    trial, no second copy of the model in memory."""
    ours = own_model or not isinstance(task, Classification)
    unused = trial_step(model, splits, task, cfg) if ours and (not spec.in_process or cfg.ddp) else None
    asked = cfg.find_unused_parameters
    if not (own_model and (spec.world_size > 1 or cfg.ddp) and asked is not True and unused is not None):
        return asked
    shown = ", ".join(unused[:5]) + (f" and {len(unused) - 5} more" if len(unused) > 5 else "")
    if unused and asked is False:
        raise ConfigError(
            f"{len(unused)} parameter(s) get no gradient from the loss ({shown}), and DDP fails on them with "
            f"--no-find-unused-parameters; drop that flag (DDP then searches for them each step), or remove "
            f"or freeze them (requires_grad_(False))"
        )
    if unused:
        print(
            f"ddpkit: {len(unused)} parameter(s) get no gradient from the loss ({shown}): DDP will look for "
            f"unused parameters every step (find_unused_parameters, one extra walk of the autograd graph per "
            f"step); freeze them (requires_grad_(False)) to save it"
        )
    return bool(unused)


def settle_run_dir(
    cfg: TrainConfig, identity: dict, named: bool, lr_total: str | None = None
) -> tuple[TrainConfig, dict | None]:
    """(the config to run, the finished run's summary to return or None). ``named``: the user gave the run dir;
    ``lr_total``: why the lr policy depends on the total steps (a longer horizon is then refused).

    The identity guards a resume; it never proves a finished run unchanged (no reading of a
    program can: an edit it does not read looks the same). So a finished run is returned only when
    the user asks (``reuse_finished``) and everything passed in was read and matches. Otherwise a
    rerun of a finished run trains again: with the default run dir in the next free one
    (``runs/NAME-2``, ..., where a rerun after a kill resumes it), and with a run dir the user named
    it is refused, nothing overwritten. An unfinished run resumes either way: the config and
    everything readable match, and a kill is why runs are rerun.
    """
    doubts = unproven(identity)
    if not named and not Path(cfg.run_dir).exists():
        # A run ddpkit before 0.4 named with its horizon in the hash: a rerun after the upgrade resumes it there
        older = dataclasses.replace(cfg, run_dir="").named(horizon=True)
        if Path(older.run_dir).exists():
            cfg = older
    try:
        finished = check_run_dir(cfg, identity, lr_total)
    except HorizonRefused as exc:
        if named:
            raise
        # A default run dir holding this run at a horizon it cannot be trained to: a new run beside it
        return _next_free(cfg, identity, lr_total, exc.held)
    if finished is None:
        return cfg, None  # nothing there, or a run to resume: its [start] line says what was not read
    if cfg.reuse_finished and not doubts:
        return cfg, finished
    if env.restart_count() > 0 and finished.get("finished_at", 0) >= agent_started_at():
        return cfg, finished  # this very job finished it, and torchrun's agent restarted it afterwards
    why = (
        f"ddpkit cannot tell whether this run is the same: it cannot read {'; '.join(doubts)}"
        if doubts
        else "reuse_finished (--reuse-finished) is off"
    )
    if named:
        raise RunDirError(
            f"{cfg.run_dir} holds a finished run, left as it is ({why}); to train again pass a new run_dir "
            f"(--run-dir) or delete it" + ("" if doubts else "; to return its result, pass --reuse-finished")
        )
    return _next_free(cfg, identity, lr_total, f"a finished run of this config ({why})")


def _next_free(cfg: TrainConfig, identity: dict, lr_total: str | None, why: str) -> tuple[TrainConfig, None]:
    """The next of ``RUN_DIR-2``, ``-3``, ... that is free or holds this run to resume, said in one line."""
    base = cfg.run_dir
    for n in range(2, 1000):
        cfg = dataclasses.replace(cfg, run_dir=f"{base}-{n}")
        try:
            if check_run_dir(cfg, identity, lr_total) is None:
                doing = "resuming" if RunFiles(cfg.run_dir).checkpoints.exists() else "training in"
                print(f"ddpkit: {base} holds {why}; {doing} {cfg.run_dir}")
                return cfg, None
        except HorizonRefused:
            continue  # this run at another horizon, not to be trained on: the next one
    raise RunDirError(f"{base}-2 ... {base}-999 all hold finished runs; pass a run_dir")


def past_the_epochs(cfg: TrainConfig, splits: DataSplits, world: int) -> str:
    """A --max-steps past the steps the epochs hold, in words ("" if not): the run ends at the epochs' end.
    The epoch's optimizer steps as the train source counts them (data/loader.py, whole accumulation groups;
    --join, whose last batch is partial, takes no --max-steps): per rank, whole batches of its share; for a
    stream, whole batches of each shard (world size x loader workers)."""
    if not cfg.max_steps:
        return ""
    micro, n = cfg.batch_size // world // cfg.grad_accum, len(splits.train)
    if isinstance(splits.train, IterableDataset):
        workers = max(1, cfg.num_workers or 0)
        batches = workers * (n // (world * workers) // micro)
    else:
        batches = n // world // micro
    total = cfg.epochs * (batches // cfg.grad_accum)
    if cfg.max_steps <= total:
        return ""
    epochs = f"{cfg.epochs} epoch's" if cfg.epochs == 1 else f"{cfg.epochs} epochs'"
    return (
        f"--max-steps {cfg.max_steps} is past the {epochs} {total} steps: the run ends at step {total}; raise "
        f"--epochs to train longer"
    )


def agent_started_at() -> float:
    """When this worker's parent (torchrun's elastic agent, which restarts the workers) started, in seconds
    since the epoch; infinity where unknown. A finished run written after it is this job's own."""
    return env.process_started_at(os.getppid())


def check_validation(cfg: TrainConfig, splits: DataSplits) -> None:
    """What evaluates on the validation split needs one: said before anything loads further."""
    if splits.val is not None and len(splits.val) == 0:
        raise DataError("val_data is empty: give at least one validation sample, or leave it out")
    if splits.val is not None:
        return
    asking = [
        flag
        for flag, value in (
            ("--eval-every-steps", cfg.eval_every_steps),
            ("--keep-best", cfg.keep_best),
            ("--early-stop", cfg.early_stop),
        )
        if value
    ]
    if asking:
        raise ConfigError(
            f"{', '.join(asking)} need{'s' if len(asking) == 1 else ''} a validation split, and this run has none: "
            f"hold one out of the training set with --val-fraction F (e.g. 0.1), or pass val_data= from Python "
            f"(the test set is never used to choose)"
        )


def check_watched(cfg: TrainConfig, task: Task) -> None:
    """``--keep-best`` and ``--early-stop`` name a metric the task reports."""
    for flag, spec in (("--keep-best", cfg.keep_best), ("--early-stop", cfg.early_stop)):
        if not spec:
            continue
        name = watched_metric(spec.split(":")[0], flag)[0]
        if name.removeprefix("val_") not in task.names:
            offered = ", ".join(f"val_{n}" for n in task.names)
            raise ConfigError(f"{flag} {spec}: this run's validation metrics are {offered}; name one of them")


def content_fingerprints(cfg: TrainConfig, splits: DataSplits) -> dict[str, Fingerprint]:
    """What the run identity reads of content the config names by path: the built-in or imagefolder
    data (tensors by content, image files by path, size and mtime), and the --init-from file (SHA-256).
    Data passed from Python is read by the Trainer (config field ``dataset``)."""
    found = {}
    if not cfg.dataset.startswith("custom:"):
        found["data_digest"] = data_fingerprint(splits.train, splits.test, val=splits.val)
        if is_import_path(cfg.dataset):  # and the function that made it
            found["data_digest"] = with_code(found["data_digest"], "factory", resolve(cfg.dataset, "--dataset"))
    if cfg.init_from:
        try:
            digest = file_fingerprint(cfg.init_from)
        except OSError as exc:
            raise ConfigError(f"--init-from {cfg.init_from}: cannot read it ({exc.strerror})") from None
        found["init_digest"] = Fingerprint(f"sha256:{digest}", {"sha256": digest})
    return found


def check_fsdp2(optimizer: Any) -> None:
    """``--strategy fsdp2``: this torch has it, and an optimizer passed in is a factory (called after the
    sharding), not an object over the parameters the sharding replaces."""
    missing = fsdp2_available()
    if missing:
        raise ConfigError(missing)
    if isinstance(optimizer, torch.optim.Optimizer):
        raise ConfigError(
            "--strategy fsdp2 replaces the model's parameters with their shards, so an optimizer built on "
            "model.parameters() before it would step tensors the model no longer uses: pass a factory, "
            "optimizer=lambda model: torch.optim.AdamW(model.parameters(), ...), which each rank calls after "
            "the sharding"
        )


def check_processes(
    spec: LaunchSpec, splits: DataSplits, model: nn.Module, staging: bool = False, sharded: bool = False
) -> None:
    """More processes than the node can hold: a warning past the core count (on CPU), an error
    past the memory. Each spawned rank holds what this process holds now (torch, the data)
    plus its model, gradients and optimizer state (about 4 copies of the weights; ``sharded``, under
    FSDP2: 4 / world of them, and up to one whole copy gathered for a forward); with ``staging``
    (``--async-snapshots``) rank 0 also holds a copy of a snapshot's state (about 3 copies: the weights
    and an optimizer's two moments; more with EMA or AMSGrad). Where DDP would not fit and FSDP2 would,
    the error says so."""
    if spec.in_process or spec.device_type != "cpu":
        return
    cores = cpu_cores()
    if spec.nproc > cores:
        print(
            f"ddpkit: warning: --nproc {spec.nproc} runs {spec.nproc} processes on {cores} core(s); each gets one "
            f"thread and they take turns, which is slower than --nproc {cores}",
            file=sys.stderr,
        )
    weights = sum(t.numel() * t.element_size() for t in model.state_dict().values())
    held = lambda shard: rss_bytes() + (weights * (4 / spec.world_size + 1) if shard else 4 * weights)  # noqa: E731
    per_rank = held(sharded)
    staged = 3 * weights if staging and not sharded else 0  # FSDP2: each rank writes its shards itself
    available = available_memory_bytes()
    if available is not None and spec.nproc * per_rank + staged > available:
        also = f", and {staged / 2**30:.2f} GiB for rank 0's copy of a snapshot (--async-snapshots)" if staged else ""
        fits_sharded = not sharded and spec.nproc * held(True) + staged <= available
        raise ConfigError(
            f"--nproc {spec.nproc} needs about {(spec.nproc * per_rank + staged) / 2**30:.1f} GiB ({spec.nproc} x "
            f"{per_rank / 2**30:.2f} GiB per process: torch, the data and the model{also}), but "
            f"{available / 2**30:.1f} GiB are available; "
            + (
                "pass --strategy fsdp2 (the model's state sharded over the ranks: docs/fsdp2.md), or "
                if fits_sharded
                else ""
            )
            + "lower --nproc"
            + (", or pass --no-async-snapshots" if staged else "")
        )


def sample_batch(splits: DataSplits, n: int = 2) -> Any:
    """A batch of the first ``n`` training samples, shaped as the training loop will see it, on the CPU."""
    data = splits.train
    if isinstance(data, ImageData) and splits.collate_fn is None:
        x, y = data.images[:n], data.labels[:n]
    else:
        items = first_items(data, n)
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
        labels = batch[1] if isinstance(batch, (tuple, list)) and len(batch) == 2 else None
        narrow = (torch.int8, torch.int16, torch.int32)
        # (the loss's own complaint about the target's type only: a model's error with such labels is the model's)
        about_target = "target" in first.lower() or "expected scalar type long" in first.lower()
        if (
            isinstance(task, Classification)
            and isinstance(labels, torch.Tensor)
            and labels.dtype in narrow
            and about_target
        ):
            # Not the model's fault: the classification loss takes int64 class indices (the porter's seed-004
            # port: int32 labels were said as "model ... fails on a batch")
            raise DataError(
                f"the labels of {cfg.dataset} are {labels.dtype}: the classification loss needs int64 class "
                f"indices; return them as torch.long from your dataset (y.long()). ({type(exc).__name__}: {first})"
            ) from None
        step = "model" if isinstance(task, Classification) else f"{task.identity} step with model"
        raise ConfigError(
            f"{step} {cfg.model} fails on a batch of {cfg.dataset} (input {shape}): {type(exc).__name__}: {first}"
        ) from None
    finally:
        model.train(was_training)


def trial_step(model: nn.Module, splits: DataSplits, task: Task, cfg: TrainConfig) -> list[str] | None:
    """One training step of the task on the preflight batch, as the workers will run it: a copy of the
    model in training mode, with gradients (BatchNorm statistics and the caller's model untouched).

    What only training mode shows is one line here, before launch: a loss_fn that fails, or returns a
    non-scalar, or a loss cut off from the model (``.item()``, ``.detach()``, ``torch.tensor(...)``),
    and a backward that fails. Returns the names of the parameters that get no gradient (DDP at world
    > 1 fails on them unless it searches for them each step); None where the step cannot run outside
    the workers (SyncBatchNorm, a forward that asks for its rank) or the model is on a GPU: the
    workers' own checks stand.
    """
    if any(p.device.type != "cpu" for p in model.parameters()):
        return None
    import copy

    try:
        trial = copy.deepcopy(model)
    except Exception:  # noqa: BLE001 - e.g. weight_norm's non-leaf tensors: DDP's own checks stand
        return None
    trial.train()
    try:  # a loss object with state of its own (a step counter) keeps it: the trial runs on a copy
        task = copy.deepcopy(task)
    except Exception:  # noqa: BLE001 - an uncopyable closure: the step runs on it as it is
        pass
    where = f"a training step of {task.identity} with model {cfg.model} on a batch of {cfg.dataset}"
    batch = sample_batch(splits)
    with generators_kept():  # dropout's draws here leave your script's generators as they were
        try:
            loss, outputs = task.loss(trial, batch)
        except DdpkitError:
            raise
        except Exception as exc:  # noqa: BLE001 - a user's forward or loss; said in one line
            if _needs_the_workers(exc, trial):
                return None
            raise ConfigError(f"{where} fails: {raised_at(exc)}") from None
        if not (isinstance(loss, torch.Tensor) and loss.numel() == 1 and loss.is_floating_point()):
            what = f"a tensor of shape {list(loss.shape)}" if isinstance(loss, torch.Tensor) else type(loss).__name__
            raise TaskError(
                f"in training mode the loss is {what}; it must be a scalar float tensor (reduce it: .mean())"
            )
        if not loss.requires_grad:
            raise TaskError(
                "in training mode the loss does not depend on the model's parameters: something cut it off "
                "the autograd graph (.item(), .detach(), float(...), torch.tensor(...) or a torch.no_grad() "
                "block); return the tensor the model's output gave"
            )
        task.measure(loss, outputs, batch)  # the metric contract, on training-mode outputs
        try:
            loss.backward()
        except Exception as exc:  # noqa: BLE001
            if _needs_the_workers(exc, trial):  # a backward with a collective in it
                return None
            raise ConfigError(f"{where}: backward fails: {raised_at(exc)}") from None
    return [name for name, p in trial.named_parameters() if p.requires_grad and p.grad is None]


def _needs_the_workers(exc: Exception, model: nn.Module) -> bool:
    """An error of a step that runs only inside the workers: it asks for the process group."""
    return "process group" in str(exc) or any("SyncBatchNorm" in type(m).__name__ for m in model.modules())


def task_for(cfg: TrainConfig, splits: DataSplits | None, loss_fn=None, metrics=None) -> Task:
    """The task a run of ``splits`` trains (``train/task.py``'s ``resolve_task``): the user's loss, a model's
    own loss for dict samples, or classification with the classes the data holds (the test labels too: a class
    seen only there would fail at evaluation). For ``Trainer`` and the tools built on it alike."""
    sample, classes, least = None, None, None
    if splits is not None:
        data = splits.train if splits.train is not None else splits.test
        sample = first_items(data, 1)[0] if data is not None and len(data) else None
        classes = splits.meta.classes if splits.meta else None
        if classes is None:
            found = [n for n in (infer_classes(splits.train), infer_classes(splits.test)) if n is not None]
            least = max(found) if found else None
    return resolve_task(cfg, loss_fn, metrics, sample, classes, least)


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
