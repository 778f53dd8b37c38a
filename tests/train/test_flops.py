"""MFU's parts: the FLOP count of a training step (checked against hand counts), the peak table, and the
figures in the records, summary.json and the [start] line."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from user_code import TinyTransformer, token_classes

from ddpkit import TrainConfig, Trainer
from ddpkit.train.flops import PEAKS_TFLOPS, peak_flops, step_flops
from ddpkit.train.task import Classification, UserLoss


def mse(model, batch):
    x, y = batch
    return F.mse_loss(model(x), y)


def test_a_linear_steps_flops_are_the_hand_count():
    """Two linear layers, batch B: forward 2B(IH + HO); backward 2BHO (weights) + 2BHO (the hidden's
    gradient) + 2BIH (the first weights; the input needs no gradient). Biases and tanh are not matmuls."""
    b, i, h, o = 5, 8, 16, 4
    model = nn.Sequential(nn.Linear(i, h), nn.Tanh(), nn.Linear(h, o))
    flops, why = step_flops(model, UserLoss(mse), (torch.randn(b, i), torch.randn(b, o)))
    assert (flops, why) == (4 * b * i * h + 6 * b * h * o, "")
    assert next(model.parameters()).device.type == "cpu"  # counted on a meta copy: the model untouched


def test_a_convolutions_step_flops_are_the_hand_count():
    """Conv2d C -> K, k x k, 'same' padding on H x W, batch B: 2BKHWCk^2 forward, as much for the weights'
    gradient (the input needs none); then a linear head: 2BFO forward, 2BFO (weights) + 2BFO (its input)."""
    b, c, k, hw, kernel, classes = 2, 3, 6, 10, 3, 5
    conv_flops = 2 * b * k * hw * hw * c * kernel * kernel
    feats = k * hw * hw
    model = nn.Sequential(nn.Conv2d(c, k, kernel, padding=1), nn.Flatten(), nn.Linear(feats, classes))
    batch = (torch.randn(b, c, hw, hw), torch.randint(0, classes, (b,)))
    flops, _ = step_flops(model, Classification(classes=classes), batch)
    assert flops == 2 * conv_flops + 3 * 2 * b * feats * classes


def test_a_step_that_needs_real_values_is_not_counted_and_says_why():
    class Reads(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(2, 1)

        def forward(self, x):
            return self.lin(x) * float(x.abs().max())  # a host read of a value

    flops, why = step_flops(Reads(), UserLoss(mse), (torch.randn(3, 2), torch.randn(3, 1)))
    assert flops is None and why.startswith("not counted: the step needs real values on the meta device")


def test_the_peak_is_by_device_and_dtype_and_none_on_a_cpu():
    assert peak_flops(torch.device("cpu"), TrainConfig()) == (None, "no peak for a CPU (TFLOP/s only)")
    names = [row[0] for row in PEAKS_TFLOPS]
    assert names.index("H100 PCIe") < names.index("H100")  # the first match wins: the longer name first


@pytest.mark.multiprocess
@pytest.mark.parametrize("workload", ["convnet", "transformer"])
def test_tflops_appear_for_the_convnet_and_a_transformer(tmp_path, workload):
    """The records' and summary's TFLOP/s are the counted FLOPs per sample times samples/s per device."""
    common = dict(nproc="2", device="cpu", epochs=1, progress=False, log_every=2, plots=False, run_dir=str(tmp_path))
    if workload == "convnet":
        result = Trainer(TrainConfig(dataset="mnist", limit_train=512, limit_test=64, batch_size=64, **common)).fit()
        # the seed ConvNet on 1x28x28, by hand: conv 1->16 5x5 (28x28 out), conv 16->32 5x5 (14x14), linear 1568->10
        macs = 28 * 28 * 16 * 25, 14 * 14 * 32 * 16 * 25, 1568 * 10
        per_sample = 2 * sum(macs) + 2 * macs[0] + 4 * macs[1] + 4 * macs[2]  # forward; backward (no input grad)
    else:
        torch.manual_seed(0)
        result = Trainer(
            TrainConfig(batch_size=64, **common),
            model=TinyTransformer(),
            train_data=token_classes(256, 0),
            test_data=token_classes(32, 1),
        ).fit()
        per_sample = None
    s = result.summary
    if per_sample is not None:
        assert s["flops_per_step"] == per_sample * 32  # 32 samples per rank per step
    assert s["flops_per_step"] > 0 and s["peak_tflops"] is None and "mfu" not in s
    flops_per_sample = s["flops_per_step"] / 32  # 64 a step over 2 ranks
    assert s["tflops_per_device"] == pytest.approx(flops_per_sample * s["samples_per_s"] / 2 / 1e12)
    records = [json.loads(line) for line in (result.run_dir / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in records if r["event"] == "step"]
    assert all(r["tflops"] == pytest.approx(flops_per_sample * r["samples_per_s"] / 2 / 1e12) for r in steps)
    start = records[0]
    assert start["flops_per_step"] == s["flops_per_step"] and start["mfu_peak"] == "no peak for a CPU (TFLOP/s only)"


def test_a_gpu_is_matched_by_its_whole_model_name():
    """Review finding: names were matched as substrings, so an L40 took the L4's peak and an A10G the A10's."""
    from ddpkit.train.flops import known_as

    assert known_as("L4", "NVIDIA L4") and not known_as("L4", "NVIDIA L40S") and not known_as("L4", "NVIDIA L40")
    assert known_as("H100", "NVIDIA H100 80GB HBM3") and not known_as("A10", "NVIDIA A10G")
    names = [row[0] for row in PEAKS_TFLOPS]
    nvl = next(n for n in names if known_as(n, "NVIDIA H100 NVL"))
    assert nvl == "H100 NVL"
