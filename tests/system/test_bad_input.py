"""Bad input and environment faults: one clean line, a non-zero exit, nothing in the run dir lost.

Every case runs the real CLI entry point. Those that fail before launch run it in this
process (``ddpkit.cli.main``: the same code as the ``ddpkit`` command, without paying an
interpreter start per case); faults that need processes, signals or a filesystem of
their own run it as a subprocess. Each case asserts: the exit status, exactly one
``ddpkit: error:`` line (not one per rank) carrying the expected words, no
``Traceback``, and every file that was in the run dir before still there, unchanged.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from clirun import WAIT_S, cli_env, free_port, read_jsonl, run_cli, run_python, start_python, worker_pids

import ddpkit.preflight
from ddpkit.cli import main
from ddpkit.run.checksums import checksums
from ddpkit.run.rundir import run_lock

TINY = [
    "--dataset",
    "mnist",
    "--recipe",
    "mnist",
    "--limit-train",
    "400",
    "--limit-test",
    "200",
    "--batch-size",
    "50",
    "--lr",
    "0.05",
    "--epochs",
    "1",
    "--nproc",
    "1",
    "--device",
    "cpu",
    "--no-progress",
    "--log-every",
    "4",
    "--no-plots",
]  # plots are tested in test_loggers.py; here they would add 1.5 s a run


def files(run_dir: Path) -> dict[str, str]:
    """Every file under ``run_dir`` and a digest of its bytes (the lock file is bookkeeping)."""
    if not run_dir.exists():
        return {}
    return {
        str(p.relative_to(run_dir)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(run_dir.rglob("*"))
        if p.is_file() and p.name != ".lock"
    }


def check_one_line(code: int, out: str, err: str, fragments: list[str], exit_code: int = 2) -> str:
    assert code == exit_code, err[-2000:]
    assert "Traceback" not in out + err, err[-3000:]
    errors = [line for line in err.splitlines() if line.startswith("ddpkit: error:")]
    assert len(errors) == 1, err[-2000:]
    for fragment in fragments:
        assert fragment in errors[0], errors[0]
    return errors[0]


def run_main(capsys, *argv: str) -> tuple[int, str, str]:
    capsys.readouterr()
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


@pytest.fixture(scope="module")
def finished(tmp_path_factory) -> Path:
    """A tiny finished run to copy and damage (trained once per module, in this process)."""
    run_dir = tmp_path_factory.mktemp("finished") / "run"
    assert main(["train", *TINY, "--save-every-steps", "4", "--run-dir", str(run_dir)]) == 0
    return run_dir


def copy_of(finished: Path, tmp_path: Path) -> Path:
    run_dir = tmp_path / "run"
    shutil.copytree(finished, run_dir)
    return run_dir


# ---------------------------------------------------------------------- values and flags
def toml_file(tmp_path, text: str | bytes) -> str:
    path = tmp_path / "run.toml"
    path.write_bytes(text if isinstance(text, bytes) else text.encode())
    return str(path)


VALUE_CASES = {
    "timeout nan": (["--timeout-s", "nan"], ["timeout_s = nan: expected a finite number"]),
    "timeout inf": (["--timeout-s", "inf"], ["timeout_s = inf: expected a finite number"]),
    "timeout huge": (["--timeout-s", "1e30"], ["--timeout-s 1e+30 is out of range: give 3 to 100,000,000 seconds"]),
    "timeout tiny": (["--timeout-s", "0.5"], ["--timeout-s 0.5 is out of range: give 3 to 100,000,000 seconds"]),
    "nproc superscript": (["--nproc", "²"], ["--nproc must be a positive integer or 'auto', got '²'"]),
    "adam beta1": (["--optimizer", "adam", "--momentum", "1.5"], ["--momentum is Adam's beta1", "[0, 1)"]),
    "custom dataset": (["--dataset", "custom:x"], ["--dataset custom:x: custom: names are recorded by the Python"]),
    "custom model": (["--model", "custom:x"], ["--model custom:x: custom: names"]),
    "input too small": (
        ["--dataset", "synthetic", "--synthetic-shape", "3,1,1", "--synthetic-size", "100", "--model", "resnet9"],
        ["model resnet9 fails on a batch of synthetic (input [2, 3, 1, 1])"],
    ),
    "negative clip": (["--clip-grad-norm", "-1"], ["--clip-grad-norm must be >= 0"]),
    "accum not dividing": (["--grad-accum", "3"], ["--grad-accum 3 does not divide the per-rank batch 50"]),
    # issue 33, case 16: the seed was blamed on the dataset function (torch.manual_seed's overflow in its call)
    "seed 2**64": (
        ["--seed", str(2**64)],
        ["--seed 18446744073709551616 is out of range: give a whole number from 0 to 2**63-1"],
    ),
    "seed negative": (["--seed", "-1"], ["--seed -1 is out of range"]),
    "dataset returns an int": (
        ["--dataset", "user_code:returns_int"],
        ["--dataset user_code:returns_int returned an int; return (train, test) datasets"],  # was "a int"
    ),
}

TOML_CASES = {
    "epochs string": ('[train]\nepochs = "two"\n', ["epochs = 'two' (str): expected an integer"]),
    "device int": ("[run]\ndevice = 1\n", ["device = 1 (int): expected a string in quotes"]),
    "lr string": ('[optim]\nlr = "0.1"\n', ["lr = '0.1' (str): expected a number"]),
    "a list": ("[train]\nseed = [1, 2]\n", ["seed = [1, 2] (list): expected an integer"]),
    "fractional epochs": ("[train]\nepochs = 1.5\n", ["epochs = 1.5 (float): expected an integer"]),
    "progress no": ('[run]\nprogress = "no"\n', ["progress = 'no' (str): expected true or false"]),
    "unknown key": ("[train]\nepoch = 3\n", ["unknown config key(s): epoch (did you mean epochs?)"]),
    "not toml": ("epochs = = 3\n", ["is not valid TOML"]),
    "not utf-8": (b"[train]\nseed = 1 # \xff\xfe\n", ["is not UTF-8 text"]),
}


@pytest.mark.parametrize("case", VALUE_CASES)
def test_bad_values_are_one_line_before_anything_is_written(tmp_path, capsys, case):
    args, fragments = VALUE_CASES[case]
    run_dir = tmp_path / "run"
    code, out, err = run_main(capsys, "train", *TINY, *args, "--run-dir", str(run_dir))
    check_one_line(code, out, err, fragments)
    assert not run_dir.exists()


@pytest.mark.multiprocess  # the CLI starts its forkserver early, while it checks
def test_more_processes_than_memory_holds_is_one_line_before_launch(tmp_path, capsys, monkeypatch):
    # The memory is pinned: with the machine's own, 64 processes fit on a large enough host and would start.
    monkeypatch.setattr(ddpkit.preflight, "available_memory_bytes", lambda: 4 * 2**30)
    run_dir = tmp_path / "run"
    code, out, err = run_main(capsys, "train", *TINY, "--nproc", "64", "--batch-size", "128", "--run-dir", str(run_dir))
    check_one_line(code, out, err, ["--nproc 64 needs about", "but 4.0 GiB are available; lower --nproc"])
    assert not run_dir.exists()


@pytest.mark.multiprocess
def test_a_model_ddp_cannot_hold_but_fsdp2_can_is_told_to_shard(tmp_path, capsys, monkeypatch):
    """The memory check counts 4 copies of the weights per rank under DDP (weights, gradients, two moments),
    4 / world plus one gathered copy under FSDP2: where only the second fits, the one line says to shard."""
    from ddpkit.models import build_model

    weights = sum(t.numel() * t.element_size() for t in build_model("convnet", 1, 28, 28, 10).state_dict().values())
    monkeypatch.setattr(ddpkit.preflight, "rss_bytes", lambda: 0)
    # world 4, no staging: DDP 4 x 4 = 16 copies; FSDP2 4 x (1 + 1) = 8
    monkeypatch.setattr(ddpkit.preflight, "available_memory_bytes", lambda: 12 * weights)
    args = [*TINY, "--nproc", "4", "--batch-size", "48", "--no-async-snapshots", "--run-dir", str(tmp_path / "run")]
    code, out, err = run_main(capsys, "train", *args)
    check_one_line(code, out, err, ["--nproc 4 needs about", "pass --strategy fsdp2 (the model's state sharded"])
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("case", TOML_CASES)
def test_bad_config_files_name_the_key_and_the_expected_type(tmp_path, capsys, case):
    text, fragments = TOML_CASES[case]
    code, out, err = run_main(capsys, "train", "--config", toml_file(tmp_path, text), "--run-dir", str(tmp_path / "r"))
    check_one_line(code, out, err, fragments)
    assert not (tmp_path / "r").exists()


def test_nproc_may_be_a_plain_number_in_a_config_file(tmp_path):
    from ddpkit.config import TrainConfig

    assert TrainConfig.from_toml(toml_file(tmp_path, "[launch]\nnproc = 2\n")).nproc == "2"


def test_a_directory_given_as_config_file(tmp_path, capsys):
    code, out, err = run_main(capsys, "train", "--config", str(tmp_path), "--run-dir", str(tmp_path / "r"))
    check_one_line(code, out, err, [f"config file {tmp_path} is a directory"])


def test_an_error_in_your_function_names_your_line_not_a_relative_path_into_a_library(tmp_path, capsys, monkeypatch):
    """Issue 33, case 16: the location was the innermost frame as a path relative to the working directory:
    `../../../usr/lib/python3.11/json/decoder.py:355`, a line of the library, not of the user's code."""
    import inspect

    import user_code

    monkeypatch.chdir(tmp_path)  # the user's module lies outside the working directory
    lines, first = inspect.getsourcelines(user_code.unparsable_settings)
    line = first + next(i for i, text in enumerate(lines) if "json.loads" in text)
    code, out, err = run_main(capsys, "train", *TINY, "--dataset", "user_code:unparsable_settings", "--run-dir", "r")
    said = check_one_line(code, out, err, ["calling unparsable_settings() raised JSONDecodeError: Expecting"])
    assert said.endswith(f"({user_code.__file__}:{line})"), said
    assert not (tmp_path / "r").exists()


# ---------------------------------------------------------------------- launch variables set wrong (issue 33)
SLURM_TASK = dict(
    SLURM_JOB_ID="4242",
    SLURM_STEP_ID="0",
    SLURM_PROCID="0",
    SLURM_LOCALID="0",
    SLURM_NODEID="0",
    SLURM_NTASKS="2",
    SLURM_NNODES="1",
    SLURM_JOB_NODELIST="127.0.0.1",
)  # task 0 of `srun --ntasks 2` on one node: one task per GPU, each task one rank
TORCHRUN_RANK = dict(RANK="0", LOCAL_RANK="0", WORLD_SIZE="2", MASTER_ADDR="127.0.0.1")

ENV_CASES = {
    "SLURM_NODEID": ({**SLURM_TASK, "SLURM_NODEID": "x"}, [], ["SLURM_NODEID='x' is not a node index", "srun sets"]),
    "SLURM_JOB_ID": ({**SLURM_TASK, "SLURM_JOB_ID": "abc"}, [], ["SLURM_JOB_ID='abc' is not a job id"]),
    "SLURM_NTASKS_PER_NODE": (
        {**SLURM_TASK, "SLURM_NTASKS_PER_NODE": "x"},
        [],
        ["SLURM_NTASKS_PER_NODE='x' is not SLURM's tasks per node"],
    ),
    "SLURM_PROCID beyond the tasks": (
        {**SLURM_TASK, "SLURM_PROCID": "2"},
        [],
        ["SLURM_PROCID='2' is not a task index below SLURM_NTASKS=2"],
    ),
    "SLURM_STEP_NODELIST": (  # was blamed on SLURM_JOB_NODELIST, which is fine here
        {**SLURM_TASK, "SLURM_STEP_NODELIST": "a[1-"},
        [],
        ["SLURM_STEP_NODELIST='a[1-' is not a SLURM host list"],
    ),
    "MASTER_PORT under srun": (
        {**SLURM_TASK, "MASTER_PORT": "abc"},
        [],
        ["MASTER_PORT='abc' is not a TCP port (1 to 65535)", "29742"],  # 29500 + job id 4242 % 1000
    ),
    "MASTER_PORT with torchrun's variables": (
        {**TORCHRUN_RANK, "MASTER_PORT": "abc"},
        [],
        ["MASTER_PORT='abc' is not a TCP port (1 to 65535)"],
    ),
    "--nnodes against SLURM_NNODES": (  # was "--nnodes 3 needs --rdzv-endpoint"
        SLURM_TASK,
        ["--nnodes", "3"],
        ["--nnodes 3 but SLURM_NNODES=1: drop --nnodes under srun"],
    ),
    "PET_NPROC_PER_NODE": ({"PET_NPROC_PER_NODE": "x"}, [], ["PET_NPROC_PER_NODE='x' is not a process count"]),
    "PET_NNODES=0": ({"PET_NNODES": "0"}, [], ["PET_NNODES='0' is not a node count"]),  # was a ZeroDivisionError
    "PET_MASTER_PORT": (  # was accepted at one node
        {"PET_NNODES": "1", "PET_MASTER_ADDR": "127.0.0.1", "PET_MASTER_PORT": "notaport"},
        [],
        ["PET_MASTER_PORT='notaport' is not a TCP port (1 to 65535)"],
    ),
    "PET_NODE_RANK beyond PET_NNODES": (  # was accepted, and trained as node 0 of 1
        {"PET_NNODES": "1", "PET_NODE_RANK": "5"},
        [],
        ["PET_NODE_RANK='5' is not a node index below PET_NNODES=1"],
    ),
}


@pytest.mark.parametrize("case", ENV_CASES)
def test_a_launch_variable_set_wrong_is_one_line_naming_it(tmp_path, capsys, monkeypatch, case):
    """Issue 33, case 15: each was a 27-49 line traceback (or, for the last two, accepted)."""
    variables, args, fragments = ENV_CASES[case]
    for name, value in variables.items():
        monkeypatch.setenv(name, value)
    run_dir = tmp_path / "run"
    code, out, err = run_main(capsys, "train", *TINY, *args, "--run-dir", str(run_dir))
    check_one_line(code, out, err, fragments)
    assert not run_dir.exists()


# ---------------------------------------------------------------------- a run dir that cannot be used as it is
def damage_config_utf8(run: Path):
    (run / "config.toml").write_bytes(b"\xff\xfe" + (run / "config.toml").read_bytes())


def damage_config_dir(run: Path):
    (run / "config.toml").unlink()
    (run / "config.toml").mkdir()


def damage_checkpoints_file(run: Path):
    shutil.rmtree(run / "checkpoints")
    (run / "checkpoints").write_text("not a directory")


def damage_metrics_dir(run: Path):
    (run / "metrics.jsonl").unlink()
    (run / "metrics.jsonl").mkdir()


RUN_DIR_CASES = {
    "config.toml not utf-8": (damage_config_utf8, [], ["holds a config.toml ddpkit cannot read", "not UTF-8"]),
    "config.toml a directory": (damage_config_dir, [], ["config.toml is a directory, where ddpkit keeps its"]),
    "checkpoints a file": (damage_checkpoints_file, [], ["checkpoints is a file, where ddpkit keeps its checkpoints"]),
    "metrics.jsonl a directory": (damage_metrics_dir, [], ["metrics.jsonl is a directory"]),
    "resume never": (lambda run: None, ["--resume", "never"], ["--resume never:", "already holds a run"]),
    "another config": (lambda run: None, ["--seed", "7"], ["holds a run with a different config (seed: 0 -> 7)"]),
}


@pytest.mark.parametrize("case", RUN_DIR_CASES)
def test_a_run_dir_that_cannot_be_used_is_refused_and_left_as_it_was(tmp_path, capsys, finished, case):
    damage, args, fragments = RUN_DIR_CASES[case]
    run = copy_of(finished, tmp_path)
    damage(run)
    before = files(run)
    code, out, err = run_main(capsys, "train", *TINY, "--save-every-steps", "4", *args, "--run-dir", str(run))
    check_one_line(code, out, err, fragments)
    assert files(run) == before


def test_a_locked_run_dir_holding_a_failed_attempt_is_refused_without_starting_over(tmp_path, capsys, finished):
    """Issue 33, case 16: "holds an earlier attempt that saved nothing ...; starting over in it" was printed,
    then the lock refused the run: a promise the run did not keep."""
    run = copy_of(finished, tmp_path)
    for name in ("summary.json", "model.pt", "metrics.jsonl"):
        (run / name).unlink()
    shutil.rmtree(run / "checkpoints")  # an attempt that saved nothing, with another config (seed 7 below)
    before = files(run)
    with run_lock(run):
        code, out, err = run_main(capsys, "train", *TINY, "--seed", "7", "--run-dir", str(run))
    check_one_line(code, out, err, [f"{run} is in use by another ddpkit run (pid {os.getpid()} on"])
    assert "starting over" not in out + err, out + err
    assert files(run) == before
    code, out, err = run_main(capsys, "train", *TINY, "--seed", "7", "--run-dir", str(run))  # unlocked: it may
    assert code == 0 and "holds an earlier attempt that saved nothing (config differs in seed); starting over" in out


def test_a_second_run_on_a_locked_run_dir_names_the_holder(tmp_path, capsys, finished):
    run = copy_of(finished, tmp_path)
    (run / "summary.json").unlink()  # unfinished, so the second run would train
    before = files(run)
    with run_lock(run):
        code, out, err = run_main(capsys, "train", *TINY, "--save-every-steps", "4", "--run-dir", str(run))
    check_one_line(code, out, err, [f"{run} is in use by another ddpkit run (pid {os.getpid()} on"])
    assert files(run) == before


EVAL_CASES = {
    "model.pt truncated": (
        lambda run: (run / "model.pt").write_bytes((run / "model.pt").read_bytes()[:300]),
        ["model.pt", "not a loadable weights file, truncated or damaged"],
    ),
    "model.pt of another model": (
        lambda run: torch.save(torch.nn.Linear(3, 2).state_dict(), run / "model.pt"),
        ["model.pt", "does not fit the model: missing"],
    ),
    "model.pt missing": (lambda run: (run / "model.pt").unlink(), ["model.pt not found"]),
}


@pytest.mark.multiprocess
@pytest.mark.parametrize("case", EVAL_CASES)
def test_eval_of_a_damaged_run_is_one_line(tmp_path, capsys, finished, case):
    damage, fragments = EVAL_CASES[case]
    run = copy_of(finished, tmp_path)
    damage(run)
    before = files(run)
    code, out, err = run_main(capsys, "eval", str(run), "--nproc", "2")
    check_one_line(code, out, err, fragments)
    assert files(run) == before


@pytest.mark.multiprocess
def test_eval_on_two_processes_with_missing_data_is_reported_once(tmp_path, capsys, finished):
    """Regression: each rank loaded the data and printed its own error."""
    run = copy_of(finished, tmp_path)
    text = (run / "config.toml").read_text().replace('dataset = "mnist"', 'dataset = "cifar10"')
    (run / "config.toml").write_text(text.replace('data_dir = "data"', f'data_dir = "{tmp_path / "nothing"}"'))
    code, out, err = run_main(capsys, "eval", str(run), "--nproc", "2")
    check_one_line(code, out, err, ["dataset files missing in", "cifar-10-batches-py"])


# ---------------------------------------------------------------------- damage that ddpkit repairs: nothing lost
def test_a_truncated_summary_is_rebuilt_from_the_final_snapshot(tmp_path, capsys, finished):
    run = copy_of(finished, tmp_path)
    summary = json.loads((run / "summary.json").read_text())
    weights = (run / "model.pt").read_bytes()
    (run / "summary.json").write_text((run / "summary.json").read_text()[:40])
    code, out, err = run_main(capsys, "train", *TINY, "--save-every-steps", "4", "--run-dir", str(run))
    assert code == 0, err
    rebuilt = json.loads((run / "summary.json").read_text())
    assert rebuilt["test_accuracy"] == summary["test_accuracy"] and rebuilt["steps"] == summary["steps"]
    restored = torch.load(run / "model.pt", weights_only=True)
    original = torch.load(__import__("io").BytesIO(weights), weights_only=True)
    assert all(torch.equal(restored[k], v) for k, v in original.items())


def flip_a_bit_in_the_weights(snapshot: Path) -> str:
    """Flip one bit inside the data of the snapshot's first model tensor, where the file stores it; its name."""
    name, tensor = next(iter(torch.load(snapshot, weights_only=True)["trainer"]["model"].items()))
    data, raw = bytearray(snapshot.read_bytes()), tensor.numpy().tobytes()
    assert data.count(raw) == 1
    data[data.find(raw) + len(raw) // 2] ^= 0x04
    snapshot.write_bytes(bytes(data))
    return name


@pytest.mark.parametrize("damage", ["garbage", "missing keys", "another model", "bit flip"])
def test_a_bad_newest_snapshot_is_moved_aside_and_the_one_before_it_used(tmp_path, capsys, finished, damage):
    """Regression: a garbage snapshot-999999999.pt counted toward --keep-snapshots (so with 1 each real
    snapshot was deleted as soon as written), and a valid zip with the wrong contents gave a
    traceback on every rank instead of the fallback a truncated file gets. Issue 33: one bit flipped in
    a weight loaded silently."""
    run = copy_of(finished, tmp_path)
    (run / "summary.json").unlink()
    (run / "model.pt").unlink()
    ckpt = run / "checkpoints"
    sorted(ckpt.glob("snapshot-*.pt"))[-1].unlink()  # resume mid-run, so this run saves (and prunes) again
    real = sorted(ckpt.glob("snapshot-*.pt"))[-1]
    (ckpt / "newest").write_text(real.stem.split("-")[1])  # as a run killed after that snapshot leaves it
    bad = ckpt / "snapshot-999999999.pt"
    if damage == "garbage":
        bad.write_bytes(b"not a snapshot at all")
    elif damage == "bit flip":
        bad.write_bytes(real.read_bytes())
        flip_a_bit_in_the_weights(bad)
    else:
        snap = torch.load(real, weights_only=True)
        if damage == "missing keys":
            del snap["trainer"]["optimizer"], snap["trainer"]["position"]
        else:
            snap["trainer"]["model"] = torch.nn.Linear(3, 2).state_dict()
        del snap["checksums"]  # whole but wrong contents: checksums of what it holds, so it reads as intact
        torch.save({**snap, "checksums": checksums(snap)}, bad)
    code, out, err = run_main(
        capsys, "train", *TINY, "--save-every-steps", "4", "--keep-snapshots", "1", "--run-dir", str(run)
    )
    assert code == 0, err
    warnings = [line for line in out.splitlines() + err.splitlines() if "snapshot" in line and "warning" in line]
    assert len(warnings) == 1 and "snapshot-999999999.pt" in warnings[0] and "moved to" in warnings[0]
    assert (ckpt / "corrupt" / "snapshot-999999999.pt").exists() and not bad.exists()
    starts = [r for r in read_jsonl(run / "metrics.jsonl") if r["event"] == "start"]
    assert starts[-1]["resumed_at_step"] == int(real.stem.split("-")[1])
    # keep 1 kept the real snapshot this run wrote last, not deleted it for the stray file's sake
    assert [p.name for p in ckpt.glob("snapshot-*.pt")] == ["snapshot-000000008.pt"]


@pytest.mark.slow
@pytest.mark.parametrize("nproc", ["1", pytest.param("2", marks=pytest.mark.multiprocess)])
def test_a_damaged_only_snapshot_is_one_line_and_nothing_changes(tmp_path, capsys, finished, nproc):
    """Issue 33: with no intact snapshot left, resuming is refused in one line (once, at any world size),
    every file left as it was, rather than a damaged snapshot loaded."""
    run = copy_of(finished, tmp_path)
    (run / "summary.json").unlink()
    (run / "model.pt").unlink()
    *older, only = sorted((run / "checkpoints").glob("snapshot-*.pt"))
    for path in older:
        path.unlink()
    name = flip_a_bit_in_the_weights(only)
    before = files(run)
    code, out, err = run_main(
        capsys, "train", *TINY, "--nproc", nproc, "--save-every-steps", "4", "--run-dir", str(run)
    )
    check_one_line(
        code,
        out,
        err,
        [f"{only.name} is damaged (checksum of trainer.model.{name} differs)", "Restore an intact copy"],
    )
    assert files(run) == before


# ---------------------------------------------------------------------- storage faults, on real filesystems
def in_namespace(script: str, timeout: float = 240) -> subprocess.CompletedProcess:
    """Run a bash script in a private mount namespace (its tmpfs mounts are invisible outside)."""
    proc = subprocess.run(
        ["unshare", "-m", "bash", "-c", script], env=cli_env(), capture_output=True, text=True, timeout=timeout
    )
    if "unshare failed" in proc.stderr or "Operation not permitted" in proc.stderr:
        pytest.skip("mount namespaces are not permitted here")
    return proc


PY = f"{sys.executable} -m ddpkit train {' '.join(TINY)}"


@pytest.mark.slow
@pytest.mark.multiprocess
def test_a_read_only_run_dir_is_one_line_and_untouched(tmp_path, finished):
    mnt = tmp_path / "ro"
    mnt.mkdir()
    proc = in_namespace(f"""
        set -e
        mount -t tmpfs tmpfs {mnt} && cp -r {finished} {mnt}/run && rm {mnt}/run/summary.json
        mount -o remount,ro {mnt}
        before=$(cd {mnt}/run && find . -type f | sort | xargs sha256sum)
        set +e; {PY} --save-every-steps 4 --run-dir {mnt}/run 2>{mnt}/../err.txt; echo "EXIT=$?"; set -e
        after=$(cd {mnt}/run && find . -type f | sort | xargs sha256sum)
        [ "$before" = "$after" ] && echo SAME
        cat {mnt}/../err.txt
    """)
    assert "EXIT=2" in proc.stdout and "SAME" in proc.stdout, proc.stdout + proc.stderr
    check_one_line(2, "", proc.stdout.split("SAME", 1)[1], ["the filesystem is read-only"])


@pytest.mark.slow
@pytest.mark.multiprocess
def test_a_full_disk_during_a_snapshot_is_one_line_leaving_no_partial_file(tmp_path):
    """Regression: an ENOSPC traceback, and a partial .tmp left holding the space."""
    mnt = tmp_path / "small"
    mnt.mkdir()
    proc = in_namespace(f"""
        mount -t tmpfs -o size=700k tmpfs {mnt}
        {PY} --epochs 3 --save-every-steps 2 --keep-snapshots 5 --run-dir {mnt}/run; echo "EXIT=$?"
        ls -a {mnt}/run/checkpoints
        for f in {mnt}/run/checkpoints/snapshot-*.pt; do
          {sys.executable} -c "import torch,sys; torch.load(sys.argv[1], weights_only=True); print('LOADS', sys.argv[1])" $f
        done
    """)
    out, err = proc.stdout, proc.stderr
    assert "EXIT=2" in out, out + err
    said = check_one_line(2, "", err, ["no space left writing", "are free there", "The previous files are intact"])
    # Issue 33, case 16: "it needs 0.0 MiB, 0.0 MiB are free": sizes with their digits, whatever their unit
    sizes = re.search(r"it needs ([\d.]+) (bytes|KiB|MiB), ([\d.]+) (bytes?|KiB|MiB) (is|are) free there", said)
    assert sizes and float(sizes[1]) > 0 and "0.0 " not in said, said
    assert ".tmp" not in out
    names = [line for line in out.splitlines() if line.startswith("snapshot-")]
    assert names and out.count("LOADS") == len(names)  # every snapshot left is whole


def test_a_small_write_on_a_full_disk_says_its_size_in_digits(tmp_path, monkeypatch):
    """Issue 33, case 16: a 3 KB file on a nearly full disk was "it needs 0.0 MiB, 0.0 MiB are free there"."""
    import errno

    from ddpkit.files import describe_io_error, size_text

    monkeypatch.setattr(shutil, "disk_usage", lambda path: shutil._ntuple_diskusage(2**30, 2**30 - 700, 700))
    said = describe_io_error(OSError(errno.ENOSPC, "No space left on device"), tmp_path / "x.pt", size=3000)
    assert "(it needs 2.93 KiB, 700 bytes are free there)" in said, said
    assert [size_text(n) for n in (1, 1536, 51234567, 3 * 2**40)] == ["1 byte", "1.5 KiB", "48.9 MiB", "3 TiB"]


# ---------------------------------------------------------------------- faults that need processes
@pytest.fixture
def image_tree(tmp_path) -> Path:
    from PIL import Image

    root = tmp_path / "images"
    for split, n in (("train", 6), ("val", 2)):
        for cls in ("a", "b"):
            (root / split / cls).mkdir(parents=True)
            for i in range(n):
                Image.new("RGB", (8, 8), (i * 40, 0, 0)).save(root / split / cls / f"{i}.png")
    return root


@pytest.mark.multiprocess
def test_an_unreadable_image_is_named_once_before_launch(tmp_path, capsys, image_tree):
    """Regression: a 45-75 line traceback on each rank, and with --max-restarts 2, three attempts. An image
    folder that fits in memory is decoded before launch, so the bad file is found there."""
    bad = image_tree / "train" / "b" / "3.png"
    bad.write_bytes(b"\x89PNG but not really")
    code, out, err = run_main(
        capsys,
        "train",
        "--dataset",
        f"imagefolder:{image_tree}",
        "--image-size",
        "8",
        "--model",
        "mlp",
        "--batch-size",
        "4",
        "--nproc",
        "2",
        "--device",
        "cpu",
        "--max-restarts",
        "2",
        "--run-dir",
        str(tmp_path / "run"),
    )
    check_one_line(code, out, err, [f"{bad}: not a readable image"])
    assert not (tmp_path / "run").exists()


@pytest.mark.slow
@pytest.mark.multiprocess
def test_an_unreadable_image_met_by_a_worker_is_named_once_and_never_restarted_into(tmp_path, image_tree):
    """The same on the DataLoader path, where a worker meets it: one line, and no restart into it."""
    bad = image_tree / "train" / "b" / "3.png"
    bad.write_bytes(b"\x89PNG but not really")
    run = tmp_path / "run"
    proc = run_cli(
        "train",
        "--dataset",
        f"imagefolder:{image_tree}",
        "--image-size",
        "8",
        "--model",
        "mlp",
        "--batch-size",
        "4",
        "--epochs",
        "1",
        "--nproc",
        "2",
        "--device",
        "cpu",
        "--no-progress",
        "--num-workers",
        "0",
        "--max-restarts",
        "2",
        "--data-path",
        "loader",
        "--run-dir",
        str(run),
    )
    line = check_one_line(proc.returncode, proc.stdout, proc.stderr, [f"{bad}: not a readable image"])
    assert "rank" in line
    starts = [r for r in read_jsonl(run / "metrics.jsonl") if r["event"] == "start"]
    assert len(starts) <= 2  # at most the one restart that learns it cannot help


def test_imagefolder_honours_the_limits(tmp_path, capsys, image_tree):
    """Regression: --limit-train/--limit-test were recorded in config.toml but not applied."""
    run = tmp_path / "run"
    code, out, err = run_main(
        capsys,
        "train",
        "--dataset",
        f"imagefolder:{image_tree}",
        "--image-size",
        "8",
        "--model",
        "mlp",
        "--batch-size",
        "2",
        "--epochs",
        "1",
        "--nproc",
        "1",
        "--device",
        "cpu",
        "--no-progress",
        "--num-workers",
        "0",
        "--limit-train",
        "4",
        "--limit-test",
        "2",
        "--run-dir",
        str(run),
    )
    assert code == 0, err
    summary = json.loads((run / "summary.json").read_text())
    assert summary["steps"] == 2 and summary["test_samples"] == 2


def test_a_streamed_dataset_on_the_device_path_is_refused_once_before_launch(tmp_path):
    """Regression: refused in every worker, so printed once per rank."""
    from user_code import NoisyData, RegressionMLP, mse

    from ddpkit import TrainConfig, Trainer
    from ddpkit.errors import ConfigError

    trainer = Trainer(
        TrainConfig(nproc="2", device="cpu", batch_size=8, data_path="device", run_dir=str(tmp_path / "r")),
        model=RegressionMLP(),
        train_data=NoisyData(32),
        test_data=NoisyData(8),
        loss_fn=mse,
    )
    with pytest.raises(ConfigError, match="--data-path device needs a dataset held in memory.*differ between reads"):
        trainer.fit()
    assert not (tmp_path / "r").exists()


def test_an_empty_test_set_is_an_error_not_accuracy_zero(tmp_path, capsys, image_tree):
    for png in (image_tree / "val").rglob("*.png"):
        png.unlink()
    code, out, err = run_main(
        capsys,
        "train",
        "--dataset",
        f"imagefolder:{image_tree}",
        "--image-size",
        "8",
        "--nproc",
        "1",
        "--device",
        "cpu",
        "--run-dir",
        str(tmp_path / "r"),
    )
    check_one_line(code, out, err, [f"imagefolder:{image_tree}"])


@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.parametrize(
    "task,fragments",
    [
        (
            "0",
            ["only 1 of the 2 ranks (WORLD_SIZE=2) reached the rendezvous at 127.0.0.1:", "the other 1 never arrived"],
        ),
        ("1", ["rank 1: could not reach the rendezvous at 127.0.0.1:", "rank 0, which hosts it, has not started"]),
    ],
    ids=["the host waits", "a peer finds no host"],
)
def test_a_rank_that_never_arrives_is_one_line_naming_the_rendezvous(tmp_path, task, fragments):
    """Issue 33, case 15: a 30-line DistStoreError (the host, "1/2 clients joined") or DistNetworkError (a
    peer) traceback. One srun task of two (SLURM one task per GPU) starts; the other never does."""
    port = free_port()
    variables = {**SLURM_TASK, "SLURM_PROCID": task, "SLURM_LOCALID": task, "MASTER_PORT": str(port)}
    proc = run_cli("train", *TINY, "--timeout-s", "3", "--run-dir", str(tmp_path / "r"), **variables)
    check_one_line(proc.returncode, proc.stdout, proc.stderr, [*fragments, f":{port}"], exit_code=4)


@pytest.mark.slow
@pytest.mark.multiprocess
def test_two_nodes_without_a_peer_name_the_endpoint_and_the_id(tmp_path):
    endpoint = f"127.0.0.1:{free_port()}"  # a fixed port may be taken on a shared machine
    proc = run_cli(
        "train",
        *TINY,
        "--nnodes",
        "2",
        "--rdzv-endpoint",
        endpoint,
        "--rdzv-id",
        "lonely",
        "--timeout-s",
        "3",
        "--run-dir",
        str(tmp_path / "r"),
    )
    check_one_line(
        proc.returncode,
        proc.stdout,
        proc.stderr,
        [f"did not join within --timeout-s 3 s at --rdzv-endpoint {endpoint} (--rdzv-id lonely)"],
        exit_code=4,
    )


@pytest.mark.slow
@pytest.mark.multiprocess
def test_ctrl_c_saves_a_snapshot_and_exits_130(tmp_path):
    """Regression: Ctrl-C took no snapshot, printed a KeyboardInterrupt traceback, and promised a snapshot."""
    run = tmp_path / "run"
    args = [
        sys.executable,
        "-m",
        "ddpkit",
        "train",
        "--dataset",
        "mnist",
        "--recipe",
        "mnist",
        "--limit-train",
        "4000",
        "--batch-size",
        "100",
        "--lr",
        "0.05",
        "--epochs",
        "3",
        "--nproc",
        "2",
        "--device",
        "cpu",
        "--no-progress",
        "--log-every",
        "2",
        "--run-dir",
        str(run),
    ]
    proc = start_python(*args[1:])
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            steps = (
                [r for r in read_jsonl(run / "metrics.jsonl") if r["event"] == "step"]
                if (run / "metrics.jsonl").exists()
                else []
            )
            if steps and steps[-1]["step"] >= 4:
                break
            time.sleep(0.05)
        os.killpg(proc.pid, signal.SIGINT)  # what a terminal's Ctrl-C does: the whole process group
        out, err = proc.communicate(timeout=WAIT_S)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == 130, err[-2000:]
    assert "Traceback" not in out + err and "KeyboardInterrupt" not in err, err[-3000:]
    stopped = [r for r in read_jsonl(run / "metrics.jsonl") if r["event"] == "stopped"]
    assert stopped and stopped[0]["signal"] == "SIGINT"
    assert (run / "checkpoints" / f"snapshot-{stopped[0]['step']:09d}.pt").exists()
    assert "stopped on SIGINT" in err and "error" not in err, err  # issue 33: a clean stop is no error


@pytest.mark.slow
@pytest.mark.multiprocess
def test_a_killed_launcher_takes_its_workers_with_it_and_frees_the_run_dir(tmp_path, capsys):
    """Regression: workers outlived a SIGKILLed launcher by 1-3 s and once wrote one more snapshot."""
    run = tmp_path / "run"
    args = [
        sys.executable,
        "-m",
        "ddpkit",
        "train",
        "--dataset",
        "mnist",
        "--recipe",
        "mnist",
        "--limit-train",
        "4000",
        "--batch-size",
        "100",
        "--lr",
        "0.05",
        "--epochs",
        "3",
        "--nproc",
        "2",
        "--device",
        "cpu",
        "--no-progress",
        "--log-every",
        "1",
        "--save-every-steps",
        "2",
        "--run-dir",
        str(run),
    ]
    proc = start_python(*args[1:], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 120
    while not list((run / "checkpoints").glob("snapshot-*.pt")) and time.monotonic() < deadline:
        time.sleep(0.05)
    workers = worker_pids(proc.pid)
    assert len(workers) == 2, workers
    proc.kill()
    proc.wait()
    time.sleep(0.5)
    alive = [
        pid
        for pid in workers
        if Path(f"/proc/{pid}").exists()
        and "Z" not in Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    ]
    assert not alive, f"workers outlived their launcher: {alive}"
    snapshots = sorted(p.name for p in (run / "checkpoints").glob("snapshot-*.pt"))
    time.sleep(1.0)
    assert sorted(p.name for p in (run / "checkpoints").glob("snapshot-*.pt")) == snapshots  # nobody writes on
    with run_lock(run):  # the kernel released the lock with its holder
        pass


@pytest.mark.slow
def test_any_unicode_run_dir_trains_resumes_and_evaluates(tmp_path, capsys):
    """Regression: an emoji in --run-dir was written to config.toml as a surrogate pair TOML rejects; the
    rerun the stop message recommends then refused, and `ddpkit eval` could not read the run."""
    run = tmp_path / 'runs 😀 "q" \\ é'
    assert main(["train", *TINY, "--run-dir", str(run)]) == 0
    code, out, err = run_main(capsys, "train", *TINY, "--run-dir", str(run), "--reuse-finished")
    assert code == 0 and "already holds this finished run" in out, err
    code, out, err = run_main(capsys, "eval", str(run), "--nproc", "1")
    assert code == 0, err
    assert json.loads(out.strip().splitlines()[-1])["test_samples"] == 200


# ---------------------------------------------------------------------- your code's mistakes, before launch
# Each of these used to surface only inside the workers at world 2: printed once per rank, and again on
# every restart (issue: real models at world >= 2, case 6). Now each is one line before any process starts.
class RaisesAt37(torch.utils.data.Dataset):
    def __init__(self, data):
        self.data = data

    def __len__(self):
        return len(self.data)

    def __getitem__(self, i):
        if i == 37:
            raise ValueError("corrupt record 37")
        return self.data[i]


def _blobs(n: int, classes: int = 2) -> torch.utils.data.TensorDataset:
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(n, 2, generator=gen)
    return torch.utils.data.TensorDataset(x, torch.arange(n) % classes)


def _detached(model, batch):
    return torch.tensor(torch.nn.functional.cross_entropy(model(batch[0]), batch[1]).item())


def _per_sample_in_training(model, batch):
    losses = torch.nn.functional.cross_entropy(model(batch[0]), batch[1], reduction="none")
    return losses if model.training else losses.mean()  # the preflight batch runs in eval mode


def _factory_raises(model):
    raise RuntimeError("no such optimizer setting")


PYTHON_CASES = {
    "detached loss": (dict(loss_fn=_detached), "TaskError", "does not depend on the model's parameters"),
    "non-scalar loss in training mode": (
        dict(loss_fn=_per_sample_in_training),
        "TaskError",
        "in training mode the loss is a tensor of shape [2]",
    ),
    "metric part None": (
        dict(metrics={"m": lambda out, b: (None, len(b[1]))}),
        "TaskError",
        "metric 'm' returned a sum that is None",
    ),
    "metric part numpy": (
        dict(metrics={"m": lambda out, b: (np.array(1.0), len(b[1]))}),
        "TaskError",
        "a numpy.ndarray of shape []",
    ),
    "metric part meta": (
        dict(metrics={"m": lambda out, b: (torch.zeros((), device="meta"), 1)}),
        "TaskError",
        "on the meta device",
    ),
    "getitem raises at one index": (
        dict(train_data=RaisesAt37(_blobs(64))),
        "DataError",
        "train dataset RaisesAt37: reading sample 37 of 64 raised ValueError: corrupt record 37 (",
    ),
    "labels beyond the outputs, in the test set only": (
        dict(test_data=_blobs(16, classes=5)),
        "TaskError",
        "the model outputs 2 classes but the labels go up to 4",
    ),
    "optimizer factory raises": (
        dict(optimizer=_factory_raises),
        "ConfigError",
        "the optimizer factory _factory_raises raised RuntimeError: no such optimizer setting (",
    ),
    "optimizer factory returns None": (
        dict(optimizer=lambda model: None),
        "ConfigError",
        "returned NoneType; it must return a torch.optim.Optimizer",
    ),
    "optimizer on another model": (
        dict(optimizer=torch.optim.SGD(torch.nn.Linear(2, 2).parameters(), lr=0.1)),
        "ConfigError",
        "holds parameters that are not the model's",
    ),
    # issue 33, case 15: at world 2 "the loss does not depend on the model's parameters", at 1 the optimizer's traceback
    "no trainable parameters": (
        dict(model=torch.nn.Linear(2, 2).requires_grad_(False)),
        "ConfigError",
        "the model has no trainable parameters (all 2 are frozen: requires_grad=False)",
    ),
}


@pytest.mark.parametrize("case", PYTHON_CASES)
def test_a_mistake_in_your_code_is_one_line_before_launch_at_world_2(tmp_path, capsys, case):
    from ddpkit import TrainConfig, Trainer, errors
    from ddpkit.cli import run_reporting_errors

    given, error_class, fragment = PYTHON_CASES[case]
    run_dir = tmp_path / "run"
    kw = {"model": torch.nn.Linear(2, 2), "train_data": _blobs(64), "test_data": _blobs(16), **given}
    cfg = TrainConfig(nproc="2", device="cpu", epochs=1, batch_size=16, progress=False, run_dir=str(run_dir))
    with pytest.raises(getattr(errors, error_class)) as raised:  # a public class, from Python
        Trainer(cfg, **kw).fit()
    assert fragment in str(raised.value)
    capsys.readouterr()
    code = run_reporting_errors(lambda: Trainer(cfg, **kw).fit() and 0)  # as a script's `ddpkit: error:`
    out, err = capsys.readouterr()
    check_one_line(code, out, err, [fragment])
    assert not run_dir.exists()  # found before launch: nothing started, nothing written


BRANCH_BY_BATCH = """
import sys
from user_code import DataDependentBranch, flagged_first
from ddpkit import TrainConfig, Trainer
from ddpkit.ranks.failures import exit_status
from ddpkit.errors import ConfigError

if __name__ == "__main__":
    cfg = TrainConfig(nproc="2", device="cpu", epochs=1, batch_size=16, progress=False, run_dir="run", timeout_s=30)
    try:
        Trainer(cfg, model=DataDependentBranch(), train_data=flagged_first(64), test_data=flagged_first(16)).fit()
    except ConfigError as exc:
        print("CAUGHT", type(exc).__name__, flush=True)
        sys.exit(exit_status(exc))
"""


@pytest.mark.slow
@pytest.mark.multiprocess
def test_parameters_unused_by_some_batches_name_ddpkits_flag_once(tmp_path):
    """Issue 33, case 15: DDP's 40-line error told the user to pass torch's keyword `find_unused_parameters=True`
    to DistributedDataParallel, which ddpkit builds; ddpkit's own flag went unnamed."""
    (tmp_path / "train.py").write_text(BRANCH_BY_BATCH)
    proc = run_python("train.py", cwd=tmp_path)
    said = check_one_line(
        proc.returncode,
        "",
        proc.stderr,
        ["parameters got no gradient in a training step (parameters 4, 5 in model.parameters() order)"],
    )
    assert "--find-unused-parameters (find_unused_parameters=True in TrainConfig or Loop.wrap)" in said
    assert "CAUGHT ConfigError" in proc.stdout  # a public class, from Python


SCRIPT_WITHOUT_GUARD = """
import torch
from ddpkit import TrainConfig, Trainer
from ddpkit.cli import run_reporting_errors

x = torch.randn(64, 2)
data = torch.utils.data.TensorDataset(x, (x[:, 0] > 0).long())
cfg = TrainConfig(nproc="2", device="cpu", epochs=1, batch_size=16, progress=False, run_dir="run")
run_reporting_errors(lambda: Trainer(cfg, model=torch.nn.Linear(2, 2), train_data=data, test_data=data).fit())
"""


@pytest.mark.slow
@pytest.mark.multiprocess
def test_a_script_without_the_main_guard_is_one_line_naming_its_line_before_launch(tmp_path):
    """Regression: each spawned worker imported the script, printed the reason once per rank, and the
    script's own exception said only "rank 0 exit code 2"."""
    (tmp_path / "train.py").write_text(SCRIPT_WITHOUT_GUARD)
    proc = run_python("train.py", cwd=tmp_path)
    said = [line for line in proc.stderr.splitlines() if line.startswith("ddpkit: error:")]
    assert len(said) == 1 and "train.py:9 starts the workers when the script is imported" in said[0], proc.stderr
    assert 'if __name__ == "__main__":' in said[0] and "Traceback" not in proc.stderr
    assert not (tmp_path / "run").exists()
