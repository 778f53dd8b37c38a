"""The ImageFolder decode cache is never trusted when damaged or stale, and keeps one file per version.

Each test writes a real ImageFolder tree (PNG, JPEG and BMP files) and a real cache file, then damages
or edits it the way a disk or a user would, so that only the checks stored in the cache can notice.
"""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch
from PIL import Image

from ddpkit.data.folder import CACHE_DIR, cached_decode, load_imagefolder

SIZE = 8  # pixels, the --image-size of these tests


@pytest.fixture
def tree(tmp_path):
    root = tmp_path / "images"
    rng = np.random.default_rng(0)
    for split, n in (("train", 6), ("val", 2)):
        for cls in ("a", "b"):
            (root / split / cls).mkdir(parents=True)
            for i in range(n):
                pixels = rng.integers(0, 256, (10, 12, 3), dtype=np.uint8)
                ext = ("png", "jpg", "bmp")[i % 3]  # BMP: an edit of its pixels keeps the file's size
                Image.fromarray(pixels).save(root / split / cls / f"{i}.{ext}")
    return root


def decode(root, split="train", size=SIZE, limit=0):
    splits = load_imagefolder(str(root), size, limit_train=limit)
    data = splits.train if split == "train" else splits.test
    return cached_decode(data, root, split, size, 1)


def fresh(root):
    """The train split as the DataLoader path decodes it, file by file, with no cache involved."""
    data = load_imagefolder(str(root), SIZE).train
    return torch.stack([data[i][0] for i in range(len(data))])


def caches(root, pattern="train-*"):
    return sorted(p.name for p in (root / CACHE_DIR).glob(pattern))


def test_bit_flips_in_the_cached_pixels_are_caught_and_decoded_again(tree):
    decode(tree)
    (path,) = (tree / CACHE_DIR).glob("train-*.pt")
    saved = torch.load(path, weights_only=True)
    flat = saved["images"].view(-1)
    flipped = torch.arange(0, flat.numel(), 97)  # 1 pixel value in 97, spread over every image
    flat[flipped] ^= 0x10
    torch.save(saved, path)  # the same key and stored digests: only the pixels changed
    images, note = decode(tree)
    assert "was not used" in note and "sha256" in note and "rebuilt" in note, note
    assert torch.equal(images.images, fresh(tree))
    again, note = decode(tree)  # the rebuilt cache is good again
    assert "from the cache" in note and torch.equal(again.images, fresh(tree))


def test_a_same_size_edit_with_its_modification_time_restored_is_decoded_again(tree):
    first, _ = decode(tree)
    edited = tree / "train" / "b" / "2.bmp"
    before = os.stat(edited)
    Image.fromarray(np.full((10, 12, 3), 255, dtype=np.uint8)).save(edited)
    os.utime(edited, ns=(before.st_atime_ns, before.st_mtime_ns))
    after = os.stat(edited)
    assert (after.st_size, after.st_mtime_ns) == (before.st_size, before.st_mtime_ns)  # the stat key is unchanged
    images, note = decode(tree)
    assert "decoded in" in note and "removed 1 older cache file(s)" in note, note  # its ctime moved: another key
    assert torch.equal(images.images, fresh(tree)) and not torch.equal(images.images, first.images)
    index = sorted(str(p) for p in (tree / "train").rglob("*.*")).index(str(edited))
    assert (images.images[index] == 255).all()


def test_the_caches_of_older_versions_of_the_data_are_removed(tree):
    decode(tree)
    decode(tree, split="val")
    decode(tree, size=6)
    decode(tree, limit=4)  # a --limit-train run keeps its own cache beside the full one
    (old,) = caches(tree, f"train-{SIZE}px-[0-9a-f]*.pt")
    crashed = tree / CACHE_DIR / f"train-{SIZE}px-0123456789abcdef.pt.tmp"  # left by a write that was killed
    crashed.write_bytes(b"partial")
    others = caches(tree, "val-*") + caches(tree, "train-6px-*") + caches(tree, f"train-{SIZE}px-limit4-*")
    Image.fromarray(np.zeros((10, 12, 3), dtype=np.uint8)).save(tree / "train" / "a" / "new.png")
    _, note = decode(tree)
    (new,) = caches(tree, f"train-{SIZE}px-[0-9a-f]*")
    assert new != old and "removed 2 older cache file(s)" in note, note
    assert not crashed.exists()
    assert caches(tree, "val-*") + caches(tree, "train-6px-*") + caches(tree, f"train-{SIZE}px-limit4-*") == others
    (tree / "train" / "a" / "new.png").unlink()
    _, note = decode(tree)
    assert caches(tree, f"train-{SIZE}px-[0-9a-f]*") == [old] and "removed 1 older" in note
