"""Checksums of a snapshot's contents, written with it and checked when it is read back.

    sums = checksums(tree)              # at save, on the objects about to be written
    problem = first_difference(loaded, sums)   # at load: "" if intact, else what differs

A torch file has no checksum of its own that ``torch.load`` checks: a bit flipped inside a
tensor's data loads silently, with a wrong value. So the writer records a CRC32 of every tensor's
bytes (by its path in the tree, e.g. ``model.fc.weight``) and one of everything else (positions,
settings, RNG counters: the tree with each tensor replaced by its dtype and shape), and the reader
recomputes them. CRC32 (``zlib.crc32``) reads each byte once, as the write itself does, and
catches every single-bit flip and every burst of up to 32 bits.

What is summed must come out of ``torch.save`` and ``torch.load`` the same: tensors by their
logical bytes (not their storage, which a view shares with what it does not show), and other
values only as the types ``torch.load(weights_only=True)`` rebuilds as they were (plain
containers, numbers, strings); anything else counts by its type's name alone.
"""

from __future__ import annotations

import zlib

import torch

_PLAIN = (str, int, float, bool, bytes, type(None), torch.dtype, torch.device)


def _tensor_crc(t: torch.Tensor) -> int:
    if t.device.type != "cpu":
        # A second device-to-host copy (torch.save makes its own), one tensor at a time: copying the
        # whole tree to the host once, for both, would double the host memory a save holds.
        t = t.cpu()
    data = t.detach().resolve_conj().resolve_neg().contiguous().reshape(-1)
    return zlib.crc32(data.view(torch.uint8).numpy())


def _walk(tree, path: str, tensors: list, shape: list) -> None:
    """Append (path, tensor) to ``tensors`` and the tree's non-tensor skeleton, as text, to ``shape``."""
    if isinstance(tree, torch.Tensor):
        if tree.layout == torch.strided and not (tree.is_quantized or tree.is_nested):  # others: shape only
            tensors.append((path, tree))
        shape.append(f"T{tree.dtype}{tuple(tree.shape)}")
    elif isinstance(tree, dict):
        shape.append("{")
        for key, value in tree.items():
            shape.append(f"{key!r}:")
            _walk(value, f"{path}.{key}" if path else str(key), tensors, shape)
            shape.append(",")
        shape.append("}")
    elif isinstance(tree, (list, tuple)):
        shape.append("[" if isinstance(tree, list) else "(")
        for index, value in enumerate(tree):
            _walk(value, f"{path}.{index}" if path else str(index), tensors, shape)
            shape.append(",")
        shape.append("]" if isinstance(tree, list) else ")")
    elif isinstance(tree, (set, frozenset)):  # no order of its own: by sorted text
        shape.append("set(" + ",".join(sorted(repr(v) for v in tree)) + ")")
    elif isinstance(tree, _PLAIN):
        shape.append(f"{type(tree).__name__}:{tree!r}")
    else:
        shape.append(type(tree).__name__)


def checksums(tree) -> dict:
    """``{"tensors": [[path, crc32], ...], "values": crc32}`` of ``tree`` (dicts, lists, tuples of tensors
    and plain values), tensors in the tree's order. Plain data, loadable with ``weights_only=True``."""
    tensors, shape = [], []
    _walk(tree, "", tensors, shape)
    return {
        "tensors": [[path, _tensor_crc(t)] for path, t in tensors],
        "values": zlib.crc32("".join(shape).encode()),
    }


def first_difference(tree, recorded) -> str:
    """What of ``tree`` (as loaded) differs from the checksums ``recorded`` when it was written;
    "" when nothing does."""
    if not (isinstance(recorded, dict) and isinstance(recorded.get("tensors"), list)):
        return "its checksums are unreadable"
    tensors, shape = [], []
    _walk(tree, "", tensors, shape)
    recorded_paths = [
        entry[0] if isinstance(entry, list) and len(entry) == 2 else None for entry in recorded["tensors"]
    ]
    found = [path for path, _ in tensors]
    if found != recorded_paths:
        extra, missing = sorted(set(found) - set(recorded_paths)), sorted(set(recorded_paths) - set(found), key=str)
        if extra:
            return f"tensor {extra[0]} has no checksum"
        return f"tensor {missing[0]} is missing" if missing else "its tensors are not in the order written"
    for (path, t), (_, crc) in zip(tensors, recorded["tensors"]):
        if _tensor_crc(t) != crc:
            return f"checksum of {path} differs"
    if zlib.crc32("".join(shape).encode()) != recorded.get("values"):
        return "checksum of its other values (position, settings, RNG counters) differs"
    return ""
