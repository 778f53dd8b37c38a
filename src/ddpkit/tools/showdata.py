"""A labelled grid of sample images from any dataset, optionally marked with a trained model's predictions.

    show_data("mnist", "grid.png")                               # 32 test images, each with its class
    show_data(None, "pred.png", predictions="runs/mnist-mlp-x")  # the run's data and model.pt

The images are a seeded random choice from the split (the same ``seed``, the same images). With
``predictions`` the model is the run's model.pt in the registry model its config.toml names, run
on the CPU in eval mode on inputs preprocessed exactly as ``ddpkit eval`` does (the same
normalisation, dtype and test-time augmentation). Right and wrong survive greyscale printing:
a wrong tile is framed with a thick dark border and labelled in bold with a "✗" and its true
class; a right one carries a "✓". The figure is a bare ``matplotlib.figure.Figure`` (never
pyplot), laid out from measured text widths so that no two labels overlap.
"""

from __future__ import annotations

import math
import pickle
from dataclasses import replace
from pathlib import Path

from ..config import TrainConfig, check_dataset_name
from ..errors import ConfigError, DataError, RunDirError, article
from ..files import atomic_write
from ..importpath import is_import_path, keyword_args

# torch and the modules that load it are imported where used: `ddpkit show-data` parses its flags and
# refuses a mistyped path at once, before torch loads (about 1.5 s).

MAX_IMAGES = 256
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
MAX_NAME = 16  # characters of a class name shown on a tile; longer ones end in "…"

FASHION_MNIST_CLASSES = (
    "T-shirt/top",
    "Trouser",
    "Pullover",
    "Dress",
    "Coat",
    "Sandal",
    "Shirt",
    "Sneaker",
    "Bag",
    "Ankle boot",
)
CIFAR10_CLASSES = ("airplane", "automobile", "bird", "cat", "deer", "dog", "frog", "horse", "ship", "truck")
TITLES = {
    "mnist": "MNIST",
    "fashion-mnist": "Fashion-MNIST",
    "cifar10": "CIFAR-10",
    "cifar100": "CIFAR-100",
    "synthetic": "synthetic (random pixels)",
}

# Style: right and wrong differ in mark, weight and frame, not in colour alone.
RIGHT_MARK, WRONG_MARK = "\u2713", "\u2717"  # ✓ ✗ (both in DejaVu Sans, matplotlib's own font)
WRONG_COLOUR = "#8b0000"  # dark red: red on screen, near-black in greyscale
TEXT_COLOUR = "#1a1a1a"
LABEL_PT, TITLE_PT, SUBTITLE_PT = 9.0, 13.0, 10.0


# ---------------------------------------------------------------------- class names
def class_names(dataset: str, classes: int, data_dir: str | Path = "data", data=None) -> list[str]:
    """The ``classes`` class names of ``dataset``, as shown on the tiles.

    MNIST: the digits; Fashion-MNIST and CIFAR-10: their standard names; CIFAR-100: the fine
    label names from ``DATA_DIR/cifar-100-python/meta`` when it is there (else numbers);
    imagefolder: the class folder names (from ``data``, the split's dataset, else the folders);
    synthetic: "class k".
    """
    numbers = [str(k) for k in range(classes)]
    if dataset == "mnist":
        names = numbers
    elif dataset == "fashion-mnist":
        names = list(FASHION_MNIST_CLASSES)
    elif dataset == "cifar10":
        names = list(CIFAR10_CLASSES)
    elif dataset == "cifar100":
        names = _cifar100_names(Path(data_dir) / "cifar-100-python" / "meta") or numbers
    elif dataset == "synthetic":
        names = [f"class {k}" for k in range(classes)]
    elif dataset.startswith("imagefolder:"):
        names = _folder_classes(data) if data is not None else None
        if names is None:
            from ..data.folder import list_images

            names = list_images(Path(dataset.split(":", 1)[1]) / "train")[0]
    else:
        names = numbers
    return list(names) if len(names) == classes else numbers


def _cifar100_names(path: Path) -> list[str] | None:
    try:
        with open(path, "rb") as fh:
            meta = pickle.load(fh, encoding="bytes")
        names = meta.get(b"fine_label_names") or meta.get("fine_label_names")
        # "aquarium_fish" -> "aquarium fish": the names are words, the underscores an artefact of the file
        return [(n.decode() if isinstance(n, bytes) else str(n)).replace("_", " ") for n in names]
    except Exception:  # missing, or not the pickle we know: numbers will do
        return None


def _folder_classes(data) -> list[str] | None:
    from torch.utils.data import Subset

    while isinstance(data, Subset):
        data = data.dataset
    return list(data.classes) if hasattr(data, "classes") else None


def shorten(name: str, limit: int = MAX_NAME) -> str:
    return name if len(name) <= limit else name[: limit - 1].rstrip() + "\u2026"


# ---------------------------------------------------------------------- the run, the data, the predictions
def load_run(run_dir: str | Path):
    """The run's TrainConfig, refused in one line when the CLI cannot rebuild its model."""

    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        raise RunDirError(f"--predictions {run_dir}: no such run directory")
    from ..run.rundir import finished_cli_run

    cfg = finished_cli_run(run_dir, "show its predictions from Python instead")
    if cfg.model is None:
        raise RunDirError(f"{run_dir / 'config.toml'} names no model; is {run_dir} a finished ddpkit run?")
    return cfg


def same_dataset(a: str, b: str) -> bool:
    """Whether two --dataset values name the same data (imagefolder paths compared resolved)."""
    if a.startswith("imagefolder:") and b.startswith("imagefolder:"):
        return Path(a.split(":", 1)[1]).resolve() == Path(b.split(":", 1)[1]).resolve()
    return a == b


def sample_indices(total: int, n: int, seed: int) -> list[int]:
    """``min(n, total)`` distinct indices of a ``total``-sample split: a seeded random choice."""
    import numpy as np

    return [int(i) for i in np.random.default_rng(seed).choice(total, size=min(n, total), replace=False)]


def take(data, indices: list[int]):
    """(uint8 images [k, C, H, W], int64 labels [k]) of ``data`` (ImageData or a map-style image dataset)."""
    import torch

    from ..data import ImageData

    if isinstance(data, ImageData):
        idx = torch.tensor(indices, dtype=torch.long)
        return data.images[idx], data.labels[idx]
    items = [data[i] for i in indices]
    first = items[0]
    if not (
        isinstance(first, (tuple, list))
        and len(first) == 2
        and isinstance(first[0], torch.Tensor)
        and first[0].dim() == 3
        and first[0].shape[0] in (1, 3)
    ):
        raise DataError(
            f"show-data draws images: samples as (image [C, H, W] with 1 or 3 channels, class); this "
            f"dataset's sample {indices[0]} is {_describe(first)}"
        )
    return torch.stack([x for x, _ in items]), torch.tensor([int(y) for _, y in items], dtype=torch.long)


def _describe(sample) -> str:
    import torch

    if isinstance(sample, torch.Tensor):
        return f"a tensor of shape {list(sample.shape)}"
    if isinstance(sample, (tuple, list)):
        return f"{article(type(sample).__name__)} of {', '.join(_describe(x) for x in sample[:3])}"
    return article(type(sample).__name__)


def displayable(images):
    """uint8 images for the grid: float images (a dataset of your own) scaled from their own range."""
    import torch

    if images.dtype == torch.uint8:
        return images
    x = images.float()
    lo, hi = x.amin(dim=(1, 2, 3), keepdim=True), x.amax(dim=(1, 2, 3), keepdim=True)
    return ((x - lo) / (hi - lo).clamp_min(1e-12) * 255).round().to(torch.uint8)


def predict(cfg: TrainConfig, meta, model, images, batch: int = 64):
    """``model``'s predicted classes for ``images`` (uint8, or your dataset's own), on the CPU, in eval
    mode, preprocessed as ``ddpkit eval`` does (normalisation, --dtype, --tta)."""
    import torch

    from ..data.loader import Preprocess

    model.eval()
    pre = Preprocess.for_config(meta, torch.device("cpu"), cfg)
    preds = []
    with torch.no_grad():
        for start in range(0, len(images), batch):
            x = pre.eval(images[start : start + batch])
            logits = model(x)
            if cfg.tta:  # as Classification.evaluate: average over the image and its mirror
                logits = (logits.float() + model(x.flip(3)).float()) / 2
            preds.append(logits.argmax(1))
    return torch.cat(preds) if preds else torch.zeros(0, dtype=torch.long)


def predict_on_cpu(cfg: TrainConfig, meta, model, images):
    """:func:`predict` with a model of yours, wherever it is: moved to the CPU and back, mode restored."""
    import torch

    home = next((p.device for p in model.parameters()), torch.device("cpu"))
    training = model.training
    model.to("cpu")
    try:
        return predict(cfg, meta, model, images)
    finally:
        model.to(home)
        model.train(training)


def check_out(out: str | Path) -> Path:
    """``out`` as a path the grid may be written to: a .png, not a directory, not an existing non-PNG file."""
    out = Path(out)
    if out.suffix.lower() != ".png":
        raise ConfigError(f"--out {out}: the grid is a PNG; give a path ending in .png")
    if out.is_dir():
        raise ConfigError(f"--out {out} is a directory; give a file path ending in .png")
    if out.exists():
        try:
            with open(out, "rb") as fh:
                head = fh.read(len(PNG_SIGNATURE))
        except OSError as exc:
            raise ConfigError(f"--out {out}: cannot read the existing file ({exc.strerror})") from None
        if head != PNG_SIGNATURE:
            raise ConfigError(
                f"--out {out} exists and is not a PNG image; refusing to overwrite it "
                f"(remove it or choose another path)"
            )
    return out


# ---------------------------------------------------------------------- the entry point
def show_data(
    dataset: str | None = None,
    out: str | Path = "grid.png",
    *,
    split: str = "test",
    n: int = 32,
    seed: int = 0,
    data_dir: str | None = None,
    predictions: str | Path | None = None,
    model=None,
    dataset_args: str = "",
) -> dict:
    """Write a PNG grid of ``n`` images of ``dataset``'s ``split``, each labelled with its class.

    ``dataset``: any ``--dataset`` value (mnist, fashion-mnist, cifar10, cifar100, synthetic,
    imagefolder:PATH); with ``predictions`` it may be None (the run's own) and must otherwise
    name the run's dataset. ``data_dir``: where torchvision datasets live ("data"; with
    ``predictions`` the run's). ``predictions``: a ddpkit run directory whose model.pt marks
    each image right or wrong. ``model``: an ``nn.Module`` (from Python) whose predictions mark
    them instead; ``dataset`` is then required. ``dataset_args``: ``--dataset-args``, keyword arguments
    for a ``pkg.module:function`` dataset as a JSON object (with ``predictions``, the run's by default).

    Returns {"path", "dataset", "split", "count", "indices", "labels"} and, with predictions,
    {"run_dir", "predictions", "right", "accuracy"} (accuracy on the shown images).
    """

    # Every check that needs no torch comes first: a mistyped path is reported at once.
    if split not in ("train", "test"):
        raise ConfigError(f"--split {split!r}: choose train or test")
    if not isinstance(n, int) or isinstance(n, bool) or not 1 <= n <= MAX_IMAGES:
        raise ConfigError(f"--n {n}: show between 1 and {MAX_IMAGES} images")
    if not isinstance(seed, int) or isinstance(seed, bool) or not 0 <= seed < 2**63:
        raise ConfigError(f"--seed {seed}: give a whole number >= 0")
    if dataset is not None and dataset.startswith("custom:"):
        raise ConfigError(
            f"{dataset}: a dataset given from Python cannot be shown by name; name it by import path "
            f"(pkg.module:function, as --dataset takes it)"
        )
    if dataset_args:
        keyword_args(dataset_args, "--dataset-args")  # a JSON object, said at once
        if dataset is not None and not is_import_path(dataset):
            raise ConfigError(f"--dataset-args is for a dataset named pkg.module:function, not {dataset}")
    if model is not None and predictions is not None:
        raise ConfigError("give --predictions RUN_DIR or model=..., not both")
    if model is not None and dataset is None:
        raise ConfigError("model=... needs a dataset to predict on")
    out = check_out(out)

    if predictions is not None:
        cfg = load_run(predictions)
        if dataset is not None and not same_dataset(dataset, cfg.dataset):
            raise ConfigError(
                f"dataset {dataset} is not the one {predictions} was trained on ({cfg.dataset}); "
                f"leave DATASET out to use the run's"
            )
        if dataset_args and keyword_args(dataset_args, "") != keyword_args(cfg.dataset_args, ""):
            raise ConfigError(
                f"--dataset-args {dataset_args} are not the ones {predictions} was trained with "
                f"({cfg.dataset_args or 'none'}); leave --dataset-args out to use the run's"
            )
        cfg = replace(cfg, data_dir=data_dir or cfg.data_dir, device="cpu")
    elif dataset is None:
        raise ConfigError(
            "give a DATASET (mnist, fashion-mnist, cifar10, cifar100, synthetic, imagefolder:PATH), "
            "or --predictions RUN_DIR to use the run's"
        )
    else:
        cfg = TrainConfig(dataset=dataset, dataset_args=dataset_args, data_dir=data_dir or "data", device="cpu")

    check_dataset_name(cfg.dataset)
    from ..data import load_dataset

    splits = load_dataset(cfg)
    if predictions is not None:  # a model and data by import path: still what the run trained on?
        from ..run.rundir import check_rebuilt

        check_rebuilt(cfg, predictions, splits)
    data = splits.train if split == "train" else splits.test
    if len(data) == 0:
        raise ConfigError(f"the {split} split of {cfg.dataset} is empty")
    indices = sample_indices(len(data), n, seed)
    images, labels = take(data, indices)
    meta = splits.meta
    classes = meta.classes if meta is not None else int(labels.max()) + 1
    names = class_names(cfg.dataset, classes, cfg.data_dir, data)
    result: dict = {
        "path": str(out),
        "dataset": cfg.dataset,
        "split": split,
        "count": len(indices),
        "indices": indices,
        "labels": labels.tolist(),
    }

    preds = None
    if predictions is not None:
        from ..run.rundir import load_trained_model

        preds = predict(cfg, meta, load_trained_model(cfg, meta, predictions), images)
        result["run_dir"] = str(predictions)
        whose = f"{cfg.model} from {predictions}"
    elif model is not None:
        preds, whose = predict_on_cpu(cfg, meta, model, images), type(model).__name__
    if preds is not None:
        right = int((preds == labels).sum())
        result.update(predictions=preds.tolist(), right=right, accuracy=right / len(indices))

    count = f"{len(indices)} random image{'s' if len(indices) != 1 else ''}"
    # A no-break space: never "(seed" and "0)" on two lines.
    title = f"{_dataset_title(cfg.dataset)} \u00b7 {split} split \u00b7 {count} (seed\u00a0{seed})"
    subtitles = []
    if preds is not None:
        subtitles.append(
            f"Predictions of {whose}: {result['right']} of {len(indices)} right ({100 * result['accuracy']:.1f}%)"
        )
        subtitles.append(f"{RIGHT_MARK} right    {WRONG_MARK} wrong (framed, bold, with the true class)")
    fig = grid_figure(
        displayable(images), labels.tolist(), names, None if preds is None else preds.tolist(), title, subtitles
    )
    _save(fig, out)
    return result


def _dataset_title(dataset: str) -> str:
    if dataset.startswith("imagefolder:"):
        return f"imagefolder {dataset.split(':', 1)[1]}"
    return TITLES.get(dataset, dataset)


def _save(fig, out: Path) -> None:
    import io

    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=fig.dpi, facecolor="white")
    atomic_write(out, buf.getvalue(), "--out")


# ---------------------------------------------------------------------- the figure
def _text_width_in(text: str, size: float, bold: bool = False) -> float:
    """Width of ``text`` in inches as matplotlib renders it."""
    from matplotlib.font_manager import FontProperties
    from matplotlib.textpath import TextToPath

    prop = FontProperties(size=size, weight="bold" if bold else "normal")
    width, _, _ = TextToPath().get_text_width_height_descent(text, prop, ismath=False)
    return width / 72.0


def _wrap(text: str, width_in: float, size: float, bold: bool = False) -> list[str]:
    """``text`` broken at spaces into lines no wider than ``width_in``; a longer word (a path) is
    broken after a "/" where it can be, else anywhere."""

    def fits(s: str) -> bool:
        return _text_width_in(s, size, bold) <= width_in

    pieces = []  # (text, the glue before it): " " between words, "" inside a broken word
    for word in text.split(" "):
        glue = " "
        while not fits(word) and len(word) > 1:
            cut = len(word) - 1
            while cut > 1 and not fits(word[:cut]):
                cut -= 1
            slash = word.rfind("/", 0, cut)
            cut = slash + 1 if slash > 0 else cut
            pieces.append((word[:cut], glue))
            word, glue = word[cut:], ""
        pieces.append((word, glue))
    lines, line = [], ""
    for piece, glue in pieces:
        candidate = f"{line}{glue}{piece}" if line else piece
        if line and not fits(candidate):
            lines.append(line)
            line = piece
        else:
            line = candidate
    return lines + [line] if line else lines


def _columns(n: int) -> int:
    """About twice as many columns as rows, preferring a count that fills the last row."""
    target = max(1, round(math.sqrt(2 * n)))
    best = min(range(max(1, target - 2), target + 3), key=lambda c: ((-n) % c, abs(c - target)))
    return min(n, best)


def tile_labels(labels: list[int], names: list[str], preds: list[int] | None) -> list[list[tuple[str, bool]]]:
    """Per tile, its label lines as (text, bold): the class; or "✓ pred X"; or "✗ pred X" and "true Y"."""

    def name(k: int) -> str:
        return shorten(names[k] if 0 <= k < len(names) else str(k))

    if preds is None:
        return [[(name(y), False)] for y in labels]
    return [
        [(f"{RIGHT_MARK} pred {name(p)}", False)]
        if p == y
        else [(f"{WRONG_MARK} pred {name(p)}", True), (f"true {name(y)}", True)]
        for y, p in zip(labels, preds)
    ]


def grid_figure(
    images, labels: list[int], names: list[str], preds: list[int] | None, title: str, subtitles: list[str] = ()
):
    """The grid as a bare matplotlib Figure: uint8 ``images`` [k, C, H, W] (1 channel grey, 3 RGB).

    Sizes are in inches and fonts in points, fixed whatever the number of images: each column is
    as wide as its widest label needs, so labels never overlap; the title wraps to the width.
    """
    from matplotlib.figure import Figure
    from matplotlib.patches import Rectangle

    k = len(images)
    _, c, h, w = images.shape
    cols = _columns(k)
    rows = math.ceil(k / cols)
    lines = tile_labels(labels, names, preds)
    n_lines = max(len(t) for t in lines)

    side = 1.1 if k <= 64 else 0.9  # the longer image side, inches
    img_w, img_h = (side, side * h / w) if w >= h else (side * w / h, side)
    label_w = max(_text_width_in(text, LABEL_PT, bold) for tile in lines for text, bold in tile)
    cell_w = max(img_w, label_w) + (0.3 if preds is not None else 0.22)  # column gap included
    line_h = LABEL_PT * 1.3 / 72
    frame_pad = 0.06  # the wrong-prediction frame sits this far outside the image
    label_gap = frame_pad + 0.06
    cell_h = img_h + label_gap + n_lines * line_h + 0.2  # row gap included
    margin = 0.3

    # Wide enough for the grid, and for the title on one line where that takes at most 9 inches.
    fig_w = max(2 * margin + cols * cell_w, min(_text_width_in(title, TITLE_PT, True) + 2 * margin, 9.0), 5.0)
    text_w = fig_w - 2 * margin
    title_lines = _wrap(title, text_w, TITLE_PT, True)
    sub_lines = [line for sub in subtitles for line in _wrap(sub, text_w, SUBTITLE_PT)]
    title_h = len(title_lines) * TITLE_PT * 1.35 / 72 + len(sub_lines) * SUBTITLE_PT * 1.4 / 72
    top = 0.25 + title_h + 0.2
    fig_h = top + rows * cell_h + 0.1
    dpi = max(80, min(150, 4000 / fig_w))  # at most ~4000 pixels across

    fig = Figure(figsize=(fig_w, fig_h), dpi=dpi, facecolor="white")
    # One axes over the whole figure, in inches: 256 images cost 256 AxesImages, not 256 Axes.
    ax = fig.add_axes((0, 0, 1, 1))
    ax.set_axis_off()

    def text(x, y, s, size, bold=False, colour=TEXT_COLOUR):
        ax.text(
            x,
            y,
            s,
            ha="center",
            va="top",
            fontsize=size,
            weight="bold" if bold else "normal",
            color=colour,
            parse_math=False,
        )

    y = fig_h - 0.25
    for line in title_lines:
        text(fig_w / 2, y, line, TITLE_PT, bold=True)
        y -= TITLE_PT * 1.35 / 72
    for line in sub_lines:
        text(fig_w / 2, y, line, SUBTITLE_PT)
        y -= SUBTITLE_PT * 1.4 / 72

    grid_left = (fig_w - cols * cell_w) / 2
    interpolation = "nearest" if max(h, w) <= 64 else "antialiased"
    for i in range(k):
        r, col = divmod(i, cols)
        cx = grid_left + (col + 0.5) * cell_w  # the cell's centre, inches
        left, bottom = cx - img_w / 2, fig_h - top - r * cell_h - img_h
        pixels = images[i].numpy()
        extent = (left, left + img_w, bottom, bottom + img_h)
        if c == 1:
            ax.imshow(pixels[0], cmap="gray", vmin=0, vmax=255, extent=extent, interpolation=interpolation)
        else:
            ax.imshow(pixels.transpose(1, 2, 0)[:, :, :3], extent=extent, interpolation=interpolation)
        ax.add_patch(Rectangle((left, bottom), img_w, img_h, fill=False, edgecolor="#888888", linewidth=0.5))
        wrong = preds is not None and preds[i] != labels[i]
        if wrong:
            ax.add_patch(
                Rectangle(
                    (left - frame_pad, bottom - frame_pad),
                    img_w + 2 * frame_pad,
                    img_h + 2 * frame_pad,
                    fill=False,
                    edgecolor=WRONG_COLOUR,
                    linewidth=3.0,
                    joinstyle="miter",
                )
            )
        ty = bottom - label_gap
        for line, bold in lines[i]:
            text(cx, ty, line, LABEL_PT, bold=bold, colour=WRONG_COLOUR if wrong else TEXT_COLOUR)
            ty -= line_h
    ax.set_xlim(0, fig_w)  # after imshow, which sets its own limits and aspect
    ax.set_ylim(0, fig_h)
    ax.set_aspect("auto")
    return fig


__all__ = ["show_data", "class_names", "grid_figure", "tile_labels", "sample_indices", "MAX_IMAGES"]
