"""DDPKIT_SHARE_GPU=1: several ranks on one GPU over gloo, for testing (NCCL refuses two ranks on one
GPU). Where each rank goes is decided by pure functions: tested on CPU."""

from __future__ import annotations

import pytest
import torch

from ddpkit.errors import ConfigError
from ddpkit.ranks import env, launcher
from ddpkit.ranks.context import plan

WORKER = {"RANK": "5", "LOCAL_RANK": "1", "WORLD_SIZE": "8", "LOCAL_WORLD_SIZE": "4"}
SHARED = {"DDPKIT_SHARE_GPU": "1"}


def test_the_variable_is_named_in_env():
    assert env.SHARE_GPU == "DDPKIT_SHARE_GPU"


@pytest.mark.parametrize("gpus", [1, 2, 4])
def test_shared_every_cuda_rank_of_the_node_is_on_cuda_0_over_gloo(gpus):
    for local_rank in range(4):
        ctx, threads = plan({**WORKER, "LOCAL_RANK": str(local_rank), **SHARED}, "cuda", gpu_count=gpus, cores=32)
        assert ctx.device == torch.device("cuda", 0) and ctx.backend == "gloo"
        assert (ctx.rank, ctx.local_rank, ctx.world_size, ctx.local_world_size) == (5, local_rank, 8, 4)
        assert threads == 8  # the cores are still shared among the node's 4 processes


def test_shared_a_single_process_is_on_cuda_0_over_gloo():
    ctx, threads = plan(SHARED, "cuda", gpu_count=1, cores=2)
    assert (ctx.device, ctx.backend, ctx.world_size, threads) == (torch.device("cuda", 0), "gloo", 1, 2)


def test_without_the_opt_in_more_processes_than_gpus_is_still_refused_and_names_it():
    for environ in (WORKER, {**WORKER, "DDPKIT_SHARE_GPU": "0"}):
        with pytest.raises(ConfigError, match=r"runs 4 processes but sees 1 GPU.*DDPKIT_SHARE_GPU=1"):
            plan(environ, "cuda", gpu_count=1, cores=32)
    # and with enough GPUs, each rank keeps its own GPU and NCCL
    ctx, _ = plan(WORKER, "cuda", gpu_count=4, cores=32)
    assert ctx.device == torch.device("cuda", 1) and ctx.backend == "nccl"


def test_shared_changes_nothing_on_cpu_or_without_a_gpu():
    ctx, _ = plan({**WORKER, **SHARED}, "cpu", gpu_count=0, cores=8)
    assert ctx.device == torch.device("cpu") and ctx.backend == "gloo"
    with pytest.raises(ConfigError, match="sees 0 GPU"):
        plan({**WORKER, **SHARED}, "cuda", gpu_count=0, cores=8)


def test_the_launcher_lets_more_processes_than_gpus_through_when_shared(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.delenv("DDPKIT_SHARE_GPU", raising=False)
    with pytest.raises(ConfigError, match=r"--nproc 2 asks for more processes than the 1 visible GPU.*SHARE_GPU=1"):
        launcher.resolve_nproc("2", "cuda")
    monkeypatch.setenv("DDPKIT_SHARE_GPU", "1")
    assert launcher.resolve_nproc("2", "cuda") == 2
    assert launcher.resolve_nproc("auto", "cuda") == 1  # auto stays one per GPU


def test_the_opt_in_reaches_workers_started_from_an_earlier_forkserver(monkeypatch):
    """A forkserver started before the variable was set has the environment of its start."""
    monkeypatch.setenv("DDPKIT_SHARE_GPU", "1")
    _, worker_env = launcher._launch_config(launcher.LaunchSpec(nproc=2))
    assert worker_env["DDPKIT_SHARE_GPU"] == "1"
    monkeypatch.delenv("DDPKIT_SHARE_GPU")
    _, worker_env = launcher._launch_config(launcher.LaunchSpec(nproc=2))
    assert "DDPKIT_SHARE_GPU" not in worker_env
