"""``ddpkit train``: train a model with DDP (see ``ddpkit train --help``)."""

from __future__ import annotations

from .flags import add_config_flags, config_from_args

HELP = "train a model with DistributedDataParallel"


def register(parser) -> None:
    add_config_flags(parser)
    parser.set_defaults(run=run)


def run(args) -> int:
    from ..trainer import Trainer

    summary = Trainer(config_from_args(args)).fit()
    if summary is not None:
        print(f"ddpkit: test_accuracy={summary['test_accuracy']:.4f} over {summary['test_samples']} samples; "
              f"run dir {summary['run_dir']}")
    return 0
