"""SyncBatchNorm that also runs on CPU (gloo), so CPU runs and CI exercise it.

torch's ``nn.SyncBatchNorm`` computes its statistics with CUDA-only kernels, raises on
CPU input, and DDP refuses it in CPU modules. On CPU, :class:`CPUSyncBatchNorm` computes
the per-channel sum, sum of squares and count locally and all-reduces them through
:class:`_AllReduceSum`, whose backward all-reduces the gradient, so autograd gives the
same gradients as the CUDA kernels. On CUDA it is torch's own implementation unchanged.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm


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


class CPUSyncBatchNorm(_BatchNorm):
    """BatchNorm whose training statistics span all ranks, for CPU tensors.

    It deliberately is not an ``nn.SyncBatchNorm``: DDP refuses those on CPU modules.
    """

    def _check_input_dim(self, x: torch.Tensor) -> None:
        if x.dim() < 2:
            raise ValueError(f"expected at least 2D input (got {x.dim()}D input)")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.training or not dist.is_initialized() or dist.get_world_size() == 1:
            return super().forward(x)
        dims = [0] + list(range(2, x.dim()))
        count = torch.tensor([x.numel() / x.shape[1]], dtype=x.dtype)
        local = torch.cat([x.sum(dims), (x * x).sum(dims), count])
        total = _AllReduceSum.apply(local)  # [sum (C), sum of squares (C), samples per channel (1)]
        c = x.shape[1]
        n = total[-1]
        mean = total[:c] / n
        var = (total[c:2 * c] / n - mean * mean).clamp_min(0)  # biased: what normalises the batch
        if self.track_running_stats:
            with torch.no_grad():
                self.num_batches_tracked.add_(1)
                m = self.momentum if self.momentum is not None else 1.0 / float(self.num_batches_tracked)
                self.running_mean.lerp_(mean.detach(), m)
                self.running_var.lerp_(var.detach() * n / (n - 1), m)  # unbiased, as torch's BN stores
        shape = [1, c] + [1] * (x.dim() - 2)
        y = (x - mean.view(shape)) * torch.rsqrt(var.view(shape) + self.eps)
        if self.affine:
            y = y * self.weight.view(shape) + self.bias.view(shape)
        return y


def convert_sync_batchnorm(model: nn.Module, device: torch.device) -> nn.Module:
    """Every BatchNorm*d -> torch's SyncBatchNorm on CUDA, or :class:`CPUSyncBatchNorm` on CPU."""
    if device.type != "cpu":
        return nn.SyncBatchNorm.convert_sync_batchnorm(model)
    if isinstance(model, _BatchNorm) and not isinstance(model, CPUSyncBatchNorm):
        new = CPUSyncBatchNorm(model.num_features, model.eps, model.momentum, model.affine, model.track_running_stats)
        new.load_state_dict(model.state_dict())
        new.train(model.training)
        return new
    for name, child in model.named_children():
        model.add_module(name, convert_sync_batchnorm(child, device))
    return model
