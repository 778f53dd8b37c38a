"""``ddpkit check``: do N processes compute what 1 process does, on your model and data?

    report = check(model, train_data, test_data, nproc=2, steps=5, loss_fn=...)   # or model=None: the config's
    report.passed, report.worst, print(report.text())

Short runs of the same engine, from the same initial weights, seed and global sample
order: the reference (1 process, global batch B), a noise run (1 process, the same steps in
another float order: the other memory format for conv nets, else each global batch's samples
in another order, never another split of the batch, which would share what N processes change
for a model that couples its samples), and the run under test (N processes, B/N each). Every
parameter and buffer of the N-process run is compared with the reference, relative to the
tensor's own scale; the noise run says how far rounding alone moves each tensor. A tensor
passes when it differs by at most ``NOISE_FACTOR`` times its noise, or ``FLOOR[dtype]``,
whichever is larger.

On CPU the runs are in float64 where the model allows it: rounding noise is then ~1e-16
relative and a real divergence (BatchNorm statistics per rank, rank-dependent noise, a data
order bug) stands out by ten orders of magnitude. In float32 the noise is larger and uneven:
a BatchNorm bias's gradient is a sum over the whole batch that nearly cancels, so the order
of that sum (NCHW or NHWC kernels, one or two ranks) moves it by ~1e-3 of itself after one
step while the weights move by ~1e-7. The per-tensor noise run keeps that tensor's tolerance
wide and every other tensor's tight, and the report prints both.

The noise run must measure rounding, not randomness, so every random draw ddpkit can reach is
switched off first (:func:`without_randomness`: dropout modules and layers' dropout arguments).
What remains is detected twice, and makes the verdict INCONCLUSIVE, never PASSED: before any run,
two training steps of copies that differ only in the generators' seeds (:func:`randomness_probe`,
which also names the modules whose forward drew); and a fourth run, the reference again with its
generators seeded apart (:class:`OtherDraws`), which on CPU is bitwise the reference unless a
draw reaches the weights (a draw from the second step on, or one the probe's batch missed).

It also checks, on the real dataset and world size, that each rank's epoch order covers the
training set at most once per epoch (exactly once unless the last partial batch is dropped),
that two epochs differ in order (``set_epoch``), and that the test shards count every test
sample exactly once. And it explains what makes a model unfit for DDP: parameters that get
no gradient, BatchNorm without SyncBN, and rank-dependent randomness (dropout).

Verdicts: PASSED, FAILED (a tensor beyond its tolerance, a data-coverage fault, a run that
failed), INCONCLUSIVE (randomness it could not switch off); the CLI exits 0, 1 and 3.
"""

from __future__ import annotations

import copy
import dataclasses
import math
import random
import shutil
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Mapping

import numpy as np
import torch
from torch import nn
from torch.utils.data import IterableDataset, default_collate

from ..config import TrainConfig
from ..data import DataSplits, ImageData, TensorData, load_dataset
from ..data.batch import tensor_leaves, tree_map
from ..data.draws import batched_reader, read_samples
from ..data.loader import make_sources
from ..data.seeds import seed_all, seed_batch, seed_generators, seed_weights, train_keys
from ..data.stream import first_items
from ..device import resolve_device_type
from ..errors import (
    ConfigError,
    DataError,
    DdpkitError,
    RunDirError,
    TaskError,
    WorkersFailed,
)
from ..importpath import generators_kept
from ..models import model_for
from ..preflight import sample_batch, task_for
from ..ranks.context import distributed
from ..ranks.launcher import LaunchSpec, run_workers
from ..run.checkpoint import read_weights
from ..run.paths import RunFiles
from ..train.workers import Job
from ..trainer import Trainer, as_objects

NOISE_FACTOR = 10.0
FLOOR = {"float64": 1e-12, "float32": 1e-5}  # relative: ~4500 and ~80 ulps of the tensor's largest value
DROPOUT = nn.modules.dropout._DropoutNd  # Dropout, Dropout1d/2d/3d, AlphaDropout, FeatureAlphaDropout


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
    inconclusive: list[str] = field(default_factory=list)  # why no verdict on the weights can be given
    seeds_diff: float | None = None  # the largest difference the seeds run made: 0 on CPU without randomness
    strategy: str = "ddp"  # the N-process run's (--strategy)
    against: str = "1 process"  # what it is compared with: "1 process", and DDP at N under FSDP2

    @property
    def worst(self) -> TensorDiff | None:
        return max(self.tensors, key=lambda t: t.ratio) if self.tensors else None

    @property
    def verdict(self) -> str:
        """PASSED, FAILED or INCONCLUSIVE. A data-coverage failure or a failed run is FAILED whatever
        else is found; randomness ddpkit cannot switch off makes the weights' comparison meaningless
        (INCONCLUSIVE), however small or large their differences."""
        if self.error or not self.coverage.get("ok", False):
            return "FAILED"
        if self.inconclusive:
            return "INCONCLUSIVE"
        return "PASSED" if self.tensors and all(t.ok for t in self.tensors) else "FAILED"

    @property
    def passed(self) -> bool:
        return self.verdict == "PASSED"

    @property
    def exit_code(self) -> int:
        """The CLI's exit status: 0 PASSED, 1 FAILED, 3 INCONCLUSIVE (2 is a user error, as for every command)."""
        return {"PASSED": 0, "FAILED": 1, "INCONCLUSIVE": 3}[self.verdict]

    def to_dict(self) -> dict:
        worst = self.worst
        return {
            "verdict": self.verdict,
            "passed": self.passed,
            "inconclusive": self.inconclusive,
            "randomness_tol": FLOOR[self.dtype],
            "seeds_max_rel_diff": self.seeds_diff,
            "world_size": self.world,
            "steps": self.steps,
            "dtype": self.dtype,
            "noise_run": self.noise_run,
            "strategy": self.strategy,
            "against": self.against,
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
        under = " under FSDP2" if self.strategy == "fsdp2" else ""
        lines = [
            f"ddpkit check: {self.world} processes{under} against {self.against}, {self.steps} steps, {self.dtype}"
        ]
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
        for reason in self.inconclusive:
            lines.append(f"  not deterministic under ddpkit's control: {reason}")
        if self.verdict == "INCONCLUSIVE":
            lines.append(
                f"INCONCLUSIVE: the model's training step is random beyond what ddpkit switches off, so "
                f"{self.world} processes cannot be compared with 1; make the draw depend on a seed you pass, "
                f"or switch it off in training for the check"
            )
        elif self.passed:
            lines.append(f"PASSED: {self.world} processes{under} compute what {self.against} computes")
        elif any(n.startswith("BatchNorm without SyncBN") for n in self.notes):
            lines.append(f"FAILED: {self.world} processes differ from 1, as expected for BatchNorm without SyncBN")
        else:
            lines.append(f"FAILED: {self.world} processes do not compute what 1 process does")
        return "\n".join(lines)


def compare(reference: dict, other: dict, noise: dict, dtype: str, target: dict | None = None) -> list[TensorDiff]:
    """Every tensor of ``other`` against ``target`` (default ``reference``), with its tolerance from how far
    ``noise`` is from ``reference`` (the 1-process runs: rounding alone)."""
    out = []
    for name, ref in reference.items():
        diffs = [_relative((target or reference)[name], other[name]), _relative(ref, noise[name])]
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
    # the registry dataset too, for the two samples the probes below run on
    splits = probe.splits if probe.splits is not None else load_dataset(probe.config.resolved())
    if model is None:  # the registry model, built here so that every run starts from the same weights
        cfg = probe.config.resolved()
        seed_weights(cfg.seed)
        model = model_for(cfg, splits.meta)
    model = without_randomness(copy.deepcopy(model), notes)
    has_bn = any(isinstance(m, nn.modules.batchnorm._BatchNorm) for m in model.modules())
    fsdp2 = base.strategy == "fsdp2"
    if fsdp2 and has_bn and not sync_bn:  # FSDP2 has no SyncBN (config.FSDP2_REFUSED)
        sync_bn = False
        notes.append(
            "BatchNorm under FSDP2, which has no SyncBN: each rank normalises over its own B/N samples, so FSDP2 "
            "at N processes is held to DDP at N (which does the same), not to 1 process"
        )
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
    task = task_for(probe.config, probe.splits, probe.loss_fn, probe.metrics)
    batch = sample_batch(splits)  # two samples, as training sees them
    device = resolve_device_type(base.device)
    if dtype is None:
        dtype = "float64" if device == "cpu" and runs_in_float64(model, task, batch) else base.dtype
        if dtype != "float64" and device == "cpu":
            notes.append(
                "the model does not run in float64, so the check is in float32 and its tolerance is "
                "rounding noise measured in float32"
            )
    randomness = randomness_probe(model, task, batch, dtype)
    drawn = data_draws(splits)
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
        replicas=1,
        sample_log=False,
        nnodes=1,
    )
    cfg = dataclasses.replace(base, **common)
    cfg, noise_cfg, noise_run = noise_config(cfg, model)
    # Under --strategy fsdp2 the 1-process runs are plain (DDP's: no wrapper at world 1), and FSDP2 at N is
    # compared with them and with DDP at N
    one = {"strategy": "ddp"} if fsdp2 else {}
    runs = {
        "reference": dataclasses.replace(cfg, nproc="1", **one),
        "seeds": dataclasses.replace(cfg, nproc="1", **one),  # the reference again, its generators seeded apart
        "noise": dataclasses.replace(noise_cfg, nproc="1", **one),
        "test": dataclasses.replace(cfg, nproc=str(nproc)),
        **({"ddp": dataclasses.replace(cfg, nproc=str(nproc), strategy="ddp")} if fsdp2 else {}),
    }
    if randomness is not None or drawn:  # no verdict on the weights can be given: only the data coverage is checked
        runs = {"test": runs["test"]}
    weights, coverage, error = {}, {"ok": False, "lines": []}, ""
    try:
        for name, run_cfg in runs.items():
            run_model = copy.deepcopy(model)
            if name == "seeds":
                run_model.register_forward_pre_hook(OtherDraws())
            trainer = Trainer(
                dataclasses.replace(run_cfg, run_dir=str(work / name)),
                model=run_model,
                train_data=train_data,
                test_data=test_data,
                meta=meta,
                loss_fn=loss_fn,
                metrics=metrics,
                collate_fn=collate_fn,
            )
            if randomness is None:
                weights[name] = read_weights(RunFiles(trainer.fit().run_dir).model)
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
    tensors = []
    if len(weights) == len(runs) and "reference" in weights:
        if not (fsdp2 and has_bn):  # N processes against 1 (BatchNorm without SyncBN computes something else)
            tensors = compare(weights["reference"], weights["test"], weights["noise"], dtype)
        if fsdp2:  # FSDP2 against DDP, both at N, each tensor held to its rounding noise at 1 process
            vs_ddp = compare(weights["reference"], weights["test"], weights["noise"], dtype, target=weights["ddp"])
            tensors += [dataclasses.replace(t, name=f"{t.name} (vs DDP at {nproc})") for t in vs_ddp]
    inconclusive = [randomness.describe()] if randomness is not None else []
    inconclusive += [drawn] if drawn else []
    seeds_diff = None
    if len(weights) == len(runs) and "seeds" in weights:
        # The same run with other seeds: on CPU bitwise the same unless a draw reaches the weights. On
        # a GPU nondeterministic kernels (atomics) move it too, by rounding: there the limit is each
        # tensor's own tolerance, so randomness shows only where it exceeds what rounding does.
        seeded = compare(weights["reference"], weights["seeds"], weights["seeds"], dtype)
        seeds_diff = max((t.diff for t in seeded), default=0.0)
        tolerance = compare(weights["reference"], weights["noise"], weights["noise"], dtype)  # each tensor's own
        limit = {t.name: FLOOR[dtype] if device == "cpu" else t.tol for t in tolerance}
        moved = sorted((t for t in seeded if t.diff > limit[t.name]), key=lambda t: -t.diff)
        if moved:
            names = ", ".join(f"{t.name} ({t.diff:.2g})" for t in moved[:4])
            bound = f"{FLOOR[dtype]:g} relative" if device == "cpu" else "its rounding tolerance"
            inconclusive.append(
                f"the 1-process run repeated with torch's, numpy's and Python's generators seeded apart moved "
                f"{len(moved)} tensor(s) by more than {bound}: {names}"
                f"{' ...' if len(moved) > 4 else ''}; a random draw ddpkit did not switch off reaches the weights "
                f"(after the first step, or from a module it could not see)"
            )
    against = f"DDP at {nproc}" if fsdp2 and has_bn else f"1 process and DDP at {nproc}" if fsdp2 else "1 process"
    return CheckReport(
        nproc,
        steps,
        dtype,
        noise_run,
        tensors,
        coverage,
        notes,
        error,
        inconclusive,
        seeds_diff,
        base.strategy if fsdp2 else "ddp",
        against,
    )


def data_draws(splits: DataSplits) -> str | None:
    """What makes the training data differ between 1 and N processes, if reading it draws random numbers
    that are not keyed by sample: its first samples read twice as the DataLoader path reads them, then
    collated twice, with torch's, numpy's and Python's generators seeded apart around each. A map-style
    dataset's ``__getitem__`` draws under each sample's own seeds (seed, epoch, sample: ``data/seeds.py``),
    the same at any world size, so those reads agree; a ``collate_fn`` (or a dataset's own batched
    ``__getitems__``) draws under the batch's (seed, epoch, rank, batch), and N processes cut other batches
    than 1; an IterableDataset's draws follow its shards, and a generator the dataset keeps itself is
    reached by no seed. None: both reads, and both collates, were the same."""
    data = splits.train
    if isinstance(data, (ImageData, TensorData)) and splits.collate_fn is None:
        return None  # indexed in memory: augmented (if at all) by sample index, never through a DataLoader
    stream = isinstance(data, IterableDataset)
    n = 4 if stream else min(4, len(data))
    batch_key, sample_key = train_keys(0, 0, 0)
    reads, collated = [], []
    with generators_kept():
        for other in (1, 2):  # the batch's key differs between the reads, as between 1 and N processes
            seed_generators((other,))
            reads.append(
                first_items(data, n) if stream else read_samples(data, range(n), sample_key, (*batch_key, other))
            )
        for other in (1, 2):
            seed_batch((*batch_key, other))
            collated.append((splits.collate_fn or default_collate)(reads[0]))
    if not _same(reads[0], reads[1]):
        why = (
            "an IterableDataset's follow its shards"
            if stream
            else "the dataset's own __getitems__ reads a batch at once, under each rank's batch's seeds"
            if batched_reader(data) is not None
            else "from a generator the dataset keeps itself, which ddpkit does not seed"
        )
        return (
            f"reading the training data draws random numbers not keyed by sample ({why}): N processes train on "
            f"other numbers than 1"
        )
    if not _same(collated[0], collated[1]):
        return (
            "reading the training data draws random numbers in its collate_fn, each rank's for its own batch "
            "(seed, epoch, rank, batch): N processes, which cut the global batch into other batches, train on "
            "other numbers than 1"
        )
    return None


def _same(a, b) -> bool:
    """Whether two reads of the data hold the same tensors (the same structure, shapes and values)."""
    ta, tb = tensor_leaves(a), tensor_leaves(b)
    return len(ta) == len(tb) and all(x.shape == y.shape and torch.equal(x, y) for x, y in zip(ta, tb))


def without_randomness(model: nn.Module, notes: list[str]) -> nn.Module:
    """``model`` with every dropout ddpkit can reach switched off, noted: each rank draws its masks
    from its own seed (as it should), so with dropout N processes cannot equal 1.

    Reached: dropout modules (``p``), and a layer's own dropout argument kept as a float attribute
    whose name says so: ``nn.MultiheadAttention.dropout`` (and so every transformer layer's
    attention), ``nn.RNN/LSTM/GRU.dropout``, timm's ``DropPath.drop_prob``, Hugging Face's
    ``attention_dropout``, a minGPT-style ``self.dropout`` passed to ``scaled_dot_product_attention``.
    A constant in the forward (``F.dropout(x, 0.1)``, ``torch.rand``) is out of reach:
    :func:`randomness_probe` finds it."""
    off = []
    for name, m in model.named_modules():
        if isinstance(m, DROPOUT) and m.p > 0:
            m.p = 0.0
            off.append(name or type(m).__name__)
        for attr, value in list(vars(m).items()):
            if "drop" in attr.lower() and type(value) is float and 0 < value <= 1:
                setattr(m, attr, 0.0)
                off.append(f"{name}.{attr}" if name else attr)
    if off:
        notes.append(
            f"rank-dependent randomness: {', '.join(off[:4])}{f' and {len(off) - 4} more' if len(off) > 4 else ''} "
            f"draw their masks from each rank's own seed (allowed: ranks should not drop the same units), "
            f"so N processes cannot equal 1; checked with dropout off"
        )
    return model


@dataclass
class Randomness:
    """What :func:`randomness_probe` found: parameters whose gradient moved when only the random
    generators' seeds changed, and the modules whose forward drew from a generator."""

    moved: list[tuple[str, float]]  # (tensor name, max relative difference)
    sources: list[str]

    def describe(self) -> str:
        names = ", ".join(f"{n} ({d:.2g})" for n, d in self.moved[:4])
        more = f" and {len(self.moved) - 4} more" if len(self.moved) > 4 else ""
        source = (
            "; ".join(self.sources[:3])
            if self.sources
            else "no module's forward advanced torch's, numpy's or Python's global generator (a generator "
            "of your own, or a draw outside the forward)"
        )
        return f"gradients change with the random seed alone: {names}{more}; likely source: {source}"


def _generator_states() -> tuple:
    """The global generators a forward may draw from: torch's CPU and CUDA ones, numpy's, Python's."""
    cuda = tuple(torch.cuda.get_rng_state_all()) if torch.cuda.is_available() and torch.cuda.is_initialized() else ()
    return torch.random.get_rng_state(), cuda, np.random.get_state(), random.getstate()


def _drew(before: tuple, after: tuple) -> list[str]:
    """The generators that moved between two :func:`_generator_states`."""
    names = []
    if not torch.equal(before[0], after[0]) or any(not torch.equal(a, b) for a, b in zip(before[1], after[1])):
        names.append("torch")
    if before[2][2] != after[2][2] or not np.array_equal(before[2][1], after[2][1]):  # position, key
        names.append("numpy")
    if before[3] != after[3]:
        names.append("Python's random")
    return names


def randomness_probe(model: nn.Module, task, batch, dtype: str) -> Randomness | None:
    """Whether a training-mode step of ``model`` on ``batch`` depends on anything but the weights and
    the data: two forward/backward passes on copies that differ only in the seeds of torch's, numpy's
    and Python's generators. On CPU the same computation twice is bitwise the same, so a gradient
    that moves by more than ``FLOOR[dtype]`` moved by a random draw. Forward hooks name the
    innermost modules whose forward advanced a global generator. None: nothing moved (or no batch)."""
    if batch is None:
        return None
    if dtype == "float64":
        batch = tree_map(lambda t: t.double() if t.is_floating_point() else t, batch)
    grads, draws, states = [], {}, {"before": {}, "after": {}}
    with generators_kept():
        for seed in (1, 2):
            probe = copy.deepcopy(model).train()
            if dtype == "float64":
                probe = probe.double()
            seed_all(seed)  # restored by generators_kept
            hooks = [_watch(name, m, draws, states) for name, m in probe.named_modules()] if seed == 1 else []
            try:
                loss, _ = task.loss(probe, batch)
                if seed == 1 and "" in states["after"]:  # after the model's forward: the loss's own draws
                    gens = _drew(states["after"][""], _generator_states())
                    if gens:
                        draws["the loss function"] = ("loss", gens)
                loss.backward()
            except Exception:
                return None  # the runs themselves report what fails
            finally:
                for pre, post in hooks:
                    pre.remove()
                    post.remove()
            grads.append(
                {"loss": loss.detach()} | {n: p.grad for n, p in probe.named_parameters() if p.grad is not None}
            )
    moved = []
    for name, g in grads[0].items():
        other = grads[1].get(name)
        diff = _relative(g, other) if other is not None else math.inf
        if diff > FLOOR[dtype]:
            moved.append((name, diff))
    if not moved:
        return None
    return Randomness(sorted(moved, key=lambda t: -t[1]), _sources(draws))


def _watch(name: str, module: nn.Module, draws: dict, states: dict):
    """Hooks that record in ``draws[name]`` which global generators ``module``'s forward advanced
    (and keep the states after it in ``states["after"]``, for the loss)."""

    def pre(m, args):
        states["before"][name] = _generator_states()

    def post(m, args, output):
        after = states["after"][name] = _generator_states()
        gens = _drew(states["before"].pop(name), after)
        if gens:
            draws[name] = (type(m).__name__, gens)

    return module.register_forward_pre_hook(pre), module.register_forward_hook(post)


def _sources(draws: dict) -> list[str]:
    """The innermost modules that drew (a parent is not named for its child's draw), then the loss."""
    out = []
    for name, (kind, gens) in sorted(draws.items()):
        if kind == "loss":
            continue
        inner = [d for d in draws if d != name and (name == "" or d.startswith(name + "."))]
        if not inner:
            out.append(f"{name or 'the model'} ({kind}) draws from {' and '.join(gens)} in its forward")
    if "the loss function" in draws:
        out.append(f"the loss function draws from {' and '.join(draws['the loss function'][1])}")
    return out


def _relative(a: torch.Tensor, b: torch.Tensor) -> float:
    """max |a - b| / max(|a|, |b|), in float64; integer tensors (counters) 0 if equal, else inf."""
    if a.shape != b.shape:
        return math.inf
    if not a.is_floating_point():
        return 0.0 if torch.equal(a, b) else math.inf
    a, b = a.double(), b.double()
    if not a.numel():
        return 0.0
    scale = max(a.abs().max().item(), b.abs().max().item(), 1e-300)
    return (a - b).abs().max().item() / scale


def noise_config(cfg: TrainConfig, model: nn.Module) -> tuple[TrainConfig, TrainConfig, str]:
    """The reference's config, and the 1-process run that differs from it in rounding only, and what it is.

    The noise run computes the very same steps in another float order, never on another split of
    the batch: a split (the batch as 2 accumulated halves, as it once was) shares what N processes
    change for a model that couples its batch's samples (batch statistics, a summed or max loss, a
    buffer updated from the batch), so the noise it measured grew with the very difference under
    test and the check passed models several percent off, a summed loss 96% (issue 33).

    A conv net runs in the other memory format (NCHW unless --channels-last is given; left to its
    default it resolves per model, and the noise run once got NCHW like its reference and measured
    no rounding at all). Any other model takes each step's global batch in another order of the
    same samples (``shuffle_in_batch``): every per-batch statistic and sum is the same set of
    numbers, added up in another order."""
    if any(isinstance(m, nn.Conv2d) for m in model.modules()):
        nhwc = bool(cfg.channels_last)
        return (
            dataclasses.replace(cfg, channels_last=nhwc),
            dataclasses.replace(cfg, channels_last=not nhwc),
            f"1 process in {'NCHW' if nhwc else 'NHWC'} instead of {'NHWC' if nhwc else 'NCHW'}",
        )
    return (
        cfg,
        dataclasses.replace(cfg, shuffle_in_batch=True),
        "1 process with each global batch's samples in another order",
    )


class OtherDraws:
    """A forward pre-hook for the seeds run: at the model's first training forward, seeds torch's,
    numpy's and Python's generators apart from the reference's, so a draw ddpkit did not switch off
    differs between the two otherwise identical runs."""

    SEED = 0x0DD5EED

    def __init__(self):
        self.done = False

    def __call__(self, module, args):
        if module.training and not self.done:  # eval-mode forwards before training are followed by its seeding
            self.done = True
            seed_all(self.SEED)


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
        coverage_worker,
        (Job(cfg, task_for(cfg, trainer.splits, trainer.loss_fn, trainer.metrics), None, splits),),
        LaunchSpec.from_config(cfg, resumable=False),
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
