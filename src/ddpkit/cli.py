"""The ``ddpkit`` command line: parses, delegates, and turns user errors into one line.

    ddpkit train --dataset mnist --nproc 2 --epochs 2
    ddpkit eval RUN_DIR --nproc 2

Each subcommand lives in ``ddpkit.commands`` and registers its own parser. ``train``
flags are generated from :class:`ddpkit.config.TrainConfig`, so the flags and
config.toml are two views of one dataclass.
"""

from __future__ import annotations

import argparse
import os
import sys

from .errors import DdpkitError
from .launcher import WorkersFailed


def build_parser() -> argparse.ArgumentParser:
    from .commands import COMMANDS

    parser = argparse.ArgumentParser(prog="ddpkit", description="Data-parallel training with PyTorch DDP.")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, module in COMMANDS.items():
        module.register(sub.add_parser(name, help=module.HELP, description=module.HELP))
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return run_reporting_errors(lambda: args.run(args))


def run_reporting_errors(fn) -> int:
    """Call ``fn``; a user error becomes one line on stderr and its exit status, never a traceback."""
    try:
        return fn() or 0
    except DdpkitError as exc:
        # Under torchrun every rank gets here: an error every rank met alike (preflight) is printed by
        # rank 0; one a rank met alone was already printed by that rank (dist.report_failure).
        if os.environ.get("RANK", "0") == "0" and not getattr(exc, "reported", False):
            print(f"ddpkit: error: {exc}", file=sys.stderr)
        return exc.exit_code
    except WorkersFailed as exc:
        if not exc.reported:
            print(f"ddpkit: error: {exc}" + ("" if "above" in str(exc) else "; their output is above"), file=sys.stderr)
        return exc.exit_code
    except KeyboardInterrupt:
        print("ddpkit: interrupted", file=sys.stderr)
        return 130
