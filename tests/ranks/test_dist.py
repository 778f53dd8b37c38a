"""Process placement, threads, NCCL barriers and determinism: the CUDA decisions, tested on CPU."""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist

from ddpkit.errors import ConfigError
from ddpkit.ranks.context import DistContext, deterministic, plan

WORKER = {"RANK": "5", "LOCAL_RANK": "1", "WORLD_SIZE": "8", "LOCAL_WORLD_SIZE": "4"}


def test_a_cuda_rank_is_placed_on_its_local_gpu_with_its_share_of_the_cores():
    ctx, threads = plan(WORKER, "cuda", gpu_count=4, cores=32)
    assert (ctx.rank, ctx.local_rank, ctx.world_size, ctx.local_world_size) == (5, 1, 8, 4)
    assert ctx.device == torch.device("cuda", 1) and ctx.backend == "nccl"
    assert threads == 8  # cores // processes on the node, on CUDA as on CPU


def test_cpu_ranks_share_the_cores_and_a_single_process_gets_them_all():
    ctx, threads = plan(WORKER, "cpu", gpu_count=0, cores=2)
    assert ctx.device == torch.device("cpu") and ctx.backend == "gloo" and threads == 1
    ctx, threads = plan({}, "cpu", gpu_count=0, cores=2)
    assert (ctx.rank, ctx.world_size, threads) == (0, 1, 2)


def test_an_srun_task_bound_to_one_gpu_uses_it_as_device_0():
    """srun --gpus-per-task=1: each task sees its own GPU only; LOCAL_RANK 1 once asked for cuda:1 (refused)."""
    ctx, threads = plan({**WORKER, "DDPKIT_LAUNCHED_BY": "slurm"}, "cuda", gpu_count=1, cores=32)
    assert ctx.device == torch.device("cuda", 0) and (ctx.rank, ctx.local_rank) == (5, 1) and threads == 8
    with pytest.raises(ConfigError, match="runs 4 processes but sees 1 GPU"):  # not srun: still one clear error
        plan(WORKER, "cuda", gpu_count=1, cores=32)


def test_more_processes_on_a_node_than_gpus_is_one_clear_error_on_every_rank():
    for local_rank in ("0", "3"):  # rank 0 fails too, so the error is printed once, by rank 0
        env = {**WORKER, "LOCAL_RANK": local_rank}
        with pytest.raises(ConfigError, match=r"runs 4 processes but sees 2 GPU\(s\).*--nproc-per-node 2"):
            plan(env, "cuda", gpu_count=2, cores=8)


def test_nccl_barriers_name_the_ranks_gpu(monkeypatch):
    calls = []

    class Work:  # what barrier(async_op=True) returns; the hang watch keeps it until it completes
        def wait(self):
            return True

    monkeypatch.setattr(dist, "barrier", lambda **kw: calls.append(kw) or Work())
    DistContext(1, 1, 2, 2, torch.device("cuda", 1), "nccl").barrier()
    DistContext(1, 1, 2, 2, torch.device("cpu"), "gloo").barrier()
    assert calls == [{"device_ids": [1], "async_op": True}, {"async_op": True}]


def test_deterministic_sets_every_switch_and_restores_them(monkeypatch):
    monkeypatch.delenv("CUBLAS_WORKSPACE_CONFIG", raising=False)
    before = (torch.are_deterministic_algorithms_enabled(), torch.backends.cudnn.deterministic)
    with deterministic(True):
        assert torch.are_deterministic_algorithms_enabled() and torch.backends.cudnn.deterministic
        assert not torch.backends.cudnn.benchmark
        assert os.environ["CUBLAS_WORKSPACE_CONFIG"] == ":4096:8"
    assert (torch.are_deterministic_algorithms_enabled(), torch.backends.cudnn.deterministic) == before
    assert "CUBLAS_WORKSPACE_CONFIG" not in os.environ


@pytest.mark.parametrize("name", ["convnet", "cnn", "resnet9", "resnet18", "mlp"])
def test_every_registry_model_trains_under_deterministic_algorithms(name):
    """No layer may raise 'does not have a deterministic implementation' (adaptive pooling did on CUDA)."""
    from ddpkit.models import build_model

    torch.manual_seed(0)
    model = build_model(name, 3, 16, 16, 10)
    with deterministic(True):
        loss = torch.nn.functional.cross_entropy(model(torch.randn(4, 3, 16, 16)), torch.arange(4))
        loss.backward()
    assert all(p.grad is not None for p in model.parameters())
    names = {type(m).__name__ for m in model.modules()}
    assert not {"AdaptiveAvgPool2d", "AdaptiveMaxPool2d"} & names  # both raise in CUDA backward


@pytest.mark.parametrize("raised", [ValueError("a bug in a writer"), OSError(5, "Input/output error")])
def test_any_error_in_a_rank0_write_reaches_the_all_reduce_the_others_wait_in(monkeypatch, raised):
    """Review finding: on_rank0 let only RunDirError reach its all-reduce, so any other error in rank 0's
    write skipped it, and the other ranks waited there until their peer's death was noticed (with NCCL,
    up to --timeout-s). Rank 0 now takes part in the all-reduce, then raises what it met."""
    from ddpkit.ranks.context import on_rank0

    reduced = []

    def all_reduce(self, tensor, op=None):
        reduced.append(float(tensor.sum()))
        return tensor

    monkeypatch.setattr(DistContext, "all_reduce", all_reduce)

    def write():
        raise raised

    with pytest.raises(type(raised), match=str(raised.args[-1])):
        on_rank0(DistContext(0, 0, 2, 2, torch.device("cpu"), "gloo"), write, "writing a test file")
    assert reduced == [1.0]  # the failure flag, once
