"""``imagefolder:PATH``: the user's own images, as torchvision's ImageFolder reads them.

PATH must hold ``train/<class>/*.jpg`` and ``val/<class>/...`` (or ``test/``). Images are
decoded, resized and centre-cropped to ``--image-size`` as uint8 (torchvision's Resize and
CenterCrop, pixel for pixel); flips and normalisation then run batched on the device like
every other dataset. A folder that fits in memory is decoded once, in parallel, and
cached beside the data (:func:`cached_decode`); a larger one is decoded per epoch in
DataLoader workers. An image that cannot be read is a one-line DataError naming the file.
``--limit-train/--limit-test N`` keep N images spread evenly over the sorted file list,
so every class stays represented.
"""

from __future__ import annotations

from pathlib import Path

from ..errors import DataError, RunDirError
from ..files import atomic_write, torch_bytes
from .types import DataSplits, ImageData, Meta

IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)


def open_rgb(path: str):
    """ImageFolder's loader, with a failure that names the file."""
    from PIL import Image

    try:
        with open(path, "rb") as fh:
            return Image.open(fh).convert("RGB")
    except (OSError, ValueError, SyntaxError) as exc:  # PIL's UnidentifiedImageError is an OSError
        raise DataError(f"{path}: not a readable image ({exc}); remove or replace it") from None


def spread(data, n: int):
    """``n`` samples of ``data`` spread evenly over it (all of it for n = 0 or n >= len)."""
    from torch.utils.data import Subset

    if not n or n >= len(data):
        return data
    return Subset(data, [i * len(data) // n for i in range(n)])


IMG_EXTENSIONS = (".jpg", ".jpeg", ".png", ".ppm", ".bmp", ".pgm", ".tif", ".tiff", ".webp")  # torchvision's


def list_images(directory: Path) -> tuple[list[str], list[tuple[str, int]]]:
    """(classes, [(path, class index)]) of an ImageFolder tree, in torchvision's ImageFolder order
    (sorted class folders, sorted walk, its extensions), without importing torchvision (~1.5 s)."""
    import os

    classes = sorted(entry.name for entry in os.scandir(directory) if entry.is_dir())
    if not classes:
        raise DataError(f"{directory}: no class folders (images go in {directory}/<class>/)")
    samples, empty = [], []
    for index, cls in enumerate(classes):
        before = len(samples)
        for root, _, names in sorted(os.walk(os.path.join(directory, cls), followlinks=True)):
            samples += [(os.path.join(root, n), index) for n in sorted(names) if n.lower().endswith(IMG_EXTENSIONS)]
        if len(samples) == before:
            empty.append(cls)
    if empty:
        raise DataError(
            f"{directory}: no images in class folder(s) {', '.join(empty)} (extensions: {', '.join(IMG_EXTENSIONS)})"
        )
    return classes, samples


def resize_center_crop(img, size: int):
    """torchvision's Resize(size) then CenterCrop(size) on a PIL image, pixel for pixel (bilinear;
    the shorter side to ``size``, the longer truncated in proportion; the crop rounded to centre)."""
    from PIL import Image

    w, h = img.size
    short, long = (w, h) if w <= h else (h, w)
    new_short, new_long = size, int(size * long / short)
    new_w, new_h = (new_short, new_long) if w <= h else (new_long, new_short)
    if (new_w, new_h) != (w, h):
        img = img.resize((new_w, new_h), Image.BILINEAR)
    top, left = int(round((new_h - size) / 2.0)), int(round((new_w - size) / 2.0))
    return img.crop((left, top, left + size, top + size))


class ImageFiles:
    """An ImageFolder tree as a map-style dataset: (uint8 [3, S, S] tensor, class index) per image,
    decoded when read (the DataLoader path)."""

    def __init__(self, directory: Path, image_size: int):
        self.root, self.image_size = Path(directory), image_size
        self.classes, self.samples = list_images(self.root)
        self.targets = [label for _, label in self.samples]

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, i):
        import torch

        path, label = self.samples[i]
        return torch.from_numpy(_decode(path, self.image_size)).permute(2, 0, 1).contiguous(), label


def load_imagefolder(path: str, image_size: int, limit_train: int = 0, limit_test: int = 0):

    root = Path(path)
    test_dir = next((root / d for d in ("val", "test") if (root / d).is_dir()), None)
    if not (root / "train").is_dir() or test_dir is None:
        raise DataError(
            f"imagefolder:{path} needs {root}/train/<class>/<images> and {root}/val/<class>/<images> "
            f"(or test/ instead of val/)"
        )
    try:
        train, test = ImageFiles(root / "train", image_size), ImageFiles(test_dir, image_size)
    except DataError as exc:
        raise DataError(f"imagefolder:{path}: {exc}") from None
    if train.classes != test.classes:
        raise DataError(
            f"imagefolder:{path}: train/ has classes {train.classes} but {test_dir.name}/ has {test.classes}"
        )
    meta = Meta(3, image_size, image_size, len(train.classes), IMAGENET_MEAN, IMAGENET_STD, "flip")
    return DataSplits(spread(train, limit_train), spread(test, limit_test), meta)


# ---------------------------------------------------------------------- decoded once, cached beside the data
CACHE_VERSION = 1
CACHE_DIR = ".ddpkit-cache"


def image_files(data) -> list[tuple[str, int]]:
    """(path, class index) of every image of an ImageFolder, or of a Subset of one, in order."""
    from torch.utils.data import Subset

    if isinstance(data, Subset):
        return [data.dataset.samples[i] for i in data.indices]
    return list(data.samples)


def cache_key(files: list[tuple[str, int]], image_size: int) -> str:
    """What the decoded tensors depend on: each file's path, size and modification time, its label,
    and the image size. Any change (a file edited, added, removed, relabelled) is another key."""
    import hashlib
    import json
    import os

    stats = []
    for path, label in files:
        st = os.stat(path)
        stats.append([path, st.st_size, st.st_mtime_ns, label])
    blob = json.dumps([CACHE_VERSION, image_size, stats]).encode()
    return hashlib.sha256(blob).hexdigest()[:16]


def _decode(path: str, image_size: int):
    """One image as HWC uint8 (PIL and numpy only: safe in a forked worker, where torch's OpenMP must not run)."""
    import numpy as np

    return np.array(resize_center_crop(open_rgb(path), image_size), dtype=np.uint8)


def decode_all(files: list[tuple[str, int]], image_size: int, processes: int):
    """Decode every image (in ``processes`` forked processes for large sets) into ImageData."""
    import multiprocessing
    from functools import partial

    import numpy as np
    import torch

    paths = [p for p, _ in files]
    work = partial(_decode, image_size=image_size)
    if processes > 1 and len(paths) >= 512:
        method = "fork" if "fork" in multiprocessing.get_all_start_methods() else "spawn"
        with multiprocessing.get_context(method).Pool(processes) as pool:
            arrays = pool.map(work, paths, chunksize=max(16, len(paths) // (8 * processes)))
    else:
        arrays = [work(p) for p in paths]
    images = torch.from_numpy(np.stack(arrays)).permute(0, 3, 1, 2).contiguous()
    return ImageData(images, torch.tensor([label for _, label in files], dtype=torch.int64))


def cached_decode(data, root: Path, split: str, image_size: int, processes: int):
    """``data`` (an ImageFolder or a Subset of one) as ImageData: from ``ROOT/.ddpkit-cache`` when a
    cache of exactly these files exists and reads whole, else decoded and cached. Returns
    (ImageData, a note saying which)."""
    import time

    import torch

    files = image_files(data)
    key = cache_key(files, image_size)
    path = root / CACHE_DIR / f"{split}-{image_size}px-{key}.pt"
    note = ""
    if path.exists():
        try:
            saved = torch.load(path, map_location="cpu", weights_only=True)
            images, labels = saved["images"], saved["labels"]
            if (
                saved["key"] != key
                or images.dtype != torch.uint8
                or tuple(images.shape) != (len(files), 3, image_size, image_size)
                or len(labels) != len(files)
            ):
                raise ValueError("contents do not match the file list")
            return ImageData(images, labels), f"{split}: {len(files)} images from the cache {path}"
        except Exception as exc:  # truncated, damaged or foreign: rebuild it, never trust it
            note = f" (the cache {path} was unreadable: {type(exc).__name__}; rebuilt)"
    t = time.perf_counter()
    decoded = decode_all(files, image_size, processes)
    took = time.perf_counter() - t
    try:
        atomic_write(path, torch_bytes({"key": key, "images": decoded.images, "labels": decoded.labels}))
        where = f"cached in {path}"
    except RunDirError as exc:
        where = f"not cached ({exc})"
    return decoded, f"{split}: {len(files)} images decoded in {took:.1f} s, {where}{note}"
