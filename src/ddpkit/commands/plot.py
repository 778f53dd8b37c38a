"""``ddpkit plot RUN_DIR [RUN_DIR ...]``: draw (or redraw) a run's loss, metric and throughput PNGs.

ddpkit plot runs/mnist-convnet-1a2b3c4d                   # into RUN_DIR/plots/
ddpkit plot runs/world1 runs/world2 --out compare/        # overlaid, for comparison
"""

from __future__ import annotations

from pathlib import Path

from ..errors import ConfigError

HELP = "draw loss, metric and samples/s plots of one run, or of several overlaid"


def register(parser) -> None:
    parser.add_argument("run_dirs", nargs="+", metavar="RUN_DIR", help="ddpkit run directories (with metrics.jsonl)")
    parser.add_argument(
        "--out",
        default=None,
        metavar="DIR",
        help="where the PNGs go (default: RUN_DIR/plots for one run; needed for several)",
    )
    parser.set_defaults(run=run)


def run(args) -> int:
    from ..run.paths import RunFiles
    from ..run.plots import training_plots

    if args.out is None and len(args.run_dirs) > 1:
        raise ConfigError(
            f"{len(args.run_dirs)} run dirs are drawn into one set of plots: name its folder with --out DIR"
        )
    out = Path(args.out) if args.out else RunFiles(args.run_dirs[0]).plots
    if out.exists() and not out.is_dir():
        raise ConfigError(f"--out {out} is a file; give a directory")
    for path in training_plots(args.run_dirs, out):
        print(path)
    return 0
