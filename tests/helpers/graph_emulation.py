"""A CUDA graph emulated on the CPU, for the ``--cuda-graph`` driver's tests (ddpkit.train.graph).

A real capture records the step's kernels and runs its Python once; a replay runs the kernels
and no Python. The emulation records nothing at capture (so, as on a GPU, capturing trains
nothing), and a replay runs the step's Python but undoes what it does on the host (the metrics'
host half): what remains is the step's tensor work, which is what a replay does.
"""

from __future__ import annotations

from contextlib import nullcontext

from ddpkit.train import graph


class EmulatedGraph:
    def __init__(self, fn, host, owner):
        self.fn, self.host, self.owner = fn, host, owner

    def replay(self) -> None:
        saved = self.host.save()
        self.fn()
        self.host.restore(saved)
        self.owner.replays += 1


class EmulatedCapture:
    """``fail``: the message a failed capture raises with (as CUDA's "operation not permitted when
    stream is capturing" does for a host sync in the step)."""

    def __init__(self, fail: str | None = None):
        self.fail, self.captures, self.replays = fail, 0, 0

    def supports(self, device_type: str) -> bool:
        return True

    def warmup(self, device):
        return nullcontext()

    def capture(self, fn, device, host):
        self.captures += 1
        if self.fail:
            raise RuntimeError(self.fail)
        return EmulatedGraph(fn, host, self)


def install(fail: str | None = None) -> EmulatedCapture:
    """Put the emulation in place of CUDA's capture in this process; returns it (its counters)."""
    graph.CAPTURE = emulated = EmulatedCapture(fail)
    return emulated


def train_at_world(run_dir: str, cuda_graph: str, fail_ranks: str = "") -> dict:
    """A worker: one rank of a short resnet9 run with the emulated capture, the capture failing on
    ``fail_ranks`` (ddpkit's own fault injection, DDPKIT_CUDA_GRAPH_FAIL). Rank 0 returns the summary's
    graph status and its final weights."""
    import os

    import torch

    from ddpkit.config import TrainConfig
    from ddpkit.data import load_dataset
    from ddpkit.models import build_model
    from ddpkit.ranks.context import distributed
    from ddpkit.train.engine import Engine
    from ddpkit.train.task import Classification

    install()
    if fail_ranks:
        os.environ[graph.FORCE_FAILURE] = fail_ranks
    cfg = TrainConfig(
        dataset="synthetic",
        synthetic_size=640,
        synthetic_shape="3,16,16",
        batch_size=32,
        epochs=1,
        model="mlp",
        dtype="float64",
        log_every=5,
        plots=False,
        progress=False,
        run_dir=run_dir,
        cuda_graph=cuda_graph,
    ).resolved()
    with distributed("cpu") as ctx:
        torch.manual_seed(0)
        net = build_model(cfg.model, 3, 16, 16, 10).double()
        engine = Engine(cfg, ctx, net, load_dataset(cfg), Classification(0.0, False, 10), static_graph=True)
        summary = engine.fit()
        return {"status": summary["cuda_graph"], "weights": {k: v.clone() for k, v in engine.raw.state_dict().items()}}
