"""``ddpkit check``: do N processes compute what 1 process does? (see :mod:`ddpkit.tools.check`)"""

from __future__ import annotations

import json
from pathlib import Path

from .flags import TOOL_RUN_FIELDS, add_config_flags, config_from_args, prestart_if_workers

HELP = "check that N processes train exactly as 1 process does, and that the data is covered once"


def register(parser) -> None:
    parser.add_argument(
        "--nproc", dest="check_nproc", type=int, default=2, metavar="N", help="processes to compare with 1 (default: 2)"
    )
    parser.add_argument("--steps", type=int, default=5, help="optimizer steps per run (default: 5)")
    parser.add_argument("--json", dest="json_out", metavar="PATH", help="also write the report as JSON")
    # what the check sets itself (its runs are short, quiet and in a temporary directory)
    add_config_flags(parser, skip=TOOL_RUN_FIELDS | {"keep_snapshots", "amp", "ema", "join"})
    for action in parser._actions:
        if action.dest == "dtype":
            action.help = (
                "dtype of the runs compared (default: float64 on CPU where the model runs in it, else float32)"
            )
        if action.dest == "sync_bn":
            action.help = (
                "SyncBatchNorm in every run (default: on for models with BatchNorm; --no-sync-bn shows "
                "how far N processes then differ from 1)"
            )
    parser.set_defaults(run=run)


def run(args) -> int:
    prestart_if_workers(str(args.check_nproc))  # before torch is imported below
    from ..files import atomic_write, check_writable
    from ..tools.check import check

    if args.json_out:
        check_writable(args.json_out, "--json")  # before the runs, not after them

    # None unless given: then the check chooses (SyncBN for BatchNorm models; float64 on CPU)
    sync_bn, dtype = getattr(args, "sync_bn", None), getattr(args, "dtype", None)
    cfg = config_from_args(args)
    report = check(config=cfg, nproc=args.check_nproc, steps=args.steps, sync_bn=sync_bn, dtype=dtype)
    print(report.text())
    if args.json_out:  # a file that cannot be replaced is one line, even after the runs
        atomic_write(Path(args.json_out), (json.dumps(report.to_dict(), indent=2) + "\n").encode(), "--json")
    return report.exit_code
