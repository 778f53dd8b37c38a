"""Your own code named by an import path: ``--model pkg.module:function`` and ``--dataset pkg.module:function``.

    ddpkit train --model mynets:make_resnet --model-args '{"depth": 18}' --dataset mydata:splits

The path is recorded in config.toml, so ``ddpkit eval``, ``show-data --predictions``, ``check``,
``bench`` and a rerun build the same objects again (``models.model_for``, ``data.load_dataset``).
A path is imported as Python imports a module: from ``sys.path``, which here also holds the
current directory (as ``python -m`` has it), so ``mynets.py`` beside you is found. The workers
get the objects pickled, and with them ``sys.path`` (multiprocessing's preparation data).

Every mistake is one line naming the flag: a module that is not found or raises on import, a
name it does not have, a call that raises (with the file and line where it did).
"""

from __future__ import annotations

import importlib
import json
import os
import random
import re
import sys
from contextlib import contextmanager
from typing import Any

from .errors import ConfigError, raised_at

_PATH = re.compile(r"[A-Za-z_]\w*(\.[A-Za-z_]\w*)*:[A-Za-z_]\w*(\.[A-Za-z_]\w*)*")


def is_import_path(name: Any) -> bool:
    """``pkg.module:function`` (not ``imagefolder:PATH``, nor the ``custom:`` names the Python API records)."""
    return isinstance(name, str) and not name.startswith(("imagefolder:", "custom:")) and bool(_PATH.fullmatch(name))


def is_own(name: Any) -> bool:
    """A model, dataset, optimizer or schedule of your own: passed from Python (``custom:``) or named by
    an import path. ddpkit applies none of its own models' recipe defaults to it (README)."""
    return str(name).startswith("custom:") or is_import_path(name)


def keyword_args(text: str, flag: str) -> dict:
    """``--model-args`` / ``--dataset-args``: a JSON object, as keyword arguments."""
    if not text:
        return {}
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ConfigError(
            f"{flag} {text!r} is not JSON ({exc.msg}); write a JSON object: '{{\"depth\": 18}}'"
        ) from None
    if not isinstance(value, dict):
        raise ConfigError(f"{flag} {text!r} must be a JSON object of keyword arguments: '{{\"depth\": 18}}'")
    return value


def resolve(path: str, flag: str) -> Any:
    """The object ``path`` names, imported; one line on any failure."""
    module_name, _, attr = path.partition(":")
    if os.getcwd() not in sys.path and "" not in sys.path:
        sys.path.append(os.getcwd())  # your module beside you is found; last, so it shadows no installed one
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        if exc.name and (module_name == exc.name or module_name.startswith(exc.name + ".")):
            raise ConfigError(
                f"{flag} {path}: no module named {exc.name!r} here; run from the folder that holds it, or add "
                f"that folder to PYTHONPATH"
            ) from None
        raise ConfigError(f"{flag} {path}: importing {module_name} failed: {raised_at(exc)}") from None
    except Exception as exc:  # the module's own code raised on import
        raise ConfigError(f"{flag} {path}: importing {module_name} failed: {raised_at(exc)}") from None
    obj = module
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise ConfigError(f"{flag} {path}: {module_name} has no {attr!r}")
        obj = getattr(obj, part)
    return obj


def call(path: str, args: str, flag: str, seed: int) -> Any:
    """Import ``path`` and call it with the JSON keyword arguments ``args``, torch's, numpy's and Python's
    global generators seeded with ``seed`` (and restored after): the same weights, and data drawn at
    random, at every call. One line on any failure."""
    fn = resolve(path, flag)
    kwargs = keyword_args(args, f"{flag}-args")
    if not callable(fn):
        raise ConfigError(f"{flag} {path}: {type(fn).__name__} is not callable; name a function or a class")
    try:
        with seeded(seed):
            return fn(**kwargs)
    except Exception as exc:
        shown = ", ".join(f"{k}={v!r}" for k, v in kwargs.items())
        raise ConfigError(f"{flag} {path}: calling {path.partition(':')[2]}({shown}) raised {raised_at(exc)}") from None


@contextmanager
def generators_kept():
    """torch's (CPU, and every initialised CUDA device's), numpy's and Python's global generators as they
    were before, afterwards: code run here on the user's behalf (a seeded factory, a trial step, a probe)
    leaves the user's script's random streams where they were."""
    import numpy as np
    import torch

    np_state, py_state = np.random.get_state(), random.getstate()
    with torch.random.fork_rng(devices=list(range(torch.cuda.device_count())) if torch.cuda.is_initialized() else []):
        try:
            yield
        finally:
            np.random.set_state(np_state)
            random.setstate(py_state)


@contextmanager
def seeded(seed: int):
    """:func:`generators_kept`, with all three seeded with ``seed`` inside."""
    import numpy as np
    import torch

    with generators_kept():
        torch.manual_seed(seed)
        np.random.seed(seed % 2**32)
        random.seed(seed)
        yield
