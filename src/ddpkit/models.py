"""Models: a plain dict registry. Every builder takes (channels, height, width, classes).

model = MODELS["resnet9"](3, 32, 32, 10)
"""

from __future__ import annotations

from typing import Callable

import torch
from torch import nn

from .config import TrainConfig
from .errors import ConfigError, article
from .importpath import call, is_import_path


def conv_bn(cin: int, cout: int, k: int = 3) -> nn.Sequential:
    return nn.Sequential(
        nn.Conv2d(cin, cout, k, padding=k // 2, bias=False), nn.BatchNorm2d(cout), nn.ReLU(inplace=True)
    )


class ConvNet(nn.Module):
    """The MNIST ConvNet of the PyTorch DDP-with-MNIST tutorial notebook: two 5x5 conv+BN+ReLU+maxpool
    blocks and one linear layer."""

    def __init__(self, channels: int = 1, height: int = 28, width: int = 28, classes: int = 10):
        super().__init__()
        self.layer1 = nn.Sequential(
            nn.Conv2d(channels, 16, 5, padding=2), nn.BatchNorm2d(16), nn.ReLU(), nn.MaxPool2d(2)
        )
        self.layer2 = nn.Sequential(nn.Conv2d(16, 32, 5, padding=2), nn.BatchNorm2d(32), nn.ReLU(), nn.MaxPool2d(2))
        self.fc = nn.Linear((height // 4) * (width // 4) * 32, classes)  # 7*7*32 for 28x28 inputs

    def forward(self, x):
        return self.fc(self.layer2(self.layer1(x)).flatten(1))


class SimpleCNN(nn.Module):
    """A small CIFAR CNN (SimpleCNN): three conv+BN blocks, fc 4096->512->classes, dropout 0.5; larger
    images are average-pooled to the 4x4 feature map of a 32x32 one first."""

    def __init__(self, channels: int = 3, height: int = 32, width: int = 32, classes: int = 10):
        super().__init__()
        self.features = nn.Sequential(
            conv_bn(channels, 64),
            nn.MaxPool2d(2),
            conv_bn(64, 128),
            nn.MaxPool2d(2),
            conv_bn(128, 256),
            nn.MaxPool2d(2),
        )
        # Larger images are average-pooled to the 4x4 map a 32x32 image gives, so the classifier
        # is 4096 -> 512 at every --image-size: flattened unpooled, 224 px made it 200,704 -> 512
        # (100M weights), which diverged at the recipe's lr 0.1. At 32 px nothing is pooled.
        h, w = height // 8, width // 8
        if h <= 4 and w <= 4:
            self.pool, flat = nn.Identity(), 256 * h * w
        else:
            th, tw = min(h, 4), min(w, 4)
            exact = h % th == 0 and w % tw == 0  # plain windows: a deterministic backward on CUDA
            self.pool = nn.AvgPool2d((h // th, w // tw)) if exact else nn.AdaptiveAvgPool2d((th, tw))
            flat = 256 * th * tw
        self.classifier = nn.Sequential(
            nn.Dropout(0.5), nn.Linear(flat, 512), nn.ReLU(inplace=True), nn.Dropout(0.5), nn.Linear(512, classes)
        )

    def forward(self, x):
        return self.classifier(self.pool(self.features(x)).flatten(1))


class GlobalPool(nn.Module):
    """Global max or mean pooling to [B, C, 1, 1], with a deterministic backward on every device.

    ``AdaptiveMaxPool2d``/``AdaptiveAvgPool2d`` backward on CUDA use atomics, and raise under
    ``--deterministic``; ``amax``/``mean`` give the same forward values with plain reductions.
    It holds no parameters, so the models' state_dict keys are unchanged.
    """

    def __init__(self, mode: str):
        super().__init__()
        self.mode = mode

    def forward(self, x):
        return x.amax((2, 3), keepdim=True) if self.mode == "max" else x.mean((2, 3), keepdim=True)


class Residual(nn.Module):
    def __init__(self, c: int):
        super().__init__()
        self.body = nn.Sequential(conv_bn(c, c), conv_bn(c, c))

    def forward(self, x):
        return x + self.body(x)


class ResNet9(nn.Module):
    """Page's DAWNBench ResNet-9: prep, three pooled stages (two residual), max-pool, scaled fc."""

    def __init__(self, channels: int = 3, height: int = 32, width: int = 32, classes: int = 10):
        super().__init__()
        self.net = nn.Sequential(
            conv_bn(channels, 64),
            conv_bn(64, 128),
            nn.MaxPool2d(2),
            Residual(128),
            conv_bn(128, 256),
            nn.MaxPool2d(2),
            conv_bn(256, 512),
            nn.MaxPool2d(2),
            Residual(512),
            GlobalPool("max"),
            nn.Flatten(),
            nn.Linear(512, classes, bias=False),
        )
        self.scale = 0.125  # Page scales the logits down; it steadies the high-lr start

    def forward(self, x):
        return self.net(x) * self.scale


def resnet18(channels: int, height: int, width: int, classes: int) -> nn.Module:
    """torchvision's ResNet-18; small inputs (<= 64 px) get a 3x3 stride-1 stem and no max-pool."""
    import torchvision

    model = torchvision.models.resnet18(num_classes=classes)
    model.avgpool = GlobalPool("mean")
    if min(height, width) <= 64:
        model.conv1 = nn.Conv2d(channels, 64, 3, stride=1, padding=1, bias=False)
        model.maxpool = nn.Identity()
    elif channels != 3:
        model.conv1 = nn.Conv2d(channels, 64, 7, stride=2, padding=3, bias=False)
    return model


class MLP(nn.Module):
    def __init__(self, channels: int, height: int, width: int, classes: int, hidden: int = 512):
        super().__init__()
        self.net = nn.Sequential(
            nn.Flatten(),
            nn.Linear(channels * height * width, hidden),
            nn.ReLU(inplace=True),
            nn.Linear(hidden, hidden),
            nn.ReLU(inplace=True),
            nn.Linear(hidden, classes),
        )

    def forward(self, x):
        return self.net(x)


MODELS: dict[str, Callable[[int, int, int, int], nn.Module]] = {
    "convnet": ConvNet,
    "cnn": SimpleCNN,
    "resnet9": ResNet9,
    "resnet18": resnet18,
    "mlp": MLP,
}


def build_model(name: str, channels: int, height: int, width: int, classes: int) -> nn.Module:
    return MODELS[name](channels, height, width, classes)


def model_for(cfg: TrainConfig, meta) -> nn.Module:
    """The config's model: a registry model shaped for a dataset's ``Meta`` (channels, size, classes),
    or yours, built by ``--model pkg.module:function`` with ``--model-args``."""
    if is_import_path(cfg.model):
        return own_model(cfg)
    return build_model(cfg.model, meta.channels, meta.height, meta.width, meta.classes)


def own_model(cfg: TrainConfig) -> nn.Module:
    """Your model from its import path, its weights drawn with ``--seed`` (as the registry models'
    are), so every command that builds it again starts from the same weights."""
    model = call(cfg.model, cfg.model_args, "--model", cfg.seed)
    if not isinstance(model, nn.Module):
        raise ConfigError(f"--model {cfg.model} returned {article(type(model).__name__)}, not a torch.nn.Module")
    return model


def uses_conv(model: nn.Module) -> bool:
    """channels_last only pays off for convolutional nets."""
    return any(isinstance(m, nn.Conv2d) for m in model.modules())


def to_channels_last(model: nn.Module, device_type: str) -> nn.Module:
    """``model`` in NHWC; on CUDA, except the weights of convolutions on 1-channel input.

    Such a weight ([out, 1, k, k]) has the same bytes in both layouts, only other strides, and
    cuDNN's backward makes its gradient with the contiguous ones. Under DDP, a gradient whose
    strides differ from its bucket view is copied into the bucket every step ("Grad strides do
    not match bucket view strides", seen on an H100 with the MNIST ConvNet); so on CUDA these
    weights keep the strides their gradients get. Only this measured case is changed: 1x1 and
    depthwise convolutions see NHWC input with many channels. On CPU, oneDNN gives the
    gradient the weight's own strides, and a contiguous weight would pick other kernels (and
    other rounding) than every CPU run so far: there the weights stay as they are.
    """
    model = model.to(memory_format=torch.channels_last)
    if device_type == "cuda":
        for m in model.modules():
            if isinstance(m, nn.Conv2d) and m.in_channels == 1:
                # not .contiguous(): it returns the NHWC tensor itself, which counts as contiguous
                m.weight.data = m.weight.data.clone(memory_format=torch.contiguous_format)
    return model
