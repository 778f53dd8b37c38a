"""``ddpkit check``: do N processes compute what 1 process does, on your model and data?

    report = check(model, train_data, test_data, nproc=2, steps=5, loss_fn=...)   # or model=None: the config's
    report.passed, report.worst, print(report.text())

Three short runs of the same engine, from the same initial weights, seed and global sample
order: the reference (1 process, global batch B), a noise run (1 process, perturbed only in
rounding: the other memory format for conv nets, else B as 2 accumulated halves, or for a
BatchNorm model without convolutions the same run again), and the
run under test (N processes, B/N each). Every parameter and buffer of the N-process run is
compared with the reference, relative to the tensor's own scale; the noise run says how far
rounding alone moves each tensor. A tensor passes when it differs by at most
``NOISE_FACTOR`` times its noise, or ``FLOOR[dtype]``, whichever is larger.

On CPU the runs are in float64 where the model allows it: rounding noise is then ~1e-16
relative and a real divergence (BatchNorm statistics per rank, rank-dependent noise, a data
order bug) stands out by ten orders of magnitude. In float32 the noise is larger and uneven:
a BatchNorm bias's gradient is a sum over the whole batch that nearly cancels, so the order
of that sum (NCHW or NHWC kernels, one or two ranks) moves it by ~1e-3 of itself after one
step while the weights move by ~1e-7. The per-tensor noise run keeps that tensor's tolerance
wide and every other tensor's tight, and the report prints both.

It also checks, on the real dataset and world size, that each rank's epoch order covers the
training set at most once per epoch (exactly once unless the last partial batch is dropped),
that two epochs differ in order (``set_epoch``), and that the test shards count every test
sample exactly once. And it explains what makes a model unfit for DDP: parameters that get
no gradient, BatchNorm without SyncBN, and rank-dependent randomness (dropout).
"""

from __future__ import annotations

import copy
import dataclasses
import math
import shutil
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Mapping

import torch
from torch import nn

from ..config import TrainConfig
from ..data import load_dataset
from ..data.batch import tree_map
from ..device import resolve_device_type
from ..dist.context import distributed
from ..dist.launcher import LaunchSpec, run_workers
from ..errors import (
    ConfigError,
    DataError,
    DdpkitError,
    RunDirError,
    TaskError,
    WorkersFailed,
)
from ..models import model_for
from ..preflight import sample_batch
from ..run.checkpoint import read_weights
from ..run.paths import RunFiles
from ..train.engine import make_sources
from ..train.workers import Job
from ..trainer import Trainer, as_objects

NOISE_FACTOR = 10.0
FLOOR = {"float64": 1e-12, "float32": 1e-5}  # relative: ~4500 and ~80 ulps of the tensor's largest value
DROPOUT = (nn.Dropout, nn.Dropout1d, nn.Dropout2d, nn.Dropout3d, nn.AlphaDropout)


@dataclass
class TensorDiff:
    name: str
    diff: float  # max |N-process - reference| / max |reference|
    noise: float  # the same between the noise run and the reference
    tol: float

    @property
    def ok(self) -> bool:
        return self.diff <= self.tol

    @property
    def ratio(self) -> float:
        return self.diff / self.tol if self.tol > 0 else math.inf


@dataclass
class CheckReport:
    world: int
    steps: int
    dtype: str
    noise_run: str
    tensors: list[TensorDiff]
    coverage: dict
    notes: list[str] = field(default_factory=list)
    error: str = ""

    @property
    def worst(self) -> TensorDiff | None:
        return max(self.tensors, key=lambda t: t.ratio) if self.tensors else None

    @property
    def passed(self) -> bool:
        return not self.error and all(t.ok for t in self.tensors) and self.coverage.get("ok", False)

    def to_dict(self) -> dict:
        worst = self.worst
        return {
            "passed": self.passed,
            "world_size": self.world,
            "steps": self.steps,
            "dtype": self.dtype,
            "noise_run": self.noise_run,
            "noise_factor": NOISE_FACTOR,
            "floor": FLOOR[self.dtype],
            "worst": dataclasses.asdict(worst) if worst else None,
            "max_abs_rel_diff": max((t.diff for t in self.tensors), default=0.0),
            "tensors": [dataclasses.asdict(t) | {"ok": t.ok} for t in self.tensors],
            "coverage": self.coverage,
            "notes": self.notes,
            "error": self.error,
        }

    def text(self) -> str:
        lines = [f"ddpkit check: {self.world} processes against 1, {self.steps} steps, {self.dtype}"]
        if self.error:
            lines.append(f"  FAILED: {self.error}")
        worst = self.worst
        if worst is not None:
            bad = [t for t in self.tensors if not t.ok]
            lines.append(
                f"  weights: {len(self.tensors) - len(bad)} of {len(self.tensors)} tensors within tolerance "
                f"(tolerance = max({NOISE_FACTOR:g} x rounding noise, {FLOOR[self.dtype]:g}); noise from "
                f"{self.noise_run})"
            )
            largest = max(self.tensors, key=lambda t: t.diff)
            lines.append(
                f"  largest difference: {largest.diff:.3g} relative ({largest.name}); worst against its "
                f"tolerance: {worst.name} ({worst.diff:.3g} vs {worst.tol:.3g}, noise {worst.noise:.3g})"
            )
            for t in sorted(bad, key=lambda t: -t.ratio)[:20]:
                lines.append(f"  DIVERGED: {t.name}: {t.diff:.3g} relative, tolerance {t.tol:.3g}")
            if len(bad) > 20:
                lines.append(f"  ... and {len(bad) - 20} more diverged (all of them in --json)")
        for line in self.coverage.get("lines", []):
            lines.append(f"  data: {line}")
        for note in self.notes:
            lines.append(f"  note: {note}")
        if self.passed:
            lines.append(f"PASSED: {self.world} processes compute what 1 process does")
        elif any(n.startswith("BatchNorm without SyncBN") for n in self.notes):
            lines.append(f"FAILED: {self.world} processes differ from 1, as expected for BatchNorm without SyncBN")
        else:
            lines.append(f"FAILED: {self.world} processes do not compute what 1 process does")
        return "\n".join(lines)


def compare(reference: dict, other: dict, noise: dict, dtype: str) -> list[TensorDiff]:
    """Every tensor of ``other`` against ``reference``, with its tolerance from ``noise``."""
    out = []
    for name, ref in reference.items():
        diffs = []
        for t in (other[name], noise[name]):
            if not ref.is_floating_point():
                diffs.append(0.0 if torch.equal(ref, t) else math.inf)
                continue
            a, b = ref.double(), t.double()
            scale = max(a.abs().max().item(), b.abs().max().item(), 1e-300) if a.numel() else 1.0
            diffs.append((a - b).abs().max().item() / scale if a.numel() else 0.0)
        out.append(TensorDiff(name, diffs[0], diffs[1], max(NOISE_FACTOR * diffs[1], FLOOR[dtype])))
    return out


def check(
    model: nn.Module | Callable[[], nn.Module] | None = None,
    train_data=None,
    test_data=None,
    *,
    config: TrainConfig | None = None,
    nproc: int = 2,
    steps: int = 5,
    loss_fn: Callable | None = None,
    metrics: Mapping[str, Callable] | None = None,
    meta=None,
    collate_fn: Callable | None = None,
    batch_size: int | None = None,
    device: str | None = None,
    sync_bn: bool | None = None,
    dtype: str | None = None,
    work_dir: str | Path | None = None,
) -> CheckReport:
    """Check that ``nproc`` processes train ``model`` as one process does (see the module docstring).

    ``model`` is a module or a function returning one (None: the config's registry model);
    ``train_data``/``test_data`` the datasets (None: the config's; test_data defaults to
    train_data). ``batch_size`` (global) and ``device`` override the config's (any other
    setting goes in ``config=TrainConfig(...)``). ``sync_bn`` None turns SyncBN on for a model
    with BatchNorm. ``dtype`` None is float64 on CPU where the model runs in it, else the config's.
    """

    if nproc < 2:
        raise ConfigError(f"check compares N processes with 1: --nproc must be at least 2, got {nproc}")
    if steps < 1:
        raise ConfigError(f"--steps must be at least 1, got {steps}")
    base = config or TrainConfig()
    overrides = {k: v for k, v in (("batch_size", batch_size), ("device", device)) if v is not None}
    base = dataclasses.replace(base, **overrides)
    if callable(model) and not isinstance(model, nn.Module):
        model = model()
    # --model/--dataset pkg.module:function: built once here, every run below starts from the same objects
    base, model, train_data, test_data, meta, collate_fn = as_objects(
        base, model, train_data, test_data, meta, collate_fn
    )
    batch = base.resolved().batch_size
    if batch % nproc:
        raise ConfigError(
            f"--batch-size {batch} (global) must divide by --nproc {nproc} for the N-process run to "
            f"see the same global batch; use {batch - batch % nproc or nproc} or {batch + nproc - batch % nproc}"
        )
    if test_data is None and train_data is not None:
        test_data = train_data
    notes: list[str] = []
    probe = Trainer(
        dataclasses.replace(base, nproc="1"),
        model=model,
        train_data=train_data,
        test_data=test_data,
        meta=meta,
        loss_fn=loss_fn,
        metrics=metrics,
        collate_fn=collate_fn,
    )
    if model is None:  # the registry model, built here so that every run starts from the same weights
        cfg = probe.config.resolved()
        torch.manual_seed(cfg.seed)
        model = model_for(cfg, load_dataset(cfg).meta)
    model = without_dropout(copy.deepcopy(model), notes)
    has_bn = any(isinstance(m, nn.modules.batchnorm._BatchNorm) for m in model.modules())
    if sync_bn is None:
        sync_bn = has_bn or base.sync_bn
        if has_bn and not base.sync_bn:
            notes.append(
                "BatchNorm: checked with --sync-bn, without which each rank normalises over its own "
                "B/N samples and N processes differ from 1 (see it with --no-sync-bn)"
            )
    elif has_bn and not sync_bn:
        notes.append(
            "BatchNorm without SyncBN: each rank normalises over its own B/N samples, so the N-process run "
            "is expected to differ from 1 process; --sync-bn makes them equal"
        )
    task = probe._task(probe.config)
    batch = sample_batch(probe.splits) if probe.splits is not None else None  # two samples, as training sees them
    device = resolve_device_type(base.device)
    if dtype is None:
        dtype = "float64" if device == "cpu" and runs_in_float64(model, task, batch) else base.dtype
        if dtype != "float64" and device == "cpu":
            notes.append(
                "the model does not run in float64, so the check is in float32 and its tolerance is "
                "rounding noise measured in float32"
            )
    unused = unused_parameters(model, task, batch)
    if unused:
        notes.append(
            f"parameters that get no gradient: {', '.join(unused[:5])}{' ...' if len(unused) > 5 else ''}; "
            f"DDP fails on them at the second step unless they are removed or used"
        )

    work = Path(work_dir) if work_dir else Path(tempfile.mkdtemp(prefix="ddpkit-check-"))  # removed below
    common = dict(
        max_steps=steps,
        epochs=max(base.epochs, steps),
        log_every=steps,
        progress=False,
        quiet=True,
        resume="never",
        plots=False,
        log="",  # its own short runs in a temporary dir: nothing to look at
        sync_bn=sync_bn,
        dtype=dtype,
        amp="none",
        ema=0.0,
        save_every_steps=0,
        max_restarts=0,
        nnodes=1,
    )
    cfg = dataclasses.replace(base, **common)
    noise_cfg, noise_run = noise_config(cfg, model, has_bn)
    runs = {
        "reference": dataclasses.replace(cfg, nproc="1"),
        "noise": dataclasses.replace(noise_cfg, nproc="1"),
        "test": dataclasses.replace(cfg, nproc=str(nproc)),
    }
    weights, coverage, error = {}, {"ok": False, "lines": []}, ""
    try:
        for name, run_cfg in runs.items():
            trainer = Trainer(
                dataclasses.replace(run_cfg, run_dir=str(work / name)),
                model=copy.deepcopy(model),
                train_data=train_data,
                test_data=test_data,
                meta=meta,
                loss_fn=loss_fn,
                metrics=metrics,
                collate_fn=collate_fn,
            )
            result = trainer.fit()
            weights[name] = read_weights(RunFiles(result.run_dir).model)
            if name == "test":
                coverage = data_coverage(trainer, nproc)
    except (DdpkitError, WorkersFailed) as exc:
        # A run that fails in its workers is the check's finding, said with the notes that explain it
        # (DDP on unused parameters, say); a mistake in the input is the user's, said as for train.
        if isinstance(exc, (ConfigError, DataError, TaskError, RunDirError)):
            raise
        error = str(exc)
    finally:
        if not work_dir:
            shutil.rmtree(work, ignore_errors=True)
    tensors = compare(weights["reference"], weights["test"], weights["noise"], dtype) if len(weights) == 3 else []
    return CheckReport(nproc, steps, dtype, noise_run, tensors, coverage, notes, error)


def without_dropout(model: nn.Module, notes: list[str]) -> nn.Module:
    """``model`` with its dropout off, noted: each rank draws its masks from its own seed (as it
    should), so with dropout N processes cannot equal 1."""
    dropouts = [n for n, m in model.named_modules() if isinstance(m, DROPOUT) and m.p > 0]
    if dropouts:
        for m in model.modules():
            if isinstance(m, DROPOUT):
                m.p = 0.0
        notes.append(
            f"rank-dependent randomness: {', '.join(dropouts[:3])}{' ...' if len(dropouts) > 3 else ''} "
            f"draw their masks from each rank's own seed (allowed: ranks should not drop the same units), "
            f"so N processes cannot equal 1; checked with dropout off"
        )
    return model


def noise_config(cfg: TrainConfig, model: nn.Module, has_bn: bool) -> tuple[TrainConfig, str]:
    """The 1-process run that differs from the reference in rounding only, and what it is."""
    if any(isinstance(m, nn.Conv2d) for m in model.modules()):
        return (
            dataclasses.replace(cfg, channels_last=not (cfg.channels_last is None or cfg.channels_last)),
            "1 process in the other memory format (NCHW/NHWC)",
        )
    if not has_bn:
        return dataclasses.replace(
            cfg, grad_accum=2 * cfg.grad_accum
        ), "1 process with the batch as 2 accumulated halves"
    return cfg, "1 process, run again"  # half-batches would change BatchNorm's statistics, not just the rounding


def runs_in_float64(model: nn.Module, task, batch) -> bool:
    """Whether ``model`` in float64 takes ``batch`` in float64 through ``task`` (some models hard-code
    float32). No batch (a registry dataset and model): they do."""

    if batch is None:
        return True
    batch = tree_map(lambda t: t.double() if t.is_floating_point() else t, batch)
    try:
        with torch.no_grad():
            task.evaluate(copy.deepcopy(model).double().eval(), batch)
    except Exception:
        return False
    return True


def unused_parameters(model: nn.Module, task, batch) -> list[str]:
    """Parameters that one training step on ``batch`` leaves without a gradient (DDP's "unused parameters")."""
    if batch is None:
        return []
    probe = copy.deepcopy(model).train()
    try:
        loss, _ = task.loss(probe, batch)
        loss.backward()
    except Exception:
        return []  # the runs themselves report what fails
    return [n for n, p in probe.named_parameters() if p.requires_grad and p.grad is None]


def data_coverage(trainer, nproc: int) -> dict:
    """Run :func:`coverage_worker` on ``nproc`` ranks with the trainer's data and config."""

    cfg = trainer.config.resolved()
    cfg = dataclasses.replace(cfg, nproc=str(nproc))
    splits = trainer.splits
    if splits is None:
        splits = load_dataset(cfg)
    return run_workers(
        coverage_worker, (Job(cfg, trainer._task(cfg), None, splits),), LaunchSpec.from_config(cfg, resumable=False)
    )


def coverage_worker(job) -> dict:
    """On every rank: the sample indices the engine's own sources feed it, gathered and counted."""

    cfg = job.cfg
    with distributed(cfg.device, cfg.timeout_s) as ctx:
        train_src, eval_src = make_sources(job.splits, cfg, ctx)
        n_train, n_test = len(job.splits.train), len(job.splits.test)
        # --join: the ranks' shares differ by one sample; -1 pads the shorter ones for the gather
        width_train = -(-n_train // ctx.world_size)
        epochs = [ctx.all_gather(_padded(train_src.epoch_indices(e), width_train).to(ctx.device)).cpu() for e in (0, 1)]
        own = torch.tensor(list(eval_src.indices), dtype=torch.long)
        test = ctx.all_gather(_padded(own, -(-n_test // ctx.world_size)).to(ctx.device)).cpu()
    return coverage_verdict(epochs, test, n_train, n_test, cfg.batch_size)


def _padded(indices: torch.Tensor, width: int) -> torch.Tensor:
    out = torch.full((width,), -1, dtype=torch.long)
    out[: len(indices)] = indices
    return out


def coverage_verdict(
    epochs: list[torch.Tensor], test: torch.Tensor, n_train: int, n_test: int, global_batch: int
) -> dict:
    """Count each sample over all ranks: ``epochs`` are [world, indices] per epoch, ``test`` [world, shard]."""
    lines, ok = [], True
    for e, idx in enumerate(epochs):
        counts = torch.bincount(idx[idx >= 0], minlength=n_train)
        twice, seen = int((counts > 1).sum()), int((counts > 0).sum())
        dropped = n_train - seen
        if twice:
            ok = False
            lines.append(f"epoch {e}: {twice} training samples are used more than once across the ranks")
        elif dropped >= global_batch:
            ok = False
            lines.append(
                f"epoch {e}: {dropped} of {n_train} training samples are never used, more than the last "
                f"partial global batch ({global_batch})"
            )
        elif e == 0:
            lines.append(
                f"every training sample is used {'exactly once' if not dropped else 'at most once'} per "
                f"epoch across the ranks"
                + (
                    f" (drop-last: the last {dropped} of {n_train} fall in a partial "
                    f"global batch of {global_batch} and are left out)"
                    if dropped
                    else ""
                )
            )
    if len(epochs) > 1 and epochs[0].numel() > 1 and torch.equal(epochs[0], epochs[1]):
        ok = False
        lines.append("epochs 0 and 1 use the same order: the sampler is not told the epoch (set_epoch)")
    elif len(epochs) > 1:
        lines.append("each epoch draws a new order (set_epoch)")
    valid = test[test >= 0]
    counts = torch.bincount(valid, minlength=n_test)
    if valid.numel() != n_test or bool((counts != 1).any()):
        ok = False
        lines.append(
            f"the test shards count {valid.numel()} samples for a test set of {n_test}: "
            f"{int((counts == 0).sum())} missed, {int((counts > 1).sum())} counted twice"
        )
    else:
        lines.append(f"every one of the {n_test} test samples is evaluated exactly once (no padding)")
    return {"ok": ok, "lines": lines}
