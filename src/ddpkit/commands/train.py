"""``ddpkit train``: train a model with DDP (see ``ddpkit train --help``)."""

from __future__ import annotations

from .flags import add_config_flags, config_from_args, prestart_if_workers

HELP = "train a model with DistributedDataParallel"


def register(parser) -> None:
    add_config_flags(parser)
    parser.set_defaults(run=run)


def run(args) -> int:
    cfg = config_from_args(args)
    prestart_if_workers(cfg.nproc, cfg.max_restarts, cfg.nnodes)  # before torch is imported below
    from ..trainer import Trainer

    Trainer(cfg).fit()  # rank 0 prints the summary and where it was written
    return 0
