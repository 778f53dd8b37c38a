"""CLI subcommands: a plain dict of modules, each with ``HELP``, ``register(parser)`` and a ``run``."""

from . import eval as eval_cmd
from . import train

COMMANDS = {"train": train, "eval": eval_cmd}
