"""The ``ddpkit`` command line: parses, delegates, and turns user errors into one line.

    ddpkit train --dataset mnist --nproc 2 --epochs 2
    ddpkit eval RUN_DIR --nproc 2
    ddpkit run --nproc 2 train.py --lr 0.1       # your own script on every rank

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

from .commands import COMMANDS
from .errors import DdpkitError, WorkersFailed
from .ranks import env
from .ranks.failures import exit_status
from .version import __version__


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
    parser = Parser(prog="ddpkit", description="Data-parallel training with PyTorch DDP.")
    parser.add_argument("--version", action="version", version=f"ddpkit {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, module in COMMANDS.items():
        module.register(sub.add_parser(name, help=module.HELP, description=module.HELP))
    return parser


def main(argv: list[str] | None = None) -> int:
    os.environ[env.T0] = repr(time.time())  # launch time, for summary.json's startup_s
    try:
        parser = build_parser()
        args, extra = parser.parse_known_args(argv)
        if extra:  # reported by the subcommand's parser, which knows the flags to suggest
            sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
            sub.choices[args.command].error(f"unrecognized arguments: {' '.join(extra)}")
        args.argv = list(sys.argv[1:] if argv is None else argv)  # as given: `train --replicas` runs it per group
        return run_reporting_errors(lambda: args.run(args))
    finally:
        os.environ.pop(env.T0, None)


def run_reporting_errors(fn) -> int:
    """Call ``fn``; a user error becomes one line on stderr and its exit status, never a traceback."""
    try:
        return fn() or 0
    except (DdpkitError, WorkersFailed, KeyboardInterrupt) as exc:
        return exit_status(exc)


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
