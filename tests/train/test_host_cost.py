"""The step's host-cost cuts change no number: each new piece against the code it replaced, bitwise.

The references (the old EMA update, the old Accumulator.add) are copied here as they were; the
schedule's reference is torch's own LambdaLR.
"""

from __future__ import annotations

import copy
import math
import warnings
from pathlib import Path

import pytest
import torch
from clirun import _load_benchmark
from torch import nn

from ddpkit.config import TrainConfig
from ddpkit.models import ConvNet
from ddpkit.train.metrics import Accumulator
from ddpkit.train.optim import EMA, ScheduleFactor, TableLR, autocast, build_schedule

# The old pieces, as they were before the cut: one copy, the benchmark's (benchmarks/host_cost.py)
OLD = _load_benchmark("host_cost")
OldEMA, OldAccumulator = OLD.OldEMA, OLD.OldAccumulator

FIXTURE_SNAPSHOT = Path(__file__).parents[1] / "fixtures" / "run_v0.2_step6" / "checkpoints" / "snapshot-000000006.pt"
KINDS = [("constant", 0.0), ("cosine", 0.1), ("onecycle", 0.15), ("cosine", 0.0), ("onecycle", 0.0)]


def bits(values) -> list[str]:
    return [float(v).hex() for v in values]


def two_groups(lrs=(0.1, 0.03)) -> torch.optim.Optimizer:
    a, b = nn.Linear(2, 2), nn.Linear(2, 1)
    return torch.optim.SGD([{"params": a.parameters(), "lr": lrs[0]}, {"params": b.parameters(), "lr": lrs[1]}])


def step_both(pairs, n):
    """n steps of each (optimizer, scheduler); the lrs after each step, per scheduler."""
    seen = [[] for _ in pairs]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # scheduler steps before optimizer steps: on purpose here
        for _ in range(n):
            for (opt, sched), out in zip(pairs, seen):
                opt.step()
                sched.step()
                out.append((bits(sched.get_last_lr()), bits(g["lr"] for g in opt.param_groups), sched.last_epoch))
    return seen


# ------------------------------------------------------------------ the schedule
@pytest.mark.parametrize("kind,warmup", KINDS)
def test_the_table_schedule_gives_lambdalr_lrs_at_every_step_and_past_the_end(kind, warmup):
    total = 97
    old_opt, new_opt = two_groups(), two_groups()
    old = torch.optim.lr_scheduler.LambdaLR(old_opt, ScheduleFactor(kind, total, warmup))
    new = TableLR(new_opt, ScheduleFactor(kind, total, warmup), total)
    assert bits(new.get_last_lr()) == bits(old.get_last_lr())
    a, b = step_both([(old_opt, old), (new_opt, new)], total + 25)  # 25 steps beyond the table's end
    assert a == b
    assert new.state_dict() == old.state_dict()
    assert [g["initial_lr"] for g in new_opt.param_groups] == [0.1, 0.03]


@pytest.mark.parametrize("kind,warmup", KINDS)
def test_the_table_holds_base_lr_times_the_factor_per_group_and_step(kind, warmup):
    factor = ScheduleFactor(kind, 40, warmup)
    sched = TableLR(two_groups(), factor, 40)
    assert len(sched.table) == 2 and all(len(column) == 41 for column in sched.table)
    for column, base in zip(sched.table, (0.1, 0.03)):
        assert bits(column) == bits(base * factor(step) for step in range(41))
    on_device = torch.frombuffer(sched.table[0], dtype=torch.float64)  # as a graphed step would copy it
    assert bits(on_device.tolist()) == bits(sched.table[0])


def test_the_built_in_schedule_is_the_table_one():
    opt = two_groups()
    sched = build_schedule(opt, TrainConfig(schedule="onecycle", warmup_frac=0.15, lr=0.1), 50)
    assert isinstance(sched, TableLR) and isinstance(sched, torch.optim.lr_scheduler.LambdaLR)
    assert len(sched.table[0]) == 51


@pytest.mark.parametrize("kind,warmup", KINDS)
@pytest.mark.parametrize("at", [0, 1, 2, 37, 60, 75])
def test_a_table_schedule_resumed_mid_run_continues_on_lambdalrs_curve(kind, warmup, at):
    total = 60
    ref_opt = two_groups()
    ref = torch.optim.lr_scheduler.LambdaLR(ref_opt, ScheduleFactor(kind, total, warmup))
    opt = two_groups()
    sched = TableLR(opt, ScheduleFactor(kind, total, warmup), total)
    step_both([(ref_opt, ref), (opt, sched)], at)
    saved, saved_opt = sched.state_dict(), opt.state_dict()
    assert saved == ref.state_dict()  # the same keys and values LambdaLR writes
    assert set(saved) == {
        "base_lrs",
        "last_epoch",
        "_step_count",
        "_is_initial",
        "_get_lr_called_within_step",
        "_last_lr",
        "lr_lambdas",
    }
    assert (
        saved["lr_lambdas"]
        == [{"kind": kind, "total": total, "warmup": ScheduleFactor(kind, total, warmup).warmup}] * 2
    )
    # resumed as the engine does: a fresh optimizer and schedule, then the optimizer's state, then the schedule's
    opt2 = two_groups((0.5, 0.5))  # the snapshot's lrs win, as in a resume
    opt2.load_state_dict(saved_opt)
    sched2 = TableLR(opt2, ScheduleFactor(kind, total, warmup), total)
    sched2.load_state_dict(copy.deepcopy(saved))
    ref2_opt = two_groups((0.5, 0.5))
    ref2_opt.load_state_dict(saved_opt)
    ref2 = torch.optim.lr_scheduler.LambdaLR(ref2_opt, ScheduleFactor(kind, total, warmup))
    ref2.load_state_dict(copy.deepcopy(ref.state_dict()))
    # on: the uninterrupted LambdaLR, the resumed LambdaLR and the resumed table, past the schedule's end
    a, b, c = step_both([(ref_opt, ref), (ref2_opt, ref2), (opt2, sched2)], total + 10 - at)
    assert a == b == c
    assert sched2.state_dict() == ref.state_dict()


def test_a_lambdalr_snapshot_of_another_schedule_loads_into_the_table_and_rebuilds_it():
    """The loaded state carries the schedule's settings (LambdaLR restores the factor's __dict__) and base
    lrs: the table follows them, as LambdaLR's computed lrs would."""
    ref_opt = torch.optim.SGD(nn.Linear(2, 2).parameters(), lr=0.2)
    ref = torch.optim.lr_scheduler.LambdaLR(ref_opt, ScheduleFactor("onecycle", 30, 0.2))
    step_both([(ref_opt, ref)], 9)
    opt = torch.optim.SGD(nn.Linear(2, 2).parameters(), lr=0.2)
    opt.load_state_dict(ref_opt.state_dict())
    sched = TableLR(opt, ScheduleFactor("cosine", 50, 0.0), 50)  # other settings: the state's win
    sched.load_state_dict(ref.state_dict())
    assert sched.lr_lambdas[0].__dict__ == {"kind": "onecycle", "total": 30, "warmup": 6}
    assert bits(sched.table[0][:31]) == bits(0.2 * ScheduleFactor("onecycle", 30, 0.2)(s) for s in range(31))
    a, b = step_both([(ref_opt, ref), (opt, sched)], 40)
    assert a == b


def test_the_v0_2_fixtures_lambdalr_state_loads_and_continues_on_its_curve():
    state = torch.load(FIXTURE_SNAPSHOT, weights_only=True)["trainer"]["scheduler"]
    factor = state["lr_lambdas"][0]
    total = factor["total"]

    def make(cls, *extra):
        opt = torch.optim.SGD(nn.Linear(2, 2).parameters(), lr=state["base_lrs"][0])
        for g in opt.param_groups:
            g["initial_lr"], g["lr"] = state["base_lrs"][0], state["_last_lr"][0]
        sched = cls(opt, ScheduleFactor(factor["kind"], total, 0.0), *extra, last_epoch=state["last_epoch"])
        sched.load_state_dict(copy.deepcopy(state))
        return opt, sched

    ref_opt, ref = make(torch.optim.lr_scheduler.LambdaLR)
    opt, sched = make(TableLR, total)
    assert sched.state_dict() == ref.state_dict() == state
    a, b = step_both([(ref_opt, ref), (opt, sched)], total)
    assert a == b


def test_tensor_learning_rates_take_lambdalrs_own_step():
    opt = torch.optim.SGD(nn.Linear(2, 2).parameters(), lr=torch.tensor(0.1))
    ref_opt = torch.optim.SGD(nn.Linear(2, 2).parameters(), lr=torch.tensor(0.1))
    sched = TableLR(opt, ScheduleFactor("cosine", 10, 0.2), 10)
    ref = torch.optim.lr_scheduler.LambdaLR(ref_opt, ScheduleFactor("cosine", 10, 0.2))
    assert sched.table is None
    for _ in range(12):
        opt.step(), sched.step(), ref_opt.step(), ref.step()
        assert isinstance(opt.param_groups[0]["lr"], torch.Tensor)
        assert opt.param_groups[0]["lr"].item() == ref_opt.param_groups[0]["lr"].item()


def test_the_table_schedule_still_warns_of_a_step_before_the_optimizers():
    opt = torch.optim.SGD(nn.Linear(2, 2).parameters(), lr=0.1)
    sched = TableLR(opt, ScheduleFactor("constant", 5, 0.0), 5)
    with pytest.warns(UserWarning, match="before `optimizer.step"):
        sched.step()


# ------------------------------------------------------------------ EMA
class Counting(nn.Module):
    """A model that replaces (rather than updates in place) a buffer in its forward."""

    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.ReLU(), nn.Linear(8, 3))
        self.register_buffer("seen", torch.zeros(()))

    def forward(self, x):
        self.seen = self.seen + x.shape[0]
        return self.net(x)


def train_with_emas(model, x, steps=7, decay=0.9):
    old, new = OldEMA(model, decay), EMA(model, decay)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    for i in range(steps):
        opt.zero_grad()
        model(x[i % 2 :: 2]).square().mean().backward()
        opt.step()
        old.update(model)
        new.update(model)
    return old, new


def assert_states_bitwise(a: dict, b: dict) -> None:
    assert list(a) == list(b)
    for k in a:
        assert a[k].dtype == b[k].dtype and a[k].shape == b[k].shape, k
        assert torch.equal(a[k].reshape(-1).view(torch.uint8), b[k].reshape(-1).view(torch.uint8)), k


@pytest.mark.parametrize("make", [lambda: ConvNet(), Counting], ids=["convnet", "replaced-buffer"])
def test_the_ema_with_buffers_equals_the_old_ema_bitwise(make):
    torch.manual_seed(0)
    model = make()
    x = torch.randn(16, 1, 28, 28) if isinstance(model, ConvNet) else torch.randn(16, 4)
    old, new = train_with_emas(model, x)
    assert any(True for _ in model.buffers())
    assert_states_bitwise(old.module.state_dict(), new.state_dict())
    # the buffers are copies, the weights averages
    for name, b in model.named_buffers():
        assert torch.equal(new.state_dict()[name], b)


def test_the_ema_keeps_updating_its_own_buffers_after_load_state_dict():
    torch.manual_seed(1)
    model = ConvNet()
    x = torch.randn(8, 1, 28, 28)
    old, new = train_with_emas(model, x, steps=3)
    saved = copy.deepcopy(new.state_dict())
    fresh_new, fresh_old = EMA(model, 0.9), OldEMA(model, 0.9)
    fresh_new.load_state_dict(saved)
    fresh_old.module.load_state_dict(saved)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for _ in range(3):
        opt.zero_grad()
        model(x).sum().backward()
        opt.step()
        fresh_new.update(model)
        fresh_old.update(model)
    assert_states_bitwise(fresh_old.module.state_dict(), fresh_new.state_dict())


# ------------------------------------------------------------------ the accumulator
def awkward(x: float):
    """Values whose float64 sums round at every add."""
    return x * math.pi * 1e-3 + 1 / 3


STEPS = {
    "float64 (the built-in task)": lambda i: [
        (torch.tensor(awkward(i), dtype=torch.float64) * 100, 100),
        (torch.tensor(float(i % 7 + 90)).double(), 100),
    ],
    "float32 and int sums, tensor counts": lambda i: [
        (torch.tensor(awkward(i), dtype=torch.float32), torch.tensor(i + 1)),
        (torch.tensor(2**40 + i * 3), torch.tensor(0.7 * i, dtype=torch.float32)),
    ],
    "mixed tensors and numbers": lambda i: [
        (awkward(i), torch.tensor([3])),
        (torch.tensor(awkward(-i), dtype=torch.float16), 1),
        (torch.tensor([[awkward(i)]], dtype=torch.bfloat16), 2.5),
        (torch.tensor(True), torch.tensor(awkward(i), dtype=torch.float64)),
    ],
    "shapes [1]": lambda i: [
        (torch.tensor([awkward(i)], dtype=torch.float64), torch.tensor([i], dtype=torch.int32)),
        (torch.tensor([awkward(2 * i)], dtype=torch.float64), torch.tensor([2 * i], dtype=torch.int32)),
    ],
    "needing grad": lambda i: [
        (torch.tensor(awkward(i), dtype=torch.float64, requires_grad=True) * 2, 4),
        (torch.tensor(awkward(i), requires_grad=True).sum(), 4),
    ],
    "numbers only": lambda i: [(awkward(i), i), (i * 0.1, 3)],
    "the engine's grad norm": lambda i: [(0.0, 0.0), (0.0, 0.0), (torch.tensor(awkward(i), dtype=torch.float32), 1)],
}


@pytest.mark.parametrize("case", list(STEPS))
def test_the_accumulator_equals_the_old_one_bitwise(case):
    make = STEPS[case]
    names = tuple(f"m{i}" for i in range(len(make(0))))
    old, new = OldAccumulator(names, torch.device("cpu")), Accumulator(names, torch.device("cpu"))
    for i in range(50):
        old.add(make(i))
        new.add(make(i))
        if i == 30:  # a snapshot and a resume in between
            new.load(new.state())
            old.load(old.state())
    assert bits(old.local().tolist()) == bits(new.local().tolist())
    assert bits(old.host_sums + old.host_counts) == bits(new.host_sums + new.host_counts)
    assert not new.sums.requires_grad and new.sums.grad_fn is None
    new.reset()
    assert new.local().tolist() == [0.0] * 2 * len(names)


def test_the_accumulator_adds_without_a_no_grad_context_and_builds_no_graph():
    acc = Accumulator(("loss", "accuracy"), torch.device("cpu"))
    w = torch.tensor(2.0, requires_grad=True)
    acc.add([((w * 3).double(), 1), (w.double(), torch.tensor(1.0, requires_grad=True))])
    assert acc.sums.grad_fn is None and acc.counts.grad_fn is None
    assert acc.local().tolist() == [6.0, 2.0, 1.0, 1.0]


# ------------------------------------------------------------------ autocast
def test_amp_off_is_a_context_that_does_nothing():
    ctx = autocast(TrainConfig(amp="none"), torch.device("cpu"))
    assert not isinstance(ctx, torch.autocast)  # no autocast state saved and set at every step
    dtype_before = torch.get_autocast_dtype("cpu")
    for _ in range(2):  # reused every step
        with ctx:
            assert not torch.is_autocast_enabled("cpu")
            assert (torch.ones(2, 2) @ torch.ones(2, 2)).dtype == torch.float32
            with ctx:  # and re-entrant
                pass
    assert torch.get_autocast_dtype("cpu") == dtype_before and not torch.is_autocast_enabled("cpu")


def test_amp_off_still_turns_a_callers_autocast_off():
    """As torch.autocast(enabled=False) did: amp off means float32 even inside an autocast of the caller's."""
    ctx = autocast(TrainConfig(amp="none"), torch.device("cpu"))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        with ctx:
            assert not torch.is_autocast_enabled("cpu")
            assert (torch.ones(2, 2) @ torch.ones(2, 2)).dtype == torch.float32
        assert torch.is_autocast_enabled("cpu")
        assert (torch.ones(2, 2) @ torch.ones(2, 2)).dtype == torch.bfloat16


def test_amp_bf16_still_autocasts():
    ctx = autocast(TrainConfig(amp="bf16"), torch.device("cpu"))
    with ctx:
        assert (torch.ones(2, 2) @ torch.ones(2, 2)).dtype == torch.bfloat16
    assert (torch.ones(2, 2) @ torch.ones(2, 2)).dtype == torch.float32
