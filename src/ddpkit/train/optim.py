"""Optimizer, learning-rate schedule, mixed precision and weight EMA, built from the config.

All schedules are per step (not per epoch) and are plain LambdaLR factors, so their
state is two integers and a resumed run continues on exactly the same curve. The built-in
schedule is a :class:`TableLR`: a LambdaLR whose learning rates are computed once, before the
run, so that a step of it is a table look-up (the same floats, and the same saved state).
"""

from __future__ import annotations

import inspect
import math
from array import array

import torch
from torch import nn

from ..config import TrainConfig
from ..errors import ConfigError
from ..ranks.context import DistContext

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
        beta2 = 0.999 if cfg.beta2 is None else cfg.beta2  # unset: torch's default
        kwargs = dict(lr=cfg.lr, betas=(cfg.momentum, beta2), weight_decay=cfg.weight_decay)
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


def lr_depends_on_total(cfg: TrainConfig, scheduler=None) -> str | None:
    """Why the lr at a step depends on the run's total steps, in words (None: it does not), so that a run
    trained longer would not be the run started with the longer horizon. A scheduler object of the user's
    is the same object at any horizon; a factory that takes ``total_steps`` is given the new total."""
    if scheduler is not None:
        if hasattr(scheduler, "step") and hasattr(scheduler, "state_dict"):
            return None
        params = [
            p
            for p in inspect.signature(scheduler).parameters.values()
            if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)
        ]
        return "your scheduler factory takes the total steps" if len(params) >= 2 else None
    if cfg.schedule == "constant":
        # the recipe's rule is off with --schedule constant (recipes.apply), unless a config file sets it
        return f"the lr is scaled for runs under {cfg.full_lr_steps} steps" if cfg.full_lr_steps else None
    return f"the {cfg.schedule} lr schedule spans the total steps"


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


class TableLR(torch.optim.lr_scheduler.LambdaLR):
    """A :class:`~torch.optim.lr_scheduler.LambdaLR` whose learning rates are looked up, not computed, per step.

    ``table[g][step]`` is param group ``g``'s lr after ``step`` scheduler steps (``last_epoch == step``),
    for ``step`` in ``0..steps``: exactly ``base_lr * lr_lambda(step)``, the float LambdaLR computes
    there, made once at construction (and again after :meth:`load_state_dict`). Each ``table[g]`` is
    an ``array('d')`` of Python floats' bits, so ``torch.frombuffer(table[g], dtype=torch.float64)``
    puts it on a device as it is (for a step captured in a CUDA graph, which cannot call Python).
    Past ``steps`` (a run that goes on after its schedule's end) the lr is computed as LambdaLR does.

    ``lr_lambda`` must be a pure function of the step (as :class:`ScheduleFactor` is). Everything else is
    LambdaLR's: ``get_last_lr()``, ``last_epoch``, the optimizer's ``initial_lr``, and the state dict,
    whose keys and values are LambdaLR's (a snapshot written with a LambdaLR loads into it and goes
    on along the same curve, and the other way round). Tensor learning rates take LambdaLR's own step.
    """

    table: tuple[array, ...] | None = None  # None until built, and for tensor learning rates
    _OWN = ("table", "_steps")  # attributes of this class only: never in the state dict

    def __init__(self, optimizer: torch.optim.Optimizer, lr_lambda, steps: int, last_epoch: int = -1):
        self._steps = max(0, int(steps))
        super().__init__(optimizer, lr_lambda, last_epoch)  # its first step(), before the table: LambdaLR's
        self._build()

    def _build(self) -> None:
        self.table = None
        if any(isinstance(v, torch.Tensor) for v in [*self.base_lrs, *(g["lr"] for g in self.optimizer.param_groups)]):
            return
        factors: dict[int, list[float]] = {}  # per distinct lambda (one, shared by every group, usually)
        columns = []
        for fn, base_lr in zip(self.lr_lambdas, self.base_lrs, strict=True):
            if id(fn) not in factors:
                factors[id(fn)] = [fn(step) for step in range(self._steps + 1)]
            columns.append(array("d", [base_lr * f for f in factors[id(fn)]]))
        self.table = tuple(columns)

    def step(self, epoch: int | None = None) -> None:
        table = self.table
        # LambdaLR's own step: before the table is built, for a step given (deprecated), and for the
        # second step, where LRScheduler warns if the optimizer has not stepped yet
        if table is None or epoch is not None or self._step_count == 1:
            super().step(epoch)
            return
        self._step_count += 1
        step = self.last_epoch = self.last_epoch + 1
        if step <= self._steps:
            lrs = [column[step] for column in table]
        else:
            lrs = [base_lr * fn(step) for fn, base_lr in zip(self.lr_lambdas, self.base_lrs, strict=True)]
        for group, lr in zip(self.optimizer.param_groups, lrs, strict=True):
            group["lr"] = lr
        self._last_lr = lrs

    def state_dict(self) -> dict:
        return {k: v for k, v in super().state_dict().items() if k not in self._OWN}

    def load_state_dict(self, state_dict: dict) -> None:
        super().load_state_dict({k: v for k, v in state_dict.items() if k not in self._OWN})
        self._build()  # the loaded base_lrs and schedule settings


def peak_scale(cfg: TrainConfig, total_steps: int) -> float:
    """The factor on ``cfg.lr`` at the peak of a ``total_steps``-step run: ``sqrt(total_steps / full_lr_steps)``
    below ``cfg.full_lr_steps`` (the recipe's rule; 0 or unset: none), else 1. Never on your own optimizer."""
    full = 0 if str(cfg.optimizer).startswith("custom:") else cfg.full_lr_steps or 0
    return math.sqrt(max(1, total_steps) / full) if max(1, total_steps) < full else 1.0


def build_schedule(opt: torch.optim.Optimizer, cfg: TrainConfig, total_steps: int) -> TableLR:
    scale = peak_scale(cfg, total_steps)
    if scale != 1.0:
        # The scaled peak is the groups' lr before the schedule is made, so it is the schedule's base_lrs (and the
        # optimizer's initial_lr): in every snapshot, and a resume goes on along the curve the run started on.
        for group in opt.param_groups:
            group["lr"] = group["lr"] * scale
    return TableLR(opt, ScheduleFactor(cfg.schedule, total_steps, cfg.warmup_frac), total_steps)


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
        if cfg.optimizer != "sgd":
            extra = f", beta2 {0.999 if cfg.beta2 is None else cfg.beta2:g}"
        who = f"{cfg.optimizer} at lr {lr} ({beta} {cfg.momentum:g}{extra}, weight decay {cfg.weight_decay:g})"
    if user_scheduler:
        return f"{who}, your {type(sched).__name__} each step"
    steps = sched.lr_lambdas[0].total if isinstance(sched, TableLR) else None
    scaled = ""
    if steps is not None and peak_scale(cfg, steps) != 1.0:
        scaled = f" (scaled for a {steps}-step run; {cfg.lr:g} from {cfg.full_lr_steps} steps)"
    if cfg.schedule == "constant":
        return f"{who}{scaled}, constant"
    warm = f"{cfg.warmup_frac:g} of the steps" if cfg.warmup_frac else "no"
    shape = "then linear to 0" if cfg.schedule == "onecycle" else "then cosine to 0"
    return f"{who} as the peak{scaled}, {cfg.schedule}: {warm} warm-up {shape}"


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
    """The context the forward runs in: ``cfg.amp``'s autocast, or, with amp off, :class:`NoAutocast`
    (nothing to do, unless the caller has an autocast on)."""
    if cfg.amp in (None, "none"):
        return NoAutocast(device.type)
    return torch.autocast(device.type, dtype=torch.bfloat16 if cfg.amp == "bf16" else torch.float16)


class NoAutocast:
    """Amp off: the same as ``torch.autocast(device_type, enabled=False)``, at the cost of a flag read.

    A disabled torch.autocast costs host time at every entry (it saves and sets autocast's dtype,
    cache and nesting state). It changes something only inside an autocast that is on (a caller's,
    around ``Trainer.fit()`` in-process, say), which it turns off; this enters one only then, and
    otherwise does nothing. Reusable, and re-entrant.
    """

    __slots__ = ("device_type", "_entered")

    def __init__(self, device_type: str):
        self.device_type, self._entered = device_type, []

    def __enter__(self) -> None:
        inner = torch.autocast(self.device_type, enabled=False) if torch.is_autocast_enabled(self.device_type) else None
        if inner is not None:
            inner.__enter__()
        self._entered.append(inner)

    def __exit__(self, *exc) -> None:
        inner = self._entered.pop()
        if inner is not None:
            inner.__exit__(*exc)


def build_scaler(cfg: TrainConfig, device: torch.device):
    """GradScaler for fp16 only: bf16 has fp32's exponent range and needs no loss scaling."""
    return torch.amp.GradScaler(device.type, enabled=cfg.amp == "fp16")


class EMA:
    """Exponential moving average of the weights (and a copy of the buffers), updated per step.

    ``update`` is one ``_foreach_lerp_`` over the parameters and one ``_foreach_copy_`` per buffer
    dtype, with no walk of the modules: the buffers are found through (module, name) pairs taken at
    construction, so a buffer a model replaces (``self.buf = self.buf + 1`` in its forward) rather
    than updates in place is still the one copied, as a walk would find it.
    """

    def __init__(self, model: nn.Module, decay: float):
        self.decay = decay
        self.module = _clone(model)
        self.params = [p for p in self.module.parameters()]
        self.src = [p for p in model.parameters()]
        self._model = model
        # [(EMA's buffer slots, the model's)] per (dtype, device): one fused copy each on CUDA
        groups: dict[tuple, tuple[list, list]] = {}
        for (name, b), (ema_name, _) in zip(model.named_buffers(), self.module.named_buffers(), strict=True):
            pair = groups.setdefault((b.dtype, b.device), ([], []))
            pair[0].append(_slot(self.module, ema_name))
            pair[1].append(_slot(model, name))
        self.buffer_groups = list(groups.values())

    @torch.no_grad()
    def update(self, model: nn.Module) -> None:
        """The weights' average moves towards the parameters of the model this EMA was made of, and
        the buffers are copied from ``model`` (the same one, in the engine)."""
        torch._foreach_lerp_(self.params, self.src, 1 - self.decay)  # under no_grad: no detach needed
        if model is not self._model:  # another model's buffers: found by a walk, as they always were
            for b_ema, b in zip(self.module.buffers(), model.buffers()):
                b_ema.copy_(b)
            return
        for ema_slots, slots in self.buffer_groups:
            torch._foreach_copy_([m._buffers[n] for m, n in ema_slots], [m._buffers[n] for m, n in slots])

    def state_dict(self) -> dict:
        return self.module.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self.module.load_state_dict(state)


def _slot(model: nn.Module, name: str) -> tuple[nn.Module, str]:
    """(the module that holds buffer ``name``, its name there)."""
    owner, _, attr = name.rpartition(".")
    return model.get_submodule(owner), attr


def _clone(model: nn.Module) -> nn.Module:
    import copy

    clone = copy.deepcopy(model)
    for p in clone.parameters():
        p.requires_grad_(False)
    return clone
