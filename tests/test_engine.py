"""The training step: no host synchronisation, and one loop for every data path."""

from __future__ import annotations

import pytest
import torch

from ddpkit.config import TrainConfig
from ddpkit.data import load_dataset
from ddpkit.dist import distributed
from ddpkit.engine import Engine
from ddpkit.models import build_model
from ddpkit.task import Classification


def make_engine(tmp_path, **kw):
    cfg = TrainConfig(dataset="synthetic", synthetic_size=256, synthetic_shape="3,16,16", batch_size=32,
                      model="resnet9", epochs=1, ema=0.9, label_smoothing=0.1, run_dir=str(tmp_path),
                      progress=False, **kw).resolved()
    splits = load_dataset(cfg)
    return Engine(cfg, ctx_holder[0], build_model(cfg.model, 3, 16, 16, 10), splits, Classification(0.1, False, 10),
                  static_graph=True)


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


@pytest.mark.parametrize("options", [{}, {"clip_grad_norm": 1.0, "grad_accum": 2}])
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
