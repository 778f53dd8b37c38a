"""Batches of any structure: tensors, tuples, lists, dicts and nests of them.

    batch = to_device(batch, device)     # every tensor moved (non-blocking), structure kept
    leading_size(batch)                  # samples in it: the first tensor's first dimension
    structure(sample)                    # types, shapes and dtypes, for a dataset's fingerprint
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch


def to_device(batch: Any, device: torch.device) -> Any:
    """``batch`` with every tensor on ``device``; other leaves (strings, numbers) unchanged."""
    if isinstance(batch, torch.Tensor):
        return batch.to(device, non_blocking=True)
    if isinstance(batch, Mapping):  # a plain dict whatever the mapping type: what model(**batch) needs
        return {k: to_device(v, device) for k, v in batch.items()}
    if isinstance(batch, tuple) and hasattr(batch, "_fields"):  # a namedtuple
        return type(batch)(*(to_device(v, device) for v in batch))
    if isinstance(batch, (list, tuple)):
        return type(batch)(to_device(v, device) for v in batch)
    return batch


def first_tensor(batch: Any) -> torch.Tensor | None:
    """The first tensor in ``batch``, depth first, in insertion order."""
    if isinstance(batch, torch.Tensor):
        return batch
    values = batch.values() if isinstance(batch, Mapping) else batch if isinstance(batch, (list, tuple)) else ()
    for value in values:
        found = first_tensor(value)
        if found is not None:
            return found
    return None


def leading_size(batch: Any) -> int:
    """How many samples ``batch`` holds: the first tensor's first dimension (1 for a scalar)."""
    t = first_tensor(batch)
    return 1 if t is None or t.dim() == 0 else t.shape[0]


def structure(sample: Any) -> Any:
    """A JSON-able description of ``sample``: tensor shapes and dtypes, container types, leaf types."""
    if isinstance(sample, torch.Tensor):
        return {"shape": list(sample.shape), "dtype": str(sample.dtype).replace("torch.", "")}
    if isinstance(sample, Mapping):
        return {str(k): structure(v) for k, v in sample.items()}
    if isinstance(sample, (list, tuple)):
        return [structure(v) for v in sample]
    if hasattr(sample, "shape") and hasattr(sample, "dtype"):  # numpy arrays
        return {"shape": list(sample.shape), "dtype": str(sample.dtype)}
    return type(sample).__name__

