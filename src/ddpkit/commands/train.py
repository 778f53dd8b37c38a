"""``ddpkit train``: train a model with DDP (see ``ddpkit train --help``)."""

from __future__ import annotations

import dataclasses

from ..ranks import env
from .flags import add_config_flags, config_from_args, prestart_if_workers

HELP = "train a model with DistributedDataParallel"


def register(parser) -> None:
    add_config_flags(parser)
    parser.add_argument(
        "--print-config",
        action="store_true",
        help="print the resolved config as TOML (the recipe filled in, as config.toml will hold it) "
        "and exit without training; save it and pass it back with --config",
    )
    parser.set_defaults(run=run)


def run(args) -> int:
    cfg = config_from_args(args)
    if args.print_config:
        # run_dir stays as given: the default one is named by the config's hash, and an edited copy
        # of this file must get its own, not resume this one's
        print(dataclasses.replace(cfg.resolved(), run_dir=cfg.run_dir).to_toml(), end="")
        return 0
    if cfg.replicas > 1 and env.replica_group() is None:  # this command again, once per group, and a lighthouse
        from ..ranks.replicas import run_groups

        return run_groups(cfg, args.argv[args.argv.index("train") + 1 :])
    if env.replica_group() is not None:  # one group of --replicas: on its cores, and it ends with its launcher
        from ..ranks.replicas import enter_group

        enter_group()  # before its workers' forkserver starts, which they are forked from
    prestart_if_workers(cfg.nproc, cfg.max_restarts, cfg.nnodes)  # before torch is imported below
    from ..trainer import Trainer

    Trainer(cfg).fit()  # rank 0 prints the summary and where it was written
    return 0
