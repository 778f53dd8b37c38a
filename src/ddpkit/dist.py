"""The distributed context: process setup (device, threads, determinism), the process
group's setup and teardown, and nothing else.

    with distributed(device="auto", timeout_s=600) as ctx:
        ctx.rank, ctx.world_size, ctx.device   # an explicit value, passed to whoever needs it

Under torchrun (or ddpkit's own elastic launch) the ranks come from the environment;
otherwise this is a world of one, still with a real process group so every code path
(all-reduce, DDP) is the same at any size. The group is destroyed even on error.

The CUDA-only branches in ddpkit, and why each cannot be shared with the CPU path:

* here: ``torch.cuda.set_device`` before ``init_process_group`` (NCCL binds the current
  device), and NCCL barriers name the rank's GPU (``device_ids``; otherwise torch guesses
  it from the global rank). ``device_id=`` is not passed to ``init_process_group``: it
  makes NCCL initialise eagerly, which has been reported to hang at random
  (pytorch/pytorch#153960) and to slow training (NVIDIA-NeMo/RL#3073).
* ``data/loader.py``: the host-staged path pins its two staging buffers and copies on a
  side stream with events; CPU has no asynchronous copy engine to overlap with.
* ``data/loader.py``: ``--data-path auto`` asks CUDA for free memory; on CPU the data is
  already in the only memory there is.
* ``optim.py``: fused optimizer kernels on CUDA, foreach on CPU (no fused CPU SGD in
  older torch).
* ``syncbn.py``: torch's ``nn.SyncBatchNorm`` on CUDA by default (see there).
* ``checkpoint.py``: the CUDA generator's state joins the CPU ones.
* ``metrics.py``: peak memory is CUDA's allocator peak, or the process's peak RSS on CPU.
* ``engine.py``: DDP gets ``device_ids`` on CUDA, as DDP requires for single-device modules.
* ``models.py``: ``to_channels_last`` keeps the weights of convolutions on 1-channel input
  contiguous on CUDA, where cuDNN makes their gradients so; on CPU oneDNN follows the
  weight's strides, and changing them would change CPU results.
"""

from __future__ import annotations

import json
import os
import re
import sys
import time
import traceback
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import timedelta
from typing import Iterator, Mapping

import torch
import torch.distributed as dist

from .errors import CollectiveTimeout, ConfigError, DdpkitError, PeerLost

LAUNCH_VARS = ("RANK", "LOCAL_RANK", "WORLD_SIZE")
CUBLAS_DETERMINISTIC = ":4096:8"  # cuBLAS workspace config that makes its kernels reproducible


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

    def all_gather(self, tensor: torch.Tensor) -> torch.Tensor:
        """Every rank's ``tensor``, stacked in rank order; every rank must call it."""
        if self.world_size == 1:
            return tensor.unsqueeze(0)
        parts = [torch.empty_like(tensor) for _ in range(self.world_size)]
        dist.all_gather(parts, tensor.contiguous())
        return torch.stack(parts)

    def barrier(self) -> None:
        if self.world_size > 1:
            if self.backend == "nccl":
                dist.barrier(device_ids=[self.device.index])
            else:
                dist.barrier()


def under_launcher(env: Mapping[str, str] = os.environ) -> bool:
    """True inside torchrun / an elastic agent's worker (the ranks come from the env)."""
    return all(k in env for k in LAUNCH_VARS)


def cpu_cores() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def cpu_threads(local_world_size: int, cores: int | None = None) -> int:
    """Intra-op threads per process, so N processes on a node never oversubscribe its cores."""
    return max(1, (cpu_cores() if cores is None else cores) // max(1, local_world_size))


def resolve_device_type(pref: str) -> str:
    if pref == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if pref == "cuda" and not torch.cuda.is_available():
        raise ConfigError("--device cuda asked for, but no CUDA GPU is visible; use --device cpu")
    return pref


def plan(env: Mapping[str, str], device_type: str, gpu_count: int, cores: int) -> tuple[DistContext, int]:
    """This process's place in the job, and its intra-op thread count. Pure: no device is touched.

    The thread rule holds on CUDA too: ``elastic_launch``, unlike torchrun, leaves
    OMP_NUM_THREADS unset, and 8 ranks each using every core for host work (data
    indexing, kernel launches, the optimizer's Python) slow each other down.
    """
    if under_launcher(env):
        rank, local_rank, world = int(env["RANK"]), int(env["LOCAL_RANK"]), int(env["WORLD_SIZE"])
        local_world = int(env.get("LOCAL_WORLD_SIZE", world))
    else:
        rank, local_rank, world, local_world = 0, 0, 1, 1
    if device_type == "cuda":
        # Checked on the node's process count, not this rank's index, so every rank of the
        # node fails alike and the error is printed once (by rank 0), not "invalid device ordinal".
        if local_world > gpu_count:
            raise ConfigError(f"this node runs {local_world} processes but sees {gpu_count} GPU(s); start at most "
                              f"{gpu_count} per node (torchrun --nproc-per-node {gpu_count}), or check "
                              f"CUDA_VISIBLE_DEVICES")
        device, backend = torch.device("cuda", local_rank), "nccl"
    else:
        device, backend = torch.device("cpu"), "gloo"
    ctx = DistContext(rank, local_rank, world, local_world, device, backend)
    # A worker forked from a process that used OpenMP hangs in its first parallel region: one thread.
    threads = 1 if env.get("DDPKIT_FORKED_WORKER") == "1" else cpu_threads(local_world, cores)
    return ctx, threads


@contextmanager
def deterministic(on: bool) -> Iterator[None]:
    """``--deterministic``: reproducible kernels on every device, restored on exit.

    Bitwise-identical resume on CUDA needs it: cuDNN's algorithm search, atomics in some
    backward kernels and cuBLAS's split-K reductions otherwise differ from run to run.
    """
    if not on:
        yield
        return
    saved = (torch.are_deterministic_algorithms_enabled(), torch.backends.cudnn.deterministic,
             torch.backends.cudnn.benchmark, os.environ.get("CUBLAS_WORKSPACE_CONFIG"))
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", CUBLAS_DETERMINISTIC)  # read at the first cuBLAS call
    torch.use_deterministic_algorithms(True)
    torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark = True, False
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(saved[0])
        torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark = saved[1], saved[2]
        if saved[3] is None:
            os.environ.pop("CUBLAS_WORKSPACE_CONFIG", None)


@contextmanager
def distributed(device: str = "auto", timeout_s: float = 600.0, deterministic_algorithms: bool = False
                ) -> Iterator[DistContext]:
    dev_type = resolve_device_type(device)
    ctx, threads = plan(os.environ, dev_type, torch.cuda.device_count() if dev_type == "cuda" else 0, cpu_cores())
    torch.set_num_threads(threads)
    if ctx.device.type == "cuda":
        torch.cuda.set_device(ctx.device)  # before init_process_group, so NCCL binds this rank's GPU
    timeout = timedelta(seconds=timeout_s)
    if under_launcher():
        dist.init_process_group(backend=ctx.backend, timeout=timeout)
    else:
        dist.init_process_group(backend=ctx.backend, timeout=timeout, store=dist.HashStore(), rank=0, world_size=1)
    ok = False
    try:
        with deterministic(deterministic_algorithms):
            yield ctx
        ok = True
    except Exception as exc:
        user_error = _comm_failure(exc, timeout_s) if isinstance(exc, RuntimeError) else None
        if isinstance(user_error or exc, (PeerLost, CollectiveTimeout)):
            # Another rank's failure reached this one as a broken collective. If that rank said why,
            # this rank stays quiet: one line for one cause.
            (user_error or exc).quiet = ctx.world_size > 1 and _cause_reported()
        if ctx.world_size > 1:
            report_failure(user_error or exc, ctx)  # before the group goes: its teardown is what the others see
        if user_error is None:
            raise
        raise user_error from exc
    finally:
        if ok:
            # Let every rank's last collective finish before any rank tears down its gloo/NCCL
            # threads: a rank that exits while a peer is mid-collective can abort
            # ("terminate called without an active exception"). Skipped on error: a dead peer
            # would make it wait for the full timeout.
            ctx.barrier()
        dist.destroy_process_group()


_CAUSE_KEY = "ddpkit/cause-reported"


def report_failure(exc: BaseException, ctx: DistContext) -> None:
    """Say once why this rank fails: its one line (a ddpkit error) or its traceback (a bug), on
    stderr and in the file where the elastic agent collects workers' errors for the launcher;
    and note in the job's store that a cause was given, so peers that merely lost this rank
    stay quiet. An error every rank meets alike (``all_ranks``) is left to the launcher."""
    if getattr(exc, "reported", False) or getattr(exc, "all_ranks", False):
        return
    quiet = bool(getattr(exc, "quiet", False))
    if isinstance(exc, DdpkitError):
        line, code = f"rank {ctx.rank}: {exc}", exc.exit_code
        if not quiet:
            print(f"ddpkit: error: {line}", file=sys.stderr, flush=True)
    else:
        traceback.print_exc()  # a bug keeps its traceback
        sys.stderr.flush()
        line, code = f"rank {ctx.rank} raised {type(exc).__name__}: {exc}", 1
    if not quiet:
        _note_cause(ctx)
    write_error_file(line, quiet, code)
    exc.reported = True


def write_error_file(line: str, quiet: bool, exit_code: int) -> None:
    """The elastic agent's per-worker error file (``TORCHELASTIC_ERROR_FILE``), which the launcher reads."""
    path = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if not path:
        return
    first = line.strip().splitlines()[0][:500] if line.strip() else line
    try:
        with open(path, "w") as fh:
            json.dump({"message": first, "timestamp": int(time.time()),
                       "ddpkit": {"quiet": quiet, "exit_code": exit_code}}, fh)
    except OSError:
        pass


def _note_cause(ctx: DistContext) -> None:
    """Tell the job (through the process group's store) that this rank prints why it failed."""
    try:
        dist.distributed_c10d._get_default_store().set(_CAUSE_KEY, str(ctx.rank))
    except Exception:  # the store may be gone with a dead peer: then the others speak for themselves
        pass


def _cause_reported() -> bool:
    """Whether another rank already said why the job failed (a non-blocking store check)."""
    try:
        return dist.distributed_c10d._get_default_store().check([_CAUSE_KEY])
    except Exception:
        return False


_TIMEOUT = re.compile(r"timed out|timeout", re.IGNORECASE)
_COMM = re.compile(r"gloo|nccl|store|collective|process ?group", re.IGNORECASE)
_PEER_GONE = re.compile(r"connection (closed|reset) by peer|broken pipe|connection refused", re.IGNORECASE)


def timeout_message(timeout_s: float, detail: str = "") -> str:
    """What a collective timeout means and what to do, for gloo errors and NCCL aborts alike."""
    return (f"a collective did not complete within --timeout-s {timeout_s:g} s: another rank stalled, or died "
            f"without its launcher noticing. If a step, an evaluation or a snapshot save can legitimately take "
            f"that long, raise --timeout-s.{f' ({detail})' if detail else ''}")


def _comm_failure(exc: RuntimeError, timeout_s: float) -> Exception | None:
    """A collective's failure, said in the user's terms; None for any other error."""
    text = str(exc)
    comm = isinstance(exc, getattr(dist, "DistError", ())) or _COMM.search(text)
    if not comm:
        return None
    first = text.strip().splitlines()[0][:240] if text.strip() else type(exc).__name__
    if _TIMEOUT.search(text):
        return CollectiveTimeout(timeout_message(timeout_s, first))
    if _PEER_GONE.search(text):
        return PeerLost(f"another rank left mid-collective (it died or was stopped; its own output says why). "
                        f"({first})")
    return None
