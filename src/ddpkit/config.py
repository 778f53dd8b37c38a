"""The run configuration: one frozen dataclass, shown as CLI flags and as TOML.

Every field has a default, a section (for config.toml) and a one-line help text with
units. ``None`` means "the recipe decides" (see :mod:`ddpkit.recipes`); ``resolved()``
fills those in, checks every value once, and derives the run directory, so what is
written to ``config.toml`` and into every snapshot is exactly what ran.

    cfg = TrainConfig(dataset="mnist", epochs=2).resolved()
    cfg.to_toml()
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import hashlib
import inspect
import json
import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Optional

import tomli_w

from . import recipes
from .errors import ConfigError
from .importpath import is_import_path, is_own, keyword_args

try:
    import tomllib
except ModuleNotFoundError:  # Python < 3.11
    import tomli as tomllib


# The names the registries are keyed by (data/datasets.py DATASETS, models.py MODELS, run/loggers.py
# LOGGERS; tests/api/test_config.py checks they agree): config values are checked here, before anything loads.
DATASET_NAMES = ("mnist", "fashion-mnist", "cifar10", "cifar100", "synthetic")
MODEL_NAMES = ("convnet", "cnn", "resnet9", "resnet18", "mlp")
LOGGER_NAMES = ("tensorboard", "wandb", "csv")
# Said before launch (run/rundir.py) and by a worker that finds a snapshot (train/engine.py); why: train/ddp.py.
POWERSGD_NO_RESUME = (
    "--comm-hook powersgd keeps its error feedback per rank in DDP's gradient buckets, which a new "
    "process lays out anew, so a PowerSGD run cannot resume exactly and ddpkit does not resume it"
)


def _f(default: Any, section: str, help: str, choices: tuple | None = None, cli: bool = True) -> Any:
    """A config field: default, TOML section, help with units, allowed values; ``cli=False`` for a
    field that only the Python API sets (it is still written to config.toml)."""
    return field(default=default, metadata={"section": section, "help": help, "choices": choices, "cli": cli})


@dataclass(frozen=True)
class TrainConfig:
    # [data]
    dataset: str = _f(
        "mnist",
        "data",
        "mnist | fashion-mnist | cifar10 | cifar100 | synthetic | imagefolder:PATH | pkg.module:function "
        "(your function returning (train, test) datasets, or a dict with train, test and collate_fn)",
    )
    dataset_args: str = _f(
        "", "data", 'keyword arguments for --dataset pkg.module:function, as a JSON object: \'{"root": "data"}\''
    )
    data_dir: str = _f("data", "data", "where torchvision datasets are read from / downloaded to")
    data_digest: str = _f(
        "",
        "data",
        "what the built-in or imagefolder data was read as, by content (ddpkit.identity): set by ddpkit",
        cli=False,
    )
    limit_train: int = _f(
        0,
        "data",
        "use N training samples (0 = all): the first N; for imagefolder N spread "
        "evenly over the sorted files, so every class stays",
    )
    limit_test: int = _f(0, "data", "use N test samples (0 = all), chosen as for --limit-train")
    val_fraction: float = _f(
        0.0,
        "data",
        "hold out this fraction of the training set as the validation split (drawn with --seed, the same at "
        "every world size; 0 = none): evaluated at epoch ends, or every --eval-every-steps instead, and what "
        "--keep-best and --early-stop watch; the test set is then evaluated once, at the end",
    )
    synthetic_shape: str = _f("3,32,32", "data", "C,H,W of the synthetic dataset's images")
    synthetic_size: int = _f(50000, "data", "synthetic training samples (test set is a fifth of it)")
    synthetic_classes: int = _f(10, "data", "synthetic class count")
    image_size: int = _f(224, "data", "imagefolder: images are resized and centre-cropped to this many pixels")
    num_workers: Optional[int] = _f(
        None,
        "data",
        "DataLoader worker processes per rank, DataLoader path only "
        "(default: the rank's cores less one, at most 8; 0 with one core per rank)",
    )
    data_path: str = _f(
        "auto",
        "data",
        "auto: device-resident when it fits, else host; or force device | host | loader",
        ("auto", "device", "host", "loader"),
    )
    device_data_fraction: float = _f(0.25, "data", "max fraction of free device memory the resident train set may take")
    shuffle_in_batch: bool = _f(
        False,
        "data",
        "each global batch's samples in another order of their own, drawn from (seed, epoch): the same steps "
        "summed in another float order; on only for ddpkit check's noise run",
        cli=False,
    )
    # [model]
    model: Optional[str] = _f(
        None,
        "model",
        "convnet | cnn | resnet9 | resnet18 | mlp (default: the recipe's), or pkg.module:function "
        "returning your nn.Module",
    )
    model_args: str = _f(
        "", "model", "keyword arguments for --model pkg.module:function, as a JSON object: '{\"num_classes\": 10}'"
    )
    model_digest: str = _f(
        "",
        "model",
        "what --model pkg.module:function built, by structure and code (ddpkit.identity): set by ddpkit",
        cli=False,
    )
    task: str = _f(
        "classification",
        "model",
        "what the loop optimises: classification; the Python API records model-loss or custom:<loss_fn> here",
        cli=False,
    )
    init_from: str = _f(
        "",
        "model",
        "start from these weights: a model.pt or a snapshot, for fine-tuning "
        "(a resumed run continues from its own snapshot instead)",
    )
    init_digest: str = _f("", "model", "SHA-256 of the --init-from file (ddpkit.identity): set by ddpkit", cli=False)
    sync_bn: bool = _f(False, "model", "convert BatchNorm to SyncBatchNorm before the DDP wrap")
    channels_last: Optional[bool] = _f(
        None, "model", "NHWC activations and inputs for conv nets (default: on; faster with cuDNN and oneDNN)"
    )
    compile: bool = _f(False, "model", "torch.compile the model; compile time is reported apart from train time")
    # reduce-overhead and max-autotune use CUDA graphs, which are skipped or broken with
    # BatchNorm under DDP (pytorch/pytorch#139207, #161302): not offered until a GPU run shows otherwise.
    compile_mode: str = _f(
        "default",
        "model",
        "torch.compile mode (modes with CUDA graphs are not offered: they break with BatchNorm under DDP)",
        ("default", "max-autotune-no-cudagraphs"),
    )
    ddp: Optional[bool] = _f(
        None,
        "model",
        "wrap in DistributedDataParallel (default: when world size > 1; --ddp at world size 1 to measure the wrapper)",
    )
    strategy: str = _f(
        "auto",
        "model",
        "how the model is spread over the ranks: ddp, a whole replica on each (auto), or fsdp2, its parameters, "
        "gradients and optimizer state sharded over them (when DDP's memory runs out; docs/fsdp2.md)",
        ("auto", "ddp", "fsdp2"),
    )
    find_unused_parameters: Optional[bool] = _f(
        None,
        "model",
        "DDP's find_unused_parameters: search the autograd graph every step for parameters the loss does not "
        "reach (default: on when one training step before launch finds such parameters, and says which)",
    )
    comm_hook: str = _f(
        "none",
        "model",
        "DDP communication hook: gradients all-reduced as bf16 or fp16 (half the "
        "bytes), or PowerSGD rank-1 compressed (its error feedback is not in snapshots: such a run never resumes)",
        ("none", "bf16", "fp16", "powersgd"),
    )
    zero: bool = _f(False, "model", "ZeroRedundancyOptimizer: each rank holds 1/world_size of the optimizer state")
    # [optim]
    recipe: str = _f("auto", "optim", "named preset filling every unset field below (auto: by dataset)")
    optimizer: Optional[str] = _f(None, "optim", "sgd | adam | adamw", (None, "sgd", "adam", "adamw"))
    lr: Optional[float] = _f(None, "optim", "peak learning rate (per global batch, not per sample)")
    momentum: Optional[float] = _f(None, "optim", "SGD momentum / Adam beta1")
    beta2: Optional[float] = _f(
        None, "optim", "Adam/AdamW beta2 (unset: torch's 0.999; GPT recipes often use 0.95-0.99)"
    )
    nesterov: Optional[bool] = _f(None, "optim", "Nesterov momentum (SGD only)")
    weight_decay: Optional[float] = _f(None, "optim", "L2 weight decay (decoupled for adamw)")
    schedule: Optional[str] = _f(
        None,
        "optim",
        "onecycle (linear up, linear down to 0) | cosine (linear warm-up) | constant",
        (None, "onecycle", "cosine", "constant"),
    )
    warmup_frac: Optional[float] = _f(None, "optim", "fraction of all steps spent warming up (0..1)")
    full_lr_steps: Optional[int] = _f(
        None,
        "optim",
        "optimizer steps from which lr is the onecycle or cosine peak as it is; a shorter run peaks at "
        "lr x sqrt(steps / full_lr_steps) (0 = lr at any length). The recipe's rule: 0 when lr is given",
        cli=False,
    )
    label_smoothing: Optional[float] = _f(None, "optim", "cross-entropy label smoothing (0..1)")
    ema: Optional[float] = _f(None, "optim", "weight EMA decay per step, e.g. 0.999 (0 = off); eval uses the EMA")
    clip_grad_norm: float = _f(
        0.0,
        "optim",
        "clip the gradients' global L2 norm to this (0 = off); the norm before clipping is logged as grad_norm",
    )
    tta: Optional[bool] = _f(None, "optim", "test-time augmentation: average logits over a horizontal flip")
    # [train]
    epochs: int = _f(2, "train", "passes over the training set")
    batch_size: Optional[int] = _f(None, "train", "GLOBAL batch size; each rank gets batch_size // world_size")
    grad_accum: int = _f(
        1,
        "train",
        "micro-batches per optimizer step: each rank runs batch_size // world_size "
        "// grad_accum samples at a time and all-reduces once per step",
    )
    max_steps: int = _f(
        0,
        "train",
        "stop after this many optimizer steps in all (0 = run every epoch); the LR "
        "schedule spans them, and a partial last epoch counts as one",
    )
    dtype: str = _f(
        "float32",
        "train",
        "parameter and input dtype: float64 makes reduction-order noise ~1e-16 "
        "(exact comparisons on CPU; see ddpkit check)",
        ("float32", "float64"),
    )
    join: bool = _f(
        False,
        "train",
        "uneven inputs: each rank takes its own share of every epoch, none dropped or "
        "padded (ranks' step counts may differ by one); DDP's Join stands in for ranks that finish "
        "first. DataLoader path; logs and snapshots at epoch ends only",
    )
    grad_sync: bool = _f(
        True,
        "train",
        "all-reduce gradients; off only for ddpkit bench's compute-only timing (the ranks then diverge)",
        cli=False,
    )
    amp: Optional[str] = _f(
        None,
        "train",
        "mixed precision: bf16 | fp16 (with GradScaler) | none (default: the "
        "recipe's: none, or bf16 on CPUs with native bf16 for MNIST)",
        (None, "none", "bf16", "fp16"),
    )
    seed: int = _f(0, "train", "seed for weights, data order and augmentation")
    deterministic: bool = _f(
        False,
        "train",
        "deterministic kernels (torch, cuDNN, cuBLAS): bitwise-identical reruns "
        "and resumes on CUDA too, at some speed cost",
    )
    cuda_graph: str = _f(
        "auto",
        "train",
        "capture the whole training step as one CUDA graph after warm-up and replay it (its lr read as "
        "float32): on | off | auto (off until its GPU acceptance run; then on at world 1 for ddpkit's own "
        "model, task, optimizer and schedule). A failed capture falls back to the eager step",
        ("auto", "on", "off"),
    )
    log_every: int = _f(
        50, "train", "steps between metric logs, NaN checks and SIGTERM checks (the only host syncs in an epoch)"
    )
    # [run]
    run_dir: str = _f("", "run", "run directory (default: runs/<dataset>-<model>-<config hash>)")
    device: str = _f("auto", "run", "auto | cpu | cuda", ("auto", "cpu", "cuda"))
    timeout_s: float = _f(
        600.0, "run", "collective timeout in seconds (3 to 100,000,000); a stalled rank fails the job after this"
    )
    progress: bool = _f(True, "run", "rich progress bar on rank 0")
    log: str = _f(
        "",
        "run",
        "experiment loggers besides metrics.jsonl (always written), comma-separated: "
        "tensorboard, wandb, csv; written by global rank 0 into the run dir",
    )
    plots: bool = _f(
        True,
        "run",
        "write loss, metric and samples/s plots (PNG) to RUN_DIR/plots at the end; `ddpkit plot RUN_DIR` redraws them",
    )
    quiet: bool = _f(
        False,
        "run",
        "no per-interval or per-epoch lines on the console (metrics.jsonl still gets "
        "them); warnings and errors still print",
    )
    sample_log: bool = _f(
        False,
        "run",
        "with --replicas: write RUN_DIR/samples.jsonl, each committed step's sample indices by the share (rank of R) "
        "this group computed them as, so that every sample of every epoch can be counted once across the groups",
    )
    resume: str = _f(
        "auto",
        "run",
        "auto: continue a killed run from the run dir's newest snapshot | never: refuse a run dir that "
        "already holds a run",
        ("auto", "never"),
    )
    reuse_finished: bool = _f(
        False,
        "run",
        "return a finished run's stored result instead of training, when its config and everything ddpkit "
        "reads of what you passed in match and nothing is unreadable. Off: a finished run trains again "
        "(in the next free default run dir; a --run-dir you named is refused, nothing overwritten)",
    )
    on_nan: str = _f(
        "stop",
        "run",
        "non-finite loss or weights, checked at log intervals and before each snapshot: "
        "stop (keep the last good snapshot) | warn",
        ("stop", "warn"),
    )
    # [checkpoint]
    save_every_steps: int = _f(0, "checkpoint", "also snapshot every N optimizer steps (0 = at epoch ends only)")
    eval_every_steps: int = _f(
        0,
        "checkpoint",
        "evaluate on the validation split every N optimizer steps, not at epoch ends (0 = at epoch ends); "
        "needs one (--val-fraction, or val_data from Python)",
    )
    keep_best: str = _f(
        "",
        "checkpoint",
        "keep the weights with the best METRIC of the validation split in RUN_DIR/best.pt, with its step: "
        "val_loss, val_accuracy, ...; lowest for a loss or error, highest otherwise, or say METRIC:min|max",
    )
    early_stop: str = _f(
        "",
        "checkpoint",
        "METRIC:PATIENCE: stop when the validation METRIC has not improved for PATIENCE evaluations in a "
        "row (lowest or highest best as for --keep-best; METRIC:PATIENCE:min|max to say)",
    )
    keep_snapshots: int = _f(2, "checkpoint", "how many of the newest snapshots to keep")
    async_snapshots: bool = _f(
        True,
        "checkpoint",
        "write snapshots in the background: the state is copied aside at the step (host memory on rank 0, as "
        "much as the model, optimizer and schedule hold) and a thread writes it while training goes on; "
        "--no-async-snapshots: every rank waits while rank 0 writes",
    )
    # [launch]
    nproc: str = _f("auto", "launch", "processes on this node: N, or auto (one per visible GPU, 1 on CPU)")
    nnodes: int = _f(1, "launch", "nodes in the job; run the same command on each (needs --rdzv-endpoint when > 1)")
    rdzv_endpoint: str = _f("", "launch", "HOST:PORT of the c10d rendezvous, reachable from every node")
    rdzv_id: str = _f(
        "",
        "launch",
        "job id shared by all nodes (default: derived from the config, so the same command on every node agrees)",
    )
    local_addr: str = _f(
        "",
        "launch",
        "this node's address as the other nodes reach it (default: the local address that routes to --rdzv-endpoint)",
    )
    max_restarts: int = _f(
        0,
        "launch",
        "times the elastic agent restarts all workers after a failure; each restart resumes from the newest snapshot",
    )
    replicas: int = _f(
        1,
        "launch",
        "replica groups that train on when one is lost (torchft, the ddpkit[ft] extra): each group under its own "
        "elastic agent, a lost one restarted (--max-restarts) and healed from a live one while the others compute "
        "its share of every global batch; 1: none (docs/fault-tolerance.md)",
    )

    def __post_init__(self) -> None:
        if isinstance(self.nproc, int) and not isinstance(self.nproc, bool):
            object.__setattr__(self, "nproc", str(self.nproc))  # nproc=2 means "2", as on the command line

    # ------------------------------------------------------------------ resolution
    def resolved(self) -> "TrainConfig":
        """Fill recipe fields, check every value, and fix the run directory."""
        return self.filled().named()

    def filled(self) -> "TrainConfig":
        """The recipe's values in every field left unset, and every value checked; the run dir as given."""
        cfg = recipes.apply(self)
        cfg.validate()
        return cfg

    def named(self, horizon: bool = False) -> "TrainConfig":
        """The run dir fixed: as given, or ``runs/DATASET-MODEL-HASH``, the hash over the identity fields
        (so over the content fingerprints too, once preflight has recorded them) but the horizon's
        (``horizon=True``: with them, the name ddpkit before 0.4 gave)."""
        if self.run_dir:
            return self
        name = f"{_slug(self.dataset)}-{_slug(self.model)}-{self.hash(horizon)[:8]}"
        return dataclasses.replace(self, run_dir=str(Path("runs") / name))

    def validate(self) -> None:
        for f in dataclasses.fields(self):
            check_value(f.name, getattr(self, f.name))
        check_dataset_name(self.dataset)
        if self.model not in MODEL_NAMES and not is_own(self.model):
            raise ConfigError(
                f"unknown model {self.model!r}; choose one of: {', '.join(MODEL_NAMES)}, "
                f"or pkg.module:function (a function returning your nn.Module)"
            )
        for name, target in (("model_args", self.model), ("dataset_args", self.dataset)):
            if getattr(self, name):
                keyword_args(getattr(self, name), f"--{_flag(name)}")
                if not is_import_path(target):
                    what = _flag(name.removesuffix("_args"))
                    raise ConfigError(f"--{_flag(name)} is for --{what} pkg.module:function, not --{what} {target}")
        if self.task != "classification" and not self.task.startswith(("custom:", "model-loss", "classification+")):
            raise ConfigError(f"--task {self.task!r}: the CLI trains classification; a loss_fn is given from Python")
        for f in dataclasses.fields(self):
            choices = f.metadata.get("choices")
            value = getattr(self, f.name)
            if isinstance(value, str) and value.startswith("custom:"):  # set by the Python API
                continue
            if choices and value not in choices:
                raise ConfigError(
                    f"--{_flag(f.name)} {getattr(self, f.name)!r} is not one of {[c for c in choices if c]}"
                )
        positive = {
            "epochs": self.epochs,
            "batch_size": self.batch_size,
            "log_every": self.log_every,
            "grad_accum": self.grad_accum,
            "keep_snapshots": self.keep_snapshots,
            "nnodes": self.nnodes,
            "timeout_s": self.timeout_s,
            "synthetic_size": self.synthetic_size,
            "synthetic_classes": self.synthetic_classes,
            "image_size": self.image_size,
        }
        for name, value in positive.items():
            if value is None or value <= 0:
                raise ConfigError(f"--{_flag(name)} must be positive, got {value}")
        check_timeout_s(self.timeout_s)
        if not str(self.optimizer).startswith("custom:") and (self.lr is None or not self.lr > 0):
            raise ConfigError(f"--lr must be positive, got {self.lr}")
        if not 0 <= self.clip_grad_norm < float("inf"):
            raise ConfigError(f"--clip-grad-norm must be >= 0 (0 = off), got {self.clip_grad_norm}")
        if self.dtype == "float64" and self.amp not in (None, "none"):
            raise ConfigError(f"--dtype float64 and --amp {self.amp} contradict each other; drop one")
        if self.zero and (self.ema or str(self.optimizer).startswith("custom:")):
            raise ConfigError(
                "--zero shards ddpkit's own optimizer; it cannot wrap your own optimizer or run with --ema"
            )
        if self.strategy == "fsdp2":
            clash = [
                flag
                for flag, on in (
                    ("--cuda-graph on", self.cuda_graph == "on"),
                    ("--join", self.join),
                    ("--zero", self.zero),
                    (f"--comm-hook {self.comm_hook}", self.comm_hook != "none"),
                    ("--sync-bn", self.sync_bn),
                    ("--ema", self.ema),
                    ("--compile", self.compile),
                    ("--amp fp16", self.amp == "fp16"),
                    ("--ddp", self.ddp),
                    ("--find-unused-parameters", self.find_unused_parameters),
                    ("--channels-last", self.channels_last),
                )
                if on
            ]
            if clash:
                raise ConfigError(
                    f"--strategy fsdp2 cannot be combined with {', '.join(clash)}: "
                    + "; ".join(FSDP2_REFUSED[flag.split()[0]] for flag in clash)
                )
        if self.replicas < 1:
            raise ConfigError(f"--replicas must be >= 1 (1 = no replica groups), got {self.replicas}")
        if self.sample_log and self.replicas == 1:
            raise ConfigError(
                "--sample-log records which replica group computed each sample: it needs --replicas R > 1 (without "
                "groups each rank takes its share as the epoch order says, which `ddpkit check` counts)"
            )
        if self.replicas > 1:
            clash = [
                flag
                for flag, on in (
                    (f"--nproc {self.nproc}", self.nproc not in ("1", "auto")),
                    (f"--nnodes {self.nnodes}", self.nnodes > 1),
                    ("--strategy fsdp2", self.strategy == "fsdp2"),
                    ("--cuda-graph on", self.cuda_graph == "on"),
                    ("--join", self.join),
                    ("--zero", self.zero),
                    (f"--comm-hook {self.comm_hook}", self.comm_hook != "none"),
                    ("--sync-bn", self.sync_bn),
                    ("--data-path loader", self.data_path == "loader"),
                    ("--compile", self.compile),
                )
                if on
            ]
            if clash:
                raise ConfigError(
                    f"--replicas {self.replicas} cannot be combined with {', '.join(clash)} yet: each group is one "
                    f"process on this node, reads its share of the data held in memory, and all-reduces its "
                    f"whole gradient through torchft (docs/fault-tolerance.md)"
                )
            # Each group computes one rank's share of every global batch (and, while others are gone, theirs): the
            # shares of a run of --replicas ranks, so the batch must split as it would over that many ranks
            share, left = divmod(self.batch_size, self.replicas)
            if left:
                near = " or ".join(str(v) for v in (share * self.replicas, (share + 1) * self.replicas) if v > 0)
                raise ConfigError(
                    f"--batch-size {self.batch_size} (global) is not divisible by --replicas {self.replicas}: each "
                    f"group takes an equal share of every global batch; use {near}"
                )
            if share % self.grad_accum:
                raise ConfigError(
                    f"--grad-accum {self.grad_accum} does not divide a replica group's share of the batch, {share} "
                    f"(--batch-size {self.batch_size} over --replicas {self.replicas})"
                )
        if self.join:
            clash = [
                flag
                for flag, on in (
                    ("--sync-bn", self.sync_bn),
                    ("--max-steps", self.max_steps),
                    ("--save-every-steps", self.save_every_steps),
                    ("--eval-every-steps", self.eval_every_steps),
                    ("--ema", self.ema),
                    ("--grad-accum", self.grad_accum > 1),
                    ("--amp fp16", self.amp == "fp16"),
                    ("--data-path device/host", self.data_path in ("device", "host")),
                )
                if on
            ]
            if clash:
                raise ConfigError(
                    f"--join cannot be combined with {', '.join(clash)}: Join stands in only for DDP's "
                    f"and ZeRO's own all-reduces, and ranks run different step counts"
                )
        if not 0 <= self.val_fraction < 1:
            raise ConfigError(f"--val-fraction must be in [0, 1) (0 = no validation split), got {self.val_fraction}")
        if self.keep_best:
            watched_metric(self.keep_best, "--keep-best")
        if self.early_stop:
            early_stop_rule(self.early_stop)
        nonneg = {
            "eval_every_steps": self.eval_every_steps,
            "max_steps": self.max_steps,
            "limit_train": self.limit_train,
            "limit_test": self.limit_test,
            "num_workers": self.num_workers,
            "save_every_steps": self.save_every_steps,
            "max_restarts": self.max_restarts,
            "weight_decay": self.weight_decay,
            "momentum": self.momentum,
        }
        for name, value in nonneg.items():
            if value is not None and value < 0:
                raise ConfigError(f"--{_flag(name)} must be >= 0, got {value}")
        if self.full_lr_steps is not None and self.full_lr_steps < 0:  # no flag: TOML and Python only
            raise ConfigError(f"full_lr_steps must be >= 0 (0 = lr at any length), got {self.full_lr_steps}")
        if not 0 <= self.seed <= SEED_MAX:
            raise ConfigError(f"--seed {self.seed} is out of range: give a whole number from 0 to 2**63-1 ({SEED_MAX})")
        for name in ("warmup_frac", "label_smoothing", "ema"):
            if getattr(self, name) is not None and not 0 <= getattr(self, name) < 1:
                raise ConfigError(f"--{_flag(name)} must be in [0, 1), got {getattr(self, name)}")
        if not 0 < self.device_data_fraction <= 1:
            raise ConfigError(f"--device-data-fraction must be in (0, 1], got {self.device_data_fraction}")
        if self.nproc != "auto" and not re.fullmatch(r"[1-9][0-9]*", self.nproc):  # ASCII digits: int() takes no "²"
            raise ConfigError(f"--nproc must be a positive integer or 'auto', got {self.nproc!r}")
        if self.optimizer in ("adam", "adamw") and self.momentum is not None and not 0 <= self.momentum < 1:
            raise ConfigError(
                f"--momentum is Adam's beta1 with --optimizer {self.optimizer}, and must be in [0, 1); "
                f"got {self.momentum}"
            )
        if self.beta2 is not None and (self.optimizer not in (None, "adam", "adamw") or not 0 <= self.beta2 < 1):
            raise ConfigError(
                f"--beta2 is Adam's and AdamW's second-moment decay: it must be in [0, 1) with --optimizer adam "
                f"or adamw; got {self.beta2} with --optimizer {self.optimizer}"
            )
        if self.comm_hook == "powersgd" and self.max_restarts:
            raise ConfigError(
                f"--max-restarts {self.max_restarts} resumes from snapshots, and a --comm-hook powersgd run "
                f"cannot resume exactly (its error feedback is not in snapshots); drop one of them"
            )
        # --nnodes > 1 without --rdzv-endpoint is refused at launch (ranks/launcher.py: LaunchSpec.from_config),
        # where SLURM's and Kubeflow's variables, which may give the endpoint, are read
        if self.rdzv_endpoint:
            host, _, port = self.rdzv_endpoint.rpartition(":")
            if not host or not port.isdigit() or not 0 <= int(port) < 65536:
                raise ConfigError(f"--rdzv-endpoint must be HOST:PORT, got {self.rdzv_endpoint!r}")
        parse_loggers(self.log)
        try:
            shape = self.synthetic_shape_tuple
        except ValueError:
            shape = ()
        if len(shape) != 3 or min(shape) <= 0:
            raise ConfigError(f"--synthetic-shape must be C,H,W with positive ints, got {self.synthetic_shape!r}")

    @property
    def synthetic_shape_tuple(self) -> tuple[int, ...]:
        return tuple(int(v) for v in self.synthetic_shape.split(","))

    # ------------------------------------------------------------------ identity
    # Fields that change where or how verbosely a run happens, not what it computes:
    # a run directory may be resumed with different values of these.
    NON_IDENTITY = frozenset(
        {
            "run_dir",
            "data_dir",
            "log_every",
            "timeout_s",
            "num_workers",
            "progress",
            "resume",
            "reuse_finished",
            "nproc",
            "data_path",
            "device_data_fraction",
            "on_nan",
            "quiet",
            "save_every_steps",
            "keep_snapshots",
            "async_snapshots",
            "nnodes",
            "rdzv_endpoint",
            "rdzv_id",
            "local_addr",
            "max_restarts",
            "ddp",
            "strategy",
            "find_unused_parameters",
            "log",
            "plots",
            "sample_log",
        }
    )  # ddp: at world 1 the wrapper changes no bit (tests/train/test_engine.py). strategy: FSDP2 computes what
    # DDP does to float noise and each reads the other's snapshots (tests/train/test_fsdp2.py), so a run dir
    # resumes under either, as at another world size. Not cuda_graph: on CUDA it reads the lr as float32 (DeviceLR)

    def identity(self) -> dict:
        return {k: v for k, v in self.to_dict().items() if k not in self.NON_IDENTITY}

    # Identity keys added after run directories were named by this hash, left out of it at their
    # default: an unfinished run named by an older ddpkit keeps its name, so rerunning its command
    # after an upgrade resumes it.
    HASHED_UNLESS_DEFAULT = {
        "beta2": None,
        "cuda_graph": "auto",
        "shuffle_in_batch": False,
        "val_fraction": 0.0,
        "eval_every_steps": 0,
        "keep_best": "",
        "early_stop": "",
        "full_lr_steps": 0,
        "replicas": 1,
    }

    # "Horizon" fields: how long the run trains, not what any of its steps computes. A run dir is named
    # without them, and a run whose horizon grows goes on from its last snapshot where its lr policy does
    # not depend on the total (preflight.settle_run_dir); a snapshot of another horizon loads.
    HORIZON = frozenset({"epochs", "max_steps"})

    def hash(self, horizon: bool = False) -> str:
        """The identity's hash, without the horizon fields (``horizon=True``: with them, as run dirs were
        named before ddpkit 0.4)."""
        kept = {
            k: v
            for k, v in self.identity().items()
            if not (k in self.HASHED_UNLESS_DEFAULT and v == self.HASHED_UNLESS_DEFAULT[k])
            and (horizon or k not in self.HORIZON)
        }
        blob = json.dumps(kept, sort_keys=True, default=str)
        return hashlib.sha256(blob.encode()).hexdigest()

    def horizon_changes(self, other: dict) -> dict[str, tuple]:
        """{field: (saved, now)} for each horizon field that differs from ``other`` (a saved config dict)."""
        return {
            k: (other[k], getattr(self, k)) for k in sorted(self.HORIZON) if k in other and other[k] != getattr(self, k)
        }

    # Identity keys a run dir written before ddpkit 0.3 leaves empty: such a run is matched on the rest.
    RECORDED_SINCE_0_3 = frozenset({"data_digest", "init_digest"})
    # Keys a run dir written before they existed lacks altogether: such a run is matched on the rest. Their
    # empty value is a real one ("" = no arguments), so only a missing key means "not recorded".
    ADDED_SINCE_0_3 = frozenset(
        {
            "model_digest",
            "model_args",
            "dataset_args",
            "cuda_graph",
            "shuffle_in_batch",
            "val_fraction",
            "eval_every_steps",
            "keep_best",
            "early_stop",
            "replicas",
        }
    )
    # Keys a recipe fills that were added after run dirs were written: a config.toml from before reads them as
    # unset (None), which a resolved config never holds, so such a run is matched on the rest. Its snapshots hold
    # the lr curve it started on (the schedule's base_lrs, train/optim.py), so it finishes as it began.
    UNSET_IN_OLDER = frozenset({"full_lr_steps"})

    def differing_keys(self, other: dict) -> list[str]:
        """Identity keys whose values differ from ``other`` (a saved config dict)."""
        unrecorded = {k for k in self.RECORDED_SINCE_0_3 if not other.get(k)}
        unrecorded |= {k for k in self.ADDED_SINCE_0_3 if k not in other}
        unrecorded |= {k for k in self.UNSET_IN_OLDER if other.get(k) is None}
        mine = {k: v for k, v in self.identity().items() if k not in unrecorded}
        other = {k: v for k, v in other.items() if k not in unrecorded}
        theirs = {k: v for k, v in other.items() if k not in self.NON_IDENTITY}
        return sorted(k for k in mine.keys() | theirs.keys() if mine.get(k) != theirs.get(k) and k not in self.HORIZON)

    def world_change(self, old_world: int, new_world: int) -> str:
        """Why a snapshot of this run made at ``old_world`` cannot resume at ``new_world`` ("" if it can): the
        run-key protocol of ``run/runkey.py``. Under --join the last, uneven batch of an epoch is averaged per
        rank (each rank's mean, then DDP's mean over ranks), so its gradient depends on the world size."""
        if self.join and old_world != new_world:
            return (
                f"with --join, this run has {new_world}; a --join run resumes only at the world size it was made with"
            )
        return ""

    # ------------------------------------------------------------------ (de)serialisation
    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, values: dict, source: str = "") -> "TrainConfig":
        """Build from a flat or sectioned dict (as read from TOML); unknown keys and values of the
        wrong type are errors naming the key (``source`` says where the values came from)."""
        section_of = {f.name: f.metadata["section"] for f in dataclasses.fields(cls)}
        flat: dict = {}
        for key, value in values.items():
            if isinstance(value, dict) and key not in section_of.values():
                raise ConfigError(
                    f"{source}unknown section [{key}]; the sections are "
                    f"{', '.join(f'[{s}]' for s in dict.fromkeys(section_of.values()))}"
                )
            for k, v in value.items() if isinstance(value, dict) else [(key, value)]:
                name = k.replace("-", "_")  # batch-size, as the flag is spelt, is batch_size
                if isinstance(value, dict) and section_of.get(name, key) != key:
                    raise ConfigError(f"{source}{k} belongs in [{section_of[name]}], not [{key}]")
                if name in flat:
                    raise ConfigError(
                        f"{source}{name} is given twice (as {name} and {name.replace('_', '-')}); keep one"
                    )
                flat[name] = v
        names = set(section_of)
        unknown = sorted(set(flat) - names)
        if unknown:
            near = {k: difflib.get_close_matches(k, names, 1) for k in unknown}
            hints = [f"{k} (did you mean {m[0]}?)" if m else k for k, m in near.items()]
            raise ConfigError(
                f"{source}unknown config key(s): {', '.join(hints)}; see `ddpkit train --help` for the valid ones"
            )
        return cls(**{k: check_value(k, v, source) for k, v in flat.items()})

    @classmethod
    def from_toml(cls, path: str | Path) -> "TrainConfig":
        return cls.from_dict(read_toml(path), f"config file {path}: ")

    def to_toml(self) -> str:
        """The config as TOML, in sections; unset (None) fields are left out, as TOML has no null."""
        sections: dict[str, dict] = {}
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if value is not None:
                sections.setdefault(f.metadata["section"], {})[f.name] = value
        return tomli_w.dumps(sections)


_KINDS = {int: "an integer", float: "a number", bool: "true or false", str: "a string in quotes"}


def _field_types() -> dict[str, tuple[type, bool]]:
    """name -> (type, may be None), from the annotations ("int", "Optional[float]", ...)."""
    out = {}
    for f in dataclasses.fields(TrainConfig):
        text = str(f.type)
        optional = text.startswith("Optional[")
        out[f.name] = (
            {"int": int, "float": float, "bool": bool, "str": str}[text[9:-1] if optional else text],
            optional,
        )
    return out


# --timeout-s, in seconds. Below 3 s a healthy run's own pauses (a rank starting later than another,
# rank 0 writing a snapshot) outlast it, and the hang watch looks at half of it. Above 1e8 s (3 years,
# no timeout in effect): timedelta ends at 8.6e13 s, and the process group's deadline (now + timeout,
# in int64 nanoseconds) overflows near 9.2e9 s, which gloo reports as a connect timeout.
TIMEOUT_S_RANGE = (3.0, 1e8)


def check_timeout_s(value: float, name: str = "--timeout-s") -> None:
    """A one-line ConfigError unless ``value`` is in TIMEOUT_S_RANGE (``name``: how the caller gave it)."""
    low, high = TIMEOUT_S_RANGE
    number = isinstance(value, (int, float)) and not isinstance(value, bool)
    if not number or not low <= value <= high:  # NaN too
        raise ConfigError(
            f"{name} {f'{value:.10g}' if number else repr(value)} is out of range: give {low:g} to {high:,.0f} "
            f"seconds (the collectives' timeout; the hang watch reports at half of it)"
        )


# --seed's largest value: what an int64 holds. torch.manual_seed takes up to 2**64-1, but ddpkit adds the
# epoch to it (data/loader.py), and numpy's SeedSequence (data/seeds.py reseed) takes no negative seed.
SEED_MAX = 2**63 - 1


def check_value(name: str, value: Any, source: str = "") -> Any:
    """``value`` if it has ``name``'s type (an int is taken for a float); else a one-line ConfigError."""
    typ, optional = FIELD_TYPES[name]
    if name == "nproc" and isinstance(value, int) and not isinstance(value, bool):
        value = str(value)  # "N or auto": a plain number means N, in TOML and Python alike
    if value is None:
        if optional:
            return None
        raise ConfigError(f"{source}{name} must be set ({_KINDS[typ]})")
    if typ is float and isinstance(value, int) and not isinstance(value, bool):
        value = float(value)
    ok = isinstance(value, typ) and not (typ is int and isinstance(value, bool))
    if not ok:
        example = '2 or "auto"' if name == "nproc" else _example(name, typ)
        raise ConfigError(
            f"{source}{name} = {value!r} ({type(value).__name__}): expected {_KINDS[typ]}, e.g. {name} = {example}"
        )
    if typ is float and not math.isfinite(value):
        raise ConfigError(f"{source}{name} = {value}: expected a finite number")
    if typ is str:
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            raise ConfigError(
                f"{source}{name} = {value!r} holds bytes that are not UTF-8 (a file name in another "
                f"encoding?); rename it"
            ) from None
    return value


def _example(name: str, typ: type) -> str:
    default = {f.name: f.default for f in dataclasses.fields(TrainConfig)}[name]
    if default is None or not isinstance(default, typ):
        default = {int: 1, float: 0.1, bool: True, str: "..."}[typ]
    return tomli_w.dumps({name: default}).split(" = ", 1)[1].strip()


def check_dataset_name(name: str) -> None:
    if name in DATASET_NAMES or name.startswith(("imagefolder:", "custom:")) or is_import_path(name):
        return
    raise ConfigError(
        f"unknown dataset {name!r}; choose one of: {', '.join(DATASET_NAMES)}, imagefolder:PATH, or "
        f"pkg.module:function (a function returning your train and test datasets)"
    )


def parse_loggers(text: str) -> tuple[str, ...]:
    """``--log`` as a tuple of logger names; an unknown name is a one-line error."""
    names = tuple(dict.fromkeys(n.strip() for n in text.split(",") if n.strip()))
    unknown = [n for n in names if n not in LOGGER_NAMES]
    if unknown:
        raise ConfigError(
            f"--log {text!r}: unknown logger(s) {', '.join(unknown)}; choose from "
            f"{', '.join(LOGGER_NAMES)} (comma-separated; metrics.jsonl is always written)"
        )
    return names


def read_toml(path: str | Path) -> dict:
    """A TOML file as a dict; a missing, unreadable, non-UTF-8 or malformed file is a one-line ConfigError."""
    try:
        data = Path(path).read_bytes()
    except FileNotFoundError:
        raise ConfigError(f"config file {path} does not exist") from None
    except IsADirectoryError:
        raise ConfigError(f"config file {path} is a directory, not a TOML file") from None
    except OSError as exc:
        raise ConfigError(f"cannot read config file {path} ({exc.strerror})") from None
    try:
        return tomllib.loads(data.decode("utf-8"))
    except UnicodeDecodeError as exc:
        raise ConfigError(f"config file {path} is not UTF-8 text (byte {exc.start}); TOML files are UTF-8") from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"config file {path} is not valid TOML: {exc}") from None


def _flag(name: str) -> str:
    return name.replace("_", "-")


def _slug(name: str) -> str:
    """A dataset or model name as a directory-name part: ``custom:MLP#1a2b3c4d`` -> ``MLP-1a2b3c4d``."""
    if name.startswith("imagefolder:"):
        return "imagefolder-" + (Path(name.split(":", 1)[1]).name or "data")
    if is_import_path(name):
        return name.rsplit(":", 1)[1].rsplit(".", 1)[-1]  # the function's name
    return name.removeprefix("custom:").replace("#", "-")


FIELD_TYPES = _field_types()


def watched_metric(spec: str, flag: str) -> tuple[str, str]:
    """``--keep-best`` / ``--early-stop``'s metric: (name, "min" or "max"). ``val_loss`` is lowest-best (a
    name holding loss, error, perplexity or mse/mae), any other highest-best; ``NAME:min|max`` says."""
    name, _, mode = spec.partition(":")
    if not re.fullmatch(r"val_[A-Za-z0-9_]+", name):
        raise ConfigError(
            f"{flag} {spec!r}: name a metric of the validation split, e.g. val_loss or val_accuracy "
            f"(the test set only reports, once, at the end; it never chooses)"
        )
    if mode and mode not in ("min", "max"):
        raise ConfigError(f"{flag} {spec!r}: the direction after ':' is min or max, got {mode!r}")
    lowest = re.search(r"loss|err|perplexity|ppl|mse|mae|rmse", name[4:])
    return name, mode or ("min" if lowest else "max")


def early_stop_rule(spec: str) -> tuple[str, str, int]:
    """``--early-stop METRIC:PATIENCE[:min|max]``: (name, mode, patience)."""
    parts = spec.split(":")
    if len(parts) not in (2, 3) or not re.fullmatch(r"[1-9][0-9]*", parts[1]):
        raise ConfigError(
            f"--early-stop {spec!r}: give METRIC:PATIENCE, e.g. val_loss:5 (stop after 5 evaluations in a row "
            f"without a new best), optionally :min or :max after it"
        )
    name, mode = watched_metric(":".join([parts[0], *parts[2:]]), "--early-stop")
    return name, mode, int(parts[1])


# ---------------------------------------------------------------------- a Loop's config
# Beside TrainConfig: both are plain data saved into every run (config.toml, loop.json), and ddpkit.Loop,
# like Trainer, is a face over the one run session (train/session.py).
LOOP_STRATEGIES = ("auto", "ddp", "fsdp2")  # train/strategy.py
# Why --strategy fsdp2 refuses each flag, in the one-line error (by flag name)
FSDP2_REFUSED = {
    "--cuda-graph": "the captured step is built on DDP's buckets",
    "--join": "a rank out of batches cannot answer FSDP2's all-gathers (drop_last keeps the ranks even)",
    "--zero": "FSDP2 shards the optimizer state already",
    "--comm-hook": "DDP's communication hooks do not apply to FSDP2's reduce-scatter",
    "--sync-bn": "SyncBatchNorm is not built for sharded modules (rank 0's BatchNorm statistics are broadcast, as "
    "DDP does)",
    "--ema": "its averaged copy would be a whole unsharded model on every rank",
    "--compile": "torch.compile around a sharded model is not verified yet",
    "--amp": "the fp16 loss scaler is not verified on sharded gradients (--amp bf16 needs none)",
    "--ddp": "--ddp asks for the DDP wrapper",
    "--find-unused-parameters": "FSDP2 has none: every rank must give every parameter a gradient",
    "--channels-last": "FSDP2 shards contiguous parameters only, and NHWC conv weights are not",
}
LOOP_AMP = ("off", "bf16", "fp16")  # a Loop's autocast: "off" adds none and leaves the user's own


@dataclass(frozen=True)
class LoopConfig:
    """What the user asked of a :class:`Loop`; saved as ``loop.json`` in the run dir."""

    run_dir: str = "runs/loop"
    device: str = "auto"  # auto (cuda when there is a GPU), cpu, cuda
    seed: int = 0  # the reseed at another world size, and the per-sample and per-batch draws of DataLoader workers
    amp: str = "off"  # off, bf16, fp16 (fp16 adds a GradScaler, used by backward/optimizer_step)
    sync_bn: bool = False  # every BatchNorm made synchronised across ranks by wrap()
    deterministic: bool = False  # torch.use_deterministic_algorithms, cuDNN deterministic
    save_every_steps: int = 0  # 0: snapshots at each epochs() end, at the end, and on a stop only
    keep_snapshots: int = 2
    async_snapshots: bool = True  # copied aside at the step, written by a thread on rank 0 (run/staging.py)
    log_every: int = 50  # steps per record; a stop signal is acted on at the next one
    timeout_s: float = 600.0  # collectives and the hang watch (seconds)
    check_code: bool = True  # refuse a snapshot that other code (the loop function's) made
    # auto (ddp), ddp, fsdp2 (train/fsdp2.py). Not in the run identity: a DDP run's snapshot resumes under FSDP2
    strategy: str = "auto"

    # What a snapshot is matched on, with the loop's code: the rest may differ between runs.
    HASHED = ("seed", "amp", "sync_bn", "deterministic")

    def validate(self) -> None:
        if self.amp not in LOOP_AMP:
            raise ConfigError(f"Loop(amp={self.amp!r}): {_choose(self.amp, LOOP_AMP)}")
        if self.device not in ("auto", "cpu", "cuda"):
            raise ConfigError(f"Loop(device={self.device!r}): choose auto, cpu or cuda")
        for name in ("save_every_steps", "log_every", "keep_snapshots"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < (1 if name == "keep_snapshots" else 0):
                raise ConfigError(f"Loop({name}={value!r}): expected an int >= {int(name == 'keep_snapshots')}")
        if not isinstance(self.seed, int) or isinstance(self.seed, bool):
            raise ConfigError(f"Loop(seed={self.seed!r}): expected an int")
        if not isinstance(self.async_snapshots, bool):
            raise ConfigError(f"Loop(async_snapshots={self.async_snapshots!r}): expected True or False")
        if self.strategy not in LOOP_STRATEGIES:
            raise ConfigError(f"Loop(strategy={self.strategy!r}): {_choose(self.strategy, LOOP_STRATEGIES)}")
        if self.strategy == "fsdp2" and self.sync_bn:
            raise ConfigError(
                "Loop(strategy='fsdp2', sync_bn=True): SyncBatchNorm's all-reduce in the forward is not built for "
                "sharded modules; use plain BatchNorm (rank 0's statistics are broadcast, as DDP does), or "
                "strategy='ddp'"
            )
        if self.strategy == "fsdp2" and self.amp == "fp16":
            raise ConfigError(
                "Loop(strategy='fsdp2', amp='fp16'): the fp16 loss scaler is not verified on sharded gradients; "
                "use amp='bf16' (no scaler needed), or strategy='ddp'"
            )
        check_timeout_s(self.timeout_s, "Loop(timeout_s=...)")


def _choose(value: Any, choices: tuple[str, ...]) -> str:
    """ "did you mean X? (choose one of ...)" for a near miss (strategy='fsdp'), else "choose one of ..."."""
    import difflib

    near = difflib.get_close_matches(str(value), choices, 1) if isinstance(value, str) else []
    listed = f"choose one of {', '.join(choices)}"
    return f"did you mean {near[0]!r}? ({listed})" if near else listed


def keywords_checked(init: Callable) -> Callable:
    """``init`` (a public class's ``__init__``) raising :class:`ConfigError` for a keyword it does not take, with
    the nearest it does: Python's own TypeError names the keyword alone, with no hint (``Loop(log_evry=10)``),
    and it was a traceback per rank (a ddpkit error is one line: ``import ddpkit`` installs the hook that says
    it). Its signature, for ``help()`` and editors, is ``init``'s."""
    params = list(inspect.signature(init).parameters.values())[1:]  # less self
    names = [p.name for p in params if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]
    owner = init.__qualname__.rsplit(".", 1)[0]

    @functools.wraps(init)
    def checked(self, *args, **kwargs):
        unknown = [k for k in kwargs if k not in names]
        if unknown:
            near = {k: difflib.get_close_matches(k, names, 1) for k in unknown}
            said = ", ".join(f"{k}= (did you mean {m[0]}=?)" if m else f"{k}=" for k, m in near.items())
            raise ConfigError(f"{owner}() takes no keyword {said}: see help(ddpkit.{owner}) for the ones it takes")
        init(self, *args, **kwargs)

    return checked


TrainConfig.__init__ = keywords_checked(TrainConfig.__init__)  # (a dataclass's, made by @dataclass above)
