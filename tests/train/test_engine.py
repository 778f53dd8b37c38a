"""The training step: no host synchronisation, and one loop for every data path."""

from __future__ import annotations

import subprocess
import sys
import time

import pytest
import torch

from ddpkit.config import TrainConfig
from ddpkit.data import load_dataset
from ddpkit.models import build_model
from ddpkit.ranks.context import distributed
from ddpkit.ranks.env import process_started_at
from ddpkit.train.engine import Engine
from ddpkit.train.report import startup_seconds
from ddpkit.train.task import Classification


def make_engine(tmp_path, **kw):
    cfg = TrainConfig(
        dataset="synthetic",
        synthetic_size=256,
        synthetic_shape="3,16,16",
        batch_size=32,
        model="resnet9",
        epochs=1,
        ema=0.9,
        label_smoothing=0.1,
        run_dir=str(tmp_path),
        progress=False,
        **kw,
    ).resolved()
    splits = load_dataset(cfg)
    return Engine(
        cfg,
        ctx_holder[0],
        build_model(cfg.model, 3, 16, 16, 10),
        splits,
        Classification(0.1, False, 10),
        static_graph=True,
    )


ctx_holder: list = []


@pytest.fixture
def engine(tmp_path):
    with distributed("cpu") as ctx:
        ctx_holder[:] = [ctx]
        yield make_engine(tmp_path)


def spy_host_syncs(monkeypatch) -> list:
    calls = []
    for name in ("item", "cpu", "tolist", "numpy", "__bool__", "__float__", "__int__"):
        original = getattr(torch.Tensor, name)

        def spy(self, *a, _name=name, _orig=original, **k):
            calls.append(_name)
            return _orig(self, *a, **k)

        monkeypatch.setattr(torch.Tensor, name, spy)
    return calls


@pytest.mark.slow
@pytest.mark.parametrize("options", [{}, {"clip_grad_norm": 1.0, "grad_accum": 2}, {"ddp": True}])
def test_step_makes_no_host_sync(tmp_path, monkeypatch, options):
    with distributed("cpu") as ctx:
        ctx_holder[:] = [ctx]
        engine = make_engine(tmp_path, **options)
        batches = engine.train_src.batches(0)
        group = tuple(next(batches) for _ in range(engine.accum))
        engine._step(group)  # the first step also checks shapes, once
        calls = spy_host_syncs(monkeypatch)
        for _ in range(3):
            engine._step(group)
        monkeypatch.undo()
        assert calls == [], f"host syncs in the step: {calls}"
        assert engine.acc.sums[0] > 0  # the step did accumulate, on the device


def test_step_trains(engine):
    batch = next(engine.train_src.batches(0))
    before = [p.detach().clone() for p in engine.raw.parameters()]
    engine._step((batch,))
    assert any(not torch.equal(a, b) for a, b in zip(before, engine.raw.parameters()))
    assert engine.sched.last_epoch == 1


def test_the_per_rank_snapshot_state_is_plain_floats(engine):
    engine._step((next(engine.train_src.batches(0)),))
    acc = engine.state_dict()["rank_state"]["acc"]
    assert isinstance(acc, list) and all(type(v) is float for v in acc) and acc[0] > 0


@pytest.mark.slow
def test_world_one_leaves_ddp_off_and_trains_the_same_bits(tmp_path):
    """At world size 1 DDP has nothing to all-reduce and took 20-37% of a small step on an H100."""
    weights = {}
    with distributed("cpu") as ctx:
        ctx_holder[:] = [ctx]
        for ddp in (None, True):
            torch.manual_seed(0)
            engine = make_engine(tmp_path / str(ddp), ddp=ddp)
            assert (engine.ddp is None) == (ddp is None)
            for batch in list(engine.train_src.batches(0))[:3]:
                engine._step((batch,))
            weights[ddp] = [p.detach().clone() for p in engine.raw.parameters()]
    assert all(torch.equal(a, b) for a, b in zip(weights[None], weights[True]))


def test_ddp_skips_the_buffer_broadcast_only_when_every_buffer_is_batchnorms():
    from user_code import TaggedConvNet

    from ddpkit.models import ConvNet, resnet18
    from ddpkit.train.syncbn import convert_sync_batchnorm, only_batchnorm_buffers

    assert only_batchnorm_buffers(ConvNet()) and only_batchnorm_buffers(resnet18(3, 32, 32, 10))
    assert only_batchnorm_buffers(convert_sync_batchnorm(ConvNet(), torch.device("cpu")))
    assert only_batchnorm_buffers(torch.nn.Linear(2, 2))  # no buffers at all
    assert not only_batchnorm_buffers(TaggedConvNet())

    class Renorm(torch.nn.BatchNorm2d):  # a subclass may feed its running statistics into the forward
        pass

    assert not only_batchnorm_buffers(torch.nn.Sequential(Renorm(3)))
    assert not only_batchnorm_buffers(torch.nn.utils.parametrizations.spectral_norm(torch.nn.Linear(2, 2)))


@pytest.mark.slow
@pytest.mark.multiprocess
def test_without_the_buffer_broadcast_model_pt_and_every_figure_are_the_same_bits(tmp_path):
    """World 2, BatchNorm: rank 0's running statistics do not depend on DDP's per-step broadcast."""
    from user_code import TaggedConvNet

    from ddpkit import Trainer
    from ddpkit.models import ConvNet

    results, weights = {}, {}
    for name, model_cls in (("bn-only", ConvNet), ("broadcast", TaggedConvNet)):
        torch.manual_seed(0)
        model = model_cls()
        run = tmp_path / name
        cfg = TrainConfig(
            dataset="mnist",
            limit_train=512,
            limit_test=256,
            batch_size=64,
            epochs=2,
            nproc="2",
            device="cpu",
            progress=False,
            log_every=3,
            run_dir=str(run),
        )
        results[name] = Trainer(cfg, model=model).fit()
        state = torch.load(run / "model.pt", weights_only=True)
        weights[name] = {k.removeprefix("net."): v for k, v in state.items() if k != "tag"}
    assert weights["bn-only"].keys() == weights["broadcast"].keys()
    assert all(torch.equal(weights["bn-only"][k], weights["broadcast"][k]) for k in weights["bn-only"])
    for key in ("test_loss", "test_accuracy", "final_train_loss", "final_train_accuracy"):
        assert results["bn-only"][key] == results["broadcast"][key], key
    assert results["bn-only"].per_rank == results["broadcast"].per_rank


@pytest.mark.slow
@pytest.mark.multiprocess
def test_uneven_inputs_under_join_finish_without_a_hang_and_every_sample_is_used(tmp_path):
    """--join: 97 samples, 16 per rank-batch: rank 0 has 49 samples (4 batches), rank 1 48 (3).
    Without Join rank 0's extra step all-reduces alone and hangs; with it the run ends, with every
    rank at rank 0's step count."""
    import json
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).parent))
    from user_code import PlainData, RegressionMLP, mse

    from ddpkit import Trainer
    from ddpkit.tools.check import data_coverage

    world, nproc = 2, "2"
    cfg = TrainConfig(
        nproc=nproc,
        join=True,
        batch_size=16 * world,
        epochs=2,
        lr=0.05,
        momentum=0.9,
        device="cpu",
        num_workers=0,
        progress=False,
        timeout_s=60,
        run_dir=str(tmp_path / "r"),
    )
    torch.manual_seed(0)
    result = Trainer(
        cfg, model=RegressionMLP(), train_data=PlainData(97, 0), test_data=PlainData(20, 1), loss_fn=mse
    ).fit()
    steps = 4
    assert result["steps"] == 2 * steps  # rank 0's count: the others caught up after each Join
    records = [json.loads(line) for line in (result.run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records if r["event"] == "step"] == [steps, 2 * steps]  # one log per epoch
    # the data invariant, counted from the engine's own sampler: all 97 samples, each once
    coverage = data_coverage(
        Trainer(cfg, model=RegressionMLP(), train_data=PlainData(97, 0), test_data=PlainData(20, 1), loss_fn=mse), world
    )
    assert coverage["ok"] and "exactly once" in " ".join(coverage["lines"]), coverage


class _Killed(Exception):
    """Stands in for a SIGKILL right after a snapshot."""


def float64_engine(ctx, run_dir, **kw) -> Engine:
    """An MLP engine in float64 on 256 synthetic samples (8 steps of 32), without the cost of plots."""
    cfg = TrainConfig(
        dataset="synthetic",
        synthetic_size=256,
        synthetic_shape="3,16,16",
        batch_size=32,
        model="mlp",
        dtype="float64",
        epochs=1,
        plots=False,
        run_dir=str(run_dir),
        progress=False,
        **kw,
    ).resolved()
    torch.manual_seed(0)
    model = build_model(cfg.model, 3, 16, 16, 10).double()
    return Engine(cfg, ctx, model, load_dataset(cfg), Classification(0.0, False, 10))


def _run_to_the_end(tmp_path, kill_after_snapshot_at: int | None = None):
    """A float64 run of 8 steps (log every 4, snapshot every 6) in this process; optionally killed
    right after its step-6 snapshot. Returns the step records of metrics.jsonl by step."""
    from clirun import read_jsonl

    with distributed("cpu") as ctx:
        engine = float64_engine(ctx, tmp_path, log_every=4, save_every_steps=6)
        if kill_after_snapshot_at is not None:
            save = engine.session.ckpt.save

            def save_then_die(state, step):
                path = save(state, step)
                if step == kill_after_snapshot_at:
                    raise _Killed
                return path

            engine.session.ckpt.save = save_then_die
            with pytest.raises(_Killed):
                engine.fit()
        else:
            engine.fit()
    return {r["step"]: r for r in read_jsonl(tmp_path / "metrics.jsonl") if r["event"] == "step"}


@pytest.mark.slow
def test_the_first_step_record_after_a_resume_covers_the_whole_interval(tmp_path):
    """Regression: the step-8 record after a resume from step 6 held the mean of steps 7-8 only,
    where an uninterrupted run's holds steps 5-8; the snapshot now keeps the interval's start."""
    ref = _run_to_the_end(tmp_path / "ref")
    killed = _run_to_the_end(tmp_path / "run", kill_after_snapshot_at=6)
    assert sorted(killed) == [4]  # the kill came between the step-4 and step-8 records
    resumed = _run_to_the_end(tmp_path / "run")
    assert sorted(ref) == sorted(resumed) == [4, 8]
    for key in ("loss", "accuracy"):
        assert abs(resumed[8][key] - ref[8][key]) <= 1e-15 * abs(ref[8][key]), (key, resumed[8], ref[8])
    assert resumed[8]["samples_per_s"] > 0


def test_the_test_loss_of_a_float64_run_is_computed_in_float64(tmp_path):
    """Regression: the default task's test loss went through float32 (logits.float()), 1e-7 off."""
    import torch.nn.functional as F

    with distributed("cpu") as ctx:
        engine = float64_engine(ctx, tmp_path)
        result, _ = engine._evaluate()
        engine.raw.eval()
        with torch.no_grad():
            batches = list(engine.eval_src.batches())
            x, y = torch.cat([b[0] for b in batches]), torch.cat([b[1] for b in batches])
            assert x.dtype == torch.float64
            logits = engine.raw(x)
            ref = F.cross_entropy(logits, y).item()
            in_float32 = F.cross_entropy(logits.float(), y).item()
    assert result["test_samples"] == len(y) == 51
    assert abs(result["test_loss"] - ref) <= 1e-15 * ref, (result["test_loss"], ref)
    assert in_float32 != ref  # what the float32 path gave is told apart


@pytest.mark.multiprocess  # (the /proc reader is tried on a process of its own)
def test_startup_after_a_restart_in_the_job_is_this_attempts_own():
    """Regression (the porter's seed-004 port): after the agent restarted the workers (--max-restarts), summary.json's
    startup_s ran from the job's launch, so it held the first attempt's whole training (21 s for a 0.4 s start). A
    script under torchrun times each attempt from its own fit() call (t0 later than its process's start): kept."""
    assert startup_seconds(100.0, 103.5, 0, 150.0) == 3.5  # the first attempt: from the launch
    assert startup_seconds(100.0, 153.0, 1, 150.0) == 3.0  # a restart: from its own process's start
    assert startup_seconds(151.0, 153.0, 1, 150.0) == 2.0  # ...or its own fit() call, where that is later
    assert startup_seconds(100.0, 153.0, 1, float("inf")) is None  # unknown: no figure rather than a wrong one
    assert startup_seconds(None, 103.5, 0, 150.0) is None
    # The real reader, on a process started now: within the clock tick of its start (btime's whole seconds were up
    # to 1 s early: a review finding)
    before = time.time()
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(5)"])
    try:
        started = process_started_at(child.pid)
        assert before - 0.05 <= started <= time.time() + 0.05, (before, started)
    finally:
        child.kill()
        child.wait()
