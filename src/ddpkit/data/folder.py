"""``imagefolder:PATH``: the user's own images, streamed through torchvision's ImageFolder.

PATH must hold ``train/<class>/*.jpg`` and ``val/<class>/...`` (or ``test/``). Images are
decoded, resized and centre-cropped to ``--image-size`` in DataLoader workers and
arrive as uint8; flips and normalisation then run batched on the device like every
other dataset. An image that cannot be read is a one-line DataError naming the file.
``--limit-train/--limit-test N`` keep N images spread evenly over the sorted file list,
so every class stays represented.
"""

from __future__ import annotations

from pathlib import Path

from ..errors import DataError

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


def load_imagefolder(path: str, image_size: int, limit_train: int = 0, limit_test: int = 0):
    from torchvision import transforms
    from torchvision.datasets import ImageFolder

    from . import DataSplits, Meta

    root = Path(path)
    test_dir = next((root / d for d in ("val", "test") if (root / d).is_dir()), None)
    if not (root / "train").is_dir() or test_dir is None:
        raise DataError(f"imagefolder:{path} needs {root}/train/<class>/<images> and {root}/val/<class>/<images> "
                        f"(or test/ instead of val/)")
    tf = transforms.Compose([transforms.Resize(image_size), transforms.CenterCrop(image_size),
                             transforms.PILToTensor()])  # ImageFolder's loader already converts to RGB
    try:
        train = ImageFolder(str(root / "train"), transform=tf, loader=open_rgb)
        test = ImageFolder(str(test_dir), transform=tf, loader=open_rgb)
    except (FileNotFoundError, RuntimeError) as exc:
        raise DataError(f"imagefolder:{path}: {exc}") from None
    if train.classes != test.classes:
        raise DataError(f"imagefolder:{path}: train/ has classes {train.classes} but {test_dir.name}/ has {test.classes}")
    meta = Meta(3, image_size, image_size, len(train.classes), IMAGENET_MEAN, IMAGENET_STD, "flip")
    return DataSplits(spread(train, limit_train), spread(test, limit_test), meta)

