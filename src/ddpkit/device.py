"""``--device`` as a device type: the one place that asks whether a CUDA GPU is visible.

Torch-free at import (the config's recipes ask it while resolving, and ``ddpkit --help`` loads no torch).
"""

from __future__ import annotations

from .errors import ConfigError


def resolve_device_type(pref: str) -> str:
    """``"cuda"`` or ``"cpu"``: ``auto`` is CUDA where a GPU is visible; ``cuda`` without one is an error."""
    import torch  # here, not at the top: see the module docstring

    if pref == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if pref == "cuda" and not torch.cuda.is_available():
        raise ConfigError("--device cuda asked for, but no CUDA GPU is visible; use --device cpu")
    return pref
