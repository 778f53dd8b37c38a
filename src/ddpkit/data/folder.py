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


def open_rgb(path: str, data: bytes | None = None):
    """ImageFolder's loader, with a failure that names the file; from ``data``, the file's bytes
    already read, when given (the cache hashes exactly the bytes it decodes)."""
    import io

    from PIL import Image

    try:
        with io.BytesIO(data) if data is not None else open(path, "rb") as fh:
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
CACHE_VERSION = 3  # 2: the decoded data's sha256 checked on every load; 3: ctime and inode in the key
CACHE_DIR = ".ddpkit-cache"
HASH_CHUNK = 16 * 2**20  # bytes of decoded data per sha256 task; hashlib releases the GIL, so threads hash in parallel
SHA = 32  # bytes in a sha256 digest


def image_files(data) -> list[tuple[str, int]]:
    """(path, class index) of every image of an ImageFolder, or of a Subset of one, in order."""
    from torch.utils.data import Subset

    if isinstance(data, Subset):
        return [data.dataset.samples[i] for i in data.indices]
    return list(data.samples)


def cache_key(files: list[tuple[str, int]], image_size: int) -> str:
    """Which cache file to look for, at one stat per file: each file's path, inode, size, modification
    and status-change times, its label, and the image size. Any change (a file edited, added,
    removed, relabelled, replaced) is another key. The status-change time (ctime) is what catches
    an edit that keeps the size and restores the modification time (``os.utime`` or ``touch -d``
    set mtime; no call sets ctime, and writing or utime both move it), without reading the files:
    re-hashing every source on each load would cost a read of the whole dataset per run."""
    import hashlib
    import json
    import os

    stats = []
    for path, label in files:
        st = os.stat(path)
        stats.append([path, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns, label])
    blob = json.dumps([CACHE_VERSION, image_size, stats]).encode()
    return hashlib.sha256(blob).hexdigest()[:16]


def _decode(path: str, image_size: int):
    """One image as HWC uint8 (PIL and numpy only: safe in a forked worker, where torch's OpenMP must not run)."""
    import numpy as np

    return np.array(resize_center_crop(open_rgb(path), image_size), dtype=np.uint8)


def _decode_hashed(path: str, image_size: int):
    """(one image as HWC uint8, the sha256 of the very bytes decoded): a file edited meanwhile cannot
    be cached under the digest of another version of it."""
    import hashlib

    import numpy as np

    try:
        with open(path, "rb") as fh:
            data = fh.read()
    except OSError as exc:
        raise DataError(f"{path}: not a readable image ({exc.strerror}); remove or replace it") from None
    image = np.array(resize_center_crop(open_rgb(path, data), image_size), dtype=np.uint8)
    return image, hashlib.sha256(data).digest()


def data_digest(images, labels, threads: int) -> str:
    """sha256 of the decoded data: over the shape, the sha256 of each HASH_CHUNK of the images' bytes
    (hashed in ``threads`` threads) and the labels' bytes."""
    import hashlib
    from concurrent.futures import ThreadPoolExecutor

    import torch

    flat = images.contiguous().reshape(-1).view(torch.uint8).numpy()
    chunks = [flat[i : i + HASH_CHUNK] for i in range(0, len(flat), HASH_CHUNK)]
    with ThreadPoolExecutor(max(1, threads)) as pool:
        parts = list(pool.map(lambda chunk: hashlib.sha256(chunk).digest(), chunks))
    whole = hashlib.sha256(repr((tuple(images.shape), str(images.dtype), str(labels.dtype))).encode())
    whole.update(b"".join(parts))
    whole.update(labels.contiguous().numpy().tobytes())
    return whole.hexdigest()


def decode_all(files: list[tuple[str, int]], image_size: int, processes: int):
    """Decode every image (in ``processes`` forked processes for large sets): (ImageData, the sha256
    of each file's bytes, 32 per file, kept in the cache as a record of what was decoded)."""
    import multiprocessing
    from functools import partial

    import numpy as np
    import torch

    paths = [p for p, _ in files]
    work = partial(_decode_hashed, image_size=image_size)
    if processes > 1 and len(paths) >= 512:
        method = "fork" if "fork" in multiprocessing.get_all_start_methods() else "spawn"
        with multiprocessing.get_context(method).Pool(processes) as pool:
            done = pool.map(work, paths, chunksize=max(16, len(paths) // (8 * processes)))
    else:
        done = [work(p) for p in paths]
    images = torch.from_numpy(np.stack([image for image, _ in done])).permute(0, 3, 1, 2).contiguous()
    labels = torch.tensor([label for _, label in files], dtype=torch.int64)
    return ImageData(images, labels), b"".join(digest for _, digest in done)


class _Untrusted(Exception):
    """A cache file that reads whole but does not hold what it claims; the message says why."""


def _load_cache(path: Path, files: list[tuple[str, int]], key: str, image_size: int, threads: int) -> ImageData:
    """The cache at ``path``, checked: shapes and labels, and the decoded data against its sha256 (the
    sources were checked by the key's stat of each file). Raises _Untrusted (or whatever a damaged file
    makes torch.load raise). Its cost: benchmarks/cache_check.py, in BENCHMARKS.md ("Data paths")."""
    import torch

    saved = torch.load(path, map_location="cpu", weights_only=True)
    images, labels, sources = saved["images"], saved["labels"], saved["sources"]
    expected = torch.tensor([label for _, label in files], dtype=torch.int64)
    if (
        saved["key"] != key
        or images.dtype != torch.uint8
        or tuple(images.shape) != (len(files), 3, image_size, image_size)
        or labels.dtype != torch.int64
        or not torch.equal(labels, expected)
        or sources.dtype != torch.uint8
        or tuple(sources.shape) != (len(files), SHA)
    ):
        raise _Untrusted("its contents do not match the file list")
    if data_digest(images, labels, threads) != saved["data_sha256"]:
        raise _Untrusted("its images or labels do not match their sha256 (the file is damaged)")
    return ImageData(images, labels)


def _prune(path: Path) -> str:
    """Remove the cache files of the same split, image size and --limit under another key (older
    versions of the data), and the temporary files a crashed write of one left; say what went.
    ``path``'s own temporary file is left alone: it may be another node's write in progress."""
    import re

    stem = path.name[: -len(".pt")].rsplit("-", 1)[0]  # train-32px, or train-32px-limit100
    same_slot = re.compile(re.escape(stem) + r"-[0-9a-f]{16}\.pt(\.tmp)?")
    gone, freed = 0, 0
    for other in path.parent.iterdir():
        if same_slot.fullmatch(other.name) and not other.name.startswith(path.name):
            try:
                size = other.stat().st_size
                other.unlink()
            except OSError:  # removed by a concurrent run first, or not ours to remove: leave it
                continue
            gone, freed = gone + 1, freed + size
    return f"; removed {gone} older cache file(s) of {stem} ({freed / 2**20:.1f} MiB)" if gone else ""


def cached_decode(data, root: Path, split: str, image_size: int, processes: int):
    """``data`` (an ImageFolder or a Subset of one) as ImageData: from ``ROOT/.ddpkit-cache`` when a
    cache of exactly these files exists and passes its checks (:func:`_load_cache`), else decoded and
    cached, and the older caches of the same split, size and limit removed. Returns (ImageData, a note
    saying which)."""
    import time

    import numpy as np
    import torch
    from torch.utils.data import Subset

    files = image_files(data)
    key = cache_key(files, image_size)
    limit = f"-limit{len(files)}" if isinstance(data, Subset) else ""  # a --limit run keeps its own cache
    path = root / CACHE_DIR / f"{split}-{image_size}px{limit}-{key}.pt"
    note = ""
    if path.exists():
        try:
            images = _load_cache(path, files, key, image_size, processes)
            return images, f"{split}: {len(files)} images from the cache {path} (checked against its sha256s)"
        except _Untrusted as exc:
            note = f" (the cache {path} was not used: {exc}; rebuilt)"
        except Exception as exc:  # truncated, damaged or foreign: rebuild it, never trust it
            note = f" (the cache {path} was unreadable: {type(exc).__name__}; rebuilt)"
    t = time.perf_counter()
    decoded, sources = decode_all(files, image_size, processes)
    took = time.perf_counter() - t
    saved = {
        "key": key,
        "images": decoded.images,
        "labels": decoded.labels,
        "data_sha256": data_digest(decoded.images, decoded.labels, processes),
        "sources": torch.from_numpy(np.frombuffer(sources, dtype=np.uint8).reshape(len(files), SHA).copy()),
    }
    try:
        atomic_write(path, torch_bytes(saved))
        where = f"cached in {path}{_prune(path)}"
    except RunDirError as exc:
        where = f"not cached ({exc})"
    return decoded, f"{split}: {len(files)} images decoded in {took:.1f} s, {where}{note}"
