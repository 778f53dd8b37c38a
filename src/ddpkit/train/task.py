"""The step contract: what the training loop asks of a workload, and nothing more.

    loss, outputs = task.loss(model, batch)        # training: the loss to minimise, and what metrics read
    values = task.measure(loss, outputs, batch)    # [(sum, count)] in task.names order
    values = task.evaluate(model, batch)           # the same, for a test batch

Metrics are (sum, count) pairs. The engine adds them up on the device (numbers, such as
a batch size, on the host) and all-reduces both halves at log intervals and in
evaluation, so every reported mean is sum over all samples / count over all samples,
exact at any world size. "loss" is always reported: as the batch's loss times its
sample count (the first tensor's first dimension), unless the task's metrics define
"loss" themselves (a per-token loss, say).

Three tasks; :func:`resolve_task` picks one:

* :class:`Classification` (the default): ``(inputs, integer targets)`` batches, cross-entropy
  with ``--label-smoothing``, ``accuracy``, ``--tta`` at evaluation. It refuses, in one
  line, what it cannot do: float targets, outputs that are not [batch, classes] logits, a
  class count that differs from the dataset's.
* :class:`ModelLoss`: dict batches (Hugging Face style) given as ``model(**batch)`` to a model
  whose output carries its own loss (``out.loss`` or ``out["loss"]``).
* :class:`UserLoss`: ``loss_fn(model, batch) -> loss`` or ``-> (loss, outputs)``.

Any task takes extra ``metrics={"name": fn}``, each ``fn(outputs, batch) -> (sum, count)``.
"""

from __future__ import annotations

import hashlib
import math
import numbers
from collections.abc import Mapping
from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch import nn

from ..config import TrainConfig
from ..data.batch import leading_size
from ..errors import TaskError
from ..identity import code_digest, code_name

MetricFn = Callable[[Any, Any], tuple]
# test_samples is the evaluated sample count; the others are keys of the step record a metric's mean
# sits beside (metrics.jsonl), and grad_norm the engine's own metric under --clip-grad-norm
RESERVED = {"samples", "event", "time", "epoch", "step", "lr", "samples_per_s", "grad_norm"}


class Task:
    """The shared part: the metric list, measuring, and evaluating as training does."""

    builtin: tuple[str, ...] = ("loss",)
    kind = "task"

    def __init__(self, metrics: Mapping[str, MetricFn] | None = None):
        metrics = dict(metrics or {})
        for name, fn in metrics.items():
            if not isinstance(name, str) or not name.isidentifier() or name in RESERVED:
                raise TaskError(
                    f"metric name {name!r} must be an identifier other than {sorted(RESERVED)}; "
                    f"it is reported as train_<name> and test_<name>"
                )
            if not callable(fn):
                raise TaskError(f"metric {name!r} must be a function (outputs, batch) -> (sum, count)")
        self.metrics = metrics
        self.names = tuple(dict.fromkeys([*self.builtin, *metrics]))
        self._counts_read: set[str] = set()  # metrics whose count was read and checked (see _metric)

    @property
    def identity(self) -> str:
        """What the run identity records of the task (config field ``task``): its kind, the metric names,
        and a digest of the metrics' code, so an edited metric is a new run."""
        return f"{self.kind}{self._metric_part()}"

    def _metric_part(self) -> str:
        if not self.metrics:
            return ""
        names = "".join(f"+{n}" for n in self.metrics)
        return (
            f"{names}#{hashlib.sha256(''.join(code_digest(f) for f in self.metrics.values()).encode()).hexdigest()[:8]}"
        )

    def loss(self, model: nn.Module, batch: Any) -> tuple[torch.Tensor, Any]:
        raise NotImplementedError

    def builtin_values(self, loss: torch.Tensor, outputs: Any, batch: Any, n: int) -> dict:
        return {"loss": (loss.detach().double() * n, n)}

    def measure(self, loss: torch.Tensor, outputs: Any, batch: Any) -> list[tuple]:
        values = self.builtin_values(loss, outputs, batch, leading_size(batch))
        for name, fn in self.metrics.items():
            values[name] = self._metric(name, fn, outputs, batch)
        return [values[name] for name in self.names]

    def _metric(self, name: str, fn: MetricFn, outputs: Any, batch: Any) -> tuple:
        """``fn``'s (sum, count), checked; a count in a tensor is read once per metric (the first batch,
        in preflight before launch), not per step: reading it is a host copy."""
        result = _call_metric(name, fn, outputs, batch, read_count=name not in self._counts_read)
        self._counts_read.add(name)
        return result

    def evaluate(self, model: nn.Module, batch: Any) -> list[tuple]:
        loss, outputs = self.loss(model, batch)
        return self.measure(loss, outputs, batch)


def _at_least_float32(t: torch.Tensor) -> torch.Tensor:
    """``t`` in float32 if narrower (autocast's float16/bfloat16 outputs), else as it is (float64 stays)."""
    return t if t.dtype == torch.float64 else t.float()


def _call_metric(name: str, fn: MetricFn, outputs: Any, batch: Any, read_count: bool = True) -> tuple:
    try:
        result = fn(outputs, batch)
    except Exception as exc:
        hint = (
            " It got outputs=None: loss_fn returned only the loss; return (loss, outputs) for the metrics to read"
            if outputs is None
            else ""
        )
        raise TaskError(f"metric {name!r} raised {type(exc).__name__}: {str(exc)[:200]}.{hint}") from None
    if not (isinstance(result, (tuple, list)) and len(result) == 2):
        raise TaskError(
            f"metric {name!r} returned {type(result).__name__}; a metric returns (sum, count), e.g. "
            f"((pred == y).sum(), len(y)), so that ddpkit can reduce it exactly across ranks"
        )
    for part, what in zip(result, ("sum", "count")):
        if isinstance(part, torch.Tensor):
            if part.numel() != 1:
                raise TaskError(
                    f"metric {name!r} returned a {what} of shape {list(part.shape)}; both parts of (sum, count) "
                    f"are single numbers: add .sum()"
                )
            if part.is_meta:
                raise TaskError(f"metric {name!r} returned a {what} on the meta device, which holds no value")
        elif isinstance(part, bool) or not isinstance(part, numbers.Real):
            raise TaskError(
                f"metric {name!r} returned a {what} that is {_kind(part)}; each part of (sum, count) is a "
                f"one-element tensor or a Python number, e.g. ((pred == y).sum(), len(y))"
            )
    count = result[1]
    if isinstance(count, torch.Tensor):
        if count.is_complex():
            raise TaskError(f"metric {name!r} returned a complex count; the count is a number of samples or a weight")
        count = count.detach().double().item() if read_count else 0.0
    if not (math.isfinite(count) and count >= 0):
        raise TaskError(
            f"metric {name!r} returned a count of {count!r}; the count is how many samples (or how much weight) "
            f"the sum covers, a finite number >= 0, e.g. len(y)"
        )
    return result[0], result[1]


def _kind(value) -> str:
    if value is None:
        return "None"
    shape = getattr(value, "shape", None)
    return f"a {type(value).__module__}.{type(value).__name__}" + (
        f" of shape {list(shape)}" if shape is not None else ""
    )


class Classification(Task):
    """Cross-entropy on [batch, classes] logits with integer targets; the default task."""

    builtin = ("loss", "accuracy")
    kind = "classification"

    def __init__(
        self,
        label_smoothing: float = 0.0,
        tta: bool = False,
        classes: int | None = None,
        metrics: Mapping[str, MetricFn] | None = None,
        min_classes: int | None = None,
    ):
        super().__init__(metrics)
        self.label_smoothing, self.tta, self.classes = label_smoothing, tta, classes
        self.min_classes = min_classes  # from the labels, where the dataset declares no class count
        self._checked = False

    def loss(self, model, batch):
        x, y = self._unpack(batch)
        logits = model(x)
        self._check(logits, y)
        return F.cross_entropy(logits, y, label_smoothing=self.label_smoothing), logits

    def builtin_values(self, loss, logits, batch, n):
        y = batch[1]
        return {"loss": (loss.detach().double() * n, n), "accuracy": ((logits.argmax(1) == y).sum().double(), n)}

    def evaluate(self, model, batch):
        x, y = self._unpack(batch)
        logits = model(x)
        self._check(logits, y)
        if self.tta:  # average over the image and its mirror
            logits = (_at_least_float32(logits) + _at_least_float32(model(x.flip(3)))) / 2
        n = len(y)
        values = {
            # no smoothing at test; autocast logits in float32, --dtype float64 logits as they are
            "loss": (F.cross_entropy(_at_least_float32(logits), y, reduction="sum").double(), n),
            "accuracy": ((logits.argmax(1) == y).sum().double(), n),
        }
        for name, fn in self.metrics.items():
            values[name] = self._metric(name, fn, logits, batch)
        return [values[name] for name in self.names]

    @staticmethod
    def _unpack(batch):
        if isinstance(batch, (tuple, list)) and len(batch) == 2:
            return batch
        raise TaskError(
            f"the default classification task takes (inputs, targets) batches; this dataset gives "
            f"{type(batch).__name__} batches. Pass loss_fn=... (see docs/python-api.md, 'The step contract')"
        )

    def _check(self, logits, y) -> None:
        """Shapes and dtypes, once: metadata only, no host sync."""
        if self._checked:
            return
        fix = "pass loss_fn=... to Trainer (see docs/python-api.md, 'The step contract')"
        if not isinstance(logits, torch.Tensor):
            raise TaskError(f"the model returned {type(logits).__name__}, not a tensor of logits; {fix}")
        if y.is_floating_point():
            raise TaskError(
                f"the targets are {str(y.dtype).replace('torch.', '')} {list(y.shape)}; the default "
                f"classification task needs integer class labels. For regression or any other loss, {fix}"
            )
        if logits.dim() != 2:
            raise TaskError(
                f"the model's output has shape {list(logits.shape)}; the default classification task "
                f"needs [batch, classes] logits. For sequence models or other outputs, {fix}"
            )
        if y.dim() != 1 or y.shape[0] != logits.shape[0]:
            raise TaskError(
                f"the targets have shape {list(y.shape)} for logits {list(logits.shape)}; "
                f"classification needs one integer label per sample, shape [{logits.shape[0]}]"
            )
        if logits.shape[1] < 2:
            raise TaskError(
                f"the model outputs {logits.shape[1]} value per sample; classification needs one logit per "
                f"class (2 for a binary problem). For one logit with a sigmoid, {fix} "
                f"(F.binary_cross_entropy_with_logits)"
            )
        if self.classes is not None and logits.shape[1] != self.classes:
            raise TaskError(
                f"the model outputs {logits.shape[1]} classes but the dataset has {self.classes}; "
                f"build the model with {self.classes} outputs"
            )
        if self.min_classes is not None and logits.shape[1] < self.min_classes:
            raise TaskError(
                f"the model outputs {logits.shape[1]} classes but the labels go up to "
                f"{self.min_classes - 1}; build the model with at least {self.min_classes} outputs"
            )
        self._checked = True


class ModelLoss(Task):
    """A model that computes its own loss from a dict batch: ``model(**batch).loss``."""

    kind = "model-loss"

    def loss(self, model, batch):
        out = model(**batch)
        loss = getattr(out, "loss", None)
        if loss is None and isinstance(out, Mapping):
            loss = out.get("loss")
        if not isinstance(loss, torch.Tensor):
            raise TaskError(
                f"dict batches are passed as model(**batch), and the model's output ({type(out).__name__}) "
                f"has no .loss or 'loss' entry. Return the loss there (Hugging Face models do when given "
                f"labels), or pass loss_fn=..."
            )
        return loss, out


class UserLoss(Task):
    """``loss_fn(model, batch) -> loss`` or ``-> (loss, outputs)``; ``outputs`` reach the metrics."""

    kind = "custom"

    def __init__(self, loss_fn: Callable, metrics: Mapping[str, MetricFn] | None = None):
        if not callable(loss_fn):
            raise TaskError("loss_fn must be a function (model, batch) -> loss or (loss, outputs)")
        super().__init__(metrics)
        self.loss_fn = loss_fn
        self._checked = False

    @property
    def identity(self) -> str:
        return f"custom:{code_name(self.loss_fn)}#{code_digest(self.loss_fn)}{self._metric_part()}"

    def loss(self, model, batch):
        result = self.loss_fn(model, batch)
        loss, outputs = result if isinstance(result, tuple) and len(result) == 2 else (result, None)
        if not self._checked:
            if not (isinstance(loss, torch.Tensor) and loss.numel() == 1 and loss.is_floating_point()):
                what = (
                    f"a tensor of shape {list(loss.shape)}" if isinstance(loss, torch.Tensor) else type(loss).__name__
                )
                raise TaskError(f"loss_fn returned {what}; it must return a scalar float tensor, or (loss, outputs)")
            self._checked = True
        return loss, outputs


def resolve_task(
    cfg: TrainConfig,
    loss_fn: Callable | None = None,
    metrics: Mapping[str, MetricFn] | None = None,
    sample: Any = None,
    classes: int | None = None,
    min_classes: int | None = None,
) -> Task:
    """The user's loss first; then a model's own loss for dict samples; else classification."""
    if loss_fn is not None:
        return UserLoss(loss_fn, metrics)
    if isinstance(sample, Mapping):
        return ModelLoss(metrics)
    return Classification(cfg.label_smoothing or 0.0, bool(cfg.tta), classes, metrics, min_classes)
