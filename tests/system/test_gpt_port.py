"""A nanoGPT-style character GPT written for plain DDP (tests/helpers/gpt_plain.py) and its port onto
``ddpkit.Loop`` (tests/helpers/gpt_ported.py), as a newcomer ports it from the docs: under the real
torchrun at world size 2 both end with the same weights bit for bit and the same best validation loss; the
port, stopped by SIGTERM and later SIGKILLed, ends bitwise the same too (each rank's prefetched batch is its
own in the snapshot); and the port changes few lines, counted as a plain ``git diff`` counts them."""

from __future__ import annotations

import difflib
import subprocess

import numpy as np
import pytest
import torch
from clirun import ROOT, read_jsonl, run_python
from once import once

pytestmark = pytest.mark.multiprocess

HELPERS = ROOT / "tests" / "helpers"
ITERS = 60  # the scripts' default; evaluations at iterations 0, 20 and 40


def launched(script: str, cwd, tokens, launcher: str = "torchrun", **env) -> subprocess.CompletedProcess:
    """``torchrun --standalone --nproc-per-node 2 SCRIPT out out.pt`` in ``cwd``, or ``ddpkit run --nproc 2``."""
    cwd.mkdir(exist_ok=True)
    cmd = ["-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
    if launcher == "ddpkit run":
        cmd = ["-m", "ddpkit", "run", "--nproc", "2"]
    return run_python(*cmd, HELPERS / script, "out", "out.pt", cwd=cwd, TOKENS=str(tokens), ITERS=str(ITERS), **env)


def torchrun(script: str, cwd, tokens) -> dict:
    """What rank 0 saved at the end of an uninterrupted run."""
    proc = launched(script, cwd, tokens)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    return torch.load(cwd / "out.pt")


def changed_lines(old: str, new: str) -> int:
    """Lines removed plus lines added between two files, as a plain ``git diff`` counts them: a line whose
    indentation changed counts too."""
    a, b = ((HELPERS / f).read_text().splitlines() for f in (old, new))
    matcher = difflib.SequenceMatcher(None, a, b, False)
    return sum(a2 - a1 + b2 - b1 for tag, a1, a2, b1, b2 in matcher.get_opcodes() if tag != "equal")


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """The token file, and the uninterrupted plain and ported runs: computed once per pytest run, for this
    module's tests on any worker (tests/helpers/once.py)."""

    def make(root):
        tokens = root / "tokens.bin"
        np.random.default_rng(0).integers(0, 32, 20000).astype(np.uint16).tofile(tokens)
        torchrun("gpt_plain.py", root / "plain", tokens)
        torchrun("gpt_ported.py", root / "ported", tokens)

    root = once(tmp_path_factory, "gpt-port", make)
    return root, root / "tokens.bin", torch.load(root / "plain" / "out.pt"), torch.load(root / "ported" / "out.pt")


@pytest.mark.slow
def test_ported_gpt_ends_with_plain_ddps_weights_and_best_val_bitwise(runs):
    tmp_path, tokens, plain, ported = runs

    assert plain["model"].keys() == ported["model"].keys()
    assert [k for k in plain["model"] if not torch.equal(plain["model"][k], ported["model"][k])] == []
    assert isinstance(ported["best_val"], float) and plain["best_val"] == ported["best_val"] < 1e9

    # the best checkpoint: the same weights, written by the Loop's best() where the script wrote its own
    plain_best = torch.load(tmp_path / "plain" / "out" / "best.pt")
    loop_best = torch.load(tmp_path / "ported" / "out" / "best.pt")
    assert (loop_best["step"], loop_best["value"]) == (plain_best["iter"], plain_best["best_val"])
    assert all(torch.equal(v, loop_best["weights"]["model"][k]) for k, v in plain_best["model"].items())
    assert not all(torch.equal(v, plain["model"][k]) for k, v in plain_best["model"].items())  # training moved on

    # what the port gains: a snapshot of the end to resume from, and the loss in metrics.jsonl
    run = tmp_path / "ported" / "out"
    snap = torch.load(run / "checkpoints" / f"snapshot-{ITERS:09d}.pt", weights_only=False)["trainer"]
    assert snap["loop"]["step"] == ITERS
    assert all(torch.equal(snap["state"]["model"][k], v) for k, v in ported["model"].items())
    steps = [r for r in read_jsonl(run / "metrics.jsonl") if r["event"] == "step"]
    assert [r["step"] for r in steps] == list(range(10, ITERS + 1, 10)) and all(r["loss"] > 0 for r in steps)


def test_port_changes_at_most_40_lines():
    n = changed_lines("gpt_plain.py", "gpt_ported.py")
    assert 0 < n <= 40, n


@pytest.mark.slow
def test_the_port_stopped_and_killed_resumes_bitwise_with_each_ranks_prefetched_batch(runs, tmp_path):
    """SIGTERM at iteration 13 (saved at the next log interval, step 20), then SIGKILL at iteration 47 (nothing
    saved; the rerun resumes from the step-40 snapshot): the weights end bitwise the uninterrupted run's. Each
    rank's prefetched X, Y come back to that rank (before, rank 1 resumed on rank 0's batch: 4e-3 off). Run by
    ``ddpkit run --nproc 2`` and by torchrun in turn: the snapshots are the Loop's, whichever launched it."""
    _, tokens, _, whole = runs
    term = launched("gpt_ported.py", tmp_path, tokens, "ddpkit run", DIE_AT="13", SIG="SIGTERM")
    assert term.returncode == 143, term.stderr[-3000:]
    assert term.stderr.count("ddpkit: stopped on SIGTERM at step 20") == 1, term.stderr[-3000:]
    kill = launched("gpt_ported.py", tmp_path, tokens, "torchrun", DIE_AT="47", SIG="SIGKILL")
    assert kill.returncode != 0
    done = launched("gpt_ported.py", tmp_path, tokens, "ddpkit run")
    assert done.returncode == 0, done.stderr[-3000:]
    resumed = [r["resumed_at_step"] for r in read_jsonl(tmp_path / "out" / "metrics.jsonl") if r["event"] == "start"]
    assert resumed == [None, 20, 40]
    cut = torch.load(tmp_path / "out.pt")
    assert [k for k in whole["model"] if not torch.equal(whole["model"][k], cut["model"][k])] == []
    assert cut["best_val"] == whole["best_val"]
