"""``TrainConfig`` fields as argparse flags, and back.

Flags default to SUPPRESS, so only what the user typed overrides the TOML file and
the recipe; everything else stays ``None``/default and is resolved in one place.
"""

from __future__ import annotations

import argparse
import dataclasses

from ..config import TrainConfig
from ..errors import ConfigError


def _parse_type(annotation: str):
    if "bool" in annotation:
        return bool
    for name, typ in (("float", float), ("int", int)):
        if name in annotation:
            return typ
    return str


# Fields a tool sets itself for its own runs (short, quiet, on this node, in a temporary directory): `ddpkit bench`
# and `ddpkit check` offer no flag for them.
TOOL_RUN_FIELDS = frozenset(
    {
        "nproc",
        "max_steps",
        "epochs",
        "resume",
        "progress",
        "quiet",
        "run_dir",
        "log",
        "plots",
        "log_every",
        "save_every_steps",
        "max_restarts",
        "replicas",
        "sample_log",
        "nnodes",
        "rdzv_endpoint",
        "rdzv_id",
        "local_addr",
        "grad_sync",
    }
)


def add_config_flags(parser: argparse.ArgumentParser, skip: frozenset = frozenset(), config_file: bool = True) -> None:
    groups: dict[str, argparse._ArgumentGroup] = {}
    for f in dataclasses.fields(TrainConfig):
        if f.name in skip or not f.metadata["cli"]:
            continue
        section = f.metadata["section"]
        group = groups.setdefault(section, parser.add_argument_group(section))
        flag = "--" + f.name.replace("_", "-")
        typ = _parse_type(str(f.type))
        shown = "recipe" if f.default is None else f.default
        text = f.metadata["help"] if "default:" in f.metadata["help"] else f"{f.metadata['help']} (default: {shown})"
        if typ is bool:
            group.add_argument(
                flag, dest=f.name, action=argparse.BooleanOptionalAction, default=argparse.SUPPRESS, help=text
            )
        else:
            group.add_argument(
                flag, dest=f.name, type=typ, default=argparse.SUPPRESS, metavar=f.name.upper(), help=text
            )
    if config_file:  # not for `ddpkit run`, whose flags are the launch's alone
        help_ = "read config values from a TOML file; flags override it"
        parser.add_argument("--config", dest="config_file", metavar="TOML", help=help_)


def config_from_args(args: argparse.Namespace) -> TrainConfig:
    names = {f.name for f in dataclasses.fields(TrainConfig)}
    values: dict = {}
    if getattr(args, "config_file", None):
        values = TrainConfig.from_toml(args.config_file).to_dict()
        values = {k: v for k, v in values.items() if v is not None}
    values.update({k: v for k, v in vars(args).items() if k in names})
    for key in ("dataset", "model"):
        if str(values.get(key, "")).startswith("custom:"):
            raise ConfigError(
                f"--{key} {values[key]}: custom: names are recorded by the Python API for your own "
                f"{key}s (Trainer(model=..., train_data=...)); the command line takes the built-in ones"
            )
    return TrainConfig.from_dict(values)


def visible_gpus() -> int:
    """GPUs this process would see, guessed without importing torch (CUDA_VISIBLE_DEVICES, /dev/nvidia*)."""
    import glob
    import os

    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        return len([v for v in visible.split(",") if v.strip() and v.strip() != "-1"])
    return len(glob.glob("/dev/nvidia[0-9]*"))


def prestart_if_workers(nproc: str, max_restarts: int = 0, nnodes: int = 1) -> None:
    """Start the forkserver now if this command will fork workers (see ddpkit.ranks.prestart); under
    torchrun the processes exist already."""
    import os

    from ..ranks.env import slurm_per_gpu
    from ..ranks.prestart import prestart_workers

    if "RANK" in os.environ or slurm_per_gpu() is not None:  # each srun task is one rank: it forks none
        return
    n = visible_gpus() if str(nproc) == "auto" else int(nproc) if str(nproc).isdecimal() else 1
    if n > 1 or max_restarts > 0 or nnodes > 1:
        prestart_workers()
