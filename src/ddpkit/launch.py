"""Process launch: hand off to torch's elastic agent, never manage processes ourselves.

    result = launch(fn, args, nproc=2)   # rank 0's return value

* Already under torchrun (RANK/LOCAL_RANK/WORLD_SIZE set): run ``fn`` here, no relaunch.
* One process: run ``fn`` here.
* Otherwise: ``elastic_launch`` starts ``nproc`` workers with c10d rendezvous on
  ``localhost:0``, i.e. a free port the store picks itself (as ``torchrun --standalone``).
"""

from __future__ import annotations

import os
import sys
import uuid
from typing import Any, Callable

import torch

from .dist import resolve_device_type, under_launcher
from .errors import ConfigError, DdpkitError

USER_ERROR_EXIT = 2  # a worker that already printed a DdpkitError exits with this


class WorkersFailed(Exception):
    """Workers exited non-zero. ``reported`` is True when they already printed why."""

    def __init__(self, message: str, reported: bool):
        super().__init__(message)
        self.reported = reported


def resolve_nproc(nproc: str, device: str) -> int:
    """``--nproc`` as a number: auto is one per visible GPU, or 1 on CPU."""
    if under_launcher():
        return int(os.environ.get("LOCAL_WORLD_SIZE", os.environ["WORLD_SIZE"]))
    gpus = torch.cuda.device_count() if resolve_device_type(device) == "cuda" else 0
    if nproc == "auto":
        return max(1, gpus)
    n = int(nproc)
    if gpus and n > gpus:
        raise ConfigError(f"--nproc {n} asks for more processes than the {gpus} visible GPU(s); "
                          f"use --nproc {gpus} or --nproc auto")
    return n


def world_size(nproc: int) -> int:
    return int(os.environ["WORLD_SIZE"]) if under_launcher() else nproc


def launch(fn: Callable, args: tuple, nproc: int) -> Any:
    if under_launcher() or nproc == 1:
        return fn(*args)
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    config = LaunchConfig(min_nodes=1, max_nodes=1, nproc_per_node=nproc, run_id=str(uuid.uuid4()),
                          rdzv_backend="c10d", rdzv_endpoint="localhost:0", max_restarts=0,
                          start_method="spawn")
    try:
        results = elastic_launch(config, _guarded)(fn, *args)
    except ChildFailedError as exc:
        codes = {rank: f.exitcode for rank, f in exc.failures.items()}
        reported = all(code == USER_ERROR_EXIT for code in codes.values())
        raise WorkersFailed(f"worker(s) failed: {', '.join(f'rank {r} exit code {c}' for r, c in codes.items())}",
                            reported) from None
    return results[0]


def _guarded(fn: Callable, *args) -> Any:
    """Worker entry: a user error is printed once (by global rank 0) and ends the worker with exit 2."""
    try:
        return fn(*args)
    except DdpkitError as exc:
        if os.environ.get("RANK", "0") == "0":
            print(f"ddpkit: error: {exc}", file=sys.stderr, flush=True)
        sys.exit(USER_ERROR_EXIT)
