"""Run identity for your own code: what makes a run "the same run" as one already in a run dir.

    model_fingerprint(model)          # "MLP#1a2b3c4d": parameter layout, module structure, forward code
    data_fingerprint(train, test)     # "TensorDataset#5e6f7a8b": lengths, first and last samples
    code_digest(loss_fn)              # bytecode, constants and plain closure values

These go into the config (``model``, ``dataset``, ``task``), whose hash names the default
run dir and is checked against every snapshot, so editing your model, data, loss or
metrics never returns a stale result. Initial weight values are left out on purpose: an
unseeded script must still resume its own run after a kill.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from typing import Any

import torch
from torch import nn
from torch.utils.data import Dataset

from .data.batch import structure


def _digest(obj: Any) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True, default=str).encode()).hexdigest()[:8]


def code_name(obj: Any) -> str:
    return getattr(obj, "__qualname__", None) or type(obj).__name__


def code_digest(fn: Any) -> str:
    """What a function does, as far as it can be read without running it: its bytecode, constants
    and names (nested functions and lambdas included), and the plain values it closes over."""
    code = getattr(fn, "__code__", None) or getattr(getattr(type(fn), "__call__", None), "__code__", None)
    if code is None:
        return code_name(fn)

    def describe(c):
        consts = [describe(k) if hasattr(k, "co_code") else repr(k) for k in c.co_consts]
        return [c.co_code.hex(), consts, list(c.co_names)]

    cells = [
        repr(cell.cell_contents)
        for cell in (getattr(fn, "__closure__", None) or ())
        if isinstance(getattr(cell, "cell_contents", None), (int, float, str, bool, type(None)))
    ]
    return _digest([describe(code), cells])


def model_fingerprint(model: nn.Module) -> str:
    """``ClassName#digest`` of what the model computes: its parameter and buffer names, shapes and
    dtypes, its module structure (``repr``: layer types and settings) and the ``forward`` code of
    your own module classes. An edited model is a new run. (Initial weight values are left out:
    an unseeded script must still resume its own run.)"""
    layout = [(k, list(v.shape), str(v.dtype)) for k, v in model.state_dict().items()]
    own = sorted(
        {type(m) for m in model.modules() if not type(m).__module__.startswith("torch.")}, key=lambda t: t.__qualname__
    )
    forwards = [(t.__qualname__, code_digest(t.forward)) for t in own]
    return f"{type(model).__name__}#{_digest([type(model).__qualname__, layout, repr(model), forwards])}"


def data_fingerprint(train: Dataset | None, test: Dataset | None) -> str:
    """``ClassName#digest`` of each split's length, and the structure and values of its first and
    last samples: other data is another run."""

    def describe(data):
        if data is None:
            return None
        ends = [data[0], data[len(data) - 1]] if len(data) else []
        return [type(data).__qualname__, len(data), [structure(x) for x in ends], [value_digest(x) for x in ends]]

    name = type(train if train is not None else test).__name__
    return f"{name}#{_digest([describe(train), describe(test)])}"


def value_digest(sample: Any) -> str:
    h = hashlib.sha256()

    def feed(x):
        if isinstance(x, torch.Tensor):
            h.update(x.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
        elif isinstance(x, Mapping):
            for k in x:
                h.update(str(k).encode())
                feed(x[k])
        elif isinstance(x, (list, tuple)):
            for v in x:
                feed(v)
        else:
            h.update(repr(x).encode())

    feed(sample)
    return h.hexdigest()[:16]
