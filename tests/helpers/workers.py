"""Worker functions for multi-process tests (importable by spawned children)."""

from __future__ import annotations

import time
from types import SimpleNamespace

import torch
import torch.distributed as dist
from torch import nn

from ddpkit.data import ImageData, Meta
from ddpkit.data.loader import EvalSource, Preprocess
from ddpkit.ranks.context import distributed
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


def late_from_init_on_rank_1(late_s: float) -> list[tuple[float, float]]:
    """Rank 1 returns from ``init_process_group`` ``late_s`` seconds after its peers, as a rank still
    finishing gloo's handshake with them does; every rank's (init returned, function started) wall times,
    gathered: a peer that may start (and fail, and tear its group down) before rank 1 left its init is the
    race of issue 33's nested launch()."""
    import os

    real = dist.init_process_group

    def late(*args, **kwargs):
        real(*args, **kwargs)
        if os.environ["RANK"] == "1":
            time.sleep(late_s)
        late.returned = time.time()

    dist.init_process_group = late  # ddpkit.ranks.context calls it through the torch.distributed module
    try:
        with distributed("cpu", timeout_s=30) as ctx:
            mine, times = (late.returned, time.time()), [None] * ctx.world_size
            dist.all_gather_object(times, mine)
            return times
    finally:
        dist.init_process_group = real


class TermWhileStarting:
    """An argument that sends its launcher SIGTERM while the workers start. ``when="starting"``: while torch's
    agent is starting them (it is pickled for each worker inside the agent's ``_start_workers``; ddpkit's own
    check of the arguments before pickles it too, and sends nothing). ``when="unpickled"``: from a worker as
    it unpickles its arguments, newly forked from the forkserver and still ignoring SIGTERM as the forkserver
    does, which it goes on doing for 1 s, past the agent's signal to it."""

    def __init__(self, when: str):
        self.when = when

    def __reduce__(self):
        import inspect
        import os
        import signal

        in_agent = any(frame.function == "_start_workers" for frame in inspect.stack())
        if self.when == "starting" and in_agent:
            _signalled()
            os.kill(os.getpid(), signal.SIGTERM)
        if self.when == "unpickled" and in_agent:
            return (_term_launcher, (os.getpid(),))
        return (TermWhileStarting, (self.when,))


def _term_launcher(pid: int) -> None:
    import os
    import signal

    _signalled()
    os.kill(pid, signal.SIGTERM)  # from each worker: the launcher's handler takes the first
    time.sleep(1.0)  # still unpickling: SIGTERM ignored, as the forkserver ignores it


def _signalled() -> None:
    """Record when the first SIGTERM went (``SIGNALLED_AT``: a file), so a test times the stop from the signal,
    not from the processes' start, which a loaded machine stretches."""
    import os

    path = os.environ.get("SIGNALLED_AT")
    if path:
        try:
            with open(path, "x") as fh:  # the first sender's time only
                fh.write(repr(time.time()))
        except FileExistsError:
            pass


def sleep_then_return(seconds: float, *ignored) -> float:
    """A worker that sleeps ``seconds`` (stopped by a signal's default action before that, if one reaches it)."""
    time.sleep(seconds)
    return seconds


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


class _BroadcastCounter:
    """Counts ``torch.distributed.broadcast`` calls while active (DistContext looks it up at each call)."""

    def __init__(self):
        self.calls = 0

    def __enter__(self):
        self._real = dist.broadcast

        def counted(*args, **kwargs):
            self.calls += 1
            return self._real(*args, **kwargs)

        dist.broadcast = counted
        return self

    def __exit__(self, *exc):
        dist.broadcast = self._real


def _rank_buffers(model: nn.Module, rank: int) -> None:
    """Every buffer set to values that differ per rank (and per buffer)."""
    with torch.no_grad():
        for i, buf in enumerate(model.buffers()):
            buf.copy_(torch.arange(buf.numel()).view_as(buf) + 100 * rank + 10 * i)


def _all_ranks(ok: bool) -> bool:
    flag = torch.tensor([float(ok)])
    dist.all_reduce(flag, op=dist.ReduceOp.MIN)
    return bool(flag.item())


def coalesced_broadcast() -> dict:
    """DistContext.broadcast_many at world size 2: rank 0's values everywhere, one broadcast per
    (device, dtype) group, each tensor's own strides kept."""
    with distributed("cpu") as ctx:
        model = nn.Sequential(nn.BatchNorm2d(3), nn.BatchNorm2d(4), nn.BatchNorm1d(5))
        expected = nn.Sequential(nn.BatchNorm2d(3), nn.BatchNorm2d(4), nn.BatchNorm1d(5))
        _rank_buffers(model, ctx.rank)
        _rank_buffers(expected, 0)
        with _BroadcastCounter() as bn_count:
            ctx.broadcast_many(list(model.buffers()))
        bn_equal = all(torch.equal(a, b) for a, b in zip(model.buffers(), expected.buffers()))
        bn_dtypes = all(a.dtype == b.dtype for a, b in zip(model.buffers(), expected.buffers()))

        nhwc = (torch.arange(2 * 3 * 4 * 5.0).view(2, 3, 4, 5) + ctx.rank).contiguous(memory_format=torch.channels_last)
        mixed = [nhwc, torch.full((3,), float(ctx.rank), dtype=torch.float64), torch.tensor(7 + ctx.rank)]
        ptr = nhwc.data_ptr()
        with _BroadcastCounter() as mixed_count:
            ctx.broadcast_many(mixed)
        mixed_ok = (
            torch.equal(nhwc, torch.arange(2 * 3 * 4 * 5.0).view(2, 3, 4, 5))
            and nhwc.is_contiguous(memory_format=torch.channels_last)
            and nhwc.data_ptr() == ptr
            and torch.equal(mixed[1], torch.zeros(3, dtype=torch.float64))
            and mixed[2].item() == 7
        )
        with _BroadcastCounter() as empty_count:
            ctx.broadcast_many([])
        return {
            "world": ctx.world_size,
            "bn_equal": _all_ranks(bn_equal and bn_dtypes),
            "bn_broadcasts": bn_count.calls,
            "mixed_ok": _all_ranks(mixed_ok),
            "mixed_broadcasts": mixed_count.calls,
            "empty_broadcasts": empty_count.calls,
        }


def coalesced_engine(run_dir: str) -> dict:
    """The engine's own buffer broadcasts at world size 2 (the ConvNet, BatchNorm-only buffers): after the
    DDP wrap and before an evaluation, rank 0's buffers everywhere, in one broadcast per dtype."""
    from ddpkit.config import TrainConfig
    from ddpkit.data import load_dataset
    from ddpkit.models import build_model
    from ddpkit.train.engine import Engine
    from ddpkit.train.strategy import DDPStrategy, prepare

    with distributed("cpu") as ctx:
        cfg = TrainConfig(
            dataset="synthetic",
            synthetic_shape="1,12,12",
            synthetic_size=64,
            batch_size=16,
            model="convnet",
            epochs=1,
            progress=False,
            run_dir=run_dir,
        ).resolved()
        model = build_model("convnet", 1, 12, 12, 10)
        expected = build_model("convnet", 1, 12, 12, 10)
        _rank_buffers(model, ctx.rank)
        _rank_buffers(expected, 0)
        n_buffers = len(list(model.buffers()))
        with _BroadcastCounter() as wrap_count:
            raw, ddp, _, _ = prepare(model, cfg, ctx, DDPStrategy(), static_graph=True)
        wrap_equal = all(torch.equal(a, b) for a, b in zip(raw.buffers(), expected.buffers()))

        engine = Engine(
            cfg, ctx, build_model("convnet", 1, 12, 12, 10), load_dataset(cfg), Classification(), static_graph=True
        )
        _rank_buffers(engine.raw, ctx.rank)
        with _BroadcastCounter() as eval_count:
            engine._evaluate()
        eval_equal = all(torch.equal(a, b) for a, b in zip(engine.raw.buffers(), expected.buffers()))
        return {
            "wrapped": ddp is not None,
            "buffers": n_buffers,
            "wrap_equal": _all_ranks(wrap_equal),
            "wrap_broadcasts": wrap_count.calls,
            "eval_equal": _all_ranks(eval_equal),
            "eval_broadcasts": eval_count.calls,
        }


def agree_on_steps(run_dir: str, steps: tuple) -> list[str]:
    """Checkpointer._agree_on at world size 2, rank r at ``steps[r]``: what every rank said."""
    from ddpkit.config import TrainConfig
    from ddpkit.errors import RunDirError
    from ddpkit.run.checkpoint import Checkpointer

    with distributed("cpu") as ctx:
        ckpt = Checkpointer(run_dir, ctx, TrainConfig(run_dir=run_dir).resolved())
        try:
            ckpt._agree_on(steps[ctx.rank])
            said = "agreed"
        except RunDirError as exc:
            said = str(exc)
        gathered = [None] * ctx.world_size
        dist.all_gather_object(gathered, said)
        return gathered


def data_path_on_a_busy_gpu(free_bytes: tuple) -> list[str]:
    """Every rank's ``choose_path`` when each sees ``free_bytes[rank]`` free on its GPU (other processes on
    one of the GPUs), as rank 0 gathers them. The GPU is a label: ``torch.cuda.mem_get_info`` answers
    for it, and the process group is gloo on the CPU."""
    from ddpkit.data.loader import choose_path
    from ddpkit.ranks.context import DistContext

    with distributed("cpu") as ctx:
        real = torch.cuda.mem_get_info
        torch.cuda.mem_get_info = lambda device=None: (free_bytes[ctx.rank], 80 * 2**30)
        try:
            on_gpu = DistContext(
                ctx.rank,
                ctx.local_rank,
                ctx.world_size,
                ctx.local_world_size,
                torch.device("cuda", ctx.local_rank),
                "gloo",
            )
            data = ImageData(torch.zeros(100, 1, 3, 3, dtype=torch.uint8), torch.zeros(100, dtype=torch.long))
            cfg = SimpleNamespace(join=False, data_path="auto", device_data_fraction=0.25, dataset="synthetic")
            path = choose_path(data, cfg, on_gpu)  # 900 + 800 bytes: resident where a quarter of free holds it
        finally:
            torch.cuda.mem_get_info = real
        gathered = [None] * ctx.world_size
        dist.all_gather_object(gathered, path)
        return gathered


def least_free_per_rank(free_bytes: tuple) -> list[dict]:
    """``least_free_bytes`` at world 2 with each rank's own value, and how many all-reduces ``choose_path``
    runs whatever the flags (every rank must run the same collectives)."""
    from ddpkit.data.loader import choose_path, least_free_bytes
    from ddpkit.ranks.context import DistContext

    with distributed("cpu") as ctx:
        least = least_free_bytes(ctx, free_bytes[ctx.rank])
        cpu_none = least_free_bytes(ctx, None)  # off CUDA: no collective, on every rank alike
        real_reduce, real_info, calls = dist.all_reduce, torch.cuda.mem_get_info, []
        dist.all_reduce = lambda *a, **kw: calls.append(1) or real_reduce(*a, **kw)
        torch.cuda.mem_get_info = lambda device=None: (free_bytes[ctx.rank], 80 * 2**30)
        try:
            on_gpu = DistContext(ctx.rank, ctx.local_rank, 2, 2, torch.device("cuda", ctx.rank), "gloo")
            data = ImageData(torch.zeros(100, 1, 3, 3, dtype=torch.uint8), torch.zeros(100, dtype=torch.long))
            flags = ({"join": True}, {"data_path": "host"}, {"data_path": "device"}, {"data_path": "auto"})
            base = dict(join=False, data_path="auto", device_data_fraction=0.25, dataset="x")
            paths = [choose_path(data, SimpleNamespace(**{**base, **f}), on_gpu) for f in flags]
        finally:
            dist.all_reduce, torch.cuda.mem_get_info = real_reduce, real_info
        gathered = [None] * ctx.world_size
        dist.all_gather_object(gathered, {"least": least, "cpu": cpu_none, "reduces": len(calls), "paths": paths})
        return gathered


def user_model_on_another_gpu_in_rank_1() -> list[dict]:
    """``own_copy`` at world 2 where rank 1 alone finds the model on a GPU not its own (the check is
    stubbed: the tensors are on the CPU and count as foreign on rank 1): what each rank printed, and
    whether its copied optimizer steps its copied model's parameters."""
    import contextlib
    import io

    from ddpkit.train import workers as train_workers

    with distributed("cpu") as ctx:
        model = nn.Sequential(nn.Linear(2, 2), nn.BatchNorm1d(2))
        opt = torch.optim.Adam(model.parameters(), lr=0.1)
        model(torch.ones(3, 2)).sum().backward()
        opt.step()  # state to copy
        real = train_workers.foreign_devices
        train_workers.foreign_devices = lambda devices, mine: (
            [torch.device("cpu")] if ctx.rank == 1 and mine == ctx.device else []
        )
        said = io.StringIO()
        try:
            with contextlib.redirect_stderr(said):
                copied, copy_opt = train_workers.own_copy(ctx, (model, opt))
        finally:
            train_workers.foreign_devices = real
        params = {id(p) for p in copied.parameters()}
        state = [t for s in copy_opt.state.values() for t in s.values() if t.dim()]
        mine = {
            "said": said.getvalue(),
            "steps_copy": {id(p) for g in copy_opt.param_groups for p in g["params"]} == params,
            "state_copied": set(map(id, copy_opt.state)) == params
            and not {t.data_ptr() for t in state} & {t.data_ptr() for s in opt.state.values() for t in s.values()},
        }
        gathered = [None] * ctx.world_size
        dist.all_gather_object(gathered, mine)
        return gathered


def fails_while_rank0_is_held(mark: str) -> None:
    """Rank 1 raises while rank 0 is held in its own code with ddpkit's stop signals installed (as a rank of
    Trainer or Loop is: a SIGTERM is only noted, for the next safe point, which a held rank never reaches).
    Rank 1 writes the time it fails to ``mark``."""
    from pathlib import Path

    from ddpkit.ranks.context import distributed
    from ddpkit.train.signals import StopSignal

    with distributed("cpu", timeout_s=120) as ctx, StopSignal():
        ctx.barrier()
        if ctx.rank == 1:
            Path(mark).write_text(repr(time.time()))
            raise RuntimeError("rank 1 fails")
        time.sleep(120)


def weight_check_dealt(ctx, nan_in: int) -> dict:
    """World 2 under DDP: the safe point's weight check, each rank reading its dealt share
    (``DDPStrategy.weights_to_check``), with a NaN put into parameter ``nan_in`` (-1: none) on every rank, as a
    NaN in replicated weights is. What rank 0 read, and the verdict every rank got."""
    from ddpkit.train.metrics import sync_interval
    from ddpkit.train.strategy import strategy_for

    torch.manual_seed(0)
    raw = nn.Sequential(nn.Linear(8, 64), nn.ReLU(), nn.Linear(64, 64), nn.Linear(64, 2))
    strategy = strategy_for("ddp")
    model = strategy.wrap(raw, ctx)
    params = list(raw.parameters())
    if nan_in >= 0:
        with torch.no_grad():
            params[nan_in].view(-1)[0] = float("nan")
    mine = strategy.weights_to_check(model, ctx)
    synced = sync_interval(ctx, None, stop=False, log_error=None, weights=mine)
    return {"read": [next(i for i, p in enumerate(params) if p is w) for w in mine], "bad": synced.bad_weights}
