"""CLI subcommands: a plain dict of modules, each with ``HELP``, ``register(parser)`` and a ``run``."""

from . import bench, check, doctor, plot, run, show_data, train
from . import eval as eval_cmd

COMMANDS = {
    "train": train,
    "run": run,
    "eval": eval_cmd,
    "check": check,
    "bench": bench,
    "plot": plot,
    "show-data": show_data,
    "doctor": doctor,
}
