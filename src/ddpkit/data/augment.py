"""Batched, per-sample augmentation and normalisation on uint8 image tensors.

Every sample gets its own crop offset and flip, drawn for a whole epoch at once from
(seed, epoch) and indexed by the sample's index in the dataset. So a sample's augmentation
does not depend on which rank draws it, or at which position: the DataLoader path and the
device-resident path produce identical batches, a resumed run sees the same augmentations
as one that never stopped, and N ranks see what 1 rank sees (``ddpkit check`` compares
them; drawn per rank, they made augmented datasets fail it). The same
code runs on CPU and CUDA tensors; there is no Python loop over samples and no PIL.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .seeds import augment_generator

CROP_PAD = 4  # pixels of zero padding for random crops, as in the CIFAR seeds


def epoch_params(n: int, seed: int, epoch: int, augment: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Crop offsets [n, 2] (int64, 0..2*pad) and flip flags [n] (bool) for every sample of an
    ``n``-sample dataset in ``epoch``, by sample index."""
    gen = augment_generator(seed, epoch)
    pad = CROP_PAD if augment == "crop-flip" else 0
    offsets = torch.randint(0, 2 * pad + 1, (n, 2), generator=gen)
    flips = (
        torch.randint(0, 2, (n,), generator=gen).bool()
        if augment in ("flip", "crop-flip")
        else torch.zeros(n, dtype=torch.bool)
    )
    return offsets, flips


def crop_flip(x: torch.Tensor, offsets: torch.Tensor, flips: torch.Tensor, pad: int) -> torch.Tensor:
    """Random-crop (zero pad ``pad``) and horizontally flip each image of ``x`` [B, C, H, W].

    Both are one gather: the flip is folded into the column index, so the batch is read
    once whatever the augmentation.
    """
    b, c, h, w = x.shape
    if pad:
        x = F.pad(x, (pad, pad, pad, pad))
    dev = x.device
    rows = offsets[:, 0, None] + torch.arange(h, device=dev)  # [B, H]
    cols = offsets[:, 1, None] + torch.arange(w, device=dev)  # [B, W]
    cols = torch.where(flips[:, None], cols.flip(1), cols)
    return x[
        torch.arange(b, device=dev)[:, None, None, None],
        torch.arange(c, device=dev)[None, :, None, None],
        rows[:, None, :, None],
        cols[:, None, None, :],
    ]


class Normalize:
    """uint8 [B, C, H, W] -> float32 ((x/255 - mean) / std), optionally channels_last."""

    def __init__(self, mean, std, device, channels_last: bool = False):
        mean = torch.tensor(mean, dtype=torch.float32, device=device).view(1, -1, 1, 1)
        std = torch.tensor(std, dtype=torch.float32, device=device).view(1, -1, 1, 1)
        # (x/255 - m)/s == x * (1/(255 s)) - m/s: one multiply-add per pixel
        self.scale, self.shift = 1.0 / (255.0 * std), -mean / std
        self.memory_format = torch.channels_last if channels_last else torch.contiguous_format

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        out = torch.addcmul(self.shift, x.float(), self.scale)
        return out.contiguous(memory_format=self.memory_format)
