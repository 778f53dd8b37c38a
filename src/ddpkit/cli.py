"""The ``ddpkit`` command line: parses, delegates, and turns user errors into one line.

    ddpkit train --dataset mnist --nproc 2 --epochs 2
    ddpkit eval RUN_DIR --nproc 2

Each subcommand lives in ``ddpkit.commands`` and registers its own parser. ``train``
flags are generated from :class:`ddpkit.config.TrainConfig`, so the flags and
config.toml are two views of one dataclass.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import time

from .errors import DdpkitError, WorkersFailed


PEER_WAIT_S = 5.0  # under torchrun, how long a rank other than 0 leaves rank 0 to print an error first


def build_parser() -> argparse.ArgumentParser:
    from .commands import COMMANDS

    parser = argparse.ArgumentParser(prog="ddpkit", description="Data-parallel training with PyTorch DDP.")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, module in COMMANDS.items():
        module.register(sub.add_parser(name, help=module.HELP, description=module.HELP))
    return parser


def main(argv: list[str] | None = None) -> int:
    os.environ["DDPKIT_T0"] = repr(time.time())  # launch time, for summary.json's startup_s
    try:
        args = build_parser().parse_args(argv)
        return run_reporting_errors(lambda: args.run(args))
    finally:
        os.environ.pop("DDPKIT_T0", None)


def run_reporting_errors(fn) -> int:
    """Call ``fn``; a user error becomes one line on stderr and its exit status, never a traceback."""
    try:
        return fn() or 0
    except DdpkitError as exc:
        if not getattr(exc, "reported", False):  # else its rank printed it already (dist.report_failure)
            rank = os.environ.get("RANK", "0")
            if rank != "0":
                # Under torchrun every rank gets here. An error met before training (a bad flag) is
                # usually met by every rank: rank 0 prints it, and torchrun stops the others when
                # it exits. Wait for that, so the line is printed once and rank 0 is not stopped
                # before it prints; a rank still alive afterwards met the error alone, and says so.
                time.sleep(PEER_WAIT_S)
            print(f"ddpkit: error: {'' if rank == '0' else f'rank {rank}: '}{exc}", file=sys.stderr)
        return exc.exit_code
    except WorkersFailed as exc:
        if not exc.reported:
            print(f"ddpkit: error: {exc}" + ("" if "above" in str(exc) else "; their output is above"), file=sys.stderr)
        return exc.exit_code
    except KeyboardInterrupt:
        print("ddpkit: interrupted", file=sys.stderr)
        return 130


def entry() -> None:
    """The ``ddpkit`` command (and ``python -m ddpkit``): :func:`main`, then a prompt exit.

    Once everything is written and flushed, finalising an interpreter that holds torch takes
    about 0.3-0.5 s (module teardown) and does nothing the user needs, so it is skipped.
    """
    code = main()
    sys.stdout.flush()
    sys.stderr.flush()
    logging.shutdown()
    os._exit(code)
