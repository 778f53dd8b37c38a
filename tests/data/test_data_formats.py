"""IDX and CIFAR-pickle parsers on generated files in the real on-disk formats, including every corruption."""

from __future__ import annotations

import gzip
import struct
from types import SimpleNamespace

import numpy as np
import pytest
from formats import write_cifar10, write_fashion

from ddpkit.data import load_dataset
from ddpkit.data.cifar import read_cifar_batch, write_cifar_batch
from ddpkit.data.idx import read_idx, read_idx_pair, write_idx
from ddpkit.errors import DataError


def cfg(**kw):
    base = dict(data_dir="data", limit_train=0, limit_test=0, val_fraction=0.0, dataset="mnist")
    return SimpleNamespace(**{**base, **kw})


@pytest.mark.parametrize("suffix", [".gz", ""])
def test_idx_roundtrip(tmp_path, rng, suffix):
    images = rng.integers(0, 256, (7, 28, 28), dtype=np.uint8)
    write_idx(tmp_path / f"x{suffix}", images)
    assert np.array_equal(read_idx(tmp_path / f"x{suffix}", 3), images)


def test_idx_header_is_the_real_format(tmp_path):
    write_idx(tmp_path / "l", np.array([1, 2, 3], dtype=np.uint8))
    assert (tmp_path / "l").read_bytes() == bytes([0, 0, 8, 1]) + struct.pack(">I", 3) + bytes([1, 2, 3])


def test_bundled_mnist_is_the_canonical_data():
    splits = load_dataset(cfg(), download=False)
    assert tuple(splits.train.images.shape) == (60000, 1, 28, 28) and len(splits.test) == 10000
    assert splits.train.labels.bincount().tolist()[:3] == [5923, 6742, 5958]  # the published class counts


def test_idx_wrong_magic(tmp_path, rng):
    write_idx(tmp_path / "labels.gz", rng.integers(0, 10, 5, dtype=np.uint8))
    with pytest.raises(DataError, match=r"labels.gz: wrong IDX magic 0x00000801, expected 0x00000803"):
        read_idx(tmp_path / "labels.gz", 3)


def test_idx_truncated_data(tmp_path, rng):
    path = tmp_path / "x"
    write_idx(path, rng.integers(0, 256, (4, 28, 28), dtype=np.uint8))
    path.write_bytes(path.read_bytes()[:-10])
    with pytest.raises(DataError, match=r"x: truncated: header says \(4, 28, 28\) = 3136 data bytes, file has 3126"):
        read_idx(path, 3)


def test_idx_truncated_gzip(tmp_path, rng):
    path = tmp_path / "x.gz"
    write_idx(path, rng.integers(0, 256, (50, 28, 28), dtype=np.uint8))
    path.write_bytes(path.read_bytes()[:200])
    with pytest.raises(DataError, match=r"x.gz: corrupt or truncated gzip"):
        read_idx(path, 3)


def test_idx_count_mismatch_and_label_range(tmp_path, rng):
    write_idx(tmp_path / "i.gz", rng.integers(0, 256, (5, 28, 28), dtype=np.uint8))
    write_idx(tmp_path / "l.gz", np.array([0, 1, 2, 3], dtype=np.uint8))
    with pytest.raises(DataError, match=r"i.gz holds 5 images but .*l.gz holds 4 labels"):
        read_idx_pair(tmp_path / "i.gz", tmp_path / "l.gz", 10)
    write_idx(tmp_path / "l.gz", np.array([0, 1, 2, 3, 10], dtype=np.uint8))
    with pytest.raises(DataError, match=r"l.gz: label 10 is outside the 10 classes"):
        read_idx_pair(tmp_path / "i.gz", tmp_path / "l.gz", 10)


def test_fashion_mnist_loads_from_data_dir(tmp_path, rng):
    write_fashion(tmp_path, rng)
    splits = load_dataset(cfg(dataset="fashion-mnist", data_dir=str(tmp_path)), download=False)
    assert len(splits.train) == 30 and len(splits.test) == 10 and splits.meta.classes == 10


def test_missing_files_name_the_directory(tmp_path):
    with pytest.raises(DataError, match=rf"dataset files missing in {tmp_path}/FashionMNIST/raw: train-images"):
        load_dataset(cfg(dataset="fashion-mnist", data_dir=str(tmp_path)), download=False)
    with pytest.raises(
        DataError, match=rf"missing in {tmp_path}/cifar-10-batches-py: data_batch_1.*cifar-10-python.tar.gz"
    ):
        load_dataset(cfg(dataset="cifar10", data_dir=str(tmp_path)), download=False)


def test_cifar10_loads_in_channel_major_layout(tmp_path, rng):
    folder = write_cifar10(tmp_path, rng)
    splits = load_dataset(cfg(dataset="cifar10", data_dir=str(tmp_path)), download=False)
    assert tuple(splits.train.images.shape) == (30, 3, 32, 32) and len(splits.test) == 6
    import pickle

    raw = pickle.load(open(folder / "data_batch_1", "rb"), encoding="bytes")
    # row 0 of the file is R plane, then G, then B, each 32x32 row-major
    assert np.array_equal(splits.train.images[0, 1].numpy().ravel(), raw[b"data"][0, 1024:2048])


def test_cifar100_uses_fine_labels(tmp_path, rng):
    folder = tmp_path / "cifar-100-python"
    folder.mkdir()
    for name in ("train", "test"):
        write_cifar_batch(
            folder / name,
            rng.integers(0, 256, (4, 3, 32, 32), dtype=np.uint8),
            np.array([0, 50, 99, 7]),
            label_key=b"fine_labels",
        )
    splits = load_dataset(cfg(dataset="cifar100", data_dir=str(tmp_path)), download=False)
    assert splits.meta.classes == 100 and splits.train.labels.tolist() == [0, 50, 99, 7]


def test_cifar_corruptions(tmp_path, rng):
    path = tmp_path / "b"
    write_cifar_batch(path, rng.integers(0, 256, (4, 3, 32, 32), dtype=np.uint8), [1, 2, 3, 4])
    path.write_bytes(path.read_bytes()[:500])
    with pytest.raises(DataError, match=r"b: corrupt or truncated CIFAR pickle"):
        read_cifar_batch(path, b"labels", 10)
    write_cifar_batch(path, rng.integers(0, 256, (4, 3, 32, 32), dtype=np.uint8), [1, 2, 3])
    with pytest.raises(DataError, match=r"b: 4 images but 3 labels"):
        read_cifar_batch(path, b"labels", 10)
    write_cifar_batch(path, rng.integers(0, 256, (4, 3, 32, 32), dtype=np.uint8), [1, 2, 3, 12])
    with pytest.raises(DataError, match=r"b: label 12 is outside the 10 classes"):
        read_cifar_batch(path, b"labels", 10)
    write_cifar_batch(path, rng.integers(0, 256, (4, 3, 16, 16), dtype=np.uint8), [1, 2, 3, 4])
    with pytest.raises(DataError, match=r"b: data has shape \(4, 768\)"):
        read_cifar_batch(path, b"labels", 10)


def test_gzip_written_by_other_tools_is_read(tmp_path, rng):
    labels = rng.integers(0, 10, 9, dtype=np.uint8)
    blob = bytes([0, 0, 8, 1]) + struct.pack(">I", 9) + labels.tobytes()
    (tmp_path / "l.gz").write_bytes(gzip.compress(blob, compresslevel=1))
    assert np.array_equal(read_idx(tmp_path / "l.gz", 1), labels)
