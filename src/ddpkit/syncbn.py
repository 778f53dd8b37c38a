"""SyncBatchNorm that also runs on CPU (gloo), so CPU runs and CI exercise it.

torch's ``nn.SyncBatchNorm`` computes its statistics with CUDA-only kernels and raises on
CPU input. On CPU this subclass computes the per-channel sum, sum of squares and count
locally and all-reduces them with ``torch.distributed.nn.functional.all_reduce``, which
is differentiable (its backward all-reduces the gradient), so autograd gives the same
gradients as the CUDA kernels. On CUDA it is torch's own implementation unchanged.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.distributed.nn.functional as dist_fn
from torch import nn


class SyncBatchNorm(nn.SyncBatchNorm):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.device.type != "cpu" or not self.training or not dist.is_initialized() or dist.get_world_size() == 1:
            return super().forward(x)
        dims = [0] + list(range(2, x.dim()))
        count = torch.tensor([x.numel() / x.shape[1]], dtype=x.dtype)
        local = torch.cat([x.sum(dims), (x * x).sum(dims), count])
        total = dist_fn.all_reduce(local)  # [sum (C), sum of squares (C), samples per channel (1)]
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


def convert_sync_batchnorm(model: nn.Module) -> nn.Module:
    """torch's conversion, with each SyncBatchNorm given the CPU-capable forward above.

    The subclass adds no state, so re-classing the converted modules is exact.
    """
    model = nn.SyncBatchNorm.convert_sync_batchnorm(model)
    for module in model.modules():
        if type(module) is nn.SyncBatchNorm:
            module.__class__ = SyncBatchNorm
    return model


