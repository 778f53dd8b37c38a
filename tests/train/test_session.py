"""The run session (train/session.py): the protocol between a loop and the parts, written once.

Both faces, the engine (``Trainer``, the CLI) and ``ddpkit.Loop``, reach snapshots, stops, records, best.pt,
evaluation and autocast through it. These tests hold them to that: each face is run in this process at
world 1 (a real gloo group of one), and the session's functions are spied on, not replaced.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
import torch
from test_engine import float64_engine

import ddpkit
from ddpkit.errors import Stopped
from ddpkit.ranks.context import DistContext, distributed
from ddpkit.train import evaluate as evaluate_module
from ddpkit.train.session import Amp, Session, misfit

SRC = Path(__file__).resolve().parents[2] / "src" / "ddpkit"


def _spy(monkeypatch, owner, name) -> list:
    calls = []
    original = getattr(owner, name)

    def spy(*args, **kwargs):
        calls.append(args)
        return original(*args, **kwargs)

    monkeypatch.setattr(owner, name, spy)
    return calls


def _loop_keeping_best(run_dir: str) -> None:
    with ddpkit.Loop(run_dir, device="cpu", log_every=0) as loop:
        model = loop.wrap(torch.nn.Linear(2, 1))
        loop.resume(model=model)
        for step in loop.steps(3):
            loop.best("val_loss", 3.0 - step)


def test_both_faces_write_best_pt_through_the_one_writer(tmp_path, monkeypatch):
    """``--keep-best`` in the engine and ``Loop.best`` decide a new best through ``Session.keep_best`` (a
    ``selection.Watch``) and write best.pt through ``Session.write_best`` alone, in one layout:
    ``torch.load(path)["weights"]["model"]`` loads into the model."""
    kept, inside = [], []  # keep_best's calls; for each write_best call, whether a keep_best was running
    keep_best, write_best = Session.keep_best, Session.write_best

    def spy_keep(self, *args):
        kept.append(args)
        self.deciding = True
        try:
            return keep_best(self, *args)
        finally:
            self.deciding = False

    def spy_write(self, *args):
        inside.append(getattr(self, "deciding", False))
        return write_best(self, *args)

    monkeypatch.setattr(Session, "keep_best", spy_keep)
    monkeypatch.setattr(Session, "write_best", spy_write)
    calls = inside
    with distributed("cpu") as ctx:
        engine = float64_engine(ctx, tmp_path / "engine", val_fraction=0.25, keep_best="val_loss", eval_every_steps=2)
        engine.fit()
    engine_calls = len(calls)
    assert engine_calls >= 1
    _loop_keeping_best(str(tmp_path / "loop"))
    assert len(calls) - engine_calls == 3  # a new best at every step: 3.0, 2.0, 1.0
    assert all(inside) and {type(c[0]).__name__ for c in kept} == {"Watch"}  # each write decided by keep_best
    for face in ("engine", "loop"):
        blob = torch.load(tmp_path / face / "best.pt", weights_only=True)
        assert set(blob) == {"metric", "value", "step", "weights"} and set(blob["weights"]) == {"model"}
    assert torch.load(tmp_path / "loop" / "best.pt", weights_only=True)["value"] == 1.0
    engine.raw.load_state_dict(torch.load(tmp_path / "engine" / "best.pt", weights_only=True)["weights"]["model"])


def test_both_faces_evaluate_through_the_one_function(tmp_path, monkeypatch):
    """The engine's test and validation evaluations and ``Loop.evaluate`` run ``evaluate_split``; its exact
    means are the means over the whole split."""
    from ddpkit import loop as loop_module

    assert loop_module.evaluate_split is evaluate_module.evaluate_split  # the same function, imported by name
    calls = _spy(monkeypatch, evaluate_module, "evaluate_split")
    monkeypatch.setattr(loop_module, "evaluate_split", evaluate_module.evaluate_split)  # the spy, there too
    with distributed("cpu") as ctx:
        float64_engine(ctx, tmp_path / "engine", val_fraction=0.25).fit()
    assert len(calls) >= 2  # the validation split at the epoch's end, the test set at the run's end
    seen = len(calls)
    data = torch.arange(10.0).reshape(10, 1)
    with ddpkit.Loop(str(tmp_path / "loop"), device="cpu", log_every=0) as loop:
        identity = torch.nn.Linear(1, 1)
        with torch.no_grad():
            identity.weight.fill_(1.0), identity.bias.zero_()
        model = loop.wrap(identity)
        loop.resume(model=model)
        result = loop.evaluate(
            model, torch.utils.data.TensorDataset(data), lambda m, b: {"x": m(b[0]).mean()}, batch_size=3
        )
    assert len(calls) == seen + 1
    assert result == {"x": 4.5}  # batches of 3, 3, 3 and 1: weighted by size, not a mean of batch means


def test_there_is_one_raise_stopped_and_it_is_the_sessions():
    """A stop saves, records and raises in one place: a grep of the package finds one ``raise Stopped``."""
    found = []
    for path in SRC.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Raise) and node.exc is not None:
                call = node.exc.func if isinstance(node.exc, ast.Call) else node.exc
                if isinstance(call, ast.Name) and call.id == "Stopped":
                    found.append(path.relative_to(SRC).as_posix())
    assert found == ["train/session.py"]


@pytest.mark.parametrize("face", ["engine", "loop"])
def test_a_stop_at_a_step_already_saved_names_that_snapshot_and_saves_no_other(tmp_path, face):
    """Both faces stop through ``Session.stop``: a snapshot, the record, Stopped. A stop at a step whose
    snapshot was just written (the Loop's save_every_steps) writes it once."""
    run_dir = tmp_path / face
    if face == "loop":
        with pytest.raises(Stopped, match="stopped on SIGTERM at step 2 .*snapshot-000000002.pt"):
            with ddpkit.Loop(str(run_dir), device="cpu", log_every=2, save_every_steps=2) as loop:
                model = loop.wrap(torch.nn.Linear(2, 1))
                loop.resume(model=model)
                for step in loop.steps(4):
                    if step == 1:
                        loop.session.signal.received = "SIGTERM"
    else:
        with distributed("cpu") as ctx, pytest.raises(Stopped, match="stopped on SIGTERM at step 4"):
            engine = float64_engine(ctx, run_dir, log_every=4)
            engine.session.signal.received = "SIGTERM"
            engine.fit()
    from clirun import read_jsonl

    stopped = [r for r in read_jsonl(run_dir / "metrics.jsonl") if r["event"] == "stopped"]
    assert [(r["reason"], r["signal"]) for r in stopped] == [("signal", "SIGTERM")]
    assert len(list((run_dir / "checkpoints").glob("snapshot-*.pt"))) == 1


def test_a_snapshot_is_due_at_epoch_ends_and_every_n_steps_once_per_step(tmp_path):
    ctx = DistContext(0, 0, 1, 1, torch.device("cpu"), "gloo")
    session = Session(ctx, tmp_path, None, None, every_steps=3)
    assert [s for s in range(1, 10) if session.snapshot_due(s)] == [3, 6, 9]
    assert session.snapshot_due(4, epoch_end=True)
    session.last_saved = 6
    assert not session.snapshot_due(6) and not session.snapshot_due(6, epoch_end=True)


def test_amp_none_promises_float32_inside_a_callers_autocast_and_a_loops_off_leaves_it():
    """``--amp none`` turns off an autocast the caller has on (float32, as promised); ``Loop(amp="off")``
    adds nothing to the user's own."""
    a, b = torch.ones(2, 2), torch.ones(2, 2)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        with Amp("none", torch.device("cpu")).autocast():
            assert (a @ b).dtype == torch.float32
        with Amp("off", torch.device("cpu")).autocast():
            assert (a @ b).dtype == torch.bfloat16
        with Amp("bf16", torch.device("cpu")).autocast():
            assert (a @ b).dtype == torch.bfloat16
    assert not Amp("bf16", torch.device("cpu")).scaling and Amp("fp16", torch.device("cpu")).scaling


def test_the_one_validator_names_what_does_not_fit():
    model, other = torch.nn.Linear(2, 3), torch.nn.Linear(2, 4)
    assert misfit(model, model.state_dict()) == ""
    assert "other shapes ['bias', 'weight']" in misfit(model, other.state_dict())
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    assert misfit(opt, opt.state_dict()) == ""
    two = torch.optim.SGD([{"params": [model.weight]}, {"params": [model.bias]}], lr=0.1)
    assert misfit(opt, two.state_dict()) == "parameters per group [1, 1] in the snapshot, [2] here"


def test_only_the_ddp_strategy_knows_ddp():
    """The strategy seam holds: no module but ``train/ddp.py`` names torch's DistributedDataParallel (the
    engine, Loop, the checkpointer and the tools ask the strategy), so a second strategy is one file beside it."""
    naming = []
    for path in SRC.rglob("*.py"):
        tree = ast.parse(path.read_text())
        names = {a.name for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) for a in n.names}
        names |= {n.attr for n in ast.walk(tree) if isinstance(n, ast.Attribute)}
        if "DistributedDataParallel" in names:
            naming.append(path.relative_to(SRC).as_posix())
    assert naming == ["train/ddp.py"]


def _regression_loop(run_dir: str, stop_in_step: int | None = None) -> dict:
    """A float64 regression with a snapshot every step, written in the background; a stop signal in the
    body of step ``stop_in_step`` (while the previous step's snapshot may still be written)."""
    with ddpkit.Loop(run_dir, device="cpu", log_every=1, save_every_steps=1) as loop:
        torch.manual_seed(0)
        model = loop.wrap(torch.nn.Linear(3, 1).double())
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        loop.resume(model=model, optimizer=opt)
        for step in loop.steps(5):
            x = torch.randn(4, 3, dtype=torch.float64)
            loss = model(x).pow(2).mean()
            loss.backward()
            opt.step()
            opt.zero_grad()
            if step == stop_in_step:
                loop.session.signal.received = "SIGTERM"
        return {k: v.clone() for k, v in model.state_dict().items()}


def test_a_stop_while_a_snapshot_is_written_in_the_background_waits_for_it_and_resumes_bitwise(tmp_path, monkeypatch):
    """Step 1's snapshot is still being written when step 2's safe point meets a stop: the stop's snapshot
    waits for it (one write in flight), both end whole, and the rerun resumes at step 2 and ends with the
    uninterrupted run's weights bitwise."""
    import threading

    from ddpkit.run import checkpoint

    whole = _regression_loop(str(tmp_path / "whole"))
    original, events = checkpoint.atomic_write, []

    def slow(path, data, *args, **kw):  # step 1's write lasts into step 2
        if path.name == "snapshot-000000001.pt":
            events.append("1 begins")
            threading.Event().wait(0.5)
        original(path, data, *args, **kw)
        if path.name.startswith("snapshot-"):
            events.append(f"{path.name[-4]} ends")

    monkeypatch.setattr(checkpoint, "atomic_write", slow)
    stop, whole_at_stop = Session.stop, []

    def stop_and_look(self, *args, **kw):  # what is on disk when the stop is raised, before the Loop closes
        try:
            stop(self, *args, **kw)
        finally:
            whole_at_stop.extend(sorted(p.name for p in self.ckpt.dir.glob("snapshot-*.pt")))

    monkeypatch.setattr(Session, "stop", stop_and_look)
    with pytest.raises(Stopped, match=r"stopped on SIGTERM at step 2 .*snapshot-000000002.pt"):
        _regression_loop(str(tmp_path / "cut"), stop_in_step=1)
    assert events == ["1 begins", "1 ends", "2 ends"]
    assert whole_at_stop == ["snapshot-000000001.pt", "snapshot-000000002.pt"]  # the stop waited for its own
    monkeypatch.setattr(checkpoint, "atomic_write", original)
    snaps = sorted(p.name for p in (tmp_path / "cut" / "checkpoints").glob("snapshot-*.pt"))
    assert snaps == ["snapshot-000000001.pt", "snapshot-000000002.pt"]
    resumed = _regression_loop(str(tmp_path / "cut"))
    assert all(torch.equal(resumed[k], whole[k]) for k in whole)


@pytest.mark.parametrize(
    "bad, expected",
    [
        (float("nan"), True),
        (float("inf"), True),
        (-float("inf"), True),
        (1e300, False),  # float64's huge but finite: no false alarm from a float32 cast
        (None, False),
    ],
)
def test_the_safe_point_finds_a_non_finite_weight_in_any_float_type(bad, expected):
    """``Session.sync(weights=...)`` (``--on-nan``'s check before each snapshot): NaN and either infinity in
    any weight, of any float type, empty ones included; a finite weight is never one."""
    from ddpkit.train.metrics import sync_interval

    ctx = DistContext(0, 0, 1, 1, torch.device("cpu"), "gloo")
    weights = [torch.ones(3, dtype=torch.bfloat16), torch.empty(0), torch.zeros(2, 2), torch.ones(4).double()]
    if bad is not None:
        weights[3][2] = bad
    synced = sync_interval(ctx, None, stop=False, log_error=None, weights=weights)
    assert synced.bad_weights is expected
    half = [torch.tensor([1.0, bad if bad is not None else 2.0]).half()] if bad != 1e300 else []
    if half:
        assert sync_interval(ctx, None, stop=False, log_error=None, weights=half).bad_weights is expected


def test_under_ddp_each_rank_checks_a_share_of_the_weights_and_together_every_one():
    """The weight check before a snapshot read every weight on every rank (ResNet-9 at world 2: 6-11 ms a snapshot
    on the 2-core CPU). DDP's copies are equal, so each rank reads a share dealt by size, the same deal on every
    rank; FSDP2's ranks read their own shards."""
    from ddpkit.train.strategy import strategy_for

    raw = torch.nn.Sequential(torch.nn.Linear(8, 64), torch.nn.Linear(64, 64), torch.nn.Linear(64, 2))
    params = list(raw.parameters())
    for world in (1, 2, 3, 4):
        shares = [
            strategy_for("ddp").weights_to_check(raw, DistContext(r, r, world, 1, torch.device("cpu"), "gloo"))
            for r in range(world)
        ]
        read = sorted(id(w) for share in shares for w in share)
        assert read == sorted(id(p) for p in params), world  # every weight once
        sizes = [sum(w.numel() for w in share) for share in shares]
        assert max(sizes) - min(sizes) <= max(p.numel() for p in params), (world, sizes)
    # A frozen weight (which a rank may hold its own values of) is read by every rank (a review finding)
    raw[1].weight.requires_grad_(False)
    ctxs = [DistContext(r, r, 2, 1, torch.device("cpu"), "gloo") for r in range(2)]
    assert all(any(w is raw[1].weight for w in strategy_for("ddp").weights_to_check(raw, c)) for c in ctxs)


@pytest.mark.multiprocess
@pytest.mark.slow
def test_a_nan_in_the_weights_another_rank_checks_is_found_on_every_rank():
    import workers

    import ddpkit

    clean = ddpkit.launch(workers.weight_check_dealt, -1, nproc=2, device="cpu")
    assert clean["bad"] is False and clean["read"], clean
    elsewhere = next(i for i in range(6) if i not in clean["read"])  # a weight rank 1 checks, rank 0 does not
    found = ddpkit.launch(workers.weight_check_dealt, elsewhere, nproc=2, device="cpu")
    assert found["bad"] is True and elsewhere not in found["read"], found
