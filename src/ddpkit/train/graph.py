"""``--cuda-graph``: the whole training step captured once as one CUDA graph, then replayed.

On a GPU a small model's step is bound by the host: the MNIST ConvNet's step held 0.53 ms of
GPU work inside 2.4-3.1 ms of Python and ~51 kernel launches (BENCHMARKS.md, step floor).
Replaying a captured graph launches all of it at once. What the graph holds is the engine's own
step, :meth:`Engine._step`, unchanged, fed by :class:`StaticBatches` and followed by
:class:`DeviceLR`, so that nothing in it reads the host:

* the batch is gathered on the device from a device step counter, out of the epoch's order,
  crop offsets and flips, copied in place into static buffers once per epoch;
* the learning rate is a device tensor looked up from the schedule's precomputed table
  (``base_lr * factor(step)``, the floats LambdaLR computes), which fused SGD and fused
  Adam/AdamW read (as float32 on CUDA: see :class:`DeviceLR`); the scheduler's own state is
  mirrored on the host, so snapshots and the log keep plain floats;
* metric sums are added on the device; the host half of the metrics (counts that are Python
  numbers, the same every step) is measured over the warm-up steps and added per replay.

Protocol (:class:`GraphedSteps`): ``WARMUP_STEPS`` eager steps, then one capture; every rank
says whether its capture worked (one eager all-reduce) and, if any failed, every rank drops the
graph, one line names the rank and the reason, and the run goes on eagerly from the same step.
A capture records kernels and runs none, so nothing of the step has happened when it fails; its
Python side effects (which ran once) are undone. The eager step here is the same
``Engine._step`` on the same batches and the same lr tensor, so a fallen-back run equals a
captured one bit for bit, and on the CPU (float64 lr) both equal ``--cuda-graph off``
(tests/train/test_graph.py, with the capture emulated). World size > 1 on CUDA is refused until
DDP's capture is built (see :func:`blockers`).

The CUDA-only lines are :class:`CudaCapture`; tests replace :data:`CAPTURE` with an emulation.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import torch.distributed as dist

from ..config import TrainConfig
from ..errors import ConfigError
from ..ranks.context import DistContext
from .task import Classification

# Eager steps before the capture. DDP samples its runtime statistics on iterations 1-10 and
# rebuilds its buckets after the first (torch/nn/parallel/distributed.py, _set_static_graph and
# the logger's sampling); cuDNN and cuBLAS pick and allocate their workspaces on first use.
WARMUP_STEPS = 11
# --cuda-graph auto captures only once the capture has passed benchmarks/gpu_acceptance.py's graph
# checks on a GPU (bitwise equal to eager, fallback, resume); until then it stays off and says so.
# This code was built without a GPU: the CPU tests emulate the capture (tests/train/test_graph.py).
AUTO_VERIFIED = False
# Fault injection for the fallback path (benchmarks/gpu_acceptance.py): "all", or global ranks "0,2".
FORCE_FAILURE = "DDPKIT_CUDA_GRAPH_FAIL"


@dataclass(frozen=True)
class Decision:
    """Whether this run captures its step, and why not (said on the ``[start]`` line)."""

    use: bool
    reason: str = ""

    def __str__(self) -> str:
        return f"on after {WARMUP_STEPS} eager steps" if self.use else f"off ({self.reason})"


def blockers(cfg: TrainConfig, device_type: str, world_size: int) -> list[str]:
    """What makes a run of ``cfg`` impossible to capture, from the config and the launch alone (checked
    before launch for ``--cuda-graph on``; what only a rank knows is checked there, alike on every rank)."""
    found = []
    if device_type != "cuda" and not CAPTURE.supports(device_type):
        found.append("the device is not CUDA")
    if device_type == "cuda" and world_size > 1:
        # DDP under capture needs more than the eager warm-up: DDP built on the capture stream and its
        # all-reduce on a group of its own, so that a capture failing inside backward leaves no reduction
        # pending for the eager step after it. Not built yet (no GPU to test it on).
        found.append("world size > 1 (DDP's capture is not built yet)")
    for flag, on in (
        ("--grad-accum > 1", cfg.grad_accum > 1),  # no_sync micro-steps: DDP's Python decides per micro-step
        ("--join", cfg.join),
        ("--strategy fsdp2", cfg.strategy == "fsdp2"),  # its step is FSDP2's hooks, not DDP's buckets
        ("--compile", cfg.compile),
        ("--amp fp16", cfg.amp == "fp16"),  # GradScaler reads found_inf on the host to skip a step
        ("--zero", cfg.zero),
        (f"--comm-hook {cfg.comm_hook}", cfg.comm_hook != "none"),  # hooks keep per-step Python state
        ("--data-path loader/host", cfg.data_path in ("loader", "host")),
    ):
        if on:
            found.append(flag)
    return found


def user_code(static_graph: bool, optimizer_given: bool, task) -> str:
    """What ``--cuda-graph auto`` leaves to ``--cuda-graph on``: the user's code whose Python a replay would not
    run ("" for a registry model, built-in optimizer and classification loss); ``static_graph``: a registry
    model (train/workers.py)."""
    mine = (
        ("model", not static_graph),
        ("optimizer", optimizer_given),
        ("loss or metrics", type(task) is not Classification or bool(task.metrics)),
    )
    return ", ".join(what for what, yes in mine if yes)


def decide(cfg: TrainConfig, ctx: DistContext, engine) -> Decision:
    """The same answer on every rank: its inputs are the config, the world size and the run's parts."""
    if cfg.cuda_graph == "off":
        return Decision(False, "--cuda-graph off")
    hard = blockers(cfg, ctx.device.type, ctx.world_size)
    if not getattr(engine.train_src, "on_device", False) or not hasattr(engine.train_src, "images"):
        hard.append(f"the train data is read through the {engine.train_src.path} path, not resident on the device")
    if engine.user_scheduler:
        hard.append("your scheduler's Python runs every step")
    host_lr = ctx.device.type == "cuda" and not all(
        g.get("fused") or g.get("capturable") for g in engine.opt.param_groups
    )
    if host_lr:  # a foreach or for-loop step takes the lr as a host number (torch/optim/sgd.py, adam.py)
        hard.append(f"your {type(engine.opt).__name__} is neither fused nor capturable (build it with fused=True)")
    if hard:
        if cfg.cuda_graph == "on":
            raise ConfigError(
                f"--cuda-graph on cannot capture this run: {'; '.join(hard)}. Use --cuda-graph auto (it says "
                f"why it stays off) or off"
            )
        return Decision(False, hard[0])
    if cfg.cuda_graph == "auto":
        if not AUTO_VERIFIED:
            return Decision(False, "auto awaits its first GPU acceptance run; --cuda-graph on uses it now")
        if ctx.world_size > 1:
            return Decision(False, "world size > 1: --cuda-graph on captures DDP's all-reduce too (not yet measured)")
        if engine.user_code:
            return Decision(False, f"your {engine.user_code}: --cuda-graph on tries to capture it")
    return Decision(True)


def lr_table(sched, steps: int) -> list[list[float]]:
    """Every param group's lr at steps 0..``steps``, as LambdaLR computes it (``base_lr * lmbda(step)``)."""
    return [[base * fn(s) for s in range(steps + 1)] for base, fn in zip(sched.base_lrs, sched.lr_lambdas)]


class DeviceLR:
    """The optimizer's learning rates as one device tensor, advanced on the device from the table.

    Each param group's ``lr`` becomes a 0-d view of ``self.now``; the fused optimizers read it from
    there, so the captured graph uses each replay's value, not the one seen during capture. The
    host keeps the scheduler's own state (``last_epoch``, ``get_last_lr()``) as plain floats.

    On CUDA the fused kernels read a tensor lr as float32, where they take a Python float lr in
    double (torch's FusedSgdKernel.cu: ``p -= lr * g`` in double): so under ``--cuda-graph`` the lr is
    the schedule's value rounded to float32, in the warm-up, every replay, a fallback and after a
    resume alike, and the host's copy (the log, snapshots) holds those rounded values. That is the
    one difference from ``--cuda-graph off`` (said on the ``[start]`` line). On the CPU the table is
    float64 and the eager kernels take it as the same double.
    """

    def __init__(self, opt, sched, total_steps: int, device: torch.device):
        self.opt, self.sched = opt, sched
        # float32 on CUDA (the fused kernels read a float lr; they cast a Python float to float32 too),
        # float64 elsewhere, where the eager kernels take the lr as a double
        dtype = torch.float32 if device.type == "cuda" else torch.float64
        exact = lr_table(sched, max(total_steps, sched.last_epoch) + 1)
        self.table = torch.tensor(exact, dtype=dtype, device=device)  # [groups, steps + 2]
        self.host = torch.tensor(exact, dtype=dtype).tolist()  # the values the kernels read, as floats
        self.counter = torch.tensor(sched.last_epoch, dtype=torch.long, device=device)
        self.now = self.table[:, sched.last_epoch].clone()
        self.capturable = [g.get("capturable") for g in opt.param_groups]  # as built: what snapshots keep
        for i, group in enumerate(opt.param_groups):
            group["lr"] = self.now[i]

    def capturable_for(self, capture: bool) -> None:
        """Adam and AdamW refuse capture unless ``capturable`` (Optimizer's graph capture health check),
        and warn if run eagerly with it; their fused step, the only kind let through on CUDA, ignores the
        flag otherwise. Set for the capture (replays run no Python), back as built for eager steps."""
        for group, built in zip(self.opt.param_groups, self.capturable):
            if "capturable" in group:
                group["capturable"] = True if capture else built

    def advance(self) -> None:
        """The scheduler's step, on the device (what the graph replays)."""
        self.counter += 1
        self.now.copy_(self.table.index_select(1, self.counter.view(1)).view(-1))

    def mirror(self) -> None:
        """The scheduler's step, on the host: every field its ``step()`` changes (LRScheduler.step and
        _update_lr), so that its state_dict is the eager run's."""
        self.sched._step_count += 1
        self.sched.last_epoch += 1
        self.sched._last_lr = [row[self.sched.last_epoch] for row in self.host]


class StaticBatches:
    """A device-resident epoch's batches, gathered on the device from a device step counter.

    The same samples and augmentation as :meth:`ResidentSource.batches` (the same order, offsets and
    flips, the same ``Preprocess.train``), from buffers that never move: the graph reads them.
    """

    def __init__(self, src, device: torch.device):
        self.src, self.b = src, src.batch
        used = src.used
        self.order = torch.empty(used, dtype=torch.long, device=device)
        self.offsets = torch.empty(used, 2, dtype=torch.long, device=device)
        self.flips = torch.empty(used, dtype=torch.bool, device=device)
        self.step = torch.zeros((), dtype=torch.long, device=device)
        self.lanes = torch.arange(self.b, device=device)

    def start_epoch(self, epoch: int, start_step: int) -> None:
        offsets, flips = self.src._params(epoch)
        self.order.copy_(self.src.epoch_indices(epoch))
        self.offsets.copy_(offsets)
        self.flips.copy_(flips)
        self.step.fill_(start_step)

    def next(self) -> tuple[torch.Tensor, torch.Tensor]:
        pos = self.step * self.b + self.lanes
        idx = self.order.index_select(0, pos)
        x = self.src.pre.train(
            self.src.images.index_select(0, idx), self.offsets.index_select(0, pos), self.flips.index_select(0, pos)
        )
        self.step += 1
        return x, self.src.labels.index_select(0, idx)


class HostHalf:
    """The metrics' host half (Python-number counts): what one step adds, read in each warm-up step,
    added per replay; and put back as it was after a capture (whose Python ran once, trained nothing)."""

    def __init__(self, acc):
        self.acc, self.delta, self.steady = acc, None, True

    def save(self) -> tuple:
        return list(self.acc.host_sums), list(self.acc.host_counts)

    def restore(self, saved: tuple) -> None:
        self.acc.host_sums, self.acc.host_counts = list(saved[0]), list(saved[1])

    def measured(self):
        """Around one eager step: the step adds into zeros (so what it adds is read exactly, not as a
        difference of running totals), and the totals then get it as the step would have added it."""
        return _Measured(self)

    def add(self) -> None:
        for total, step in zip((self.acc.host_sums, self.acc.host_counts), self.delta):
            for i, v in enumerate(step):
                total[i] += v


class _Measured:
    def __init__(self, host: HostHalf):
        self.host = host

    def __enter__(self):
        self.saved = self.host.save()
        k = len(self.saved[0])
        self.host.acc.host_sums, self.host.acc.host_counts = [0.0] * k, [0.0] * k
        return self

    def __exit__(self, *exc):
        step = self.host.save()
        self.host.restore(self.saved)
        if exc[0] is not None:
            return
        if self.host.delta is not None and step != self.host.delta:
            self.host.steady = False  # a metric's host number changes per step: a replay cannot repeat it
        self.host.delta = step
        self.host.add()


class CudaCapture:
    """The CUDA-only part: warm-up on a side stream, capture, replay (torch.cuda.graphs)."""

    def supports(self, device_type: str) -> bool:
        return device_type == "cuda"

    def warmup(self, device: torch.device):
        """Warm-up runs on a side stream, as torch's capture docs ask (autograd's and the libraries'
        per-stream state is set up there before capture)."""
        side = torch.cuda.Stream(device)
        side.wait_stream(torch.cuda.current_stream(device))
        return _SideStream(side, device)

    def capture(self, fn, device: torch.device, host: "HostHalf"):
        """``host``: what the step's Python changes on the host. A real graph runs no Python on replay;
        an emulation (tests) undoes it after each replay."""
        torch.cuda.synchronize(device)
        graph = torch.cuda.CUDAGraph()
        # thread_local: the hang watch's thread queries CUDA events during the capture (ranks/hangwatch.py),
        # which the default "global" mode counts as an unsafe call that invalidates it
        with torch.cuda.graph(graph, capture_error_mode="thread_local"):
            fn()
        return graph


class _SideStream:
    def __init__(self, stream, device):
        self.stream, self.device, self.inner = stream, device, torch.cuda.stream(stream)

    def __enter__(self):
        return self.inner.__enter__()

    def __exit__(self, *exc):
        self.inner.__exit__(*exc)
        torch.cuda.current_stream(self.device).wait_stream(self.stream)


CAPTURE = CudaCapture()


def _forced(rank: int) -> bool:
    value = os.environ.get(FORCE_FAILURE, "")
    return value == "all" or str(rank) in value.split(",")


class GraphedSteps:
    """The engine's steps under ``--cuda-graph``: eager warm-up, one capture, replays (see the module)."""

    def __init__(self, engine):
        self.engine, self.ctx = engine, engine.ctx
        self.batches = StaticBatches(engine.train_src, self.ctx.device)
        self.lr = DeviceLR(engine.opt, engine.sched, engine.total_steps, self.ctx.device)
        self.host = HostHalf(engine.acc)
        self.graph = None
        self.done = 0  # steps taken this run (not counting those before a resume)
        self.eager_only = False
        self.status = f"warming up ({WARMUP_STEPS} eager steps)"
        engine._advance_lr = self.lr.advance

    def epoch(self, epoch: int, start_step: int):
        """The epoch's steps, one placeholder each (the batch is gathered inside the step)."""
        self.batches.start_epoch(epoch, start_step)
        for _ in range(start_step, self.engine.train_src.steps_per_epoch):
            yield None

    def _body(self) -> None:
        self.engine._step((self.batches.next(),))

    def step(self) -> None:
        if self.graph is not None:
            self.graph.replay()
            self.host.add()
        elif self.done < WARMUP_STEPS:
            with CAPTURE.warmup(self.ctx.device), self.host.measured():
                self._body()
        elif self.eager_only:
            self._body()
        else:
            self._capture()
        self.lr.mirror()
        self.done += 1

    def _capture(self) -> None:
        """Capture on every rank, agree, and take this step by replay or, if any rank failed, eagerly."""
        saved, graph, why = self.host.save(), None, ""
        if not self.host.steady:
            why = "a metric returns a Python number that changes from step to step"
        else:
            try:
                self.lr.capturable_for(True)
                graph = CAPTURE.capture(self._body, self.ctx.device, self.host)
                if _forced(self.ctx.rank):  # after a capture that worked: the graph is dropped unused
                    raise RuntimeError(f"capture failure forced by {FORCE_FAILURE}")
            except Exception as exc:  # noqa: BLE001 - any failure of capture falls back; the reason is said
                why = f"{type(exc).__name__}: {str(exc).strip().splitlines()[0][:200] if str(exc).strip() else ''}"
        self.host.restore(saved)  # the capture ran the step's Python once and none of its kernels
        failed = self._failed_ranks(bool(why), why)
        if failed:
            self.lr.capturable_for(False)
            self.eager_only = True
            rank, reason = failed[0]
            self.status = f"fell back to eager at step {self.engine.pos.global_step}: rank {rank}: {reason}"
            self.engine.log.print(
                f"ddpkit: warning: the CUDA graph capture failed on rank {rank} ({reason}); training on with "
                f"the eager step, with the same results as the graph's (--cuda-graph off skips the attempt)"
            )
            self._body()
            return
        self.graph = graph
        self.status = f"captured at step {self.engine.pos.global_step}"
        self.graph.replay()
        self.host.add()

    def _failed_ranks(self, mine: bool, why: str) -> list[tuple[int, str]]:
        """(rank, reason) of every rank whose capture failed: one eager all-reduce, and the reasons
        gathered only when some rank failed (every rank takes the same branch)."""
        flag = torch.tensor([float(mine)], dtype=torch.float64, device=self.ctx.device)
        if not self.ctx.all_reduce(flag, op=dist.ReduceOp.MAX).item():
            return []
        reasons = [why]
        if self.ctx.world_size > 1:
            reasons = [None] * self.ctx.world_size
            dist.all_gather_object(reasons, why)
        return [(rank, r) for rank, r in enumerate(reasons) if r]

    def optimizer_state(self, state: dict) -> dict:
        """A snapshot's optimizer state with plain float lrs (the host's, no device read)."""
        if not isinstance(state, dict) or "param_groups" not in state:
            return state
        last = self.lr.sched.last_epoch
        groups = [
            {**g, "lr": row[last], **({"capturable": flag} if "capturable" in g else {})}
            for g, row, flag in zip(state["param_groups"], self.lr.host, self.lr.capturable)
        ]
        return {**state, "param_groups": groups}
