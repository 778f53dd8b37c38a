"""Optimizer, learning-rate schedule, mixed precision and weight EMA, built from the config.

All schedules are per step (not per epoch) and are plain LambdaLR factors, so their
state is two integers and a resumed run continues on exactly the same curve.
"""

from __future__ import annotations

import inspect
import math

import torch
from torch import nn

from ..config import TrainConfig
from ..dist.context import DistContext
from ..errors import ConfigError

OPTIMIZERS = {"sgd": torch.optim.SGD, "adam": torch.optim.Adam, "adamw": torch.optim.AdamW}


def build_optimizer(
    model: nn.Module, cfg: TrainConfig, device: torch.device, zero: bool = False
) -> torch.optim.Optimizer:
    params = [p for p in model.parameters() if p.requires_grad]
    if cfg.optimizer == "sgd":
        kwargs = dict(
            lr=cfg.lr, momentum=cfg.momentum, nesterov=cfg.nesterov and cfg.momentum > 0, weight_decay=cfg.weight_decay
        )
    else:
        kwargs = dict(lr=cfg.lr, betas=(cfg.momentum, 0.999), weight_decay=cfg.weight_decay)
    # fused kernels on CUDA (one launch for all params; SGD, Adam and AdamW have them since torch
    # 2.4), foreach elsewhere; both are exact re-orderings of the same per-parameter update, so
    # results match the for-loop version to rounding.
    impl = {"fused": True} if device.type == "cuda" else {"foreach": True}
    if zero:
        # Each rank keeps the optimizer state of its own shard of the parameters and broadcasts
        # its updated shard; the update itself is the same arithmetic.
        from torch.distributed.optim import ZeroRedundancyOptimizer

        return ZeroRedundancyOptimizer(params, optimizer_class=OPTIMIZERS[cfg.optimizer], **kwargs, **impl)
    return OPTIMIZERS[cfg.optimizer](params, **kwargs, **impl)


def optimizer_state(opt: torch.optim.Optimizer, ctx: DistContext):
    """The optimizer's whole state for a snapshot. Called on every rank: ZeRO gathers its shards
    to global rank 0 (a collective), which alone returns them; the others return None."""
    from torch.distributed.optim import ZeroRedundancyOptimizer

    if not isinstance(opt, ZeroRedundancyOptimizer):
        return opt.state_dict()
    opt.consolidate_state_dict(to=0)
    return opt.state_dict() if ctx.rank == 0 else None


def check_owned(opt: torch.optim.Optimizer, model: nn.Module) -> None:
    """An optimizer passed in must be built on this model's parameters (else it would step others)."""
    owned = {id(p) for p in model.parameters()}
    if not all(id(p) in owned for group in opt.param_groups for p in group["params"]):
        raise ConfigError(
            "the optimizer passed to Trainer holds parameters that are not the model's; build it "
            "on model.parameters() of the model you pass, or pass a factory: optimizer=lambda model: ..."
        )


def user_optimizer(spec, model: nn.Module) -> torch.optim.Optimizer:
    """The user's optimizer: a factory ``fn(model)``, or an optimizer built on (a copy of) this
    model's parameters. A factory is called on the worker's final model (moved, converted)."""
    if isinstance(spec, torch.optim.Optimizer):
        check_owned(spec, model)
        return spec
    opt = spec(model)
    if not isinstance(opt, torch.optim.Optimizer):
        raise ConfigError(f"optimizer=... must return a torch.optim.Optimizer, got {type(opt).__name__}")
    return opt


def user_schedule(spec, opt: torch.optim.Optimizer, total_steps: int):
    """The user's LR schedule, stepped once per optimizer step: a factory ``fn(optimizer)`` or
    ``fn(optimizer, total_steps)``, or a scheduler built on the optimizer passed with it."""
    if hasattr(spec, "step") and hasattr(spec, "state_dict"):
        if getattr(spec, "optimizer", opt) is not opt:
            raise ConfigError(
                "the scheduler passed to Trainer is not built on the optimizer passed with it; "
                "pass both, or a factory: scheduler=lambda opt, total_steps: ..."
            )
        return spec
    params = [
        p for p in inspect.signature(spec).parameters.values() if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)
    ]
    return spec(opt, total_steps) if len(params) >= 2 else spec(opt)


class ScheduleFactor:
    """lr multiplier at a step. A callable object (not a lambda) so LambdaLR can save it."""

    def __init__(self, kind: str, total_steps: int, warmup_frac: float):
        self.kind, self.total = kind, max(1, total_steps)
        self.warmup = int(round((warmup_frac or 0.0) * self.total))

    def __call__(self, step: int) -> float:
        if self.kind == "constant":
            return 1.0
        if step < self.warmup:  # onecycle starts at lr/25 like torch's OneCycleLR; cosine at 0
            start = 1 / 25 if self.kind == "onecycle" else 0.0
            return start + (1 - start) * step / self.warmup
        frac = (step - self.warmup) / max(1, self.total - self.warmup)
        if self.kind == "onecycle":
            return max(0.0, 1.0 - frac)
        return 0.5 * (1 + math.cos(math.pi * min(1.0, frac)))


def build_schedule(opt: torch.optim.Optimizer, cfg: TrainConfig, total_steps: int) -> torch.optim.lr_scheduler.LambdaLR:
    return torch.optim.lr_scheduler.LambdaLR(opt, ScheduleFactor(cfg.schedule, total_steps, cfg.warmup_frac))


def lr_policy(cfg: TrainConfig, opt: torch.optim.Optimizer, user_optimizer: bool, sched, user_scheduler: bool) -> str:
    """The learning-rate policy in effect, in words, for the ``[start]`` line: whose optimizer at
    which lr, and what (if anything) changes that lr over the run."""
    # initial_lr: the lr before a scheduler's first factor (LRScheduler sets it on every group)
    rates = sorted({float(g.get("initial_lr", g["lr"])) for g in opt.param_groups})
    lr = "/".join(f"{r:g}" for r in rates)
    if user_optimizer:
        who = f"your {type(opt).__name__} at lr {lr}"
    else:
        beta = "momentum" if cfg.optimizer == "sgd" else "beta1"
        extra = " nesterov" if cfg.optimizer == "sgd" and cfg.nesterov and cfg.momentum else ""
        who = f"{cfg.optimizer} at lr {lr} ({beta} {cfg.momentum:g}{extra}, weight decay {cfg.weight_decay:g})"
    if user_scheduler:
        return f"{who}, your {type(sched).__name__} each step"
    if cfg.schedule == "constant":
        return f"{who}, constant"
    warm = f"{cfg.warmup_frac:g} of the steps" if cfg.warmup_frac else "no"
    shape = "then linear to 0" if cfg.schedule == "onecycle" else "then cosine to 0"
    return f"{who} as the peak, {cfg.schedule}: {warm} warm-up {shape}"


def changes(cfg: TrainConfig, applies_conv: bool) -> str:
    """What ddpkit does to the model's maths or numerics on top of what was given, in words, for
    the ``[start]`` line ("none" when nothing)."""
    said = []
    if cfg.dtype == "float64":
        said.append("float64 weights and inputs")
    if cfg.amp in ("bf16", "fp16"):
        said.append(f"{cfg.amp} autocast" + (" with GradScaler" if cfg.amp == "fp16" else ""))
    if cfg.sync_bn:
        said.append("SyncBatchNorm")
    if cfg.channels_last and applies_conv:
        said.append("channels_last")
    if cfg.clip_grad_norm:
        said.append(f"grad norm clipped to {cfg.clip_grad_norm:g}")
    if cfg.ema:
        said.append(f"weight EMA {cfg.ema:g} (eval uses it)")
    if cfg.task.startswith("classification"):
        if cfg.label_smoothing:
            said.append(f"label smoothing {cfg.label_smoothing:g}")
        if cfg.tta:
            said.append("flip TTA at eval")
    if cfg.comm_hook != "none":
        said.append(f"{cfg.comm_hook} gradient all-reduce")
    if cfg.compile:
        said.append("torch.compile")
    return ", ".join(said) or "none"


def autocast(cfg: TrainConfig, device: torch.device):
    if cfg.amp in (None, "none"):
        return torch.autocast(device.type, enabled=False)
    return torch.autocast(device.type, dtype=torch.bfloat16 if cfg.amp == "bf16" else torch.float16)


def build_scaler(cfg: TrainConfig, device: torch.device):
    """GradScaler for fp16 only: bf16 has fp32's exponent range and needs no loss scaling."""
    return torch.amp.GradScaler(device.type, enabled=cfg.amp == "fp16")


class EMA:
    """Exponential moving average of the weights (and a copy of the buffers), updated per step."""

    def __init__(self, model: nn.Module, decay: float):
        self.decay = decay
        self.module = _clone(model)
        self.params = [p for p in self.module.parameters()]
        self.src = [p for p in model.parameters()]

    @torch.no_grad()
    def update(self, model: nn.Module) -> None:
        torch._foreach_lerp_(self.params, [p.detach() for p in self.src], 1 - self.decay)
        for b_ema, b in zip(self.module.buffers(), model.buffers()):
            b_ema.copy_(b)

    def state_dict(self) -> dict:
        return self.module.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self.module.load_state_dict(state)


def _clone(model: nn.Module) -> nn.Module:
    import copy

    clone = copy.deepcopy(model)
    for p in clone.parameters():
        p.requires_grad_(False)
    return clone
