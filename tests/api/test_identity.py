"""The run identity: every edit to what you pass in is a new run, and what cannot be read is never a stale result.

Each test reproduces a case where ddpkit returned a stale result or resumed on changed inputs."""

from __future__ import annotations

import functools
import json
import math
import os
import re
import shutil
from os import environ

import identity_code
import pytest
import torch
from user_code import RegressionMLP, mse, regression_data

from ddpkit import TrainConfig, Trainer
from ddpkit.errors import RunDirError
from ddpkit.identity import data_fingerprint, model_fingerprint, optimizer_fingerprint, scheduler_fingerprint

SMALL = dict(batch_size=16, epochs=1, progress=False, device="cpu", num_workers=0, log_every=2, nproc="1")


def adamw(lr):
    return lambda model: torch.optim.AdamW(model.parameters(), lr=lr)


def kill_after_last_snapshot(run_dir):
    """What a kill after the last snapshot leaves: no model.pt and no summary.json."""
    (run_dir / "model.pt").unlink()
    (run_dir / "summary.json").unlink()


def fit(run_dir=None, model=None, optimizer=None, train=None, reuse=False, **kw):
    cfg = TrainConfig(**SMALL, reuse_finished=reuse, **({"run_dir": str(run_dir)} if run_dir else {}))
    return Trainer(
        cfg,
        model=model or RegressionMLP(),
        train_data=train if train is not None else regression_data(64, 0),
        test_data=regression_data(16, 1),
        loss_fn=mse,
        optimizer=optimizer,
        **kw,
    ).fit()


# ---------------------------------------------------------------- case 3: optimizer and scheduler settings
def test_an_lr_changed_inside_the_optimizer_factory_is_another_run(tmp_path, capsys):
    """Regression: the optimizer was identified by its name, so the rerun printed "already holds this
    finished run" with the old figures, and a resumed run kept the old lr."""
    first = fit(tmp_path / "r", optimizer=adamw(1e-3))
    kill_after_last_snapshot(first.run_dir)
    with pytest.raises(RunDirError, match=r"optimizer AdamW: .*group 0 lr 0.001 -> 0.0005"):
        fit(tmp_path / "r", optimizer=adamw(5e-4))
    again = fit(tmp_path / "r", optimizer=adamw(1e-3))  # the same settings resume
    assert again["steps"] == first["steps"]
    assert "resumed_at_step" in (first.run_dir / "metrics.jsonl").read_text()


def test_optimizer_objects_and_scheduler_settings_are_read_not_named():
    model = RegressionMLP()
    a, _ = optimizer_fingerprint(torch.optim.AdamW(model.parameters(), lr=1e-3), model)
    b, _ = optimizer_fingerprint(torch.optim.AdamW(model.parameters(), lr=2e-3), model)
    assert a.name == b.name == "AdamW" and a.tag != b.tag
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    step = functools.partial(torch.optim.lr_scheduler.StepLR, step_size=5)
    assert (
        scheduler_fingerprint(step, opt).tag
        != scheduler_fingerprint(functools.partial(torch.optim.lr_scheduler.StepLR, step_size=6), opt).tag
    )
    assert opt.param_groups[0]["lr"] == 0.1 and "initial_lr" not in opt.param_groups[0]  # the probe left it alone
    one = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 0.5**s)
    two = torch.optim.lr_scheduler.LambdaLR(torch.optim.SGD(model.parameters(), lr=0.1), lambda s: 0.9**s)
    assert scheduler_fingerprint(one, None).tag != scheduler_fingerprint(two, None).tag


# ---------------------------------------------------------------- case 5: code the fingerprint missed
def test_edits_to_helpers_globals_partials_and_callable_objects_are_new_runs(monkeypatch):
    """Regression: each of these kept the fingerprint, and the rerun returned "the same model code"."""
    from ddpkit.identity import code_digest

    base = model_fingerprint(identity_code.HelperNet())
    monkeypatch.setattr(identity_code, "SCALE", 2.0)  # a module-level name the forward reaches
    assert model_fingerprint(identity_code.HelperNet()).tag != base.tag
    monkeypatch.setattr(identity_code, "SCALE", 1.0)
    assert model_fingerprint(identity_code.HelperNet()).tag == base.tag  # and nothing else moves it

    def scaled(self, x):  # a helper method the forward calls, edited
        return x * identity_code.SCALE + 0

    monkeypatch.setattr(identity_code.HelperNet, "scaled", scaled)
    assert model_fingerprint(identity_code.HelperNet()).tag != base.tag

    assert code_digest(functools.partial(mse_scaled, k=1.0)) != code_digest(functools.partial(mse_scaled, k=2.0))
    assert code_digest(identity_code.Weighted(1.0)) != code_digest(identity_code.Weighted(2.0))

    net = RegressionMLP()
    net.temperature = 1.0  # a plain attribute the forward may read
    other = RegressionMLP()
    other.temperature = 2.0
    assert model_fingerprint(net).tag != model_fingerprint(other).tag


def mse_scaled(model, batch, k):
    return k * mse(model, batch)[0]


def test_a_sample_changed_in_the_middle_of_the_dataset_is_new_data():
    """Regression: only the first and last samples were read."""
    data = regression_data(64, 0)
    x, y = data.tensors
    edited = torch.utils.data.TensorDataset(x.clone(), y.clone())
    edited.tensors[0][32, 1] += 1
    assert data_fingerprint(data, None).tag != data_fingerprint(edited, None).tag
    assert data_fingerprint(data, None).tag == data_fingerprint(regression_data(64, 0), None).tag


# ---------------------------------------------------------------- case 6: random __getitem__
def test_an_unseeded_random_augmentation_still_resumes_its_own_run(tmp_path):
    """Regression: the data fingerprint hashed values drawn through __getitem__, which differ in every
    process, so a killed run could never resume (refused with a fixed run dir, from step 0 with the default)."""
    a, b = identity_code.Augmented(64), identity_code.Augmented(64)
    assert data_fingerprint(a, None).tag == data_fingerprint(b, None).tag  # read from storage, not __getitem__
    first = fit(tmp_path / "r", train=identity_code.Augmented(64))
    kill_after_last_snapshot(first.run_dir)
    fit(tmp_path / "r", train=identity_code.Augmented(64))
    starts = [json.loads(line) for line in (first.run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r.get("resumed_at_step") for r in starts if r["event"] == "start"] == [None, first["steps"]]


# ---------------------------------------------------------------- what cannot be read
def starts(run_dir):
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [r for r in records if r["event"] == "start"]


def test_what_cannot_be_read_resumes_after_a_kill_but_is_never_returned_finished(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    fp = data_fingerprint(identity_code.Streamed(32), None)
    assert fp.unproven == ("train.handle: a lock whose state ddpkit cannot read",)
    first = fit(train=identity_code.Streamed(64))  # the default run dir
    assert "train.handle: a lock" in starts(first.run_dir)[0]["not_read"]  # said on the [start] line
    capsys.readouterr()
    second = fit(train=identity_code.Streamed(64), reuse=True)  # asked for, but it cannot be told from another
    out = capsys.readouterr().out
    assert second.run_dir == first.run_dir.with_name(first.run_dir.name + "-2")
    assert "cannot tell whether this run is the same" in out and "train.handle: a lock" in out
    assert "already holds" not in out
    kill_after_last_snapshot(second.run_dir)
    third = fit(train=identity_code.Streamed(64))  # a kill: resumes its own run
    assert third.run_dir == second.run_dir and "resuming" in capsys.readouterr().out
    resumed = starts(third.run_dir)[-1]
    assert resumed["resumed_at_step"] == first["steps"] and "train.handle: a lock" in resumed["not_read"]
    with pytest.raises(RunDirError, match="cannot tell whether this run is the same: .*train.handle: a lock"):
        fit(first.run_dir, train=identity_code.Streamed(64), reuse=True)  # a run dir you name: refused


def test_a_finished_run_trains_again_unless_asked_and_a_named_run_dir_is_left_as_it_is(tmp_path, monkeypatch, capsys):
    """Regression (issue 33): a rerun returned a finished run's figures after edits the identity does not
    read (a constant in another module, a loss's settings, a collate). The identity guards a resume; it
    never proves a finished run unchanged, so a finished run is returned only when asked."""
    monkeypatch.chdir(tmp_path)
    first = fit()  # the default run dir
    capsys.readouterr()
    second = fit()
    out = capsys.readouterr().out
    assert second.run_dir == first.run_dir.with_name(first.run_dir.name + "-2") and "already holds" not in out
    assert "(reuse_finished (--reuse-finished) is off); training in" in out
    assert [r.get("resumed_at_step") for r in starts(second.run_dir)] == [None]  # trained from step 0
    named = tmp_path / "named"
    fit(named)
    before = {p.name: p.read_bytes() for p in named.iterdir() if p.is_file() and p.name != ".lock"}
    with pytest.raises(RunDirError, match=r"holds a finished run, left as it is .* pass --reuse-finished"):
        fit(named)
    assert {p.name: p.read_bytes() for p in named.iterdir() if p.is_file() and p.name != ".lock"} == before
    capsys.readouterr()
    returned = fit(named, reuse=True)  # asked for: returned, nothing trained
    assert "already holds this finished run, and --reuse-finished asks for it" in capsys.readouterr().out
    assert returned.summary == json.loads((named / "summary.json").read_text())
    assert len(starts(named)) == 1


def test_a_finished_run_returned_says_what_it_matched_on(tmp_path, capsys):
    fit(tmp_path / "r", optimizer=adamw(1e-3))
    capsys.readouterr()
    fit(tmp_path / "r", optimizer=adamw(1e-3), reuse=True)
    out = capsys.readouterr().out
    assert "asks for it (matched on the config, dataset TensorDataset (content)" in out
    assert (
        "model RegressionMLP (structure, code and attributes)" in out and "optimizer AdamW (class and settings)" in out
    )
    assert "cannot read" not in out
    saved = json.loads((tmp_path / "r" / "identity.json").read_text())
    assert saved["optimizer"]["parts"]["group 0 lr"] == "0.001"


# ---------------------------------------------------------------- case 4: data and weights named by path
@pytest.fixture
def images(tmp_path):
    from PIL import Image

    root = tmp_path / "images"
    for split, n in (("train", 8), ("val", 2)):
        for cls in ("a", "b"):
            (root / split / cls).mkdir(parents=True)
            for i in range(n):
                Image.new("RGB", (8, 8), (i * 20, 0, 0)).save(root / split / cls / f"{i}.png")
    return root


def image_run(root, run_dir):
    cfg = TrainConfig(
        dataset=f"imagefolder:{root}",
        image_size=8,
        model="mlp",
        **dict(SMALL, batch_size=4),
        **({"run_dir": str(run_dir)} if run_dir else {}),
    )
    return Trainer(cfg).fit()


@pytest.mark.slow
def test_images_added_or_removed_are_new_data(tmp_path, images, monkeypatch, capsys):
    """Regression: imagefolder:PATH was identified by its path: 40 images added gave the stale result,
    90 removed after a kill resumed on the new data and reported itself finished."""
    monkeypatch.chdir(tmp_path)
    first = image_run(images, None)
    shutil.copy(images / "train" / "a" / "0.png", images / "train" / "a" / "new.png")
    capsys.readouterr()
    added = image_run(images, None)
    assert added.run_dir != first.run_dir and "already holds" not in capsys.readouterr().out
    kill_after_last_snapshot(added.run_dir)
    (images / "train" / "b" / "3.png").unlink()
    said = r"data_digest ImageFiles: train ImageFiles, 17 samples -> ImageFiles, 16 samples, train files 17 files sha"
    with pytest.raises(RunDirError, match=said):
        image_run(images, added.run_dir)


def test_data_dir_files_and_init_from_weights_are_read_by_content(tmp_path):
    """--data-dir and --init-from were identified by path: other files there were the same run."""
    import numpy as np
    from formats import write_cifar10

    from ddpkit.data import load_dataset
    from ddpkit.preflight import content_fingerprints

    cfg = TrainConfig(dataset="cifar10", data_dir=str(tmp_path / "d")).resolved()
    write_cifar10(tmp_path / "d", np.random.default_rng(0))
    before = content_fingerprints(cfg, load_dataset(cfg, download=False))["data_digest"]
    shutil.rmtree(tmp_path / "d")
    write_cifar10(tmp_path / "d", np.random.default_rng(1))  # other files at the same --data-dir
    after = content_fingerprints(cfg, load_dataset(cfg, download=False))["data_digest"]
    assert before.tag != after.tag
    weights = tmp_path / "w.pt"
    torch.save(RegressionMLP().state_dict(), weights)
    init = TrainConfig(dataset="cifar10", data_dir=str(tmp_path / "d"), init_from=str(weights)).resolved()
    one = content_fingerprints(init, load_dataset(cfg, download=False))["init_digest"]
    torch.save(RegressionMLP(hidden=16).state_dict(), weights)
    assert content_fingerprints(init, load_dataset(cfg, download=False))["init_digest"].tag != one.tag


# ---------------------------------------------------------------- found in review: an identity that moved by itself
@pytest.mark.slow
@pytest.mark.multiprocess
def test_the_code_digest_is_the_same_under_every_hash_seed():
    """A set literal compiles to a frozenset constant whose repr order follows PYTHONHASHSEED: the same
    loss had another digest in every process, so no run could resume or be returned."""
    import subprocess
    import sys

    from clirun import cli_env

    script = (
        "from identity_code import set_literal_loss; from ddpkit.identity import code_digest; "
        "print(code_digest(set_literal_loss))"
    )
    seen = {
        subprocess.run(
            [sys.executable, "-c", script], env=cli_env(PYTHONHASHSEED=seed), capture_output=True, text=True, check=True
        ).stdout.strip()
        for seed in ("1", "2", "3")
    }
    assert len(seen) == 1, seen


def test_what_changes_by_itself_stays_out_of_the_identity(tmp_path):
    """Folders named by code (an output dir, '/'), weights reached by a closure, a rank's device index
    and object arrays' pointers changed the identity between two runs of one script (or hung)."""
    import numpy as np

    from ddpkit.identity import code_digest

    out = tmp_path / "out"
    out.mkdir()

    def make_loss(folder, root="/"):
        def loss(model, batch):
            print(folder, root)
            return mse(model, batch)

        return loss

    before = code_digest(make_loss(str(out)))
    (out / "log.txt").write_text("written by the run")
    assert code_digest(make_loss(str(out))) == before  # and "/" was not walked

    def with_weight(w):
        return lambda model, batch: (model(batch[0]) * w).mean()

    assert code_digest(with_weight(torch.nn.Parameter(torch.randn(3)))) == code_digest(
        with_weight(torch.nn.Parameter(torch.randn(3)))
    )
    a, b = RegressionMLP(), RegressionMLP()
    a.device, b.device = torch.device("cuda", 0), torch.device("cuda", 3)
    assert model_fingerprint(a).tag == model_fingerprint(b).tag

    class Words(torch.utils.data.Dataset):
        def __init__(self):
            self.words = np.array(["alpha", "beta", "gamma"], dtype=object)

        def __len__(self):
            return 3

        def __getitem__(self, i):
            return torch.tensor([len(self.words[i])], dtype=torch.float32), torch.zeros(1)

    assert data_fingerprint(Words(), None).tag == data_fingerprint(Words(), None).tag


def test_two_lambdas_of_one_name_are_both_read():
    """Two module-level lambdas shared one label, so an edit to the first read was overwritten."""
    from ddpkit.identity import code_digest

    def loss_of(first):
        scope = {}
        exec(f"A = lambda x: x * {first}\nB = lambda x: x + 1\ndef loss(model, batch): return A(B(batch))", scope)
        return scope["loss"]

    assert code_digest(loss_of(2)) != code_digest(loss_of(3))


def test_reading_never_changes_or_breaks_what_you_pass(tmp_path):
    from ddpkit.identity import code_digest

    model = RegressionMLP()
    lr = torch.tensor(1e-3)
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    scheduler_fingerprint(lambda o: torch.optim.lr_scheduler.LinearLR(o, start_factor=0.1), opt)
    assert float(opt.param_groups[0]["lr"]) == pytest.approx(1e-3)  # a tensor lr, not filled in place

    def freezing(m):
        m.net[0].weight.requires_grad_(False)
        return torch.optim.SGD([p for p in m.parameters() if p.requires_grad], lr=0.1)

    Trainer(TrainConfig(**SMALL), model=model, train_data=regression_data(64, 0), loss_fn=mse, optimizer=freezing)
    assert model.net[0].weight.requires_grad  # the factory ran on a copy

    def needs_a_process_group(m):
        raise ValueError("Default process group has not been initialized")

    fp, _ = optimizer_fingerprint(needs_a_process_group, model)
    assert fp.unproven == ("the optimizer factory could not be called before launch (ValueError)",)

    loop = [1]
    loop.append(loop)
    odd = identity_code.Unreadable()
    digest = code_digest(lambda model, batch: (loop, odd))
    assert digest == code_digest(lambda model, batch: (loop, odd))  # no crash, no recursion error


def test_schedulers_inside_a_sequential_scheduler_are_read():
    """The lr lambdas of the schedulers a SequentialLR runs were not read: an edit to one was the same run."""
    model = RegressionMLP()

    def sequential(warm_up):
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        warm = torch.optim.lr_scheduler.LambdaLR(opt, warm_up)
        return torch.optim.lr_scheduler.SequentialLR(
            opt, [warm, torch.optim.lr_scheduler.ConstantLR(opt, 1.0, 1)], milestones=[5]
        )

    one = scheduler_fingerprint(sequential(lambda step: 0.1 * step), None)
    two = scheduler_fingerprint(sequential(lambda step: 0.2 * step), None)
    assert one.tag != two.tag


@pytest.mark.multiprocess
def test_ranks_that_compute_another_identity_are_refused_on_every_rank():
    """Under torchrun each rank reads its own inputs; ranks that disagree named different run dirs."""
    from workers import identity_per_rank

    from ddpkit import launch

    results = launch(identity_per_rank, nproc=2)
    assert results == "refused: rank 1 computed another run identity than rank 0 (differs in data_digest) (on 2 ranks)"


def test_modules_that_build_modules_of_their_own_are_read_whole(tmp_path, capsys):
    """Regression (a newcomer's minGPT port): a block class reached by name from another class's
    __init__, whose own __init__ calls super(), was "nested too deep (or holds itself) to read", so
    every rerun trained again in a new run dir."""
    fp = model_fingerprint(identity_code.Stack())
    assert fp.unproven == () and "code Block.forward" in fp.parts and "code Stack.forward" in fp.parts
    run = tmp_path / "r"
    fit(run, model=identity_code.Stack())
    capsys.readouterr()
    fit(run, model=identity_code.Stack(), reuse=True)
    assert "already holds this finished run" in capsys.readouterr().out


# ---------------------------------------------------------------- issue 33: edits the identity did not read
def said(key, a, b):
    """How a refusal names what differs between two fingerprints."""
    from ddpkit.run.rundir import describe_difference

    return describe_difference(key, a.tag, b.tag, {key: a.to_json()}, {key: b.to_json()})


def test_a_constant_read_through_another_module_of_yours_is_read(tmp_path, monkeypatch):
    """Case 1: `identity_cfg.SCALE` in a forward was skipped (module objects were), so an edit resumed a run."""
    import identity_cfg

    base = model_fingerprint(identity_code.ConfigNet())
    assert model_fingerprint(identity_code.ConfigNet()).tag == base.tag
    monkeypatch.setattr(identity_cfg, "SCALE", 2.0)
    edited = model_fingerprint(identity_code.ConfigNet())
    assert edited.tag != base.tag and "global identity_cfg.SCALE 1.0 -> 2.0" in said("model", base, edited)
    monkeypatch.setattr(identity_cfg, "SCALE", 1.0)
    first = fit(tmp_path / "r", model=identity_code.ConfigNet())
    kill_after_last_snapshot(first.run_dir)
    monkeypatch.setattr(identity_cfg, "SCALE", 2.0)
    with pytest.raises(RunDirError, match=r"model ConfigNet: global identity_cfg\.SCALE 1\.0 -> 2\.0"):
        fit(tmp_path / "r", model=identity_code.ConfigNet())
    monkeypatch.setattr(identity_cfg, "SCALE", 1.0)
    fit(tmp_path / "r", model=identity_code.ConfigNet())  # unchanged: resumes
    assert [r.get("resumed_at_step") for r in starts(first.run_dir)] == [None, first["steps"]]


def test_a_library_loss_held_by_your_loss_is_read_by_its_settings_and_weights(monkeypatch):
    """Case 2: nn.CrossEntropyLoss was read by repr, which shows none of label_smoothing, weight, reduction."""
    from torch import nn

    from ddpkit.identity import code_fingerprint

    def loss_with(ce):
        monkeypatch.setattr(identity_code, "CE", ce)
        return code_fingerprint("task", {"loss_fn": identity_code.ce_loss})

    tags = {}
    for name, ce in [
        ("plain", nn.CrossEntropyLoss()),
        ("plain again", nn.CrossEntropyLoss()),
        ("label_smoothing", nn.CrossEntropyLoss(label_smoothing=0.3)),
        ("reduction", nn.CrossEntropyLoss(reduction="sum")),
        ("weight", nn.CrossEntropyLoss(weight=torch.tensor([1.0, 2.0, 3.0]))),
        ("weight again", nn.CrossEntropyLoss(weight=torch.tensor([1.0, 2.0, 3.0]))),
        ("other weight", nn.CrossEntropyLoss(weight=torch.tensor([1.0, 2.0, 4.0]))),
    ]:
        tags[name] = loss_with(ce)
    assert tags["plain"].tag == tags["plain again"].tag and tags["weight"].tag == tags["weight again"].tag
    edits = ("plain", "label_smoothing", "reduction", "weight", "other weight")
    assert len({tags[k].tag for k in edits}) == len(edits)
    assert "global identity_code.CE CrossEntropyLoss(" in said("task", tags["plain"], tags["label_smoothing"])
    assert "label_smoothing=0.3" in said("task", tags["plain"], tags["label_smoothing"])
    held = [code_fingerprint("task", {"loss_fn": identity_code.Smoothed(s)}) for s in (0.0, 0.0, 0.3)]
    assert held[0].tag == held[1].tag != held[2].tag  # held by a callable object
    assert said("task", held[0], held[2]).endswith(
        "-> Smoothed(ce=CrossEntropyLoss(reduction='mean', ignore_index=-100, label_smoothing=0.3, weight=None))"
    )


def test_library_layer_settings_that_repr_and_shapes_do_not_show_are_read():
    """Case 3: nn.TransformerEncoderLayer's nhead and norm_first change neither repr nor a parameter's shape."""
    base = identity_code.Encoder()
    assert repr(identity_code.Encoder(nhead=4)) == repr(base)  # what was read before could not tell them apart
    fp = model_fingerprint(base)
    assert model_fingerprint(identity_code.Encoder()).tag == fp.tag and fp.unproven == ()
    heads, first = (
        model_fingerprint(identity_code.Encoder(nhead=4)),
        model_fingerprint(identity_code.Encoder(norm_first=True)),
    )
    assert heads.tag != fp.tag != first.tag
    assert (
        said("model", fp, heads) == "model Encoder: layer.self_attn.num_heads 2 -> 4, layer.self_attn.head_dim 8 -> 4"
    )
    assert said("model", fp, first) == "model Encoder: layer.norm_first False -> True"


def test_private_and_class_attributes_of_your_classes_are_read(monkeypatch):
    """Case 4: `self._scale` (private) and `act = staticmethod(torch.relu)` (a class attribute) were skipped."""
    fp = model_fingerprint(identity_code.Activated())
    assert model_fingerprint(identity_code.Activated()).tag == fp.tag
    scaled = model_fingerprint(identity_code.Activated(scale=2.0))
    assert said("model", fp, scaled) == "model Activated: Activated._scale 1.0 -> 2.0"
    monkeypatch.setattr(identity_code.Activated, "act", staticmethod(torch.tanh))
    tanh = model_fingerprint(identity_code.Activated())
    assert re.fullmatch(r"model Activated: class Activated\.act [\w.]*\.relu -> [\w.]*\.tanh", said("model", fp, tanh))


def test_the_collate_fn_and_meta_passed_to_the_trainer_are_read():
    """Case 5: only the datasets were fingerprinted, so another collate_fn or meta was the same run."""
    from ddpkit.data import Meta

    def dataset_field(**kw):
        trainer = Trainer(
            TrainConfig(**SMALL), model=RegressionMLP(), train_data=regression_data(64, 0), loss_fn=mse, **kw
        )
        return trainer.config.dataset, trainer.fingerprints["dataset"]

    plain, _ = dataset_field()
    assert dataset_field()[0] == plain  # and data passed without them keeps its tag
    pad0, fp0 = dataset_field(collate_fn=functools.partial(identity_code.pad_collate, pad=0.0))
    pad1, fp1 = dataset_field(collate_fn=functools.partial(identity_code.pad_collate, pad=1.0))
    assert dataset_field(collate_fn=functools.partial(identity_code.pad_collate, pad=0.0))[0] == pad0
    assert len({plain, pad0, pad1}) == 3 and fp0["parts"]["collate code"].startswith("partial(")
    assert fp0["parts"]["collate arguments"] != fp1["parts"]["collate arguments"]
    meta = dict(channels=1, height=1, width=4, mean=(0.0,), std=(1.0,))
    one, fp = dataset_field(meta=Meta(classes=1, **meta))
    assert dataset_field(meta=Meta(classes=1, **meta))[0] == one != plain
    assert dataset_field(meta=Meta(classes=1, **{**meta, "std": (2.0,)}))[0] != one and fp["parts"]["meta std"]


def test_a_dataset_that_keeps_only_a_folder_path_is_not_matched_by_content(tmp_path):
    """Case 7: a folder's path was read as a string, so its files could change and the run still "matched on
    ... data by content". Now the folder is noted as read by name only (unproven): never returned finished."""
    from ddpkit.data.folder import ImageFiles

    folder = tmp_path / "samples"
    folder.mkdir()
    for i in range(4):
        (folder / f"{i}.txt").write_text(f"{i} 1 2 3")
    fp = data_fingerprint(identity_code.FolderData(str(folder)), None)
    assert fp.unproven == (
        f"train.root: the folder {str(folder)!r} is read by name only, not its files (ddpkit lists no folder: keep "
        f"the list of files in the dataset to have them read)",
    )
    listed = identity_code.FolderData(str(folder))
    listed.files = sorted(str(p) for p in folder.iterdir())  # a dataset that keeps its file list: read
    assert data_fingerprint(listed, None).unproven == ()
    from PIL import Image

    for cls in ("a", "b"):
        (tmp_path / "img" / cls).mkdir(parents=True)
        Image.new("RGB", (4, 4)).save(tmp_path / "img" / cls / "0.png")
    assert data_fingerprint(ImageFiles(tmp_path / "img", 4), None).unproven == ()  # its images are read
    fit(tmp_path / "r", train=identity_code.FolderData(str(folder)))
    with pytest.raises(RunDirError, match="read by name only"):
        fit(tmp_path / "r", train=identity_code.FolderData(str(folder)), reuse=True)


@pytest.mark.slow
@pytest.mark.multiprocess
def test_what_is_read_now_is_the_same_in_every_process():
    """Library settings, class and private attributes, modules' constants, folders: the same identity under
    every string hash seed (an unordered set's order, an id, would differ)."""
    import subprocess
    import sys

    from clirun import cli_env

    script = (
        "import identity_code as c, torch; from ddpkit.identity import model_fingerprint, code_fingerprint, "
        "data_fingerprint; print(model_fingerprint(c.Encoder()).tag, model_fingerprint(c.Activated()).tag, "
        "model_fingerprint(c.ConfigNet()).tag, code_fingerprint('t', {'l': c.ce_loss, 's': c.Smoothed(0.1)}).tag, "
        "data_fingerprint(c.FolderData('/'), None, c.pad_collate).tag, model_fingerprint(c.Logged()).tag)"
    )
    seen = {
        subprocess.run(
            [sys.executable, "-c", script], env=cli_env(PYTHONHASHSEED=seed), capture_output=True, text=True, check=True
        ).stdout.strip()
        for seed in ("1", "2")
    }
    assert len(seen) == 1, seen


# ---------------------------------------------------------------- case 6: eval and show-data rebuild by import path
ID33_CFG = "SCALE = 1.0\nBRIGHT = 1.0\n"
ID33_NETS = """
import id33cfg
from torch import nn


class Scaled(nn.Module):
    def __init__(self, classes=3):
        super().__init__()
        self.net = nn.Sequential(nn.Flatten(), nn.Linear(3 * 8 * 8, classes))

    def forward(self, x):
        return self.net(x) * id33cfg.SCALE


def net(classes=3):
    return Scaled(classes)
"""
ID33_DATA = """
import id33cfg
import torch
from torch.utils.data import TensorDataset


def pictures(n=64):
    x = torch.rand(n, 3, 8, 8) * id33cfg.BRIGHT
    y = x.mean((2, 3)).argmax(1)
    return TensorDataset(x[:48], y[:48]), TensorDataset(x[48:], y[48:])
"""


@pytest.fixture
def by_path(tmp_path, monkeypatch):
    """A run of a model and data named by import path, trained here; its modules in tmp_path."""
    import sys

    for name, text in (("id33cfg", ID33_CFG), ("id33nets", ID33_NETS), ("id33data", ID33_DATA)):
        (tmp_path / f"{name}.py").write_text(text)
    monkeypatch.syspath_prepend(str(tmp_path))
    cfg = TrainConfig(
        **{**SMALL, "log_every": 50}, model="id33nets:net", dataset="id33data:pictures", run_dir=str(tmp_path / "r")
    )
    result = Trainer(cfg).fit()
    yield result
    for name in ("id33cfg", "id33nets", "id33data"):
        sys.modules.pop(name, None)


@pytest.mark.slow
def test_show_data_refuses_a_model_or_data_its_import_path_no_longer_builds(by_path, tmp_path, monkeypatch, capsys):
    """Case 6: show-data --predictions rebuilt the model and data without comparing them with the run's."""
    import importlib
    import sys

    from ddpkit.tools.showdata import show_data

    shown = show_data(predictions=by_path.run_dir, out=tmp_path / "g.png", n=16)  # unchanged: shown
    assert shown["count"] == 16 and 0 <= shown["right"] <= 16
    monkeypatch.setattr(sys.modules["id33cfg"], "SCALE", 2.0)
    with pytest.raises(
        RunDirError, match=r"--model id33nets:net no longer builds .*global id33cfg\.SCALE 1\.0 -> 2\.0"
    ):
        show_data(predictions=by_path.run_dir, out=tmp_path / "g.png", n=16)
    monkeypatch.setattr(sys.modules["id33cfg"], "SCALE", 1.0)
    monkeypatch.setattr(sys.modules["id33cfg"], "BRIGHT", 0.5)
    with pytest.raises(
        RunDirError, match=r"--dataset id33data:pictures no longer builds .*id33cfg\.BRIGHT 1\.0 -> 0\.5"
    ):
        show_data(predictions=by_path.run_dir, out=tmp_path / "g.png", n=16)
    monkeypatch.setattr(sys.modules["id33cfg"], "BRIGHT", 1.0)
    # A run fingerprinted by an older ddpkit (which read less, and wrote no "reading"): its code compares.
    identity = json.loads((by_path.run_dir / "identity.json").read_text())
    (by_path.run_dir / "identity.json").write_text(json.dumps({k: {**fp, "reading": 1} for k, fp in identity.items()}))
    capsys.readouterr()
    show_data(predictions=by_path.run_dir, out=tmp_path / "g.png", n=16)
    assert "fingerprinted by an older ddpkit; its model_digest compares on code only" in capsys.readouterr().out
    (tmp_path / "id33nets.py").write_text(ID33_NETS.replace("* id33cfg.SCALE", "* id33cfg.SCALE * 2"))
    importlib.reload(sys.modules["id33nets"])
    with pytest.raises(RunDirError, match=r"model_digest Scaled: code Scaled\.forward changed \(recorded by another"):
        show_data(predictions=by_path.run_dir, out=tmp_path / "g.png", n=16)
    # Review finding: an older identity sharing no code part with today's compared nothing and said nothing
    no_code = {k: {**fp, "reading": 1, "parts": {"structure": "?"}} for k, fp in identity.items()}
    (by_path.run_dir / "identity.json").write_text(json.dumps(no_code))
    capsys.readouterr()
    show_data(predictions=by_path.run_dir, out=tmp_path / "g.png", n=16)
    assert "fingerprinted by an older ddpkit; its model_digest cannot be compared" in capsys.readouterr().out


@pytest.mark.slow
@pytest.mark.multiprocess
def test_eval_refuses_a_model_its_import_path_no_longer_builds(by_path, tmp_path):
    """Case 6: `ddpkit eval` scored model.pt on a model whose forward had changed (test loss 1.831 for a run
    that scored 1.417), with no warning."""
    import shutil as sh

    from clirun import run_cli

    ok = run_cli("eval", str(by_path.run_dir), "--nproc", "1", "--device", "cpu", cwd=tmp_path)
    assert ok.returncode == 0, ok.stderr
    assert json.loads(ok.stdout.strip().splitlines()[-1])["test_loss"] == by_path["test_loss"]  # unchanged
    (tmp_path / "id33cfg.py").write_text(ID33_CFG.replace("SCALE = 1.0", "SCALE = 2.0  # edited"))
    sh.rmtree(tmp_path / "__pycache__", ignore_errors=True)
    refused = run_cli("eval", str(by_path.run_dir), "--nproc", "1", "--device", "cpu", cwd=tmp_path)
    assert refused.returncode != 0 and "Traceback" not in refused.stderr
    lines = refused.stderr.strip().splitlines()
    assert len(lines) == 1 and "--model id33nets:net no longer builds" in lines[0]
    assert "model_digest Scaled: global id33cfg.SCALE 1.0 -> 2.0" in lines[0]


def test_a_module_level_logger_is_read_by_name():
    """Review finding: a forward using logging.getLogger(__name__) read the logger's __dict__, which reaches
    every logger of the process (an order and caches of its own): the same model had another identity in
    every process, and after any log line. (The determinism test above runs it in two processes.)"""
    import logging

    before = model_fingerprint(identity_code.Logged())
    logging.getLogger("another.logger").warning("a line that fills the registry's caches")
    identity_code.LOG.warning("and this logger's")
    after = model_fingerprint(identity_code.Logged())
    assert before.tag == after.tag and before.unproven == ()


def test_a_cached_helper_is_read_through_its_cache():
    """Review finding: functools.cache/lru_cache wrappers were read as an empty object, so an edit inside a
    cached helper left the identity as it was, with nothing said."""
    from ddpkit.identity import code_fingerprint

    def times_two(x):
        return x * 2

    def plus_100(x):
        return x + 100

    plus_100.__qualname__ = plus_100.__name__ = "times_two"  # the same name, another body
    tags = {code_fingerprint("t", {"l": functools.lru_cache(f)}).tag for f in (times_two, plus_100)}
    assert len(tags) == 2


def test_samples_of_another_shape_are_not_read_and_say_so(tmp_path):
    """Review finding: an ImageFolder-like dataset with (path, target, weight) samples raised ValueError."""
    fp = data_fingerprint(identity_code.Triplets(str(tmp_path)), None)
    assert any("samples ddpkit cannot read as (path, target)" in u for u in fp.unproven)


# ---------------------------------------------------------------- issue 41: values set outside your code
class EnvScaled(RegressionMLP):
    """Scaled by an environment variable its forward reads (issue 41 case 1)."""

    def forward(self, x):
        return super().forward(x) * float(os.environ["MUL"])


class EnvRead(RegressionMLP):
    """The other ways to read one by name: getenv, environ.get, `in`, and from-imported environ."""

    def forward(self, x):
        k = float(os.getenv("MUL_A", "1")) * float(os.environ.get("MUL_B", "1"))
        return super().forward(x) * k * (2.0 if "MUL_C" in os.environ else 1.0) * float(environ.get("MUL_D", "1"))


class EnvByName(RegressionMLP):
    """Reads the environment by a name that is not a constant, and where it runs (its launcher's RANK)."""

    key = "MUL"

    def forward(self, x):
        return super().forward(x) * float(os.environ[self.key]) * (1 + int(os.environ.get("RANK", "0")))


class MathSet(RegressionMLP):
    """Reads an attribute that code of yours set on a C-extension module at import (math.X41 = 2.0)."""

    def forward(self, x):
        return super().forward(x) * math.X41


class MathShipped(RegressionMLP):
    """Reads the shipped module's own constants."""

    def forward(self, x):
        return super().forward(x).to(torch.float32) * math.pi


def test_an_environment_variable_read_in_forward_is_read_by_its_name(tmp_path, monkeypatch):
    """Issue 41 case 1: a forward scaled by float(os.environ["MUL"]) was neither read nor listed, so
    --reuse-finished returned the run made with another MUL (1.286 where a fresh run gave 2.211)."""
    monkeypatch.setenv("MUL", "1")
    one = model_fingerprint(EnvScaled())
    assert model_fingerprint(EnvScaled()).tag == one.tag and one.unproven == ()
    monkeypatch.setenv("MUL", "2")
    two = model_fingerprint(EnvScaled())
    assert said("model", one, two) == "model EnvScaled: os.environ['MUL'] '1' -> '2'"
    monkeypatch.delenv("MUL")
    assert said("model", one, model_fingerprint(EnvScaled())) == "model EnvScaled: os.environ['MUL'] '1' -> unset"
    tags = set()
    for name in ("MUL_A", "MUL_B", "MUL_C", "MUL_D"):  # each way of reading one is read
        monkeypatch.setenv(name, "3")
        tags.add(model_fingerprint(EnvRead()).tag)
        monkeypatch.delenv(name)
    assert len(tags | {model_fingerprint(EnvRead()).tag}) == 5
    monkeypatch.setenv("MUL", "1")
    run = tmp_path / "r"
    fit(run, model=EnvScaled())
    monkeypatch.setenv("MUL", "2")
    with pytest.raises(RunDirError, match=r"model EnvScaled: os\.environ\['MUL'\] '1' -> '2'"):
        fit(run, model=EnvScaled(), reuse=True)  # not the stored result of MUL=1


def test_the_environment_read_by_another_name_is_listed_and_a_launchers_is_not_the_identity(tmp_path, monkeypatch):
    """Issue 41 case 1: what cannot be read by name is "not read" (never returned finished); RANK, which
    differs on every rank and a launcher sets, is not read (ranks must agree, and an elastic resume goes on)."""
    monkeypatch.setenv("MUL", "1")
    fp = model_fingerprint(EnvByName())
    assert fp.unproven == (
        "code EnvByName.forward: reads the environment other than by a constant name (os.environ[name], "
        "os.environ.items(), ...), so what it reads is not read",
    )
    monkeypatch.setenv("RANK", "1")
    assert model_fingerprint(EnvByName()).tag == fp.tag and not any("RANK" in part for part in fp.parts)
    monkeypatch.delenv("RANK")
    fit(tmp_path / "r", model=EnvByName())
    with pytest.raises(RunDirError, match=r"cannot tell whether this run is the same: .*os\.environ\[name\]"):
        fit(tmp_path / "r", model=EnvByName(), reuse=True)


def test_an_attribute_set_on_a_c_module_is_read_and_its_shipped_constants_stay_read(monkeypatch):
    """Issue 41 case 1: math.X41 = 2.0 at import, read in forward, was skipped with the module (the
    standard library's), so another value was the same run. math.pi and torch.float32 stay read, never
    "not read", and the same in every run."""
    monkeypatch.setattr(math, "X41", 2.0, raising=False)
    two = model_fingerprint(MathSet())
    monkeypatch.setattr(math, "X41", 3.0)
    assert said("model", two, model_fingerprint(MathSet())) == "model MathSet: global math.X41 2.0 -> 3.0"
    shipped = model_fingerprint(MathShipped())
    assert shipped.unproven == () and model_fingerprint(MathShipped()).tag == shipped.tag


def test_an_attribute_is_not_read_as_the_global_of_its_name():
    """Regression (the porter's seed 003): ``self.save_every`` read the script's global ``save_every``, set in its
    ``if __name__ == "__main__":`` block, so only where the script ran as ``__main__``: a run launched at 2
    processes (``__mp_main__``) was refused at 1 as other code. A global the code loads is still read."""
    from ddpkit.identity import code_digest

    source = "def step(self):\n    return self.save_every\n\ndef direct():\n    return save_every\n"
    bare, scripted = {"__name__": "__mp_main__"}, {"__name__": "__main__", "save_every": 10}
    exec(source, bare)
    exec(source, scripted)
    assert code_digest(bare["step"]) == code_digest(scripted["step"])
    changed = {"__name__": "__main__", "save_every": 20}
    exec(source, changed)
    assert code_digest(scripted["direct"]) != code_digest(changed["direct"])
