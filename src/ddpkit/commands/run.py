"""``ddpkit run [--nproc N] [launch flags] SCRIPT [ARGS...]``: your own script on every rank, as torchrun runs it.

    ddpkit run --nproc 2 train.py --lr 0.1     # python train.py --lr 0.1 on 2 ranks (RANK, WORLD_SIZE, ... set)

torch's elastic agent starts the ranks (:func:`ddpkit.ranks.launcher.run_script`), as for ``ddpkit train``,
with what that gives: a failure said once, in one line naming its rank, and its exit status; SIGTERM,
SIGUSR1 and Ctrl-C passed on to the ranks, so that a ``ddpkit.Loop`` in the script saves and exits 143
(138, 130); workers that die with their launcher; ``--nproc auto``, SLURM and Kubeflow's ``PET_*`` variables
read as ``ddpkit train`` reads them. Flags after SCRIPT are the script's own.
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
from pathlib import Path

from ..config import TrainConfig
from ..errors import ConfigError
from ..ranks import env
from .flags import add_config_flags

HELP = "run your own script on every rank, as torchrun does, with ddpkit's one-line errors, stop signals and exits"

LAUNCH_FIELDS = frozenset(f.name for f in dataclasses.fields(TrainConfig) if f.metadata["section"] == "launch")
USAGE = "ddpkit run --nproc 2 train.py ARGS"


def register(parser) -> None:
    others = frozenset(f.name for f in dataclasses.fields(TrainConfig)) - LAUNCH_FIELDS
    add_config_flags(parser, skip=others, config_file=False)
    for action in parser._actions:
        if action.dest == "max_restarts":
            action.help = (
                "times the elastic agent restarts all workers after a failure; a ddpkit.Loop in the script resumes "
                "from its newest snapshot (default: 0)"
            )
        if action.dest == "replicas":
            action.help = (
                "replica groups of one process each, which train on while one is lost and heal it when it is back "
                "(a ddpkit.Loop whose step reads its batches through loop.shares(loader); docs/fault-tolerance.md)"
            )
        if action.dest == "rdzv_id":
            action.help = (
                "job id shared by all nodes (default: derived from the script, its arguments and these flags, so "
                "the same command on every node agrees)"
            )
    parser.add_argument("script", metavar="SCRIPT", help="the Python script every rank runs, as `python SCRIPT ARGS`")
    rest = parser.add_argument(
        "args", nargs=argparse.REMAINDER, metavar="ARGS", help="the script's own arguments: its sys.argv[1:]"
    )
    rest.required = False  # none is fine (argparse before 3.13 lists a REMAINDER among the missing)
    parser.set_defaults(run=run)


def run(args) -> int:
    check_script(args.script)
    launch = {name: value for name, value in vars(args).items() if name in LAUNCH_FIELDS}
    replicas = launch.get("replicas", 1)
    # The launch flags checked as `ddpkit train` checks them; a recipe named, so nothing else is resolved (and a
    # batch the groups divide: the script's own batch is its Loop's to check)
    TrainConfig(recipe="mnist", batch_size=64 * replicas, **launch).filled()
    if replicas > 1 and env.replica_group() is None:  # this command again, once per group, and a lighthouse
        from ..ranks.replicas import start_groups

        argv = args.argv[args.argv.index("run") + 1 :]
        flags = argv[: len(argv) - 1 - len(args.args)]  # the launch flags, before SCRIPT ARGS (argparse's remainder)
        # One process a group (argparse takes the last --nproc given); the script's Loop names its run dir
        unmet = (
            f"--replicas {replicas}: {args.script} ended without a ddpkit.Loop meeting the other groups (at its "
            f"first loop.steps()), so it ran once, as a world of its own: replica groups train a Loop whose steps "
            f"read their batches through loop.shares(loader) (docs/fault-tolerance.md)"
        )
        return start_groups(replicas, lambda g: ["run", *flags, "--nproc", "1", args.script, *args.args], None, unmet)
    if env.replica_group() is not None:  # one group of --replicas: on its cores, and it ends with its launcher
        from ..ranks.replicas import enter_group

        enter_group()
    from ..ranks.launcher import LaunchSpec, run_script

    # A script picks its own device: --nproc N is taken as given, and auto is one rank per visible GPU (1 on CPU)
    cfg = TrainConfig(**launch, device="auto" if launch.get("nproc", "auto") == "auto" else "cpu")
    spec = LaunchSpec.from_config(cfg, resumable=False)
    if spec.nnodes > 1 and not cfg.rdzv_id:  # the same command on every node: the same id, and another script's not
        blob = json.dumps([args.script, args.args, sorted(launch.items())]).encode()
        spec = dataclasses.replace(spec, rdzv_id="ddpkit-run-" + hashlib.sha256(blob).hexdigest()[:16])
    run_script(args.script, args.args, spec)
    return 0


def check_script(script: str) -> None:
    """A script every rank can run, or one line before anything starts: a missing file, a directory, one
    that cannot be read, a syntax error (met on every rank after its import of torch, otherwise)."""
    path = Path(script)
    if not path.exists():
        raise ConfigError(f"no such script: {script}; give the path of the Python script to run ({USAGE})")
    if path.is_dir():
        raise ConfigError(f"{script} is a directory: give the Python script in it to run ({USAGE})")
    try:
        source = path.read_bytes()
    except OSError as exc:
        raise ConfigError(f"cannot read the script {script} ({exc.strerror}): check its permissions") from None
    if path.suffix in (".pyc", ".pyz", ".zip"):  # compiled or zipped: Python's own to read
        return
    try:
        compile(source, script, "exec", dont_inherit=True)
    except SyntaxError as exc:
        raise ConfigError(f"{script}:{exc.lineno}: {exc.msg}: the script does not compile; fix it and rerun") from None
    except ValueError as exc:  # "source code string cannot contain null bytes": not a script
        raise ConfigError(f"{script} is not a Python script ({exc}): give the .py file to run ({USAGE})") from None
