"""The run identity: every edit to what you pass in is a new run, and what cannot be read is never a stale result.

Each test reproduces a case where ddpkit returned a stale result or resumed on changed inputs."""

from __future__ import annotations

import functools
import json
import shutil

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


def fit(run_dir=None, model=None, optimizer=None, train=None, **kw):
    cfg = TrainConfig(**SMALL, **({"run_dir": str(run_dir)} if run_dir else {}))
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
def test_what_cannot_be_read_resumes_after_a_kill_but_is_never_returned_finished(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    fp = data_fingerprint(identity_code.Streamed(32), None)
    assert fp.unproven == ("train.handle: a lock whose state ddpkit cannot read",)
    first = fit(train=identity_code.Streamed(64))  # the default run dir
    note = [line for line in capsys.readouterr().out.splitlines() if line.startswith("ddpkit: note:")]
    assert len(note) == 1 and "cannot read train.handle: a lock" in note[0]  # said on the first run already
    second = fit(train=identity_code.Streamed(64))
    out = capsys.readouterr().out
    assert second.run_dir == first.run_dir.with_name(first.run_dir.name + "-2")
    assert "cannot tell from this one" in out and "train.handle: a lock" in out and "already holds" not in out
    kill_after_last_snapshot(second.run_dir)
    third = fit(train=identity_code.Streamed(64))  # a kill: resumes its own run
    assert third.run_dir == second.run_dir and "resuming" in capsys.readouterr().out
    with pytest.raises(RunDirError, match="cannot tell whether this run is the same .*train.handle: a lock"):
        fit(first.run_dir, train=identity_code.Streamed(64))  # a run dir you name: refused, never returned


def test_a_finished_run_returned_says_what_it_matched_on(tmp_path, capsys):
    fit(tmp_path / "r", optimizer=adamw(1e-3))
    capsys.readouterr()
    fit(tmp_path / "r", optimizer=adamw(1e-3))
    out = capsys.readouterr().out
    assert "already holds this finished run (matched on the config, dataset TensorDataset (content)" in out
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
    fit(run, model=identity_code.Stack())
    assert "already holds this finished run" in capsys.readouterr().out
