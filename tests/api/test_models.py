"""Model helpers: the NHWC conversion that keeps DDP's bucket views and gradients alike."""

from __future__ import annotations

import torch

from ddpkit.models import ConvNet, ResNet9, to_channels_last


def test_on_cuda_channels_last_keeps_size_one_weights_contiguous():
    """cuDNN makes the gradient of a [16, 1, 5, 5] conv weight with contiguous strides; a weight in
    NHWC strides then differs from its gradient, and DDP copies that gradient every step (the
    'Grad strides do not match bucket view strides' warning of the first H100 run: 0 after)."""
    model = to_channels_last(ConvNet(), "cuda")  # the rule for CUDA, applied to CPU tensors
    first, second = model.layer1[0].weight, model.layer2[0].weight
    assert first.stride() == torch.empty(16, 1, 5, 5).stride() == (25, 25, 5, 1)  # the layout its gradient gets
    assert second.is_contiguous(memory_format=torch.channels_last) and not second.is_contiguous()


def test_on_cuda_only_convolutions_on_one_channel_are_kept_contiguous():
    """1x1 and depthwise convolutions see many-channel NHWC input: their weights stay NHWC."""
    from torch import nn

    from ddpkit.models import resnet18

    model = to_channels_last(
        nn.Sequential(nn.Conv2d(8, 4, 1), nn.Conv2d(4, 4, 3, groups=4), resnet18(1, 32, 32, 10)), "cuda"
    )
    for m in model.modules():
        if isinstance(m, nn.Conv2d):
            w = m.weight
            assert w.stride() == (
                torch.empty(w.shape).stride()
                if m.in_channels == 1
                else torch.empty(w.shape, memory_format=torch.channels_last).stride()
            )


def test_on_cpu_every_weight_goes_nhwc_and_gradients_match():
    """oneDNN gives gradients the weight's own strides; a contiguous first weight would change
    the kernels, and the bits of every CPU result (tests/golden)."""
    model = to_channels_last(ConvNet(), "cpu")
    assert model.layer1[0].weight.stride() == (25, 1, 5, 1)
    x = torch.randn(4, 1, 28, 28).contiguous(memory_format=torch.channels_last)
    model(x).sum().backward()
    assert all(p.grad.stride() == p.stride() for p in model.parameters())


def test_channels_last_changes_no_value():
    torch.manual_seed(0)
    model = ResNet9()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    for device_type in ("cpu", "cuda"):
        after = to_channels_last(model, device_type).state_dict()
        assert all(torch.equal(before[k], after[k]) for k in before)
