"""Choosing by the validation split: ``--keep-best`` and ``--early-stop``.

    best = Watch("val_loss", "min")
    if best.update(result, step): ...       # a new best: write best.pt
    stopper = Watch("val_loss", "min", patience=5)
    stopper.update(result, step); stopper.exhausted

``result`` is an evaluation every rank holds already (all-reduced), so every rank decides the same with
no collective of its own. A NaN or Inf is never a best, and counts as an evaluation without one. Both
watches are snapshot state (``selection``): a resumed run keeps its best and its patience.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Optional

from ..config import TrainConfig, early_stop_rule, watched_metric


@dataclass
class Watch:
    metric: str  # a validation metric: val_loss, val_accuracy, ...
    mode: str  # "min" or "max": which way is better
    patience: int = 0  # evaluations in a row without a new best that end the run (0: never)
    value: Optional[float] = None  # the best so far
    step: Optional[int] = None  # the optimizer step it was evaluated at
    since: int = 0  # evaluations since the best (or since the start)

    def update(self, result: dict, step: int) -> bool:
        """True if ``result`` holds a new best of ``metric``."""
        v = result.get(self.metric)
        finite = v is not None and math.isfinite(v)
        if finite and (self.value is None or (v < self.value if self.mode == "min" else v > self.value)):
            self.value, self.step, self.since = v, step, 0
            return True
        self.since += 1
        return False

    @property
    def exhausted(self) -> bool:
        return bool(self.patience) and self.since >= self.patience


def watches(cfg: TrainConfig) -> tuple[Watch | None, Watch | None]:
    """(``--keep-best``'s watch, ``--early-stop``'s), None where not asked."""
    best = Watch(*watched_metric(cfg.keep_best, "--keep-best")) if cfg.keep_best else None
    stop = None
    if cfg.early_stop:
        name, mode, patience = early_stop_rule(cfg.early_stop)
        stop = Watch(name, mode, patience)
    return best, stop


def to_state(watch: Watch | None) -> dict | None:
    return dataclasses.asdict(watch) if watch is not None else None


def from_state(watch: Watch | None, state: dict | None) -> None:
    """Load a snapshot's watch into ``watch`` (the config's: same metric and mode, or the run is refused)."""
    if watch is not None and state:
        watch.value, watch.step, watch.since = state["value"], state["step"], state["since"]
