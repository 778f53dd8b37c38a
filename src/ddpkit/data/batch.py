"""Batches of any structure: tensors, tuples, lists, dicts and nests of them.

batch = to_device(batch, device)     # every tensor moved (non-blocking), structure kept
tree_map(fn, batch), tensor_leaves(batch)
leading_size(batch)                  # samples in it: the first tensor's first dimension
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Callable

import torch


def tree_map(fn: Callable[[torch.Tensor], Any], tree: Any) -> Any:
    """``tree`` with ``fn`` applied to every tensor; other leaves (strings, numbers) unchanged."""
    if isinstance(tree, torch.Tensor):
        return fn(tree)
    if isinstance(tree, Mapping):  # a plain dict whatever the mapping type: what model(**batch) needs
        return {k: tree_map(fn, v) for k, v in tree.items()}
    if isinstance(tree, tuple) and hasattr(tree, "_fields"):  # a namedtuple
        return type(tree)(*(tree_map(fn, v) for v in tree))
    if isinstance(tree, (list, tuple)):
        return type(tree)(tree_map(fn, v) for v in tree)
    return tree


def tensor_leaves(tree: Any) -> list[torch.Tensor]:
    """The tensors of ``tree``, depth first, in insertion order."""
    if isinstance(tree, torch.Tensor):
        return [tree]
    values = tree.values() if isinstance(tree, Mapping) else tree if isinstance(tree, (list, tuple)) else ()
    return [leaf for value in values for leaf in tensor_leaves(value)]


def to_device(batch: Any, device: torch.device) -> Any:
    """``batch`` with every tensor on ``device`` (non-blocking), structure kept."""
    return tree_map(lambda t: t.to(device, non_blocking=True), batch)


def first_tensor(batch: Any) -> torch.Tensor | None:
    leaves = tensor_leaves(batch)
    return leaves[0] if leaves else None


def leading_size(batch: Any) -> int:
    """How many samples ``batch`` holds: the first tensor's first dimension (1 for a scalar)."""
    t = first_tensor(batch)
    return 1 if t is None or t.dim() == 0 else t.shape[0]
