"""``ddpkit show-data DATASET --out grid.png [--predictions RUN_DIR]``: a labelled grid of sample images."""

from __future__ import annotations

HELP = "draw a labelled grid of sample images of a dataset as a PNG, optionally marking a run's predictions"


def _count(text: str) -> int:
    import argparse

    from ..tools.showdata import MAX_IMAGES

    try:
        n = int(text)
    except ValueError:
        n = 0
    if not 1 <= n <= MAX_IMAGES:
        raise argparse.ArgumentTypeError(f"expected a number of images from 1 to {MAX_IMAGES}, got {text!r}")
    return n


def register(parser) -> None:
    parser.add_argument(
        "dataset",
        nargs="?",
        default=None,
        metavar="DATASET",
        help="mnist | fashion-mnist | cifar10 | cifar100 | synthetic | imagefolder:PATH "
        "(optional with --predictions: the run's own)",
    )
    parser.add_argument(
        "--out",
        default="grid.png",
        help="the PNG to write (default: grid.png); an existing file that is not a PNG is never overwritten",
    )
    parser.add_argument("--split", choices=("train", "test"), default="test", help="which split (default: test)")
    parser.add_argument("--n", type=_count, default=32, metavar="N", help="images to show, 1 to 256 (default: 32)")
    parser.add_argument("--seed", type=int, default=0, help="which images: a seeded random choice (default: 0)")
    parser.add_argument(
        "--dataset-args",
        default="",
        metavar="JSON",
        help='keyword arguments for DATASET pkg.module:function, as a JSON object: \'{"root": "data"}\' '
        "(default: none; with --predictions, the run's)",
    )
    parser.add_argument(
        "--data-dir",
        default=None,
        help="where torchvision datasets are read from / downloaded to (default: data; with --predictions, the run's)",
    )
    parser.add_argument(
        "--predictions",
        metavar="RUN_DIR",
        default=None,
        help="a ddpkit run directory: mark each image right or wrong by its model.pt",
    )
    parser.set_defaults(run=run)


def run(args) -> int:
    from ..tools.showdata import show_data

    result = show_data(
        args.dataset,
        args.out,
        split=args.split,
        n=args.n,
        seed=args.seed,
        data_dir=args.data_dir,
        predictions=args.predictions,
        dataset_args=args.dataset_args,
    )
    line = f"wrote {result['path']}: {result['count']} {result['dataset']} {result['split']} images"
    if "right" in result:
        line += f", {result['right']} of {result['count']} predicted right ({100 * result['accuracy']:.1f}%)"
    print(line)
    return 0
