"""Your own images: an ImageFolder tree on disk, trained on 2 processes.

    python examples/custom_images.py [ROOT]

The script first writes a small dataset in the layout ddpkit's ``imagefolder:PATH`` reads
(``ROOT/train/<class>/*.png`` and ``ROOT/val/<class>/*.png``): 32x32 PNGs of stripes in
three orientations, with random colours, phases and noise. Point ``dataset`` at your own
tree instead; the same command line works: ``ddpkit train --dataset imagefolder:ROOT``.
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
from PIL import Image

from ddpkit import TrainConfig, Trainer

CLASSES = ("horizontal", "vertical", "diagonal")


def stripes(kind: str, rng: np.random.Generator, size: int = 32) -> np.ndarray:
    """An RGB uint8 image of stripes of one orientation, in random colours, with noise."""
    y, x = np.mgrid[0:size, 0:size]
    coord = {"horizontal": y, "vertical": x, "diagonal": x + y}[kind]
    period = rng.uniform(4, 9)
    wave = np.sin(2 * np.pi * coord / period + rng.uniform(0, 2 * np.pi)) > 0
    a, b = rng.integers(0, 256, 3), rng.integers(0, 256, 3)
    img = np.where(wave[..., None], a, b) + rng.normal(0, 20, (size, size, 3))
    return np.clip(img, 0, 255).astype(np.uint8)


def write_tree(root: Path, per_class: dict[str, int], seed: int = 0) -> None:
    rng = np.random.default_rng(seed)
    for split, n in per_class.items():
        for kind in CLASSES:
            folder = root / split / kind
            folder.mkdir(parents=True, exist_ok=True)
            for i in range(n):
                Image.fromarray(stripes(kind, rng)).save(folder / f"{i:04d}.png")


def main(root: str = "data/stripes") -> dict:
    root_path = Path(root)
    if not (root_path / "train").is_dir():
        write_tree(root_path, {"train": 200, "val": 50})
    config = TrainConfig(
        dataset=f"imagefolder:{root_path}",
        image_size=32,
        model="convnet",
        nproc="2",
        device="cpu",
        epochs=3,
        batch_size=64,
        lr=0.01,
        progress=False,
        log_every=5,
        run_dir="runs/stripes",
    )
    result = Trainer(config).fit()
    print(
        f"test accuracy {result['test_accuracy']:.3f} over {result['test_samples']} images of "
        f"{len(CLASSES)} classes (chance {1 / len(CLASSES):.3f})"
    )
    return {"test_accuracy": result["test_accuracy"]}


if __name__ == "__main__":  # workers are spawned and import this file
    main(*sys.argv[1:2])
