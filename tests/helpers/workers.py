"""Worker functions for multi-process tests (importable by spawned children)."""

from __future__ import annotations

import time
from types import SimpleNamespace

import torch
import torch.distributed as dist
from torch import nn

from ddpkit.data import ImageData, Meta
from ddpkit.data.loader import EvalSource, Preprocess
from ddpkit.dist.context import distributed
from ddpkit.train.evaluate import evaluate
from ddpkit.train.task import Classification


class CountingModel(nn.Module):
    """Predicts class 0 for every sample: correct count == number of label-0 samples."""

    def forward(self, x):
        out = torch.zeros(len(x), 10)
        out[:, 0] = 1
        return out


def eval_counts(n: int) -> dict:
    with distributed("cpu") as ctx:
        labels = torch.arange(n) % 10
        data = ImageData(torch.zeros(n, 1, 4, 4, dtype=torch.uint8), labels)
        pre = Preprocess(Meta(1, 4, 4, 10, (0.0,), (1.0,)), ctx.device, False)
        cfg = SimpleNamespace(amp="none", tta=False, num_workers=0)
        result, _ = evaluate(CountingModel(), EvalSource(data, pre, cfg, ctx, 16), Classification(), cfg, ctx)
        return {**result, "world": ctx.world_size, "expected_correct": int((labels == 0).sum())}


def syncbn_vs_bn(seed: int) -> dict:
    """2 ranks with SyncBatchNorm on half a batch each vs plain BN on the whole batch (rank 0 compares)."""
    from ddpkit.train.syncbn import convert_sync_batchnorm

    with distributed("cpu") as ctx:
        torch.manual_seed(seed)
        full = torch.randn(8, 3, 5, 5) * 3 + 1
        bn = nn.BatchNorm2d(3)
        sync = convert_sync_batchnorm(nn.Sequential(nn.BatchNorm2d(3)), ctx.device)
        sync.load_state_dict(nn.Sequential(bn).state_dict())
        mine = full.chunk(ctx.world_size)[ctx.rank].clone().requires_grad_(True)
        out = sync(mine)
        (out * torch.arange(out.numel()).view_as(out)).sum().backward()  # a non-trivial upstream gradient
        ref_in = full.clone().requires_grad_(True)
        ref_out = bn(ref_in)
        pattern = torch.cat([torch.arange(out.numel()).view_as(out)] * ctx.world_size)  # every rank's upstream grad
        (ref_out * pattern).sum().backward()
        grads = sync[0].weight.grad.clone()
        dist.all_reduce(grads)  # DDP would sum the per-rank parameter grads likewise
        checks = {
            "out": torch.allclose(out, ref_out.chunk(ctx.world_size)[ctx.rank], atol=1e-5),
            "input_grad": torch.allclose(mine.grad, ref_in.grad.chunk(ctx.world_size)[ctx.rank], atol=1e-4),
            "weight_grad": torch.allclose(grads, bn.weight.grad * 1.0, atol=1e-3) if ctx.world_size > 1 else None,
            "running_var": torch.allclose(sync[0].running_var, bn.running_var, atol=1e-5),
            "running_mean": torch.allclose(sync[0].running_mean, bn.running_mean, atol=1e-5),
        }
        flags = torch.tensor([float(all(v for v in checks.values() if v is not None))])
        dist.all_reduce(flags, op=dist.ReduceOp.MIN)
        return {
            "all_ranks_ok": bool(flags.item()),
            "rank0": {k: bool(v) for k, v in checks.items() if v is not None},
            "type": type(sync[0]).__name__,
        }


# ---------------------------------------------------------------- fault-injection models
# Test-only models for the fault-tolerance tests: the seed ConvNet, plus a fault at a chosen
# training step (counted in training-mode forwards, 1-based, on this process).
class FaultyConvNet(nn.Module):
    def __init__(self, fault: str = "none", at_step: int = 0, rank: int = -1, seconds: float = 0.0):
        super().__init__()
        from ddpkit.models import ConvNet

        self.net = ConvNet()
        self.fault, self.at_step, self.rank, self.seconds = fault, at_step, rank, seconds
        self.calls = 0

    def forward(self, x):
        out = self.net(x)
        if not self.training:
            return out
        self.calls += 1
        mine = self.rank < 0 or self.rank == dist.get_rank()
        if self.fault == "slow":  # every step, so a test can act between steps
            time.sleep(self.seconds)
        elif self.fault == "nan" and mine and self.calls == self.at_step:
            out = out * float("nan")
        elif self.fault == "stall" and mine and self.calls == self.at_step:
            time.sleep(self.seconds)
        return out


def abort_on(first: int) -> None:
    """Every rank dies of SIGABRT, rank ``first`` first, as NCCL's watchdog ends each process of a
    broken communicator (on gloo a rank would raise instead: this stands in for NCCL)."""
    import os

    with distributed("cpu", timeout_s=30) as ctx:
        if ctx.rank != first:
            time.sleep(0.2)
        os.abort()


def precision_matrix(run_dir: str) -> dict:
    """Two training steps of the ConvNet at world size 2 for every --amp x --sync-bn x
    --channels-last combination; returns, per combination, whether the loss and the BN
    running statistics stayed finite on every rank, and the BN module types."""
    import itertools

    from ddpkit.config import TrainConfig
    from ddpkit.data import load_dataset
    from ddpkit.models import build_model
    from ddpkit.train.engine import Engine

    results = {}
    with distributed("cpu") as ctx:
        for amp, sync_bn, channels_last in itertools.product(("none", "bf16", "fp16"), (False, True), (False, True)):
            cfg = TrainConfig(
                dataset="synthetic",
                synthetic_shape="1,12,12",
                synthetic_size=64,
                batch_size=16,
                model="convnet",
                amp=amp,
                sync_bn=sync_bn,
                channels_last=channels_last,
                epochs=1,
                progress=False,
                run_dir=run_dir,
            ).resolved()
            splits = load_dataset(cfg)
            torch.manual_seed(0)
            engine = Engine(
                cfg, ctx, build_model("convnet", 1, 12, 12, 10), splits, Classification(), static_graph=True
            )
            batches = engine.train_src.batches(0)
            for _ in range(2):
                engine._step((next(batches),))
            bn = [m for m in engine.raw.modules() if "BatchNorm" in type(m).__name__]
            finite = torch.tensor(
                [
                    float(
                        torch.isfinite(engine.acc.sums).all()
                        and all(
                            torch.isfinite(m.running_mean).all()
                            and m.num_batches_tracked == 2
                            and m.running_mean.dtype == torch.float32
                            for m in bn
                        )
                    )
                ]
            )
            dist.all_reduce(finite, op=dist.ReduceOp.MIN)
            results[f"{amp}/{'sync' if sync_bn else 'local'}/{'nhwc' if channels_last else 'nchw'}"] = {
                "ok": bool(finite.item()),
                "bn": sorted({type(m).__name__ for m in bn}),
            }
    return results


def identity_per_rank(ctx) -> str:
    """Each rank with another data digest, as per-node copies with other mtimes give (test_identity.py)."""
    import torch

    from ddpkit.config import TrainConfig
    from ddpkit.errors import ConfigError
    from ddpkit.train.workers import same_identity

    cfg = TrainConfig(data_digest=f"ImageFiles#{ctx.rank:08d}", run_dir="runs/same").resolved()
    said = "agreed"
    try:
        same_identity(cfg, ctx)
    except ConfigError as exc:
        said = "refused: " + str(exc).split(":")[0]
    refused = ctx.all_reduce(torch.tensor([float(said != "agreed")])).item()  # how many ranks refused
    return f"{said} (on {refused:.0f} ranks)"
