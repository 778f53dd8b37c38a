"""Named training recipes: values for every config field left as ``None``.

A recipe is a plain dict. ``--recipe auto`` picks one by dataset; explicit flags and
TOML values always win; the resolved values are what config.toml records.

| recipe | measured |
|---|---|
| mnist | see BENCHMARKS.md (>= 99.0% test accuracy in 2 epochs, CPU, 2 processes) |
| mnist-cpu-bf16 | mnist with bf16 autocast; ``auto`` picks it on CPUs with native bf16 (AVX512-BF16, AMX); see BENCHMARKS.md |
| cifar10-resnet9 | accuracy UNMEASURED: no CIFAR data on the machines it was built on |
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path
from typing import TYPE_CHECKING

from .device import resolve_device_type
from .errors import ConfigError
from .importpath import is_own

if TYPE_CHECKING:  # config.py imports this module: the type only, for readers and type checkers
    from .config import TrainConfig

# Fallbacks for anything no recipe sets.
BASE = dict(
    model="convnet",
    optimizer="sgd",
    lr=0.05,
    momentum=0.9,
    nesterov=True,
    weight_decay=5e-4,
    schedule="onecycle",
    warmup_frac=0.2,
    label_smoothing=0.0,
    ema=0.0,
    tta=False,
    batch_size=256,
    amp="none",
    full_lr_steps=0,
)

# The MNIST ConvNet of the DDP-with-MNIST notebook: Nesterov SGD with a short linear warm-up then linear decay
# to 0, peaking at lr 0.1 from 900 optimizer steps (make train-mnist runs 936) and at 0.1 x sqrt(steps / 900)
# below (full_lr_steps). At 0.1 a short run diverges in its first steps and ends near chance (2,000 images, batch
# 128, 15 steps: train loss 4.9, 11.7% test accuracy). Peaks tried on those images (plain loop, seed 0): the best
# were 0.02 at 15 and 45 steps and 0.05 at 150; 0.03 at 15 and 45 and 0.1 at 150 spiked the loss. The square
# root gives 0.013, 0.022, 0.041 there. Figures against plain Adam: BENCHMARKS.md, "Short runs".
MNIST = dict(
    model="convnet",
    batch_size=128,
    lr=0.1,
    weight_decay=5e-4,
    schedule="onecycle",
    warmup_frac=0.15,
    full_lr_steps=900,
)

RECIPES: dict[str, dict] = {
    "mnist": MNIST,
    # The same with bf16 autocast, for CPUs that have bf16 instructions; emulated elsewhere, bf16 is ~8x slower
    # (seed ConvNet, 100 images, one AVX2 thread: 74 ms fp32, 584 ms bf16).
    "mnist-cpu-bf16": {**MNIST, "amp": "bf16"},
    # Page-style ResNet-9 (DAWNBench): lr 0.4 per mean-loss batch of 512, linear up for the
    # first quarter then linear down, label smoothing 0.2, flip TTA at eval.
    "cifar10-resnet9": dict(
        model="resnet9",
        batch_size=512,
        lr=0.4,
        weight_decay=5e-4,
        schedule="onecycle",
        warmup_frac=0.25,
        label_smoothing=0.2,
        tta=True,
    ),
    "imagefolder": dict(model="resnet18", batch_size=128, lr=0.1, schedule="cosine", warmup_frac=0.05),
    "synthetic": dict(model="resnet9", batch_size=512, lr=0.4, schedule="onecycle"),
    "none": {},
}

# A built-in model given with --model that is not the recipe's own keeps the recipe, less what was
# tuned for that model. The SimpleCNN (plain Linear layers behind dropout) spikes and ends at chance
# at the resnet recipes' lr 0.1-0.4 (generated 4-class ImageFolder, 64 px, batch 128: loss 1.5 -> 245;
# at 0.02 it falls steadily to 1e-3): tests/api/test_fidelity.py trains it so.
BY_MODEL = {"cnn": dict(lr=0.02)}

AUTO = {
    "mnist": "mnist",
    "fashion-mnist": "mnist",
    "cifar10": "cifar10-resnet9",
    "cifar100": "cifar10-resnet9",
    "synthetic": "synthetic",
}


def pick(cfg: TrainConfig, flags: frozenset[str] | None = None) -> str:
    """The recipe ``cfg`` resolves to, from ``cfg`` and the CPU's feature ``flags`` (this
    machine's when not given; ``--device auto`` also asks whether CUDA is available). Only
    MNIST on a CPU depends on the flags."""
    if cfg.recipe != "auto":
        return cfg.recipe
    if cfg.dataset.startswith("imagefolder:"):
        return "imagefolder"
    name = AUTO.get(cfg.dataset, "none")
    # bf16 autocast is the recipe's choice for its own ConvNet, never for a model you pass in.
    own_model = is_own(cfg.model)
    if name == "mnist" and not own_model and cfg.dtype != "float64" and native_cpu_bf16(cfg.device, flags):
        return "mnist-cpu-bf16"
    return name


def native_cpu_bf16(device: str, flags: frozenset[str] | None = None) -> bool:
    """A CPU run on a CPU with bf16 instructions (where bf16 autocast is faster, not emulated)."""
    if resolve_device_type(device) != "cpu":
        return False
    flags = cpu_flags() if flags is None else flags
    return "avx512_bf16" in flags or "amx_bf16" in flags


# oneDNN ISAs without AVX512-BF16 or AMX: with oneDNN capped at one of these (ONEDNN_MAX_CPU_ISA, see
# oneDNN's "CPU Dispatcher Control"), its bf16 kernels are emulated whatever the CPU has.
ONEDNN_ISAS_WITHOUT_BF16 = frozenset(
    {"SSE41", "AVX", "AVX2", "AVX2_VNNI", "AVX2_VNNI_2", "AVX512_CORE", "AVX512_CORE_VNNI"}
)


def cpu_flags() -> frozenset[str]:
    """This x86 CPU's feature flags, less the bf16 ones when oneDNN is capped below them (empty
    where there is no /proc/cpuinfo: macOS, Windows)."""
    try:
        cpuinfo = Path("/proc/cpuinfo").read_text()
    except OSError:
        return frozenset()
    return parse_cpu_flags(cpuinfo, os.environ.get("ONEDNN_MAX_CPU_ISA", os.environ.get("DNNL_MAX_CPU_ISA", "")))


def parse_cpu_flags(cpuinfo: str, onednn_max_isa: str = "") -> frozenset[str]:
    """The feature flags of the first CPU listed in a /proc/cpuinfo text, less the bf16 ones
    when oneDNN is capped below them. x86 only: arm64's "Features" line is not read, since bf16
    autocast on arm CPUs is unmeasured here."""
    line = next((ln for ln in cpuinfo.splitlines() if ln.split(":")[0].strip() == "flags"), "")
    flags = frozenset(line.partition(":")[2].split())
    if onednn_max_isa.strip().upper() in ONEDNN_ISAS_WITHOUT_BF16:
        flags -= {"avx512_bf16", "amx_bf16"}
    return flags


def apply(cfg: TrainConfig, flags: frozenset[str] | None = None):
    """Return cfg with every ``None`` field filled from its recipe, then from BASE."""
    name = pick(cfg, flags)
    if name not in RECIPES:
        raise ConfigError(f"unknown recipe {name!r}; choose one of: auto, {', '.join(RECIPES)}")
    values = {**BASE, **RECIPES[name]}
    own_model = is_own(cfg.model)
    if cfg.channels_last is None:
        # NHWC pays off on both engines: cuDNN/tensor cores on CUDA, and oneDNN's NHWC kernels on
        # CPU (seed ConvNet fwd+bwd+step, batch 100, one thread: 29.3 ms NCHW vs 23.2 ms NHWC;
        # resnet9 batch 32: 582 vs 481 ms). The engine ignores it for models without convolutions.
        # A model you pass in keeps its memory format unless you ask (--channels-last). FSDP2 shards
        # contiguous parameters only (torch 2.14: "FSDP does not support non-contiguous parameters yet").
        values["channels_last"] = not own_model and cfg.strategy != "fsdp2"
    # The user's own optimizer or schedule (Python API) takes none of the built-in one's settings,
    # and the user's own optimizer runs at its own learning rate: no schedule unless one is asked
    # for (schedule=... in the config, or scheduler=...).
    if str(cfg.optimizer).startswith("custom:"):
        for key in ("lr", "momentum", "beta2", "nesterov", "weight_decay"):
            values.pop(key, None)
        values["schedule"] = "constant"
        if cfg.schedule is None:
            values.pop("warmup_frac", None)
    if str(cfg.schedule).startswith("custom:"):
        values.pop("warmup_frac", None)
    if cfg.model in BY_MODEL and cfg.model != values.get("model") and not str(cfg.optimizer).startswith("custom:"):
        values.update(BY_MODEL[cfg.model])
    # The recipe's peak scaled to the run's length (full_lr_steps) is ddpkit's choice of lr, made only where
    # ddpkit chooses it: an lr you give, your own optimizer or schedule, and --schedule constant run as asked.
    schedule = cfg.schedule if cfg.schedule is not None else values.get("schedule")
    if cfg.lr is not None or "lr" not in values or schedule not in ("onecycle", "cosine"):
        values["full_lr_steps"] = 0
    filled = {k: v for k, v in values.items() if getattr(cfg, k, 0) is None}
    return dataclasses.replace(cfg, recipe=name, **filled)
