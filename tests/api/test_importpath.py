"""--model/--dataset pkg.module:function: every mistake is one line naming the flag, before anything starts."""

from __future__ import annotations

import pytest
import torch

from ddpkit import TrainConfig, Trainer
from ddpkit.errors import ConfigError, DataError
from ddpkit.importpath import is_import_path

USER = """
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset


def net(hidden=4):
    return nn.Sequential(nn.Linear(2, hidden), nn.Linear(hidden, 3))


def broken(hidden=4):
    return nn.Linear(2, hidden) + 1


def not_a_model():
    return "a string"


def data(n=32):
    x = torch.randn(n, 2)
    return TensorDataset(x, (x[:, 0] > 0).long()), TensorDataset(x[:8], (x[:8, 0] > 0).long())


def loaders():
    train, test = data()
    return DataLoader(train), DataLoader(test)


def one_split():
    return data()[0]


NOT_CALLABLE = 3
"""


@pytest.fixture
def user(tmp_path, monkeypatch):
    (tmp_path / "usermod.py").write_text(USER)
    (tmp_path / "raises_on_import.py").write_text("import torch\nraise RuntimeError('no GPU here')\n")
    monkeypatch.syspath_prepend(str(tmp_path))


def test_what_is_an_import_path():
    assert is_import_path("pkg.mod:fn") and is_import_path("mod:Class.build")
    assert not any(is_import_path(s) for s in ("mnist", "imagefolder:data", "custom:MLP#1a2b3c4d", "a:b:c", "m:"))


@pytest.mark.parametrize(
    "config,error",
    [
        (dict(model="nosuchmod:net"), "--model nosuchmod:net: no module named 'nosuchmod' here; run from the folder"),
        (dict(model="usermod:nope"), "--model usermod:nope: usermod has no 'nope'"),
        (dict(model="usermod:NOT_CALLABLE"), "int is not callable"),
        (dict(model="raises_on_import:f"), "importing raises_on_import failed: RuntimeError: no GPU here \\("),
        (dict(model="usermod:broken"), "calling broken\\(\\) raised TypeError: .*usermod.py:\\d+\\)"),
        (dict(model="usermod:not_a_model"), "returned a str, not a torch.nn.Module"),
        (dict(model="usermod:net", model_args='{"hidden": '), "--model-args .* is not JSON"),
        (dict(model="usermod:net", model_args="[4]"), "must be a JSON object of keyword arguments"),
        (dict(model="usermod:net", model_args='{"width": 4}'), "calling net\\(width=4\\) raised TypeError"),
        (
            dict(model="mlp", model_args='{"hidden": 4}'),
            "--model-args is for --model pkg.module:function, not --model mlp",
        ),
        (dict(dataset="mnist", dataset_args='{"n": 4}'), "--dataset-args is for --dataset pkg.module:function"),
    ],
)
def test_a_mistake_in_a_model_path_is_one_line(user, config, error):
    with pytest.raises(ConfigError, match=error):
        Trainer(TrainConfig(**{"dataset": "usermod:data", "device": "cpu", **config})).fit()


@pytest.mark.parametrize(
    "dataset,error",
    [
        ("usermod:loaders", "returned a DataLoader as train: return map-style datasets"),
        ("usermod:one_split", "returned a TensorDataset; return \\(train, test\\) datasets"),
    ],
)
def test_a_dataset_path_must_return_the_two_datasets(user, dataset, error):
    with pytest.raises(DataError, match=error):
        Trainer(TrainConfig(dataset=dataset, model="usermod:net", device="cpu")).fit()


def test_naming_a_model_by_path_and_passing_one_is_refused(user):
    with pytest.raises(ConfigError, match="the config's model is usermod:net and model=... is passed too"):
        Trainer(TrainConfig(model="usermod:net"), model=torch.nn.Linear(2, 3))


def test_a_path_builds_the_same_weights_and_data_every_time_and_trains_in_process(user, tmp_path):
    """Seeded with --seed, as the registry models: so a rerun, eval and check start from the same objects."""
    cfg = TrainConfig(
        model="usermod:net",
        model_args='{"hidden": 5}',
        dataset="usermod:data",
        device="cpu",
        nproc="1",
        epochs=1,
        batch_size=8,
        progress=False,
        run_dir=str(tmp_path / "r"),
    )
    a, b = Trainer(cfg), Trainer(cfg)
    assert all(torch.equal(x, y) for x, y in zip(a.model.state_dict().values(), b.model.state_dict().values()))
    assert torch.equal(a.splits.train.tensors[0], b.splits.train.tensors[0])
    assert a.model[0].out_features == 5
    result = a.fit()
    assert result["steps"] == 4
    assert a.config.model == "usermod:net" and a.config.model_digest.startswith("Sequential#")


def test_arguments_added_in_a_named_run_dir_make_another_run():
    """Regression (review): "" was read as "not recorded", so arguments given on a second run matched
    a first run made without any, and its result was returned."""
    first = TrainConfig(model="usermod:net", dataset="usermod:data").to_dict()
    again = TrainConfig(model="usermod:net", model_args='{"hidden": 8}', dataset="usermod:data")
    assert again.differing_keys(first) == ["model_args"]
    older = {k: v for k, v in first.items() if k not in ("model_args", "dataset_args", "model_digest")}
    assert TrainConfig(model="usermod:net", dataset="usermod:data").differing_keys(older) == []  # ddpkit 0.2's


def test_an_edit_to_the_function_a_path_names_changes_the_run_identity(user, tmp_path):
    """The model it builds may be a library class (nn.Sequential) whose code is not read: the
    function's own code is (an added init changes the weights, not the structure)."""
    import importlib
    import sys

    cfg = TrainConfig(model="usermod:net", dataset="usermod:data", device="cpu")
    before = Trainer(cfg).config.model_digest
    path = tmp_path / "usermod.py"
    path.write_text(
        path.read_text().replace(
            "    return nn.Sequential(nn.Linear(2, hidden), nn.Linear(hidden, 3))",
            "    net = nn.Sequential(nn.Linear(2, hidden), nn.Linear(hidden, 3))\n"
            "    torch.nn.init.zeros_(net[1].weight)\n    return net",
        )
    )
    sys.modules.pop("usermod", None)
    importlib.invalidate_caches()
    after = Trainer(cfg).config.model_digest
    assert before.split("#")[0] == after.split("#")[0] == "Sequential" and before != after


def test_a_model_that_cannot_be_copied_skips_the_trial_step_instead_of_failing():
    """Regression (review): a module holding a non-leaf tensor (the old weight_norm's) raised a
    traceback from copy.deepcopy in preflight, where it had trained before."""
    from ddpkit.data import DataSplits
    from ddpkit.preflight import trial_step
    from ddpkit.train.task import Classification

    model = torch.nn.Linear(2, 3)
    model.derived = model.weight * 2  # a non-leaf tensor attribute: deepcopy refuses it
    x = torch.randn(8, 2)
    data = torch.utils.data.TensorDataset(x, (x[:, 0] > 0).long())
    assert trial_step(model, DataSplits(data, data, None), Classification(), TrainConfig()) is None
