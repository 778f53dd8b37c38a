"""SyncBatchNorm built from plain tensor ops and one autograd-aware all-reduce.

torch's ``nn.SyncBatchNorm`` computes its statistics with CUDA-only kernels, raises on
CPU input, and DDP refuses it in CPU modules. :class:`AllReduceBatchNorm` computes the
per-channel sum, sum of squares and count locally, in float32 (float64 for a float64
input) on the input's device,
and all-reduces them through :class:`_AllReduceSum`, whose backward all-reduces the
gradient, so autograd gives the same gradients as torch's kernels. Under autocast
(``--amp bf16|fp16``) the statistics stay in float32 and the output takes the input's
dtype, as torch's BatchNorm does.

Which implementation runs (``convert_sync_batchnorm``):

* CPU: :class:`AllReduceBatchNorm` (torch's cannot run there).
* CUDA: torch's ``nn.SyncBatchNorm`` by default. It drops empty ranks' statistics with a
  boolean mask, which syncs the host once per BN layer per step (torch's
  ``_functions.py`` says so); ``impl="allreduce"`` selects this module instead, which
  makes no host sync but is not fused. ``benchmarks/gpu_acceptance.py`` times both, so
  the default is chosen by measurement on the first GPU.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm

from ..errors import ConfigError


class _AllReduceSum(torch.autograd.Function):
    """Sum over ranks. d(sum over ranks)/d(mine) is the sum of every rank's upstream gradient."""

    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:
        x = x.clone()
        dist.all_reduce(x)
        return x

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        grad = grad.clone()
        dist.all_reduce(grad)
        return grad


class AllReduceBatchNorm(_BatchNorm):
    """BatchNorm whose training statistics span all ranks, on any device.

    It deliberately is not an ``nn.SyncBatchNorm``: DDP refuses those on CPU modules.
    """

    def _check_input_dim(self, x: torch.Tensor) -> None:
        if x.dim() < 2:
            raise ValueError(f"expected at least 2D input (got {x.dim()}D input)")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.training or not dist.is_initialized() or dist.get_world_size() == 1:
            return super().forward(x)
        # Statistics in float32 whatever autocast made the activations, and in float64 for a
        # float64 model (in float32 they moved a float64 run by ~1e-5 from 1 process: ddpkit check).
        xf = x.to(torch.promote_types(x.dtype, torch.float32))
        dims = [0] + list(range(2, x.dim()))
        # Built on x's device: exact up to 2**24 samples per channel over all ranks in float32.
        count = torch.full((1,), x.numel() // x.shape[1], dtype=xf.dtype, device=x.device)
        local = torch.cat([xf.sum(dims), (xf * xf).sum(dims), count])
        total = _AllReduceSum.apply(local)  # [sum (C), sum of squares (C), samples per channel (1)]
        c = x.shape[1]
        n = total[-1]
        mean = total[:c] / n
        var = (total[c : 2 * c] / n - mean * mean).clamp_min(0)  # biased: what normalises the batch
        if self.track_running_stats:
            with torch.no_grad():
                self.num_batches_tracked.add_(1)
                m = self.momentum if self.momentum is not None else 1.0 / float(self.num_batches_tracked)
                self.running_mean.lerp_(mean.detach().to(self.running_mean.dtype), m)
                unbiased = var.detach() * n / (n - 1)  # as torch's BN stores it
                self.running_var.lerp_(unbiased.to(self.running_var.dtype), m)
        shape = [1, c] + [1] * (x.dim() - 2)
        y = (xf - mean.view(shape)) * torch.rsqrt(var.view(shape) + self.eps)
        if self.affine:
            y = y * self.weight.view(shape) + self.bias.view(shape)
        return y.to(x.dtype)


def refuse_torch_syncbn_off_gpu(model: nn.Module, device: torch.device) -> None:
    """torch's ``nn.SyncBatchNorm`` (a ported script's own ``convert_sync_batchnorm``) in a model DDP wraps off a
    GPU: DDP's constructor refuses it, or its first training forward raises, on every rank, as a traceback. Said
    here instead, before the wrap, with the fix (the porter's seed 002): ddpkit's SyncBatchNorm takes those layers."""
    if device.type == "cuda":
        return
    names = [n for n, m in model.named_modules() if isinstance(m, nn.SyncBatchNorm)]
    if names:
        raise ConfigError(
            f"the model holds torch's nn.SyncBatchNorm ({names[0] or 'the model itself'}"
            f"{f' and {len(names) - 1} more' if len(names) > 1 else ''}), which runs on GPUs only, and this run's "
            f"device is {device.type}: pass sync_bn=True (Loop(sync_bn=True); --sync-bn for ddpkit train), "
            f"ddpkit's SyncBatchNorm, which trains those layers' own parameters and buffers on the CPU too, "
            f"synchronised over every rank; or drop the script's convert_sync_batchnorm"
        )


def convert_sync_batchnorm(model: nn.Module, device: torch.device, impl: str = "auto") -> nn.Module:
    """Every BatchNorm*d -> a synchronised one: ``impl`` auto (torch's on CUDA, ours elsewhere),
    ``torch`` or ``allreduce``."""
    if impl == "auto":
        impl = "torch" if device.type == "cuda" else "allreduce"
    if impl == "torch":
        return nn.SyncBatchNorm.convert_sync_batchnorm(model)
    if isinstance(model, _BatchNorm) and not isinstance(model, AllReduceBatchNorm):
        new = AllReduceBatchNorm(
            model.num_features, model.eps, model.momentum, model.affine, model.track_running_stats, device="meta"
        )
        # The very same Parameter and buffer objects, as torch's conversion does: an optimizer
        # already built on the model keeps pointing at what trains.
        for name, value in [*model.named_parameters(recurse=False), *model.named_buffers(recurse=False)]:
            setattr(new, name, value)
        new.train(model.training)
        return new
    for name, child in model.named_children():
        model.add_module(name, convert_sync_batchnorm(child, device, impl))
    return model


# BatchNorm classes whose training forward normalises with the batch's statistics. Exact types:
# a subclass (batch renormalisation, say) may feed the running statistics into the forward.
PLAIN_BATCHNORM = (
    nn.BatchNorm1d,
    nn.BatchNorm2d,
    nn.BatchNorm3d,
    nn.LazyBatchNorm1d,
    nn.LazyBatchNorm2d,
    nn.LazyBatchNorm3d,
    nn.SyncBatchNorm,
    AllReduceBatchNorm,
)


def per_rank_batchnorm(modules: list[nn.Module]) -> bool:
    """Whether any of ``modules`` holds a BatchNorm that normalises over each rank's own batch (neither torch's
    SyncBatchNorm nor ddpkit's AllReduceBatchNorm): its statistics, and so the run, depend on the world size."""
    return any(
        isinstance(m, _BatchNorm) and not isinstance(m, (nn.SyncBatchNorm, AllReduceBatchNorm))
        for module in modules
        for m in module.modules()
    )


def only_batchnorm_buffers(model: nn.Module) -> bool:
    """Whether every buffer of ``model`` is a running statistic of a plain BatchNorm.

    DDP broadcasts rank 0's buffers at every forward (two collectives per step for the MNIST
    ConvNet, ~0.2 ms of host time each step on an H100). In training mode a plain BatchNorm's
    running statistics do not enter the forward (a BatchNorm frozen in eval mode uses them, but
    does not change them), and rank 0's own sequence of them is the same with or without the
    broadcast. The engine broadcasts every buffer once after wrapping and again before each
    evaluation, so model.pt and every reported figure are unchanged (tests/train/test_engine.py
    compares them bitwise). Any other buffer (a user's step counter, spectral norm's vectors)
    may shape the forward: then DDP keeps broadcasting.
    """
    bn = {id(b) for m in model.modules() if type(m) in PLAIN_BATCHNORM for b in m.buffers(recurse=False)}
    return all(id(b) in bn for b in model.buffers())
