"""The three loops ddpkit started from (tests/helpers/seed_loops.py), ported to ``ddpkit.Loop``: under
the real torchrun at world size 2 each port ends with plain DDP's weights bit for bit, leaves a
snapshot and metrics.jsonl, and changes fewer lines of the single-process loop than plain DDP does;
docs/port.md shows those diffs as the helper computes them."""

from __future__ import annotations

import re

import pytest
import seed_loops
import torch
from clirun import ROOT, read_jsonl, run_python

SEEDS = ["tutorial", "mnist", "appendix"]  # in docs/port.md's order
STEPS = {"mnist": 8, "tutorial": 8, "appendix": 3}  # optimizer steps each seed's run takes at world size 2


def torchrun(name: str, cwd) -> dict:
    """``torchrun --standalone --nproc-per-node 2 seed_loops.py NAME OUT`` in ``cwd``: rank 0's final weights."""
    cwd.mkdir()
    out = cwd / "final.pt"
    helper = ROOT / "tests" / "helpers" / "seed_loops.py"
    cmd = ["-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", helper]
    # torchrun's own thread count for both (OMP_NUM_THREADS=1): a Loop keeps the process's, as the plain run does
    proc = run_python(*cmd, name, out, cwd=cwd)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    return torch.load(out)


@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.parametrize("seed", SEEDS)
def test_port_ends_with_plain_ddps_weights_bitwise(seed, tmp_path):
    plain = torchrun(f"plain_{seed}", tmp_path / "plain")
    ported = torchrun(f"ported_{seed}", tmp_path / "ported")
    assert plain.keys() == ported.keys()
    assert [k for k in plain if not torch.equal(plain[k], ported[k])] == []
    # Equal weights prove something only if training moved them: every float tensor did, but the ConvNet's
    # conv biases, whose gradient the BatchNorm after them cancels (it subtracts the channel's mean).
    start = seed_loops.initial_weights(seed)
    still = {k for k, v in start.items() if v.is_floating_point() and torch.equal(v, plain[k])}
    assert still <= {"layer1.0.bias", "layer2.0.bias"}, still

    run = tmp_path / "ported" / "runs" / "loop"  # where Loop() keeps a run by default, in the cwd
    last = run / "checkpoints" / f"snapshot-{STEPS[seed]:09d}.pt"
    snap = torch.load(last, weights_only=False)["trainer"]
    assert snap["loop"]["step"] == STEPS[seed]
    assert all(torch.equal(snap["state"]["model"][k], ported[k]) for k in ported)  # the run's end, resumable
    assert set(snap["state"]) == {"model", "optimizer"}
    events = [r["event"] for r in read_jsonl(run / "metrics.jsonl")]
    assert events[0] == "start" and events[-1] == "end" and "epoch" in events


@pytest.mark.parametrize("seed", SEEDS)
def test_port_changes_fewer_lines_than_plain_ddp(seed):
    ported = seed_loops.changed_lines(seed)
    # The tutorial's own diff is the one its page shows; for the others, the plain-DDP version's here.
    plain = seed_loops.TUTORIAL_DIFF_LINES if seed == "tutorial" else seed_loops.changed_lines(seed, new="plain")
    assert 0 < ported < plain, (ported, plain)


def test_port_doc_shows_each_ports_diff_as_computed():
    text = (ROOT / "docs" / "port.md").read_text()
    blocks = re.findall(r"```diff\n(.*?)```", text, re.S)
    assert blocks == ["\n".join(seed_loops.diff(seed)[2:]) + "\n" for seed in SEEDS]
    for seed in SEEDS:  # the counts the page states are the helper's
        assert f"{seed_loops.changed_lines(seed)} changed lines" in text
