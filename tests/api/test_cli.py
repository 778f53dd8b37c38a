"""The real CLI: bad input (one line, non-zero exit, no traceback, nothing written), and its frozen surface."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import numpy as np
import pytest
from clirun import cli_env, run_cli
from formats import write_fashion


def assert_one_line_error(proc, *fragments):
    assert proc.returncode == 2, proc.stderr
    errors = [line for line in proc.stderr.splitlines() if line.startswith("ddpkit: error:")]
    assert len(errors) == 1, proc.stderr
    assert "Traceback" not in proc.stderr + proc.stdout
    for fragment in fragments:
        assert fragment in errors[0], errors[0]


@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.parametrize(
    "args,fragments",
    [
        (["--dataset", "imagenet"], ["unknown dataset 'imagenet'"]),
        (["--model", "vgg"], ["unknown model 'vgg'", "convnet"]),
        (["--batch-size", "255", "--nproc", "2"], ["not divisible by the world size 2", "254 or 256"]),
        (["--epochs", "0"], ["--epochs must be positive"]),
        (["--lr", "-0.1"], ["--lr must be positive"]),
    ],
)
def test_bad_flags(tmp_path, args, fragments):
    proc = run_cli("train", "--run-dir", str(tmp_path / "run"), *args)
    assert_one_line_error(proc, *fragments)
    assert not (tmp_path / "run").exists()


@pytest.mark.slow
@pytest.mark.multiprocess
def test_missing_dataset_offline_names_directory(tmp_path):
    proc = run_cli("train", "--dataset", "cifar10", "--data-dir", str(tmp_path / "d"), "--run-dir", str(tmp_path / "r"))
    assert_one_line_error(proc, f"dataset files missing in {tmp_path}/d/cifar-10-batches-py", "data_batch_1")
    assert not (tmp_path / "d").exists()  # the failed download left no empty folders behind (it did)


@pytest.mark.parametrize(
    "args,line",
    [
        (["train", "--epochz", "1"], "ddpkit train: unrecognized arguments: --epochz 1 (did you mean --epochs?)"),
        (["train", "--epochs", "x"], "ddpkit train: argument --epochs: invalid int value: 'x'"),
        (["train", "--limit", "3"], "ddpkit train: ambiguous option: --limit could match --limit-train, --limit-test"),
        (["doctor", "--jsn"], "ddpkit doctor: unrecognized arguments: --jsn (did you mean --json?)"),
    ],
)
def test_a_bad_flag_is_one_line_with_the_nearest_flag(args, line, capsys):
    """argparse printed its whole usage block (35 lines for train) before the error, and no suggestion."""
    from ddpkit.cli import main

    with pytest.raises(SystemExit) as exit_:
        main(args)
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and err.splitlines() == [f"ddpkit: error: {line}; see `{line.split(':')[0]} --help`"]


@pytest.mark.multiprocess
def test_corrupt_idx_names_the_file(tmp_path):
    folder = write_fashion(tmp_path, np.random.default_rng(0))
    path = folder / "t10k-labels-idx1-ubyte.gz"
    path.write_bytes(path.read_bytes()[:-5])
    proc = run_cli("train", "--dataset", "fashion-mnist", "--data-dir", str(tmp_path), "--run-dir", str(tmp_path / "r"))
    assert_one_line_error(proc, str(path))


@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.parametrize("cli", ["ddpkit", "slow_rank0"])
def test_under_torchrun_an_error_is_reported_once(tmp_path, cli):
    """Regression: with rank 0 the slower one, rank 1 exited quietly first and torchrun stopped
    rank 0 before it printed, so the error was not reported at all."""
    proc = run_cli("--nproc-per-node", "2", "-m", cli, "train", "--model", "vgg", module="torch.distributed.run")
    assert proc.returncode != 0
    assert (proc.stdout + proc.stderr).count("ddpkit: error: unknown model 'vgg'") == 1, proc.stderr


@pytest.mark.multiprocess
def test_help_lists_the_subcommands():
    proc = run_cli("--help")
    assert proc.returncode == 0
    for command in ("train", "eval", "check", "bench", "plot", "show-data", "doctor"):
        assert command in proc.stdout
    assert sys.executable and cli_env()["PYTHONPATH"]


@pytest.mark.parametrize(
    "env,error,printed",
    [
        ({}, "ConfigError", "ddpkit: error: bad\n"),  # no launcher: RANK means nothing
        ({"GROUP_RANK": "0", "LOCAL_RANK": "1", "RANK": "1"}, "ConfigError", "ddpkit: error: rank 1: bad\n"),
        ({"GROUP_RANK": "0", "LOCAL_RANK": "1", "RANK": "1"}, "NonFiniteLoss", ""),  # every rank met it: rank 0 says it
        (
            {"GROUP_RANK": "1", "LOCAL_RANK": "1", "RANK": "3"},
            "ConfigError",
            "",
        ),  # another node: its local rank 0 says it
        ({"GROUP_RANK": "1", "LOCAL_RANK": "0", "RANK": "2"}, "ConfigError", "ddpkit: error: rank 2: bad\n"),
        ({"GROUP_RANK": "0", "LOCAL_RANK": "0", "RANK": "0"}, "ConfigError", "ddpkit: error: bad\n"),
    ],
)
def test_which_rank_prints_an_error_under_torchrun(monkeypatch, capsys, env, error, printed):
    from ddpkit import cli, errors
    from ddpkit.ranks import failures

    monkeypatch.setattr(failures, "PEER_WAIT_S", 0.0)
    for key in ("RANK", "LOCAL_RANK", "GROUP_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "LOCAL_WORLD_SIZE"):
        monkeypatch.delenv(key, raising=False)
    if env:
        monkeypatch.setenv("WORLD_SIZE", "4")
        monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
        monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
        monkeypatch.setenv("MASTER_PORT", "1")
        for key, value in env.items():
            monkeypatch.setenv(key, value)
    monkeypatch.setenv("RANK", env.get("RANK", "1"))  # without a launcher, a stray RANK is ignored

    def fail():
        raise getattr(errors, error)("bad")

    assert cli.run_reporting_errors(fail) == getattr(errors, error).exit_code
    assert capsys.readouterr().err == printed


@pytest.mark.multiprocess
def test_version():
    from ddpkit import __version__

    proc = run_cli("--version")
    assert proc.returncode == 0 and proc.stdout.strip() == f"ddpkit {__version__}"


# ---------------------------------------------------------------------- the CLI surface, frozen
SURFACE = Path(__file__).parents[1] / "golden" / "cli_surface.json"


def cli_surface() -> dict:
    """{subcommand: {flag: "kind default=... choices=... nargs=..."}}, plus the config fields behind
    the train flags (those flags default to unset; the dataclass holds the defaults)."""
    import argparse
    import dataclasses

    from ddpkit.cli import build_parser
    from ddpkit.config import TrainConfig

    def describe(parser: argparse.ArgumentParser) -> dict:
        out = {}
        for action in parser._actions:
            if isinstance(action, (argparse._HelpAction, argparse._SubParsersAction)):
                continue
            default = "unset" if action.default is argparse.SUPPRESS else repr(action.default)
            out["/".join(action.option_strings) or action.dest] = (
                f"{type(action).__name__.strip('_')} default={default} nargs={action.nargs}"
                + (f" choices={list(action.choices)}" if action.choices else "")
            )
        return out

    parser = build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    fields = {
        f.name: f"[{f.metadata['section']}] default={f.default!r}"
        + ("" if f.metadata["cli"] else " (no flag)")
        + (f" choices={list(f.metadata['choices'])}" if f.metadata["choices"] else "")
        for f in dataclasses.fields(TrainConfig)
    }
    return {"ddpkit": describe(parser), **{name: describe(p) for name, p in sub.choices.items()}, "TrainConfig": fields}


def test_the_cli_surface_changes_only_on_purpose():
    """Every subcommand, flag and default, against tests/golden/cli_surface.json. A change to the
    CLI is deliberate: regenerate with DDPKIT_UPDATE_SURFACE=1 and commit the diff with it."""
    import json
    import os

    now = cli_surface()
    if os.environ.get("DDPKIT_UPDATE_SURFACE"):
        SURFACE.write_text(json.dumps(now, indent=1, sort_keys=True) + "\n")
    frozen = json.loads(SURFACE.read_text())
    assert now.keys() == frozen.keys(), "subcommands changed"
    for command in now:
        added, removed = now[command].keys() - frozen[command].keys(), frozen[command].keys() - now[command].keys()
        assert not added and not removed, f"ddpkit {command}: flags added {sorted(added)}, removed {sorted(removed)}"
        for flag, spec in now[command].items():
            assert spec == frozen[command][flag], f"ddpkit {command} {flag}: {frozen[command][flag]} -> {spec}"


@pytest.mark.parametrize(
    "env,said",
    [
        ({"RANK": "0", "WORLD_SIZE": "2"}, "RANK, WORLD_SIZE set without LOCAL_RANK"),  # trained at world 1
        ({"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "2"}, "but MASTER_ADDR and MASTER_PORT are not"),  # 47 lines
        (
            {"RANK": "3", "LOCAL_RANK": "0", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "1"},
            "RANK=3, LOCAL_RANK=0, WORLD_SIZE=2: a rank must be in 0..WORLD_SIZE-1",  # waited until the timeout
        ),
        ({"RANK": "a", "LOCAL_RANK": "0", "WORLD_SIZE": "2"}, "must be integers"),
    ],
)
def test_launcher_variables_set_by_hand_or_half_way_are_one_line(env, said):
    """Regression: RANK and WORLD_SIZE without LOCAL_RANK trained silently at world 1; without MASTER_ADDR a
    47-line traceback; RANK >= WORLD_SIZE waited at the rendezvous for --timeout-s."""
    from ddpkit.errors import ConfigError
    from ddpkit.ranks.env import check_launcher_env

    with pytest.raises(ConfigError, match=re.escape(said)):
        check_launcher_env(env)
    check_launcher_env({})  # nothing set: ddpkit launches
    check_launcher_env({"RANK": "1", "LOCAL_RANK": "1", "WORLD_SIZE": "2", "MASTER_ADDR": "h", "MASTER_PORT": "1"})


@pytest.mark.multiprocess
def test_half_set_launcher_variables_stop_the_cli_before_anything_starts(tmp_path):
    proc = run_cli("train", "--dataset", "mnist", "--run-dir", str(tmp_path / "r"), RANK="0", WORLD_SIZE="2")
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert proc.stderr.strip().splitlines() == [
        "ddpkit: error: RANK, WORLD_SIZE set without LOCAL_RANK: start the job with torchrun (which sets them all), "
        "or unset them to let ddpkit launch"
    ]
    assert not (tmp_path / "r").exists()
