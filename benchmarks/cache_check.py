"""What the ImageFolder decode cache's checks cost: loading a cache with and without them.

    python benchmarks/cache_check.py

2,000 training images (JPEG and PNG, 32-64 px, random pixels) in an ImageFolder tree in a
temporary folder; at 32 px and 224 px: the first decode (and write), then the median of 3 of
``torch.load`` of the cache alone and of ``_load_cache`` (the load plus the sha256 of the
decoded pixels and of every source file's bytes), in ms.
"""

from __future__ import annotations

import shutil
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
from PIL import Image

from ddpkit.data.folder import CACHE_DIR, _load_cache, cache_key, cached_decode, image_files, load_imagefolder


def make_tree(root: Path) -> int:
    rng = np.random.default_rng(0)
    for split, per in (("train", 200), ("val", 10)):
        for c in range(10):
            d = root / split / f"c{c}"
            d.mkdir(parents=True)
            for i in range(per):
                h, w = (int(v) for v in rng.integers(32, 65, 2))
                Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8)).save(
                    d / f"{i}.{'jpg' if i % 2 else 'png'}"
                )
    return sum(p.stat().st_size for p in (root / "train").rglob("*.*"))


def main() -> None:
    root = Path(tempfile.mkdtemp()) / "images"
    try:
        src_bytes, threads = make_tree(root), 2
        for size in (32, 224):
            data = load_imagefolder(str(root), size).train
            files = image_files(data)
            t = time.perf_counter()
            cached_decode(data, root, "train", size, threads)
            decode = time.perf_counter() - t
            path = root / CACHE_DIR / f"train-{size}px-{cache_key(files, size)}.pt"
            plain, checked = [], []
            for _ in range(3):
                t = time.perf_counter()
                torch.load(path, map_location="cpu", weights_only=True)
                plain.append(time.perf_counter() - t)
                t = time.perf_counter()
                _load_cache(path, files, cache_key(files, size), size, threads)
                checked.append(time.perf_counter() - t)
            p, c = statistics.median(plain) * 1e3, statistics.median(checked) * 1e3
            print(
                f"{len(files)} images ({src_bytes / 2**20:.1f} MiB of sources) at {size} px, cache "
                f"{path.stat().st_size / 2**20:.1f} MiB: decode+write {decode * 1e3:.0f} ms; load {p:.1f} ms; "
                f"load+checks {c:.1f} ms ({c / p:.1f}x, +{c - p:.1f} ms)"
            )
    finally:
        shutil.rmtree(root.parent, ignore_errors=True)


if __name__ == "__main__":
    main()
