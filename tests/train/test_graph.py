"""``--cuda-graph``: the driver of the captured step (ddpkit.train.graph), on the CPU.

The capture itself is CUDA's; here it is emulated (tests/helpers/graph_emulation.py: capturing
records nothing, a replay does the step's tensor work and none of its host work). What these
tests pin is everything around it: the batch gathered on the device from a step counter, the
learning rate from the device table, the scheduler and the metrics' host half mirrored on the
host, the capture protocol (every rank agrees; a failure anywhere is one line and an eager
run from the same step), snapshots with plain floats, and resume. The verdict each time is
bit-for-bit equality with ``--cuda-graph off``.
"""

from __future__ import annotations

import graph_emulation
import pytest
import torch
from clirun import read_jsonl

from ddpkit.config import TrainConfig
from ddpkit.data import load_dataset
from ddpkit.errors import ConfigError
from ddpkit.models import build_model
from ddpkit.ranks.context import distributed
from ddpkit.train import graph
from ddpkit.train.engine import Engine
from ddpkit.train.optim import ScheduleFactor
from ddpkit.train.task import Classification

# 640 samples / 32 = 20 steps an epoch, 40 in all: 11 eager, one capture, 28 replays
BASE = dict(
    dataset="synthetic",
    synthetic_size=640,
    synthetic_shape="3,16,16",  # 3 channels: crop-flip augmentation, gathered in the graph too
    batch_size=32,
    epochs=2,
    log_every=5,
    plots=False,
    progress=False,
)
TIMES = {"time", "samples_per_s", "epoch_time_s", "peak_memory_mb", "startup_s", "finished_at", "train_time_s"}
TIMES |= {"snapshot_blocked_s", "snapshot_write_s"}  # how long snapshots held the steps, were written


@pytest.fixture(autouse=True)
def _real_capture_back():
    yield
    graph.CAPTURE = graph.CudaCapture()


# The MNIST ConvNet on 3x16x16: convolutions, BatchNorm buffers that every replay must update, and the
# augmentation gathered in the graph, at 8 s a 40-step run; ResNet-9 took 49 s a run on a loaded 2-core
# machine for nothing the graph driver treats differently (it captures whatever the step does).
def run(tmp_path, name: str, *, model="convnet", kill_after_snapshot_at=None, task=None, **kw):
    """One run in this process at world size 1: (summary, final weights, records without timings, engine)."""
    cfg = TrainConfig(**{**BASE, "model": model, "run_dir": str(tmp_path / name), **kw}).resolved()
    with distributed("cpu") as ctx:
        torch.manual_seed(0)
        net = build_model(cfg.model, 3, 16, 16, 10)
        if cfg.dtype == "float64":
            net = net.double()
        engine = Engine(cfg, ctx, net, load_dataset(cfg), task or Classification(0.1, False, 10), static_graph=True)
        if kill_after_snapshot_at is not None:
            save = engine.session.ckpt.save

            def save_then_die(state, step):
                path = save(state, step)
                if step == kill_after_snapshot_at:
                    raise KeyboardInterrupt
                return path

            engine.session.ckpt.save = save_then_die
            with pytest.raises(KeyboardInterrupt):
                engine.fit()
            return None
        summary = engine.fit()
    records = [{k: v for k, v in r.items() if k not in TIMES} for r in read_jsonl(tmp_path / name / "metrics.jsonl")]
    weights = {k: v.clone() for k, v in engine.raw.state_dict().items()}
    return summary, weights, records, engine


def same(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def without_graph_fields(records: list[dict]) -> list[dict]:
    return [{k: v for k, v in r.items() if k != "cuda_graph"} for r in records if r["event"] != "summary"]


OPTIONS = dict(ema=0.9, clip_grad_norm=1.0)  # EMA buffers, the clipping norm as a metric


@pytest.fixture(scope="module")
def eager(tmp_path_factory):
    """The ``--cuda-graph off`` run both bitwise tests compare with: the same config, so run once a module.
    Nothing is captured with the graph off, so it does not matter which emulation is installed."""
    try:
        return run(tmp_path_factory.mktemp("eager"), "off", cuda_graph="off", **OPTIONS)
    finally:
        graph.CAPTURE = graph.CudaCapture()


@pytest.mark.slow
def test_the_replayed_step_trains_the_same_bits_as_the_eager_one(tmp_path, eager):
    off = eager
    emulated = graph_emulation.install()
    on = run(tmp_path, "on", cuda_graph="on", **OPTIONS)
    assert emulated.captures == 1 and emulated.replays == 40 - graph.WARMUP_STEPS
    assert on[0]["cuda_graph"] == f"captured at step {graph.WARMUP_STEPS}"
    assert off[0]["cuda_graph"] == "off (--cuda-graph off)"
    assert same(on[1], off[1])
    assert same(on[3].ema.state_dict(), off[3].ema.state_dict())
    assert without_graph_fields(on[2]) == without_graph_fields(off[2])  # every loss, accuracy, lr and norm
    assert len({r["lr"] for r in on[2] if r["event"] == "step"}) == 8  # the schedule moved the lr at every record
    # the snapshot's scheduler and optimizer state: the eager run's, with plain float lrs
    state_on, state_off = on[3].state_dict(), off[3].state_dict()
    assert state_on["scheduler"] == state_off["scheduler"]
    for g_on, g_off in zip(state_on["optimizer"]["param_groups"], state_off["optimizer"]["param_groups"]):
        assert type(g_on["lr"]) is float and g_on == g_off


def test_auto_captures_the_builtin_step_at_world_one_and_says_so_on_the_start_line(tmp_path, monkeypatch):
    graph_emulation.install()
    monkeypatch.setattr(graph, "AUTO_VERIFIED", True)  # as it will be once a GPU has passed the graph checks
    summary, _, records, _ = run(tmp_path, "auto", model="mlp", epochs=1)  # --cuda-graph auto, the default
    start = next(r for r in records if r["event"] == "start")
    assert start["cuda_graph"] == f"on after {graph.WARMUP_STEPS} eager steps"
    assert summary["cuda_graph"] == f"captured at step {graph.WARMUP_STEPS}"


@pytest.mark.slow
def test_a_failed_capture_is_one_line_and_the_run_goes_on_eagerly_with_the_same_bits(tmp_path, capsys, eager):
    off = eager
    why = "operation not permitted when stream is capturing"
    emulated = graph_emulation.install(fail=why)
    fell = run(tmp_path, "fell", cuda_graph="on", **OPTIONS)
    out = capsys.readouterr().out
    assert emulated.captures == 1 and emulated.replays == 0
    assert fell[0]["cuda_graph"] == f"fell back to eager at step {graph.WARMUP_STEPS}: rank 0: RuntimeError: {why}"
    warnings = [line for line in out.splitlines() if "CUDA graph capture failed" in line]
    assert warnings == [
        f"ddpkit: warning: the CUDA graph capture failed on rank 0 (RuntimeError: {why}); training on with the "
        f"eager step, with the same results as the graph's (--cuda-graph off skips the attempt)"
    ]
    assert same(fell[1], off[1]) and without_graph_fields(fell[2]) == without_graph_fields(off[2])


def test_a_kill_and_resume_with_the_graph_on_is_bitwise_exact(tmp_path):
    """Snapshot at step 15 (after the capture at 11), killed, resumed: warm-up and capture again, and
    the run ends where an uninterrupted eager one does, to the bit (float64)."""
    graph_emulation.install()
    kw = dict(model="mlp", dtype="float64", cuda_graph="on", save_every_steps=15, **OPTIONS)
    run(tmp_path, "run", kill_after_snapshot_at=15, **kw)
    snap = torch.load(sorted((tmp_path / "run" / "checkpoints").glob("*.pt"))[-1], weights_only=False)
    assert all(type(g["lr"]) is float for g in snap["trainer"]["optimizer"]["param_groups"])
    resumed = run(tmp_path, "run", **kw)
    ref = run(tmp_path, "ref", **{**kw, "cuda_graph": "off"})
    assert resumed[0]["cuda_graph"] == f"captured at step {15 + graph.WARMUP_STEPS}"
    assert same(resumed[1], ref[1])
    last = [r for r in resumed[2] if r["event"] in ("step", "epoch")][-3:]
    assert last == [r for r in ref[2] if r["event"] in ("step", "epoch")][-3:]


def test_a_metric_whose_host_number_changes_per_step_is_not_captured(tmp_path, capsys):
    """A replay repeats the host half measured in warm-up; a count that changes cannot be repeated."""
    graph_emulation.install()
    calls = []

    def varying(outputs, batch):
        calls.append(1)
        return outputs.sum() * 0, 1 + len(calls) % 2

    summary = run(tmp_path, "v", model="mlp", epochs=1, cuda_graph="on", task=Classification(metrics={"v": varying}))[0]
    assert "changes from step to step" in summary["cuda_graph"]
    assert summary["cuda_graph"].startswith("fell back to eager")


def test_the_lr_table_is_lambdalrs_every_float(tmp_path):
    for kind, warm in (("constant", 0.0), ("cosine", 0.2), ("onecycle", 0.15)):
        opt = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.37)
        opt.add_param_group({"params": [torch.zeros(1, requires_grad=True)], "lr": 0.011})
        sched = torch.optim.lr_scheduler.LambdaLR(opt, ScheduleFactor(kind, 50, warm))
        table = graph.lr_table(sched, 50)
        seen = []
        for _ in range(51):
            seen.append([g["lr"] for g in opt.param_groups])
            opt.step()
            sched.step()
        assert [list(col) for col in zip(*table)] == seen, kind


def decision(tmp_path, registry=True, **kw):
    cfg = TrainConfig(**{**BASE, "model": "mlp", "run_dir": str(tmp_path), **kw}).resolved()
    with distributed("cpu") as ctx:
        torch.manual_seed(0)
        engine = Engine(
            cfg,
            ctx,
            build_model("mlp", 3, 16, 16, 10),
            load_dataset(cfg),
            Classification(0.0, False, 10),
            static_graph=registry,
        )
        return engine.graph_decision


def test_auto_stays_off_and_says_why_and_on_refuses_what_it_cannot_capture(tmp_path):
    assert str(decision(tmp_path, cuda_graph="auto")) == "off (the device is not CUDA)"  # the real capture: CUDA only
    with pytest.raises(ConfigError, match="--cuda-graph on cannot capture this run: the device is not CUDA"):
        decision(tmp_path, cuda_graph="on")
    graph_emulation.install()
    assert str(decision(tmp_path / "a0", cuda_graph="auto")) == (
        "off (auto awaits its first GPU acceptance run; --cuda-graph on uses it now)"
    )
    graph.AUTO_VERIFIED = True
    try:
        assert decision(tmp_path / "a", cuda_graph="auto").use
        assert str(decision(tmp_path / "u", cuda_graph="auto", registry=False)) == (
            "off (your model: --cuda-graph on tries to capture it)"
        )
    finally:
        graph.AUTO_VERIFIED = False
    assert str(decision(tmp_path / "b", cuda_graph="auto", grad_accum=2)) == "off (--grad-accum > 1)"
    assert str(decision(tmp_path / "c", cuda_graph="off")) == "off (--cuda-graph off)"
    with pytest.raises(ConfigError, match="--grad-accum > 1"):
        decision(tmp_path / "d", cuda_graph="on", grad_accum=2)


def test_cuda_graph_on_without_a_gpu_is_refused_before_launch():
    from ddpkit.preflight import preflight

    cfg = TrainConfig(dataset="synthetic", model="mlp", device="cpu", cuda_graph="on")
    with pytest.raises(ConfigError) as err:
        preflight(cfg, None, None, lambda c: None)
    assert str(err.value).startswith("--cuda-graph on cannot capture this run: the device is not CUDA")


@pytest.mark.slow
@pytest.mark.multiprocess
def test_at_world_two_a_capture_failing_on_one_rank_drops_the_graph_on_every_rank(tmp_path):
    """Rank 1's capture fails, rank 0's works: both take the eager step from there (one all-reduce
    says so), rank 1 and its reason are named, and the weights are an eager world-2 run's, bitwise.
    Without a failure both ranks replay, and it is the same run again (DDP's all-reduce in the step)."""
    from ddpkit.ranks.launcher import run_workers

    off = run_workers(graph_emulation.train_at_world, (str(tmp_path / "off"), "off"), 2)
    fell = run_workers(graph_emulation.train_at_world, (str(tmp_path / "fell"), "on", "1"), 2)
    on = run_workers(graph_emulation.train_at_world, (str(tmp_path / "on"), "on"), 2)
    assert fell["status"] == (
        f"fell back to eager at step {graph.WARMUP_STEPS}: rank 1: RuntimeError: capture failure forced by "
        f"{graph.FORCE_FAILURE}"
    )
    assert on["status"] == f"captured at step {graph.WARMUP_STEPS}"
    assert off["status"] == "off (--cuda-graph off)"
    assert same(fell["weights"], off["weights"]) and same(on["weights"], off["weights"])


def test_on_a_gpu_an_optimizer_that_reads_its_lr_on_the_host_is_refused_and_a_fused_one_is_not():
    """Only fused (or capturable) optimizers read the lr from the device; a foreach SGD would bake the
    capture's lr into the graph. Pure: the decision reads the config, the context and the run's parts."""
    from types import SimpleNamespace

    from ddpkit.ranks.context import DistContext

    ctx = DistContext(0, 0, 1, 1, torch.device("cuda", 0), "nccl")
    cfg = TrainConfig(**{**BASE, "model": "mlp", "cuda_graph": "on"}).resolved()

    def engine(**group):
        src = SimpleNamespace(on_device=True, images=None, path="device-resident")
        opt = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.1)
        opt.param_groups[0].update(group)
        return SimpleNamespace(train_src=src, user_scheduler=False, user_code="", opt=opt)

    with pytest.raises(ConfigError, match="your SGD is neither fused nor capturable"):
        graph.decide(cfg, ctx, engine(fused=None))
    assert graph.decide(cfg, ctx, engine(fused=True)).use
    # DDP's capture is not built: world > 1 on CUDA is refused, before launch too (config and launch alone)
    two = DistContext(0, 0, 2, 2, torch.device("cuda", 0), "nccl")
    with pytest.raises(ConfigError, match=r"world size > 1 \(DDP's capture is not built yet\)"):
        graph.decide(cfg, two, engine(fused=True))
    assert graph.blockers(cfg, "cuda", 2) == ["world size > 1 (DDP's capture is not built yet)"]
    assert graph.blockers(cfg, "cuda", 1) == []
