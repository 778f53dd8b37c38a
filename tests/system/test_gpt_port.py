"""A nanoGPT-style character GPT written for plain DDP (tests/helpers/gpt_plain.py) and its port onto
``ddpkit.Loop`` (tests/helpers/gpt_ported.py), as a newcomer ports it from the docs: under the real
torchrun at world size 2 both end with the same weights bit for bit and the same best validation loss,
and the port changes few lines (counted as tests/helpers/seed_loops.py's ``changed_lines`` counts)."""

from __future__ import annotations

import difflib
import subprocess
import sys

import numpy as np
import pytest
import torch
from clirun import ROOT, cli_env, read_jsonl

pytestmark = pytest.mark.multiprocess

HELPERS = ROOT / "tests" / "helpers"
ITERS = 60  # the scripts' default; evaluations at iterations 0, 20 and 40


def torchrun(script: str, cwd, tokens) -> dict:
    """``torchrun --standalone --nproc-per-node 2 SCRIPT out out.pt`` in ``cwd``: what rank 0 saved at the end."""
    cwd.mkdir()
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
    env = cli_env(TOKENS=str(tokens), ITERS=str(ITERS))
    proc = subprocess.run(
        [*cmd, str(HELPERS / script), "out", "out.pt"], cwd=cwd, env=env, capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    return torch.load(cwd / "out.pt")


def changed_lines(old: str, new: str) -> int:
    """Lines removed plus lines added between two files, a line whose only change is its indentation
    counted as unchanged (as ``git diff -w``, and seed_loops.changed_lines): a body moved under
    ``with ddpkit.Loop() as loop:`` costs that one line."""
    a, b = ((HELPERS / f).read_text().splitlines() for f in (old, new))
    matcher = difflib.SequenceMatcher(None, [line.strip() for line in a], [line.strip() for line in b], False)
    return sum(a2 - a1 + b2 - b1 for tag, a1, a2, b1, b2 in matcher.get_opcodes() if tag != "equal")


def test_ported_gpt_ends_with_plain_ddps_weights_and_best_val_bitwise(tmp_path):
    tokens = tmp_path / "tokens.bin"
    np.random.default_rng(0).integers(0, 32, 20000).astype(np.uint16).tofile(tokens)
    plain = torchrun("gpt_plain.py", tmp_path / "plain", tokens)
    ported = torchrun("gpt_ported.py", tmp_path / "ported", tokens)

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
