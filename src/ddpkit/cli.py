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


class Parser(argparse.ArgumentParser):
    """argparse, with a bad flag reported in one line (with the nearest valid flag), not a usage block."""

    def error(self, message: str):
        import difflib

        words = message.split()
        if message.startswith("unrecognized arguments:") and len(words) > 2:
            flags = [o for a in self._actions for o in a.option_strings]
            near = difflib.get_close_matches(words[2].split("=")[0], flags, 1)
            if near:
                message += f" (did you mean {near[0]}?)"
        self.exit(2, f"ddpkit: error: {self.prog}: {message}; see `{self.prog} --help`\n")


def build_parser() -> argparse.ArgumentParser:
    from .commands import COMMANDS

    from . import __version__

    parser = Parser(prog="ddpkit", description="Data-parallel training with PyTorch DDP.")
    parser.add_argument("--version", action="version", version=f"ddpkit {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, module in COMMANDS.items():
        module.register(sub.add_parser(name, help=module.HELP, description=module.HELP))
    return parser


def main(argv: list[str] | None = None) -> int:
    os.environ["DDPKIT_T0"] = repr(time.time())  # launch time, for summary.json's startup_s
    try:
        parser = build_parser()
        args, extra = parser.parse_known_args(argv)
        if extra:  # reported by the subcommand's parser, which knows the flags to suggest
            sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
            sub.choices[args.command].error(f"unrecognized arguments: {' '.join(extra)}")
        return run_reporting_errors(lambda: args.run(args))
    finally:
        os.environ.pop("DDPKIT_T0", None)


def run_reporting_errors(fn) -> int:
    """Call ``fn``; a user error becomes one line on stderr and its exit status, never a traceback."""
    try:
        return fn() or 0
    except DdpkitError as exc:
        if not getattr(exc, "reported", False):  # else its rank printed it already (dist.report_failure)
            return _report_once(exc)
        return exc.exit_code
    except WorkersFailed as exc:
        if not exc.reported:
            print(f"ddpkit: error: {exc}" + ("" if "above" in str(exc) else "; their output is above"), file=sys.stderr)
        return exc.exit_code
    except KeyboardInterrupt:
        print("ddpkit: interrupted", file=sys.stderr)
        return 130


def _report_once(exc: DdpkitError) -> int:
    """Print ``exc`` once for the job. Under torchrun every rank gets here.

    An error every rank meets alike in training is printed by global rank 0 alone. One met
    before training (a bad flag, missing data) is usually met by every rank too, but not always
    (data missing on one node). So the other ranks first leave rank 0 time to print it: torchrun
    stops a node's ranks when one of them exits, and without the wait a rank that exited first
    had a slower rank 0 stopped before it printed, and the error was not reported at all. A
    rank still alive afterwards may have met it alone, and says so: on rank 0's node every rank,
    on another node its local rank 0 only (those nodes' agents may learn of rank 0's exit too
    late, so an error met everywhere is printed once per node there).
    """
    from .dist import under_launcher

    rank = os.environ.get("RANK", "0") if under_launcher() else "0"
    if rank != "0":
        other_node = os.environ.get("GROUP_RANK", "0") != "0"
        if exc.all_ranks or (other_node and os.environ.get("LOCAL_RANK", "0") != "0"):
            return exc.exit_code
        try:
            time.sleep(PEER_WAIT_S)
        except KeyboardInterrupt:
            return 130
    print(f"ddpkit: error: {'' if rank == '0' else f'rank {rank}: '}{exc}", file=sys.stderr)
    return exc.exit_code


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
