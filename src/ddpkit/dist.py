"""The distributed context: process-group setup and teardown, and nothing else.

    with distributed(device="auto", timeout_s=600) as ctx:
        ctx.rank, ctx.world_size, ctx.device   # an explicit value, passed to whoever needs it

Under torchrun (or ddpkit's own elastic launch) the ranks come from the environment;
otherwise this is a world of one, still with a real process group so every code path
(all-reduce, DDP) is the same at any size. The group is destroyed even on error.
"""

from __future__ import annotations

import os
import re
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import timedelta
from typing import Iterator

import torch
import torch.distributed as dist

from .errors import CollectiveTimeout, ConfigError, PeerLost

LAUNCH_VARS = ("RANK", "LOCAL_RANK", "WORLD_SIZE")


@dataclass(frozen=True)
class DistContext:
    rank: int
    local_rank: int
    world_size: int
    local_world_size: int
    device: torch.device
    backend: str

    @property
    def is_main(self) -> bool:
        """Global rank 0: the only rank that writes files or prints."""
        return self.rank == 0

    def all_reduce(self, tensor: torch.Tensor, op=dist.ReduceOp.SUM) -> torch.Tensor:
        """In-place all-reduce; every rank must call it."""
        if self.world_size > 1:
            dist.all_reduce(tensor, op=op)
        return tensor

    def broadcast(self, tensor: torch.Tensor, src: int = 0) -> torch.Tensor:
        """In-place broadcast from global rank ``src``; every rank must call it."""
        if self.world_size > 1:
            dist.broadcast(tensor, src=src)
        return tensor

    def barrier(self) -> None:
        if self.world_size > 1:
            dist.barrier()


def under_launcher() -> bool:
    """True inside torchrun / an elastic agent's worker (the ranks come from the env)."""
    return all(k in os.environ for k in LAUNCH_VARS)


def cpu_cores() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def cpu_threads(local_world_size: int) -> int:
    """Intra-op threads per process, so N processes on a node never oversubscribe its cores."""
    return max(1, cpu_cores() // max(1, local_world_size))


def resolve_device_type(pref: str) -> str:
    if pref == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if pref == "cuda" and not torch.cuda.is_available():
        raise ConfigError("--device cuda asked for, but no CUDA GPU is visible; use --device cpu")
    return pref


@contextmanager
def distributed(device: str = "auto", timeout_s: float = 600.0) -> Iterator[DistContext]:
    env = os.environ
    if under_launcher():
        rank, local_rank, world = int(env["RANK"]), int(env["LOCAL_RANK"]), int(env["WORLD_SIZE"])
        local_world = int(env.get("LOCAL_WORLD_SIZE", world))
    else:
        rank, local_rank, world, local_world = 0, 0, 1, 1
    dev_type = resolve_device_type(device)
    if dev_type == "cuda":
        dev = torch.device("cuda", local_rank)
        torch.cuda.set_device(dev)  # before init_process_group, so NCCL binds this rank's GPU
        backend = "nccl"
    else:
        dev = torch.device("cpu")
        torch.set_num_threads(cpu_threads(local_world))
        backend = "gloo"
    timeout = timedelta(seconds=timeout_s)
    if under_launcher():
        dist.init_process_group(backend=backend, timeout=timeout)
    else:
        dist.init_process_group(backend=backend, timeout=timeout, store=dist.HashStore(), rank=0, world_size=1)
    ok = False
    try:
        yield DistContext(rank, local_rank, world, local_world, dev, backend)
        ok = True
    except RuntimeError as exc:  # gloo/NCCL/store errors are RuntimeError subclasses
        user_error = _comm_failure(exc, timeout_s)
        if user_error is None:
            raise
        raise user_error from exc
    finally:
        if ok and world > 1:
            # Let every rank's last collective finish before any rank tears down its gloo/NCCL
            # threads: a rank that exits while a peer is mid-collective can abort
            # ("terminate called without an active exception"). Skipped on error: a dead peer
            # would make it wait for the full timeout.
            dist.barrier()
        dist.destroy_process_group()


_TIMEOUT = re.compile(r"timed out|timeout", re.IGNORECASE)
_COMM = re.compile(r"gloo|nccl|store|collective|process ?group", re.IGNORECASE)
_PEER_GONE = re.compile(r"connection (closed|reset) by peer|broken pipe|connection refused", re.IGNORECASE)


def _comm_failure(exc: RuntimeError, timeout_s: float) -> Exception | None:
    """A collective's failure, said in the user's terms; None for any other error."""
    text = str(exc)
    comm = isinstance(exc, getattr(dist, "DistError", ())) or _COMM.search(text)
    if not comm:
        return None
    first = text.strip().splitlines()[0][:240] if text.strip() else type(exc).__name__
    if _TIMEOUT.search(text):
        return CollectiveTimeout(
            f"a collective did not complete within --timeout-s {timeout_s:g} s: another rank stalled, or died "
            f"without its launcher noticing. If a step, an evaluation or a snapshot save can legitimately take "
            f"that long, raise --timeout-s. ({first})")
    if _PEER_GONE.search(text):
        return PeerLost(f"another rank left mid-collective (it died or was stopped; its own output says why). "
                        f"({first})")
    return None
