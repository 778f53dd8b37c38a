"""FLOPs of one training step, counted once, and the device's dense peak: achieved TFLOP/s and MFU.

    flops, why = step_flops(raw_model, task, micro_batch)   # forward + backward of one micro-batch
    peak, name = peak_flops(ctx.device, cfg)                  # FLOP/s, or None where unknown (CPUs)

The count is torch's own (``torch.utils.flop_counter.FlopCounterMode``: matrix multiplies and
convolutions, forward and backward, by shape), taken on a copy of the model on the ``meta`` device: no
memory, no arithmetic, no random draw, nothing of the run touched. A step whose code needs real values
(``.item()``, a collective, data-dependent branches) cannot be counted there; then none is reported,
and the ``[start]`` line says why. Elementwise work (activations, norms, the optimizer) is not counted,
as in the usual MFU (PaLM's appendix B; nanoGPT's ``estimate_mfu``): MFU is against the matmul peak.
"""

from __future__ import annotations

import copy
import re

import torch
from torch import nn

from ..config import TrainConfig
from ..data.batch import tree_map
from .task import Task

# Dense (no sparsity) peak of one device, in TFLOP/s, from the vendors' datasheets: (name as
# torch.cuda.get_device_name() holds it, bf16/fp16 tensor cores, tf32, fp32, fp64). The first match wins.
PEAKS_TFLOPS = (
    ("H200", 989.4, 494.7, 66.9, 66.9),
    ("H100 PCIe", 756.0, 378.0, 51.2, 51.2),
    ("H100 NVL", 835.0, 417.5, 60.0, 60.0),
    ("H100", 989.4, 494.7, 66.9, 66.9),  # SXM
    ("A100", 312.0, 156.0, 19.5, 19.5),
    ("L40S", 362.0, 183.0, 91.6, 1.4),
    ("L4", 121.0, 60.0, 30.3, 0.5),
    ("A10", 125.0, 62.5, 31.2, 1.0),
    ("V100", 125.0, 15.7, 15.7, 7.8),  # fp16 tensor cores; no bf16, no tf32
    ("T4", 65.0, 8.1, 8.1, 0.25),
    ("RTX 4090", 165.2, 82.6, 82.6, 1.3),
    ("RTX 3090", 71.0, 35.6, 35.6, 0.6),
)


def step_flops(model: nn.Module, task: Task, batch) -> tuple[int | None, str]:
    """(FLOPs of ``task.loss`` and its backward on ``batch``, "") or (None, why not): on a meta copy."""
    from torch.utils.flop_counter import FlopCounterMode

    tensors = [*model.parameters(), *model.buffers()]
    dtype = next((t.dtype for t in tensors if t.is_floating_point()), torch.float32)
    memo = {
        id(t): nn.Parameter(torch.empty_like(t, device="meta"), requires_grad=t.requires_grad)
        if isinstance(t, nn.Parameter)
        else torch.empty_like(t, device="meta")
        for t in tensors
    }
    try:  # a copy: the task's first-step checks (and any state of a loss object) stay for the real step
        task = copy.deepcopy(task)
    except Exception:  # noqa: BLE001 - an uncopyable closure: not counted rather than touched
        return None, "not counted: the loss cannot be copied"
    try:
        shadow = copy.deepcopy(model, memo)
        meta = tree_map(
            lambda t: torch.empty_like(t, device="meta", dtype=dtype if t.is_floating_point() else t.dtype), batch
        )
        shadow.train()
        with FlopCounterMode(display=False) as counter:
            loss, _ = task.loss(shadow, meta)
            loss.backward()
    except Exception as exc:  # noqa: BLE001 - code that needs real values: reported as not counted
        first = str(exc).strip().splitlines()[0][:120] if str(exc).strip() else type(exc).__name__
        return None, f"not counted: the step needs real values on the meta device ({first})"
    return int(counter.get_total_flops()), ""


def known_as(model: str, name: str) -> bool:
    """``model`` (a table row's) is ``name``'s, as whole words: "L4" is not an "L40S", "A10" not an "A10G"."""
    return re.search(rf"(?<![\w]){re.escape(model)}(?![\w])", name) is not None


def peak_flops(device: torch.device, cfg: TrainConfig) -> tuple[float | None, str]:
    """(the device's dense peak in FLOP/s for the run's dtype, its name) or (None, why none)."""
    if device.type != "cuda":
        return None, "no peak for a CPU (TFLOP/s only)"
    name = torch.cuda.get_device_name(device)
    row = next((r for r in PEAKS_TFLOPS if known_as(r[0], name)), None)
    if row is None:
        return None, f"no peak known for {name} (TFLOP/s only)"
    _, half, tf32, fp32, fp64 = row
    if cfg.dtype == "float64":
        return fp64 * 1e12, f"{row[0]} fp64"
    if cfg.amp in ("bf16", "fp16"):
        return half * 1e12, f"{row[0]} {cfg.amp}"
    if torch.backends.cuda.matmul.allow_tf32:
        return tf32 * 1e12, f"{row[0]} tf32"
    return fp32 * 1e12, f"{row[0]} fp32"
