"""``ddpkit show-data``: labelled image grids as real PNG files, with a real trained run's predictions."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from clirun import WAIT_S, run_cli, start_cli
from matplotlib.image import imread
from once import once
from PIL import Image

from ddpkit.cli import main
from ddpkit.errors import ConfigError, RunDirError
from ddpkit.tools.showdata import (
    MAX_NAME,
    PNG_SIGNATURE,
    class_names,
    sample_indices,
    show_data,
    tile_labels,
)

FOLDER_CLASSES = ["cat", "dog", "sea_urchin_with_a_very_long_name"]


@pytest.fixture(scope="module")
def trained_run(tmp_path_factory):
    """A tiny MLP trained on MNIST by the real CLI: 512 images, one epoch, one CPU process; once per pytest run,
    for this module's tests on any worker (tests/helpers/once.py)."""

    def make(where: Path) -> None:
        proc = run_cli(
            "train",
            "--dataset",
            "mnist",
            "--recipe",
            "mnist",
            "--model",
            "mlp",
            "--epochs",
            "1",
            "--limit-train",
            "512",
            "--limit-test",
            "256",
            "--nproc",
            "1",
            "--device",
            "cpu",
            "--run-dir",
            str(where / "mnist-mlp"),
            "--quiet",
            "--no-progress",
        )
        assert proc.returncode == 0, proc.stderr

    return once(tmp_path_factory, "show-data-run", make) / "mnist-mlp"


@pytest.fixture
def image_folder(tmp_path):
    """An ImageFolder tree in the layout ddpkit reads: train/<class>/ and test/<class>/, PNG and JPEG files."""
    root = tmp_path / "folder"
    for split in ("train", "test"):
        for k, name in enumerate(FOLDER_CLASSES):
            (root / split / name).mkdir(parents=True)
            for j in range(2):
                pixels = np.zeros((20, 30, 3), np.uint8)
                pixels[..., k] = 200
                pixels[5:15, 5 + 5 * j : 15 + 5 * j] = 255
                Image.fromarray(pixels).save(root / split / name / f"img{j}.{'png' if j else 'jpg'}")
    return root


def read_png(path):
    assert path.read_bytes()[:8] == PNG_SIGNATURE
    return imread(str(path))  # [H, W, 4] floats


def test_mnist_grid_is_a_png_of_sensible_size(tmp_path):
    out = tmp_path / "grid.png"
    result = show_data("mnist", out, n=32, seed=3)
    assert result["count"] == 32 and result["path"] == str(out)
    pixels = read_png(out)
    height, width = pixels.shape[:2]
    assert 1000 <= width <= 2500 and 700 <= height <= 1800, (width, height)  # 8 x 4 tiles of ~1.2 in at 150 dpi
    assert pixels[..., :3].std() > 0.1  # images drawn, not a blank page
    # The same seed, the same images; another seed, others.
    assert sample_indices(10000, 32, 3) == result["indices"] and len(set(result["indices"])) == 32
    assert sample_indices(10000, 32, 4) != result["indices"]


def test_class_names_of_every_dataset():
    assert class_names("mnist", 10) == [str(k) for k in range(10)]
    assert class_names("fashion-mnist", 10)[:2] == ["T-shirt/top", "Trouser"]
    assert class_names("cifar10", 10)[:2] == ["airplane", "automobile"]
    assert class_names("cifar100", 100, "/nonexistent") == [str(k) for k in range(100)]  # no meta file: numbers
    assert class_names("synthetic", 3) == ["class 0", "class 1", "class 2"]


def test_cifar100_names_come_from_its_meta_file(tmp_path):
    import pickle

    (tmp_path / "cifar-100-python").mkdir()
    names = [f"name_{k}".encode() for k in range(100)]
    with open(tmp_path / "cifar-100-python" / "meta", "wb") as fh:
        pickle.dump({b"fine_label_names": names}, fh)
    assert class_names("cifar100", 100, tmp_path)[:2] == ["name 0", "name 1"]


def test_imagefolder_shows_its_folder_names(image_folder, tmp_path):
    assert class_names(f"imagefolder:{image_folder}", 3) == FOLDER_CLASSES
    result = show_data(f"imagefolder:{image_folder}", tmp_path / "folder.png", n=6)
    assert result["count"] == 6 and sorted(result["labels"]) == [0, 0, 1, 1, 2, 2]  # the whole test split
    read_png(tmp_path / "folder.png")
    labels = tile_labels(result["labels"], FOLDER_CLASSES, None)
    shown = {line for tile in labels for line, _ in tile}
    assert {"cat", "dog"} <= shown
    long = [line for line in shown if line.startswith("sea_urchin")]
    assert long and len(long[0]) == MAX_NAME and long[0].endswith("\u2026")  # long names truncated


def test_tile_labels_mark_right_and_wrong():
    tiles = tile_labels([0, 1], ["zero", "one"], [0, 0])
    assert tiles[0] == [("\u2713 pred zero", False)]
    assert tiles[1] == [("\u2717 pred zero", True), ("true one", True)]  # wrong: bold, with the true class


@pytest.mark.slow
@pytest.mark.multiprocess
def test_predictions_count_right_as_the_model_does(trained_run, tmp_path):
    from ddpkit.config import TrainConfig
    from ddpkit.data import load_dataset
    from ddpkit.models import model_for

    result = show_data(None, tmp_path / "pred.png", n=64, seed=1, predictions=trained_run)
    read_png(tmp_path / "pred.png")
    assert result["dataset"] == "mnist" and result["count"] == 64

    # Independently: the run's model, the raw images normalised by hand, argmax.
    cfg = TrainConfig.from_toml(trained_run / "config.toml")
    splits = load_dataset(cfg)
    model = model_for(cfg, splits.meta)
    model.load_state_dict(torch.load(trained_run / "model.pt", weights_only=True))
    model.eval()
    idx = torch.tensor(result["indices"])
    x = splits.test.images[idx].float() / 255
    x = (x - 0.1307) / 0.3081
    with torch.no_grad():
        preds = model(x).argmax(1)
    labels = splits.test.labels[idx]
    assert result["labels"] == labels.tolist()
    assert result["predictions"] == preds.tolist()
    assert result["right"] == int((preds == labels).sum())
    assert 0 < result["right"] < 64  # a one-epoch MLP: some right, some wrong, so both marks are drawn

    # The command prints the same count; the explicit dataset matches the run's.
    assert (
        main(
            [
                "show-data",
                "mnist",
                "--predictions",
                str(trained_run),
                "--n",
                "64",
                "--seed",
                "1",
                "--out",
                str(tmp_path / "cli.png"),
            ]
        )
        == 0
    )
    read_png(tmp_path / "cli.png")


def test_refuses_to_overwrite_a_file_that_is_not_a_png(tmp_path):
    precious = tmp_path / "notes.png"
    precious.write_text("not an image")
    with pytest.raises(ConfigError, match="not a PNG"):
        show_data("mnist", precious, n=4)
    assert precious.read_text() == "not an image"
    with pytest.raises(ConfigError, match=r"\.png"):
        show_data("mnist", tmp_path / "grid.jpg", n=4)
    with pytest.raises(ConfigError, match="between 1 and 256"):
        show_data("mnist", tmp_path / "grid.png", n=257)
    with pytest.raises(ConfigError, match="--seed -1: give a whole number >= 0"):  # was numpy's traceback
        show_data("mnist", tmp_path / "grid.png", n=4, seed=-1)


@pytest.mark.slow
@pytest.mark.multiprocess
def test_custom_run_is_refused(trained_run, tmp_path):
    run = tmp_path / "custom"
    run.mkdir()
    (run / "model.pt").write_bytes((trained_run / "model.pt").read_bytes())
    config = (trained_run / "config.toml").read_text()
    (run / "config.toml").write_text(config.replace('model = "mlp"', 'model = "custom:Net"'))
    with pytest.raises(RunDirError, match="trained from Python"):
        show_data(None, tmp_path / "grid.png", predictions=run)


@pytest.mark.slow
@pytest.mark.multiprocess
def test_cli_errors_are_one_line(trained_run, tmp_path):
    """A dataset that is not the run's, and a run dir that does not exist: one line each, non-zero exit."""
    a, b = str(tmp_path / "a.png"), str(tmp_path / "b.png")
    cases = {
        "cifar10 is not the one": ["cifar10", "--predictions", str(trained_run), "--out", a],
        "no such run directory": ["--predictions", str(tmp_path / "no-such-run"), "--out", b],
    }
    procs = {words: start_cli("show-data", *args) for words, args in cases.items()}  # side by side
    for words, proc in procs.items():
        _, stderr = proc.communicate(timeout=WAIT_S)
        assert proc.returncode != 0
        assert "Traceback" not in stderr
        assert len(stderr.strip().splitlines()) == 1 and words in stderr, stderr
    assert not (tmp_path / "a.png").exists() and not (tmp_path / "b.png").exists()


def test_dataset_args_reach_a_dataset_function_as_train_passes_them(tmp_path, capsys):
    """Issue 33, case 16: `show-data` had no --dataset-args, so a dataset function that needs arguments could be
    trained on but not shown."""
    out = tmp_path / "grid.png"
    assert main(["show-data", "user_code:picture_data", "--dataset-args", '{"n": 5}', "--out", str(out)]) == 0
    assert f"wrote {out}: 5 user_code:picture_data test images" in capsys.readouterr().out
    assert show_data("user_code:picture_data", out)["count"] == 12  # the function's own default
    assert show_data("user_code:picture_data", out, dataset_args='{"n": 5}')["count"] == 5
    for dataset, args, said in [
        ("mnist", '{"n": 5}', "--dataset-args is for a dataset named pkg.module:function, not mnist"),
        ("user_code:picture_data", "[5]", "--dataset-args '[5]' must be a JSON object"),
    ]:
        capsys.readouterr()
        assert main(["show-data", dataset, "--dataset-args", args, "--out", str(tmp_path / "x.png")]) == 2
        err = capsys.readouterr().err
        assert err.count("ddpkit: error:") == 1 and said in err and "Traceback" not in err, err
    assert not (tmp_path / "x.png").exists()


def test_a_model_passed_from_python_marks_the_grid_and_is_left_as_it_was(tmp_path):
    """Regression: show_data took no model, so a model trained from Python could not be shown."""
    from ddpkit.models import ConvNet

    torch.manual_seed(0)
    model = ConvNet().train()
    result = show_data("mnist", tmp_path / "mine.png", n=16, seed=2, model=model)
    read_png(tmp_path / "mine.png")
    assert model.training  # its mode restored
    from ddpkit.config import TrainConfig
    from ddpkit.data import load_dataset

    test = load_dataset(TrainConfig(dataset="mnist")).test
    x = (test.images[torch.tensor(result["indices"])].float() / 255 - 0.1307) / 0.3081
    with torch.no_grad():
        expected = model.eval()(x).argmax(1).tolist()
    assert result["predictions"] == expected and "run_dir" not in result
    with pytest.raises(ConfigError, match="needs a dataset"):
        show_data(None, tmp_path / "x.png", model=model)
