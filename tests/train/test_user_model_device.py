"""A user's model on another rank's GPU (under torchrun every rank's script builds it with
``.to("cuda")``: cuda:0) is copied to each rank's own device through host memory, never deep-copied
where it is (one more model per rank on GPU 0), and the job says so once. The decisions and the copy
are tested on CPU tensors; which tensors count as foreign is a pure function of devices."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from ddpkit.ranks.context import DistContext
from ddpkit.train import workers
from ddpkit.train.workers import copy_onto, foreign_devices, own_copy, user_tensors

CUDA = [torch.device("cuda", i) for i in range(4)]
CPU = torch.device("cpu")


def test_a_model_on_another_ranks_gpu_is_foreign_and_one_on_mine_or_the_cpu_is_not():
    assert foreign_devices([CUDA[0], CUDA[0], CPU], CUDA[1]) == [CUDA[0]]  # torchrun, rank 1, .to("cuda")
    assert foreign_devices([CUDA[1], CPU], CUDA[1]) == []  # built on cuda:LOCAL_RANK
    assert foreign_devices([CPU], CUDA[3]) == []  # built on the CPU
    assert foreign_devices([CUDA[2], CUDA[0]], CPU) == [CUDA[0], CUDA[2]]  # --device cpu: any GPU is foreign
    assert foreign_devices([torch.device("cuda:0")], torch.device("cuda", 0)) == []
    assert foreign_devices([], CUDA[1]) == []


def trained():
    """A model with parameters, buffers and a tied weight, and an Adam with state, and its schedule."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 3), nn.BatchNorm1d(3), nn.Linear(3, 3))
    model[2].weight = model[0].weight  # tied: one tensor, one copy
    opt = torch.optim.Adam(model.parameters(), lr=0.1)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    model(torch.randn(4, 3)).pow(2).sum().backward()
    opt.step()
    sched.step()
    return model, opt, sched


def snapshot(model, opt):
    return (
        [(id(p), p.data_ptr(), p.detach().clone()) for p in model.parameters()],
        [t.detach().clone() for t in model.buffers()],
        [(id(p), {k: v.clone() for k, v in s.items()}) for p, s in opt.state.items()],
        [id(p) for g in opt.param_groups for p in g["params"]],
    )


def same(a, b):
    """Two snapshots alike: the same objects, at the same addresses, with the same values."""
    (pa, ba, sa, ga), (pb, bb, sb, gb) = a, b
    return (
        [(i, ptr) for i, ptr, _ in pa] == [(i, ptr) for i, ptr, _ in pb]
        and all(torch.equal(x, y) for (*_, x), (*_, y) in zip(pa, pb))
        and all(torch.equal(x, y) for x, y in zip(ba, bb))
        and [i for i, _ in sa] == [i for i, _ in sb]
        and all(all(torch.equal(x[k], y[k]) for k in x) for (_, x), (_, y) in zip(sa, sb))
        and ga == gb
    )


def test_the_tensors_of_a_model_and_its_optimizer_each_once():
    model, opt, _ = trained()
    found = user_tensors(model, opt)
    assert len({id(t) for t in found}) == len(found)
    expected = {id(t) for t in [*model.parameters(), *model.buffers()]}
    expected |= {id(v) for s in opt.state.values() for v in s.values()}
    assert {id(t) for t in found} == expected
    assert user_tensors(None, lambda params: None) == []  # an optimizer factory holds no tensors


def test_the_copy_steps_its_own_parameters_and_leaves_the_users_objects_as_they_were():
    model, opt, sched = trained()
    before = snapshot(model, opt)
    staged = user_tensors(model, opt)  # every tensor as if it were on another rank's GPU
    cmodel, copt, csched = copy_onto((model, opt, sched), staged, CPU)

    ours = list(cmodel.parameters())
    assert [id(p) for g in copt.param_groups for p in g["params"]] == [id(p) for p in ours]
    assert set(map(id, copt.state)) == set(map(id, ours))  # the state is keyed by the copy's parameters
    assert cmodel[2].weight is cmodel[0].weight  # still tied
    assert all(isinstance(p, nn.Parameter) and p.requires_grad for p in ours)
    assert csched.optimizer is copt and csched.get_last_lr() == sched.get_last_lr()
    user = {t.data_ptr() for t in staged}
    copied = [*ours, *cmodel.buffers(), *(v for s in copt.state.values() for v in s.values())]
    assert not {t.data_ptr() for t in copied} & user  # no storage shared with the user's objects
    for a, b in zip(model.state_dict().values(), cmodel.state_dict().values()):
        assert torch.equal(a, b)
    for (_, a), (_, b) in zip(opt.state.items(), copt.state.items()):
        assert all(torch.equal(a[k], b[k]) for k in a)

    cmodel(torch.randn(4, 3)).pow(2).sum().backward()  # training the copy ...
    copt.step()
    csched.step()
    assert same(snapshot(model, opt), before)  # ... leaves the user's model and optimizer as they were
    assert sched.get_last_lr() == [0.05]


def test_a_model_on_my_device_is_deep_copied_as_ever_without_a_word(capsys):
    model, opt, sched = trained()
    before = snapshot(model, opt)
    cmodel, copt, csched = own_copy(DistContext(0, 0, 1, 1, CPU, "gloo"), (model, opt, sched))
    assert [id(p) for g in copt.param_groups for p in g["params"]] == [id(p) for p in cmodel.parameters()]
    assert not {p.data_ptr() for p in cmodel.parameters()} & {p.data_ptr() for p in model.parameters()}
    assert same(snapshot(model, opt), before)
    assert capsys.readouterr().err == ""
    assert own_copy(DistContext(0, 0, 1, 1, CPU, "gloo"), (None, None, None)) == (None, None, None)


def test_only_the_foreign_tensors_are_staged_and_the_warning_names_the_fix(monkeypatch, capsys):
    """A model on cuda:0 seen from cuda:1 (the devices stubbed: these tensors are on the CPU)."""
    model, opt, sched = trained()
    seen = []

    def staged_copy(objects, staged, device):
        seen.append(([id(t) for t in staged], device))
        return copy_onto(objects, staged, CPU)

    monkeypatch.setattr(workers, "foreign_devices", lambda devices, mine: [CPU])
    monkeypatch.setattr(workers, "copy_onto", staged_copy)
    own_copy(DistContext(0, 0, 1, 1, CPU, "gloo"), (model, opt, sched))
    assert seen == [([id(t) for t in user_tensors(model, opt)], CPU)]
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("ddpkit: warning: the model passed in is on cpu")
    assert "build the model on the CPU, or on cuda:LOCAL_RANK" in err and "torch.cuda.set_device" in err


def test_the_training_worker_hands_the_engine_the_ranks_own_copy(monkeypatch):
    """``_train`` copies through ``own_copy``: the engine gets a model and optimizer of its own."""
    from ddpkit.data import DataSplits

    model, opt, sched = trained()
    given = {}

    class Engine:
        def __init__(self, cfg, ctx, model, splits, task, optimizer, scheduler, **kw):
            given.update(model=model, optimizer=optimizer, scheduler=scheduler)

        def fit(self):
            return {}

    monkeypatch.setattr(workers, "Engine", Engine)
    calls = []
    monkeypatch.setattr(workers, "own_copy", lambda ctx, objects: calls.append(objects) or copy_onto(objects, [], CPU))
    cfg = type("Cfg", (), {"seed": 0})()
    splits = DataSplits(None, None, None)  # read by the engine only
    job = workers.Job(cfg, None, model, splits, opt, sched)
    workers._train(job, DistContext(0, 0, 1, 1, CPU, "gloo"))
    assert calls == [(model, opt, sched)]
    assert given["model"] is not model and given["optimizer"] is not opt and given["scheduler"] is not sched
    assert given["optimizer"].param_groups[0]["params"][0] is next(given["model"].parameters())


@pytest.mark.multiprocess
def test_the_warning_is_said_once_for_the_job_by_rank_0_when_another_rank_copied():
    from workers import user_model_on_another_gpu_in_rank_1

    from ddpkit.ranks.launcher import run_workers

    ranks = run_workers(user_model_on_another_gpu_in_rank_1, (), 2)
    assert ranks[0]["said"].count("ddpkit: warning: the model passed in is on") == 1
    assert ranks[1]["said"] == ""
    assert all(r["steps_copy"] and r["state_copied"] for r in ranks)
