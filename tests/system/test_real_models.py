"""Models and data ddpkit does not ship, at world 2 through the Python API (issue: real models at world >= 2)."""

from __future__ import annotations

import json

import pytest
import torch
from clirun import bench_finished
from torch.utils.data import TensorDataset
from user_code import ListData, ManyTensors, UnusedBranch, tensor_count

from ddpkit import TrainConfig, Trainer, launch
from ddpkit.errors import ConfigError

pytestmark = pytest.mark.multiprocess  # every test here starts processes

TWO = dict(nproc="2", device="cpu", epochs=1, progress=False, log_every=1)


def blobs(n: int, features: int = 2, classes: int = 3, seed: int = 0) -> TensorDataset:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(n, features, generator=gen)
    return TensorDataset(x, (x.sum(1) > 0).long() + (x[:, 0] > 1).long())


@pytest.mark.slow
def test_torchvision_resnet50_trains_at_world_2(tmp_path):
    """Regression: "ValueError: too many fds" (a 65-line traceback): its 320 tensors each went to the
    workers as a file descriptor, and a forkserver child takes at most 256."""
    import torchvision

    gen = torch.Generator().manual_seed(0)
    data = TensorDataset(torch.randn(16, 3, 32, 32, generator=gen), torch.randint(0, 10, (16,), generator=gen))
    model = torchvision.models.resnet50(num_classes=10)
    assert len(model.state_dict()) > 256
    result = Trainer(
        TrainConfig(**TWO, batch_size=8, run_dir=str(tmp_path / "r")), model=model, train_data=data, test_data=data
    ).fit()
    assert result["world_size"] == 2 and result["steps"] == 2


@pytest.mark.slow
def test_a_thousand_tensor_model_a_list_dataset_and_launch_arguments_reach_the_workers(tmp_path):
    result = Trainer(
        TrainConfig(**TWO, batch_size=20, run_dir=str(tmp_path / "r")),
        model=ManyTensors(),
        train_data=ListData(300),
        test_data=ListData(40),
    ).fit()
    assert result["world_size"] == 2 and result["steps"] == 15
    assert launch(tensor_count, [torch.full((3,), float(i)) for i in range(300)], nproc=2) == 300


def test_a_model_with_an_unused_branch_trains_at_world_2_and_says_why_it_is_slower(tmp_path, capsys):
    """Regression: it trained at nproc 1 and crashed at nproc 2 with DDP's 83-line traceback ending in
    "pass find_unused_parameters=True", which ddpkit offered no way to do."""
    result = Trainer(
        TrainConfig(**TWO, batch_size=16, run_dir=str(tmp_path / "r")),
        model=UnusedBranch(),
        train_data=blobs(64),
        test_data=blobs(16, seed=1),
    ).fit()
    out = capsys.readouterr().out
    said = [line for line in out.splitlines() if "get no gradient" in line]
    assert len(said) == 1 and "aux_head.weight, aux_head.bias" in said[0] and "find_unused_parameters" in said[0]
    assert result["steps"] == 4
    # The decision is the start record's; config.toml keeps what was asked (nothing: left unset)
    start = json.loads((result.run_dir / "metrics.jsonl").read_text().splitlines()[0])
    assert start["event"] == "start" and start["find_unused_parameters"] is True
    assert "find_unused_parameters" not in (result.run_dir / "config.toml").read_text()
    with pytest.raises(ConfigError, match="2 parameter\\(s\\) get no gradient .*--no-find-unused-parameters"):
        Trainer(
            TrainConfig(**TWO, batch_size=16, find_unused_parameters=False, run_dir=str(tmp_path / "s")),
            model=UnusedBranch(),
            train_data=blobs(64),
            test_data=blobs(16, seed=1),
        ).fit()
    assert not (tmp_path / "s").exists()  # refused before launch


def test_a_model_that_uses_every_parameter_keeps_ddps_fast_path(tmp_path, capsys):
    result = Trainer(
        TrainConfig(**TWO, batch_size=16, run_dir=str(tmp_path / "r")),
        model=torch.nn.Sequential(torch.nn.Linear(2, 8), torch.nn.ReLU(), torch.nn.Linear(8, 3)),
        train_data=blobs(64),
        test_data=blobs(16, seed=1),
    ).fit()
    assert "get no gradient" not in capsys.readouterr().out
    assert "find_unused_parameters" not in (result.run_dir / "config.toml").read_text()
    starts = [json.loads(line) for line in (result.run_dir / "metrics.jsonl").read_text().splitlines()]
    assert starts[0]["event"] == "start" and starts[0]["find_unused_parameters"] is False


USER_NETS = """
import torch
from torch import nn


def small_cnn(classes=3, width=8):
    return nn.Sequential(
        nn.Conv2d(3, width, 3, padding=1), nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(width, classes)
    )
"""
USER_DATA = '''
import torch
from clirun import bench_finished
from torch.utils.data import TensorDataset


def pictures(n=96, size=8):
    """Float images whose class is their brightest channel; drawn at random (ddpkit seeds the call)."""
    x = torch.rand(n, 3, size, size)
    y = x.mean((2, 3)).argmax(1)
    cut = n * 3 // 4
    return {"train": TensorDataset(x[:cut], y[:cut]), "test": TensorDataset(x[cut:], y[cut:])}
'''


@pytest.mark.slow
def test_a_model_and_data_named_by_import_path_train_evaluate_show_check_and_bench_from_the_cli(tmp_path):
    """Regression: --model took 5 names and --dataset 5 plus imagefolder:, so a model of your own could
    not be trained, evaluated, shown, checked or benchmarked from the CLI. The console script, run
    from the folder that holds the user's modules (which is not on its sys.path by itself)."""
    import subprocess
    import sys
    from pathlib import Path

    from clirun import cli_env

    (tmp_path / "mynets.py").write_text(USER_NETS)
    (tmp_path / "mydata.py").write_text(USER_DATA)
    script = Path(sys.executable).with_name("ddpkit")

    def ddpkit(*args):
        env = cli_env()
        env["PYTHONPATH"] = env["PYTHONPATH"].replace(str(tmp_path), "")
        return subprocess.run([str(script), *args], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)

    workload = ["--model", "mynets:small_cnn", "--model-args", '{"width": 12}', "--dataset", "mydata:pictures"]
    train = ddpkit(
        "train",
        *workload,
        "--nproc",
        "2",
        "--device",
        "cpu",
        "--epochs",
        "2",
        "--batch-size",
        "16",
        "--run-dir",
        "r",
        "--no-progress",
    )
    assert train.returncode == 0, train.stderr
    summary = json.loads((tmp_path / "r" / "summary.json").read_text())
    config = (tmp_path / "r" / "config.toml").read_text()
    assert 'model = "mynets:small_cnn"' in config and 'dataset = "mydata:pictures"' in config
    assert 'model_args = "{\\"width\\": 12}"' in config and 'model_digest = "Sequential#' in config

    evaluated = ddpkit("eval", "r", "--nproc", "2")
    assert evaluated.returncode == 0, evaluated.stderr
    again = json.loads(evaluated.stdout.strip().splitlines()[-1])
    assert again["test_accuracy"] == summary["test_accuracy"] and again["test_samples"] == 24

    shown = ddpkit("show-data", "--predictions", "r", "--out", "grid.png", "--n", "24")
    assert shown.returncode == 0, shown.stderr
    assert (tmp_path / "grid.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert f"{round(24 * summary['test_accuracy'])} of 24 predicted right" in shown.stdout  # the run's model.pt

    checked = ddpkit("check", *workload, "--nproc", "2", "--device", "cpu", "--batch-size", "16", "--json", "c.json")
    assert checked.returncode == 0, checked.stdout + checked.stderr
    assert "PASSED" in checked.stdout and json.loads((tmp_path / "c.json").read_text())["passed"]

    bench = ddpkit(
        "bench", *workload, "--nproc", "1,2", "--device", "cpu", "--batch-size", "8", "--steps", "20", "--out", "b"
    )
    bench_finished(bench, tmp_path / "b" / "bench.json")
    assert "mynets:small_cnn on mydata:pictures" in (tmp_path / "b" / "bench.md").read_text()

    rerun = ddpkit("train", "--config", "r/config.toml", "--reuse-finished")  # rebuilt from its config: returned
    assert rerun.returncode == 0 and "already holds this finished run" in rerun.stdout, rerun.stderr


def _checked(report) -> None:
    assert report.passed, report.to_dict()
    assert report.coverage["ok"], report.coverage


def test_a_transformer_with_multihead_attention_trains_at_world_2_as_at_world_1(tmp_path):
    from user_code import TinyTransformer, token_classes

    from ddpkit.tools.check import check

    torch.manual_seed(0)
    _checked(check(TinyTransformer(), token_classes(96, 0), token_classes(32, 1), nproc=2, steps=4, batch_size=16))


def test_a_hugging_face_style_model_computing_its_own_loss_trains_at_world_2_as_at_world_1(tmp_path):
    """Dict samples in, {"loss": ...} out, as a Hugging Face model given labels (a small local module)."""
    from user_code import DictData, OwnLossModel, dict_mae

    from ddpkit.tools.check import check

    torch.manual_seed(0)
    report = check(
        OwnLossModel(), DictData(96, 0), DictData(32, 1), nproc=2, steps=4, batch_size=16, metrics={"mae": dict_mae}
    )
    _checked(report)


def test_variable_length_sequences_with_a_collate_fn_train_at_world_2_as_at_world_1(tmp_path):
    """Regression: 1,024 variable-length samples with a collate_fn gave "too many fds" at world 2."""
    from user_code import MaskedMean, VarLength, pad_collate, padded_accuracy, padded_loss

    from ddpkit.tools.check import check

    torch.manual_seed(0)
    report = check(
        MaskedMean(),
        VarLength(1024, 0),
        VarLength(64, 1),
        nproc=2,
        steps=4,
        batch_size=32,
        loss_fn=padded_loss,
        metrics={"accuracy": padded_accuracy},
        collate_fn=pad_collate,
    )
    _checked(report)


def test_a_model_with_an_unused_branch_is_checked_at_world_2(tmp_path):
    from user_code import UnusedBranch

    from ddpkit.tools.check import check

    torch.manual_seed(0)
    report = check(UnusedBranch(), blobs(96), blobs(32, seed=1), nproc=2, steps=4, batch_size=16)
    _checked(report)
    assert any("aux_head.weight" in note for note in report.notes)
