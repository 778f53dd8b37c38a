"""The built-in datasets: a plain dict registry of loaders, each returning in-memory uint8 tensors.

    splits = load_dataset(cfg)          # DataSplits(train, test, meta)
    splits.train.images                 # uint8 [N, C, H, W]; batches are made by indexing

MNIST ships inside the package (``ddpkit/data/mnist``, see its README for the
attribution) and never needs the network. Fashion-MNIST and CIFAR-10/100 are read from
``--data-dir``, downloaded there by torchvision's own code when missing and online.
``imagefolder:PATH`` streams the user's images through a DataLoader instead.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Callable

import torch
from torch.utils.data import DataLoader, IterableDataset, Subset

from ..config import TrainConfig, check_dataset_name
from ..errors import DataError, article
from ..importpath import call, is_import_path
from .cifar import LAYOUTS as CIFAR_LAYOUTS
from .cifar import read_cifar_split
from .folder import load_imagefolder
from .idx import read_idx_pair
from .seeds import holdout_generator, synthetic_generator
from .types import DataSplits, ImageData, Meta, TensorData, infer_meta

MNIST_DIR = Path(__file__).parent / "mnist"
IDX_FILES = {
    "train": ("train-images-idx3-ubyte.gz", "train-labels-idx1-ubyte.gz"),
    "test": ("t10k-images-idx3-ubyte.gz", "t10k-labels-idx1-ubyte.gz"),
}


# ---------------------------------------------------------------------- loaders
def _idx_splits(folder: Path, meta: Meta, how_to_get: str) -> DataSplits:
    missing = [name for pair in IDX_FILES.values() for name in pair if not (folder / name).exists()]
    if missing:
        raise DataError(f"dataset files missing in {folder}: {', '.join(missing)}. {how_to_get}")
    splits = {
        s: ImageData.from_numpy(*read_idx_pair(folder / images, folder / labels, meta.classes))
        for s, (images, labels) in IDX_FILES.items()
    }
    for name, split in splits.items():
        if split.images.shape[1:] != (meta.channels, meta.height, meta.width):
            raise DataError(
                f"{folder / IDX_FILES[name][0]}: images are {tuple(split.images.shape[1:])}, "
                f"expected {(meta.channels, meta.height, meta.width)}"
            )
    return DataSplits(splits["train"], splits["test"], meta)


def load_mnist(cfg: TrainConfig, download: bool) -> DataSplits:
    meta = Meta(1, 28, 28, 10, (0.1307,), (0.3081,))
    return _idx_splits(MNIST_DIR, meta, "The package ships them; reinstall ddpkit.")


def load_fashion_mnist(cfg: TrainConfig, download: bool) -> DataSplits:
    folder = Path(cfg.data_dir) / "FashionMNIST" / "raw"
    if download and not (folder / IDX_FILES["train"][0]).exists():
        _torchvision_download("FashionMNIST", cfg.data_dir)
    meta = Meta(1, 28, 28, 10, (0.2860,), (0.3530,))
    return _idx_splits(folder, meta, "Copy the four Fashion-MNIST .gz files there (or run once with internet).")


def _load_cifar(name: str, cfg: TrainConfig, download: bool, meta: Meta) -> DataSplits:
    folder_name, train_files, test_files, key, classes = CIFAR_LAYOUTS[name]
    folder = Path(cfg.data_dir) / folder_name
    if download and not all((folder / f).exists() for f in train_files + test_files):
        _torchvision_download(name.upper(), cfg.data_dir)
    missing = [f for f in train_files + test_files if not (folder / f).exists()]
    if missing:
        raise DataError(
            f"dataset files missing in {folder}: {', '.join(missing)}. Extract the python-version "
            f"archive ({folder_name.split('-batches')[0]}-python.tar.gz) into {cfg.data_dir}, "
            f"or run once with internet"
        )
    train = ImageData.from_numpy(*read_cifar_split(folder, train_files, key, classes))
    test = ImageData.from_numpy(*read_cifar_split(folder, test_files, key, classes))
    return DataSplits(train, test, meta)


def load_cifar10(cfg: TrainConfig, download: bool) -> DataSplits:
    meta = Meta(3, 32, 32, 10, (0.4914, 0.4822, 0.4465), (0.2470, 0.2435, 0.2616), "crop-flip")
    return _load_cifar("cifar10", cfg, download, meta)


def load_cifar100(cfg: TrainConfig, download: bool) -> DataSplits:
    meta = Meta(3, 32, 32, 100, (0.5071, 0.4865, 0.4409), (0.2673, 0.2564, 0.2762), "crop-flip")
    return _load_cifar("cifar100", cfg, download, meta)


def load_synthetic(cfg: TrainConfig, download: bool) -> DataSplits:
    """Random uint8 images and labels, for benchmarks; the same for every rank and seed."""
    c, h, w = cfg.synthetic_shape_tuple
    gen = synthetic_generator()

    def split(n: int) -> ImageData:
        return ImageData(
            torch.randint(0, 256, (n, c, h, w), dtype=torch.uint8, generator=gen),
            torch.randint(0, cfg.synthetic_classes, (n,), generator=gen),
        )

    meta = Meta(c, h, w, cfg.synthetic_classes, (0.5,) * c, (0.25,) * c, "crop-flip" if c == 3 else "none")
    return DataSplits(split(cfg.synthetic_size), split(max(1, cfg.synthetic_size // 5)), meta)


def _torchvision_download(cls_name: str, root: str) -> None:
    """Fetch with torchvision's real download code; stays quiet when offline (the caller names what is missing)."""
    import torchvision

    new = not Path(root).exists()
    for train in (True, False):
        try:
            getattr(torchvision.datasets, cls_name)(root=root, train=train, download=True)
        except Exception:  # offline, proxy, checksum: the missing-files error that follows says what to do
            if new:  # leave no empty folders behind from a download that never happened
                for folder in sorted((p for p in Path(root).rglob("*") if p.is_dir()), reverse=True) + [Path(root)]:
                    if folder.exists() and not any(folder.iterdir()):
                        folder.rmdir()
            return


DATASETS: dict[str, Callable[..., DataSplits]] = {
    "mnist": load_mnist,
    "fashion-mnist": load_fashion_mnist,
    "cifar10": load_cifar10,
    "cifar100": load_cifar100,
    "synthetic": load_synthetic,
}


def load_dataset(cfg: TrainConfig, download: bool = True) -> DataSplits:
    """Load ``cfg.dataset`` (trimmed by ``--limit-train/--limit-test``): a built-in one, an image
    folder, or yours by ``--dataset pkg.module:function``."""
    check_dataset_name(cfg.dataset)
    if is_import_path(cfg.dataset):
        splits = own_dataset(cfg)
    elif cfg.dataset.startswith("imagefolder:"):
        splits = load_imagefolder(cfg.dataset.split(":", 1)[1], cfg.image_size, cfg.limit_train, cfg.limit_test)
    else:
        splits = DATASETS[cfg.dataset](cfg, download)
        splits = replace(splits, train=splits.train.head(cfg.limit_train), test=splits.test.head(cfg.limit_test))
    return hold_out(splits, cfg)


def hold_out(splits: DataSplits, cfg: TrainConfig) -> DataSplits:
    """``--val-fraction F``: the validation split, round(F x N) samples of the training set drawn with
    ``--seed`` (so the same samples at every world size and rerun), the rest staying the training set,
    both in their original order. Nothing held out at F = 0, or where a validation split was passed."""
    if not cfg.val_fraction:
        return splits
    if splits.val is not None:
        raise DataError("val_data is passed and --val-fraction asks for a held-out split too; give one of them")
    if isinstance(splits.train, IterableDataset):
        raise DataError(
            "--val-fraction holds samples out by index, and train_data is an IterableDataset: pass val_data"
        )
    n = len(splits.train)
    k = round(cfg.val_fraction * n)
    if not 0 < k < n:
        raise DataError(
            f"--val-fraction {cfg.val_fraction} of {n} training samples holds out {k}: it must leave at least "
            f"one sample on each side"
        )
    order = torch.randperm(n, generator=holdout_generator(cfg.seed))
    val, train = order[:k].sort().values, order[k:].sort().values
    return replace(splits, train=_subset(splits.train, train), val=_subset(splits.train, val))


def _subset(data, index: torch.Tensor):
    if isinstance(data, ImageData):
        return data.subset(index)
    if isinstance(data, TensorData):
        return TensorData(data.take(index))
    return Subset(data, index.tolist())


def own_dataset(cfg: TrainConfig) -> DataSplits:
    """Your datasets from ``--dataset pkg.module:function`` with ``--dataset-args``. The function
    returns ``(train, test)`` map-style datasets, or ``{"train": ..., "test": ..., "collate_fn": ...}``.
    It is called with torch's, numpy's and Python's random generators seeded with ``--seed``, so
    data drawn at random is the same at every call (the run identity reads it by content)."""
    flag = f"--dataset {cfg.dataset}"
    made = call(cfg.dataset, cfg.dataset_args, "--dataset", cfg.seed)
    collate_fn = None
    if isinstance(made, dict):
        unknown = sorted(set(made) - {"train", "test", "collate_fn"})
        if unknown or "train" not in made or "test" not in made:
            raise DataError(
                f"{flag} returned a dict with keys {sorted(made)}; it needs train and test (and may hold collate_fn)"
            )
        train, test, collate_fn = made["train"], made["test"], made.get("collate_fn")
    elif isinstance(made, (tuple, list)) and len(made) == 2:
        train, test = made
    else:
        raise DataError(
            f"{flag} returned {article(type(made).__name__)}; return (train, test) datasets, or a dict with "
            f"train, test and collate_fn"
        )
    for data, which in ((train, "train"), (test, "test")):
        if isinstance(data, (DataLoader, IterableDataset)) or not (
            hasattr(data, "__len__") and hasattr(data, "__getitem__")
        ):
            raise DataError(
                f"{flag} returned {article(type(data).__name__)} as {which}: return map-style datasets (with "
                f"__len__ and __getitem__; ddpkit makes the DataLoader and splits them among ranks), and a "
                f"collate_fn in a dict"
            )
    if collate_fn is not None and not callable(collate_fn):
        raise DataError(f"{flag} returned a collate_fn that is {article(type(collate_fn).__name__)}, not a function")
    return DataSplits(_first(train, cfg.limit_train), _first(test, cfg.limit_test), infer_meta(train), collate_fn)


def _first(data, limit: int):
    """The first ``limit`` samples (all when 0), as --limit-train/--limit-test take them."""
    if not limit or limit >= len(data):
        return data
    return data.head(limit) if isinstance(data, ImageData) else Subset(data, range(limit))
