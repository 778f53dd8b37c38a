"""The distributed context: process setup (device, threads, determinism), the process
group's setup and teardown, and nothing else.

    with distributed(device="auto", timeout_s=600) as ctx:
        ctx.rank, ctx.world_size, ctx.device   # an explicit value, passed to whoever needs it

Under torchrun (or ddpkit's own elastic launch) the ranks come from the environment;
otherwise this is a world of one, still with a real process group so every code path
(all-reduce, DDP) is the same at any size. The group is destroyed even on error.

CUDA-only here: ``torch.cuda.set_device`` before ``init_process_group`` (NCCL binds the
current device), and NCCL barriers name the rank's GPU (``device_ids``; otherwise torch guesses
it from the global rank). ``device_id=`` is not passed to ``init_process_group``: it makes NCCL
initialise eagerly, which has been reported to hang at random (pytorch/pytorch#153960) and to
slow training (NVIDIA-NeMo/RL#3073). Other CUDA-only branches say why at their own line.

:func:`on_rank0` is the rank-0 rule: every rank calls it, global rank 0 writes, and every rank
learns whether the write worked.
"""

from __future__ import annotations

import os
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import timedelta
from typing import Callable, Iterable, Iterator, Mapping

import torch
import torch.distributed as dist

from ..device import resolve_device_type
from ..errors import CollectiveTimeout, ConfigError, DdpkitError, RunDirError
from . import env, hangwatch
from .env import under_launcher
from .failures import cause_reported, rendezvous_failure, report_failure, worker_failure
from .hangwatch import HangWatch, watched

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

    def __eq__(self, other) -> bool:
        if isinstance(other, int) and not isinstance(other, bool):
            # ``fn(rank, world_size)`` kept from an mp.spawn script under ddpkit.launch, which passes a DistContext
            # there: ``rank == 0`` was False on every rank, and the script's rank-0 work (its prints, its saved
            # model) silently never ran (the porter's seed-001 port)
            error = ConfigError(
                f"a DistContext was compared with the number {other}: ddpkit.launch(fn) calls fn(ctx, *args), not "
                f"mp.spawn's fn(rank, *args); read the rank as ctx.rank (and ctx.world_size, ctx.device)"
            )
            error.all_ranks = True  # every rank meets it: said once
            raise error
        if other.__class__ is not self.__class__:
            return NotImplemented
        return all(getattr(self, f) == getattr(other, f) for f in self.__dataclass_fields__)

    def all_reduce(self, tensor: torch.Tensor, op=dist.ReduceOp.SUM) -> torch.Tensor:
        """In-place all-reduce; every rank must call it."""
        if self.world_size > 1:
            with watched("all_reduce", tensor) as entry:
                entry["work"] = dist.all_reduce(tensor, op=op, async_op=True)
                entry["work"].wait()  # what async_op=False does; the work stays in the watch's record
        return tensor

    def broadcast(self, tensor: torch.Tensor, src: int = 0) -> torch.Tensor:
        """In-place broadcast from global rank ``src``; every rank must call it."""
        if self.world_size > 1:
            with watched("broadcast", tensor) as entry:
                entry["work"] = dist.broadcast(tensor, src=src, async_op=True)
                entry["work"].wait()
        return tensor

    def broadcast_many(self, tensors: Iterable[torch.Tensor], src: int = 0) -> None:
        """In-place broadcast of many tensors from global rank ``src``, one collective per (device, dtype)
        group; every rank must call it with the same tensors in the same order.

        One broadcast per tensor costs one collective latency each (3 per BatchNorm layer: 159 for a
        ResNet-50's buffers); packed into one flat buffer per group it is one per group (2 for BatchNorm:
        float running stats, int64 batch counts). Each tensor gets the result by ``copy_``, so its own
        strides (channels-last buffers) stay as they are.
        """
        if self.world_size == 1:
            return
        groups: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = {}
        for t in tensors:
            groups.setdefault((t.device, t.dtype), []).append(t)
        # In first-seen order, which every rank shares, so the ranks' collectives pair up
        for group in groups.values():
            # cat always makes a new buffer (even of one tensor), so the collective never writes into
            # a tensor's own memory with strides other than its own
            flat = torch.cat([t.detach().reshape(-1) for t in group])
            with watched("broadcast", flat) as entry:
                entry["work"] = dist.broadcast(flat, src=src, async_op=True)
                entry["work"].wait()
            with torch.no_grad():
                for t, synced in zip(group, flat.split([t.numel() for t in group])):
                    t.copy_(synced.view(t.shape))

    def all_gather(self, tensor: torch.Tensor) -> torch.Tensor:
        """Every rank's ``tensor``, stacked in rank order; every rank must call it."""
        if self.world_size == 1:
            return tensor.unsqueeze(0)
        parts = [torch.empty_like(tensor) for _ in range(self.world_size)]
        with watched("all_gather", tensor) as entry:
            entry["work"] = dist.all_gather(parts, tensor.contiguous(), async_op=True)
            entry["work"].wait()
        return torch.stack(parts)

    def barrier(self) -> None:
        if self.world_size > 1:
            with watched("barrier") as entry:
                if self.backend == "nccl":
                    entry["work"] = dist.barrier(device_ids=[self.device.index], async_op=True)
                else:
                    entry["work"] = dist.barrier(async_op=True)
                entry["work"].wait()


def cpu_cores() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def cpu_threads(local_world_size: int, cores: int | None = None) -> int:
    """Intra-op threads per process, so N processes on a node never oversubscribe its cores."""
    return max(1, (cpu_cores() if cores is None else cores) // max(1, local_world_size))


def plan(environ: Mapping[str, str], device_type: str, gpu_count: int, cores: int) -> tuple[DistContext, int]:
    """This process's place in the job, and its intra-op thread count. Pure: no device is touched.

    The thread rule holds on CUDA too: ``elastic_launch``, unlike torchrun, leaves
    OMP_NUM_THREADS unset, and 8 ranks each using every core for host work (data
    indexing, kernel launches, the optimizer's Python) slow each other down.
    """
    if under_launcher(environ):
        rank, local_rank, world = int(environ[env.RANK]), int(environ[env.LOCAL_RANK]), int(environ[env.WORLD_SIZE])
        local_world = int(environ.get(env.LOCAL_WORLD_SIZE, world))
    else:
        rank, local_rank, world, local_world = 0, 0, 1, 1
    if device_type == "cuda" and environ.get(env.SHARE_GPU) == "1" and gpu_count > 0:
        # Development opt-in: every rank of the node on one GPU. NCCL refuses two ranks on one
        # device; gloo runs all_reduce, broadcast and all_gather on CUDA tensors (through the host).
        device, backend = torch.device("cuda", 0), "gloo"
    elif device_type == "cuda":
        if environ.get(env.LAUNCHED_BY) == "slurm" and gpu_count == 1 and local_world > 1:
            # srun --gpus-per-task=1 (or --gpu-bind): each task sees its own GPU only, as device 0
            return DistContext(rank, local_rank, world, local_world, torch.device("cuda", 0), "nccl"), cpu_threads(
                local_world, cores
            )
        # Checked on the node's process count, not this rank's index, so every rank of the
        # node fails alike and the error is printed once (by rank 0), not "invalid device ordinal".
        if local_world > gpu_count:
            raise ConfigError(
                f"this node runs {local_world} processes but sees {gpu_count} GPU(s); start at most "
                f"{gpu_count} per node (torchrun --nproc-per-node {gpu_count}), or check "
                f"CUDA_VISIBLE_DEVICES (or, for testing, {env.SHARE_GPU}=1: every rank on cuda:0, over gloo)"
            )
        device, backend = torch.device("cuda", local_rank), "nccl"
    else:
        device, backend = torch.device("cpu"), "gloo"
    ctx = DistContext(rank, local_rank, world, local_world, device, backend)
    # A worker forked from a process that used OpenMP hangs in its first parallel region: one thread.
    threads = 1 if environ.get(env.FORKED_WORKER) == "1" else cpu_threads(local_world, cores)
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
    saved = (
        torch.are_deterministic_algorithms_enabled(),
        torch.backends.cudnn.deterministic,
        torch.backends.cudnn.benchmark,
        os.environ.get(env.CUBLAS_WORKSPACE_CONFIG),
    )
    os.environ.setdefault(env.CUBLAS_WORKSPACE_CONFIG, CUBLAS_DETERMINISTIC)  # read at the first cuBLAS call
    torch.use_deterministic_algorithms(True)
    torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark = True, False
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(saved[0])
        torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark = saved[1], saved[2]
        if saved[3] is None:
            os.environ.pop(env.CUBLAS_WORKSPACE_CONFIG, None)


@contextmanager
def distributed(
    device: str = "auto", timeout_s: float = 600.0, deterministic_algorithms: bool = False
) -> Iterator[DistContext]:
    dev_type = resolve_device_type(device)
    ctx, threads = plan(os.environ, dev_type, torch.cuda.device_count() if dev_type == "cuda" else 0, cpu_cores())
    torch.set_num_threads(threads)
    if ctx.device.type == "cuda":
        torch.cuda.set_device(ctx.device)  # before init_process_group, so NCCL binds this rank's GPU
    if ctx.backend == "nccl":
        hangwatch.flight_recorder_defaults()  # read when the NCCL group is made
    timeout = timedelta(seconds=timeout_s)
    if under_launcher():
        try:
            store = _group_store(ctx, timeout)
            dist.init_process_group(
                backend=ctx.backend, timeout=timeout, store=store, rank=ctx.rank, world_size=ctx.world_size
            )
        except dist.DistError as exc:  # the env:// rendezvous (torchrun's or SLURM's variables): a peer not there
            raise rendezvous_failure(exc, ctx.world_size, timeout_s) from None
    else:
        dist.init_process_group(backend=ctx.backend, timeout=timeout, store=dist.HashStore(), rank=0, world_size=1)
    hangwatch.WATCH = _watch(ctx, timeout_s)
    _SETTLED[0] = False
    try:
        try:
            if ctx.backend == "gloo" and ctx.world_size > 1:
                # gloo connects every pair of ranks inside init_process_group, and one rank may return from it
                # while a peer is still finishing its handshake with it: if that rank then failed at once (a
                # nested launch(), an error on the first line of a function) and tore its group down, the peer
                # failed in init with "Connection closed by peer" (1 run in 24 under load), blaming the wrong
                # rank. No rank leaves this barrier before every rank has finished its init. Inside the try: a
                # failure here is said as any other, and the group is destroyed.
                dist.barrier()
            with deterministic(deterministic_algorithms):
                yield ctx
            # Let every rank's last collective finish before any rank tears down its gloo/NCCL
            # threads: a rank that exits while a peer is mid-collective can abort ("terminate called
            # without an active exception"). Not on error: a dead peer would make it wait the full
            # timeout. A peer still busy past --timeout-s is a timeout here, said as any other.
            # Not after settle(): that barrier was this one, and rank 0's work since must not be waited for.
            # Not after the function's own destroy_process_group() (an mp.spawn script's last line, kept under
            # ddpkit.launch): its group is gone, and with it this wait (before, an AssertionError per rank after a
            # run that had finished: the porter's seed-001 port).
            if not _SETTLED[0] and dist.is_initialized():
                ctx.barrier()
        except SystemExit as exc:
            # sys.exit(N) in this rank's own code: this rank is the cause, and says so, so that the
            # peers' "lost a rank" lines stay quiet and the job ends with its exit status. (Ctrl-C
            # reaches every rank of a terminal at once: the launcher says that one.)
            if ctx.world_size > 1 and exc.code not in (0, None) and not cause_reported():  # once, if all exit
                report_failure(_Exit(exc.code), ctx.rank)
            raise
        except Exception as exc:
            failure = worker_failure(exc, ctx.world_size, timeout_s)
            if isinstance(failure, CollectiveTimeout) and hangwatch.WATCH is not None:
                hangwatch.WATCH.publish()  # the hang its watch kept, if this was it: before the timeout's line
            if ctx.world_size > 1:
                report_failure(failure, ctx.rank)  # before the group goes: its teardown is what the others see
            if failure is exc:
                raise
            raise failure from exc
    finally:
        if hangwatch.WATCH is not None:
            hangwatch.WATCH.stop()
            hangwatch.WATCH = None
        if dist.is_initialized():  # (destroyed already by the function's own call)
            dist.destroy_process_group()


# The groups this process has made under a launcher, each with its own keys in the job's store (_group_store)
_GROUPS_MADE = [0]


def adopt(device: str = "auto") -> DistContext:
    """This rank's place in a process group made already (by ``ddpkit.launch``, or the user's own
    ``init_process_group``), which its owner sets up and tears down. The group's backend says where its
    ranks run: NCCL on the rank's GPU; gloo on the CPU, unless ``device="cuda"`` asks for CUDA tensors over
    gloo (every rank on its current device)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    local_rank = int(os.environ.get(env.LOCAL_RANK, rank))
    local_world = int(os.environ.get(env.LOCAL_WORLD_SIZE, world))
    backend = str(dist.get_backend())
    if backend == "nccl":
        where = torch.device("cuda", local_rank)
    elif device == "cuda" and resolve_device_type(device) == "cuda":
        where = torch.device("cuda", torch.cuda.current_device())
    else:
        where = torch.device("cpu")
    return DistContext(rank, local_rank, world, local_world, where, backend)


def _group_store(ctx: DistContext, timeout: timedelta):
    """The env:// rendezvous's store (torchrun's agent store, or rank 0's TCPStore), as ``init_process_group``
    would make it, under a prefix of this group's own.

    torch names the default group "0" again after ``destroy_process_group`` and keys it under the same prefix
    (``default_pg/0/``), where the first group's gloo addresses stay (``default_pg/0//cpu//0/<rank>``): in a
    second group in the same process (two Loops one after the other), a rank that read its peer's old address
    before the peer rewrote it connected to a closed port, and the group failed (gloo's connectFullMesh timing
    out, 50 s past --timeout-s, or a first collective's timeout). Every rank makes the same groups in the same
    order, so the count agrees; the restart count keeps a restarted attempt off an earlier one's keys where the
    agent's store outlives an attempt (pytorch/pytorch#135712). The hang watch's and the failure notes' keys,
    in the group's store, are the group's own too.
    """
    store, _, _ = next(dist.rendezvous("env://", ctx.rank, ctx.world_size, timeout=timeout))
    store.set_timeout(timeout)
    n, _GROUPS_MADE[0] = _GROUPS_MADE[0], _GROUPS_MADE[0] + 1
    return dist.PrefixStore(f"ddpkit/attempt{env.restart_count()}/group{n}", store)


def _watch(ctx: DistContext, timeout_s: float) -> HangWatch | None:
    """The hang watch of a multi-rank group (:mod:`ddpkit.ranks.hangwatch`), on the group's own store."""
    if ctx.world_size == 1:
        return None
    try:
        main_store = dist.distributed_c10d._get_default_store()  # private, stable since torch 1.x; guarded
        # Its own connection: a TCPStore client serves one request at a time, and the main thread may
        # wait on the store for long (NCCL's lazy connection setup at the first collective)
        store = main_store.clone()
    except Exception:  # noqa: BLE001 - no store to meet in: the timeout alone says it
        return None
    attempt = f"{os.environ.get(env.RUN_ID, 'run')}/{os.environ.get(env.RESTART_COUNT, '0')}"
    # NCCL's watchdog ends the process at the timeout, before the error reaches Python
    abrupt = ctx.backend == "nccl"
    return HangWatch(ctx.rank, ctx.world_size, timeout_s, store, attempt, main_store, abrupt).start()


# Whether the group in this process was settled (settle()): one group per process, as hangwatch.WATCH.
_SETTLED = [False]


def settle(ctx: DistContext) -> None:
    """Every rank's collectives are done: the group's final barrier, now. Call on every rank, with no
    collective after it; what a rank does next (rank 0's last records, the loggers' close, plots) holds
    no other rank in a collective that --timeout-s would end, so a run that finished keeps its exit 0."""
    ctx.barrier()
    _SETTLED[0] = True


class _Exit(DdpkitError):
    """A rank that left through ``sys.exit(code)``, said as its cause."""

    def __init__(self, code):
        super().__init__(f"called sys.exit({code!r})")
        self.exit_code = code if isinstance(code, int) else 1


# ---------------------------------------------------------------------- the rank-0 rule
def on_rank0(ctx: DistContext, write: Callable[[], object], what: str = "writing to the run directory") -> None:
    """Run ``write`` on global rank 0 only, and let every rank know whether it worked (one all-reduce).

    Without this, a rank-0 write error (full disk, read-only storage) would leave the other
    ranks waiting in their next collective until --timeout-s. Every rank raises on failure;
    rank 0's error carries the reason, which is the one the launcher prints. ``what`` names the write
    for the hang watch, which does not take the others' wait meanwhile for a hang.
    """
    error: DdpkitError | None = None
    unexpected: BaseException | None = None
    if ctx.is_main:
        try:
            with hangwatch.busy(what, announce=True):  # the others wait in agree() meanwhile: no hang
                write()
        except RunDirError as exc:
            error = exc
        except Exception as exc:  # noqa: BLE001 - any other failure: the others must not wait for rank 0 either
            error, unexpected = RunDirError(f"global rank 0 failed {what}: {type(exc).__name__}: {exc}"), exc
    try:
        agree(ctx, error)
    except RunDirError:
        if unexpected is not None:
            raise unexpected  # rank 0 raises what it met, with its traceback; the others the one line
        raise


def agree(ctx: DistContext, error: DdpkitError | None) -> None:
    """Raise on every rank if rank 0 met ``error`` (one all-reduce)."""
    if ctx.world_size > 1:
        flag = torch.tensor([float(error is not None)], device=ctx.device)
        failed = ctx.all_reduce(flag).item() > 0
    else:
        failed = error is not None
    if failed:
        raise error or RunDirError(
            "global rank 0 could not write to the run directory (its message is the one printed)"
        )
