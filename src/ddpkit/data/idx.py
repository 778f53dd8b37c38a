"""Reader for the IDX format of MNIST and Fashion-MNIST, with every corruption named.

Layout (big-endian): two zero bytes, a type byte (0x08 = uint8), a dimension count,
then one uint32 per dimension, then the data. Files may be gzip-compressed.
"""

from __future__ import annotations

import gzip
import struct
import zlib
from pathlib import Path

import numpy as np

from ..errors import DataError

_UBYTE = 0x08


def read_idx(path: str | Path, ndim: int) -> np.ndarray:
    """Read a uint8 IDX file of ``ndim`` dimensions, raising DataError on any corruption."""
    path = Path(path)
    try:
        raw = gzip.decompress(path.read_bytes()) if path.suffix == ".gz" else path.read_bytes()
    except FileNotFoundError:
        raise DataError(f"{path}: file not found") from None
    except (OSError, EOFError, zlib.error) as exc:
        raise DataError(f"{path}: corrupt or truncated gzip stream ({exc}); replace the file") from None
    if len(raw) < 4:
        raise DataError(f"{path}: truncated IDX file ({len(raw)} bytes, header needs at least 4)")
    zero, dtype, dims = struct.unpack(">HBB", raw[:4])
    expected_magic = (_UBYTE << 8) | ndim
    if zero != 0 or dtype != _UBYTE or dims != ndim:
        raise DataError(
            f"{path}: wrong IDX magic 0x{int.from_bytes(raw[:4], 'big'):08x}, "
            f"expected 0x{expected_magic:08x} (uint8, {ndim}-d); is this the right file?"
        )
    header = 4 + 4 * ndim
    if len(raw) < header:
        raise DataError(f"{path}: truncated IDX header")
    shape = struct.unpack(f">{ndim}I", raw[4:header])
    need = int(np.prod(shape))
    have = len(raw) - header
    if have != need:
        what = "truncated" if have < need else "has trailing bytes"
        raise DataError(f"{path}: {what}: header says {shape} = {need} data bytes, file has {have}")
    return np.frombuffer(raw, dtype=np.uint8, offset=header).reshape(shape).copy()  # writable for torch


def read_idx_pair(images_path: Path, labels_path: Path, num_classes: int) -> tuple[np.ndarray, np.ndarray]:
    """Images [N, H, W] and labels [N] of one split, checked against each other."""
    images = read_idx(images_path, 3)
    labels = read_idx(labels_path, 1)
    if len(images) != len(labels):
        raise DataError(f"{images_path} holds {len(images)} images but {labels_path} holds {len(labels)} labels")
    if len(labels) and int(labels.max()) >= num_classes:
        raise DataError(
            f"{labels_path}: label {int(labels.max())} is outside the {num_classes} classes (0..{num_classes - 1})"
        )
    return images, labels


def write_idx(path: str | Path, array: np.ndarray) -> None:
    """Write a uint8 array as IDX (gzip if the name ends in .gz); used by tests and tools."""
    array = np.ascontiguousarray(array, dtype=np.uint8)
    blob = struct.pack(">HBB", 0, _UBYTE, array.ndim) + struct.pack(f">{array.ndim}I", *array.shape) + array.tobytes()
    Path(path).write_bytes(gzip.compress(blob) if str(path).endswith(".gz") else blob)
