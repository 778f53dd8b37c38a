"""``ddpkit run --replicas 2``: a ``ddpkit.Loop`` script (tests/helpers/loop_replicas.py) as two replica groups of one
process each under torchft, through the CLI as a user runs it, in float64 on the 2-core machine.

The script reads each step's batches through ``loop.shares(loader)``; under plain ``ddpkit run --nproc 2`` the same
script is a DDP run of 2 ranks, the reference. With 2 groups the replicas' sum is bitwise DDP's: a group alone adds
both shares' gradients and halves the sum, DDP halves each and adds them, and halving is exact in binary floating
point. So the bound below is zero in effect, and a share dropped or used twice would move the weights by ~1e-2.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from clirun import ROOT, read_jsonl, run_cli
from once import once

pytest.importorskip("torchft")  # ddpkit[ft], in the test extras
pytestmark = [pytest.mark.multiprocess, pytest.mark.slow]  # every test here starts replica groups

SCRIPT = str(ROOT / "tests" / "helpers" / "loop_replicas.py")
STEPS, PER_EPOCH = 64, 16  # 512 samples, a global batch of 32: 4 epochs


def final(run_dir: Path) -> dict:
    return torch.load(run_dir / "final.pt", map_location="cpu", weights_only=True)


@pytest.fixture(scope="module")
def ddp(tmp_path_factory) -> dict:
    """The same script under plain DDP, 2 ranks (one shares() batch a step), once per pytest run."""

    def make(where: Path) -> None:
        done = run_cli("run", "--nproc", "2", SCRIPT, str(where / "run"), str(STEPS), cwd=where)
        assert done.returncode == 0, done.stderr

    return final(once(tmp_path_factory, "loop-replicas-ddp", make) / "run")


def test_a_loop_group_killed_mid_step_twice_is_healed_while_the_other_trains_on_and_no_sample_is_lost(tmp_path, ddp):
    # group 1 SIGKILLs itself in its step 11's forward; its agent restarts it (no snapshot yet: from step 0), and it
    # heals from group 0 at the step group 0 is at then; that attempt kills itself 5 steps later, and the next heals
    # too. Each share's forward waits 0.1 s until both heals, so group 0 is still training when group 1 is back
    run_dir = tmp_path / "run"
    done = run_cli("run", "--replicas", "2", "--max-restarts", "2", SCRIPT, str(run_dir), str(STEPS), "11,5", "0.1")
    assert done.returncode == 0, done.stderr
    assert done.stderr.count("replica group 1: rank 0 was killed (SIGKILL)") == 2, done.stderr
    groups = [run_dir, Path(f"{run_dir}-group-1")]
    a, b = (read_jsonl(g / "metrics.jsonl") for g in groups)
    # group 0 never stopped: one attempt, and each killed step computed again with group 1's share
    assert [r["event"] for r in a].count("start") == 1
    said = [(r["change"], r["step"]) for r in a if r["event"] == "replicas"]
    assert said[:2] == [("redone", 11), ("groups", 11)], said
    redone = [step for change, step in said if change == "redone"]
    back = [r["step"] for r in a if r["event"] == "replicas" and r.get("back") == "1"]
    healed = [r["step"] for r in b if r["event"] == "replicas" and r["change"] == "healed"]
    assert [r["restart_count"] for r in b if r["event"] == "start"] == [0, 1, 2], b
    assert len(back) == len(healed) == len(redone) == 2 and healed == back and healed[1] < STEPS, (back, healed)
    assert redone[1] == healed[0] + 5, (redone, healed)  # the second attempt's 5th step after its heal
    # Group 1's records (every 8th step) of each step it committed, none twice: before its first loss, between its
    # first heal and its second loss, after its second heal. (Regression: its restart dropped those after its own
    # snapshot, step 0 here, as steps to run again, and then healed past them: a hole from step 0 to the heal)
    committed = [r["step"] for r in b if r["event"] == "step"]
    kills = (11, redone[1])
    between = [s for s in range(8, STEPS + 1, 8) if s <= kills[0] or healed[0] < s <= kills[1] or s > healed[1]]
    assert committed == between, (committed, healed, kills)
    assert "[replicas] change=redone step=11" in done.stdout  # group 0's console; group 1's records are quiet
    # The groups end bitwise equal, and equal to the DDP run (see the module docstring)
    first, second = final(groups[0]), final(groups[1])
    assert [k for k in first if not torch.equal(first[k], second[k])] == []
    off = max((first[k] - ddp[k]).abs().max().item() for k in ddp)
    assert off < 1e-12, off
    # Every step's samples (each group's log of what it read through shares(), together), every sample of every
    # epoch at one step only, and every one of them used
    steps: dict[int, set] = {}
    for g in groups:
        for line in (g / "samples.jsonl").read_text().splitlines():
            r = json.loads(line)
            steps.setdefault(r["step"], set()).update(r["samples"])
    assert sorted(steps) == list(range(STEPS))
    for epoch in range(STEPS // PER_EPOCH):
        used = [i for s in range(epoch * PER_EPOCH, (epoch + 1) * PER_EPOCH) for i in steps[s]]
        assert len(used) == len(set(used)) == 512, epoch


EPOCHS = """\
import torch
import ddpkit

with ddpkit.Loop("run", device="cpu") as loop:
    model = loop.wrap(torch.nn.Linear(2, 1))
    loader = loop.data(torch.utils.data.TensorDataset(torch.randn(8, 2)), batch_size=4)
    loop.resume(model=model)
    for epoch in loop.epochs(1):
        pass
"""


NO_SHARES = EPOCHS.replace(
    "    for epoch in loop.epochs(1):\n        pass",
    "    for step in loop.steps(2):\n        for (x,) in loader:\n            pass",
)

BREAK = NO_SHARES.replace("for (x,) in loader:", "for (x,) in loop.shares(loader):").replace("pass", "break")


@pytest.mark.parametrize(
    "code,fragment,met",
    [
        # Regression: before ddpkit run took --replicas, a script under it ran as a plain job with exit 0; a script
        # with no Loop still would, once per group, each a world of its own
        ("print('trained', flush=True)\n", "ended without a ddpkit.Loop meeting the other groups", False),
        (EPOCHS, "loop over 'for step in loop.steps(n)' and read each step's batches with", False),
        # met by both groups once they have met (after the first step's body): group 1's filed quiet, and its
        # launcher ended with its status and no line (it said "exited with code 2 ... and left no message")
        (NO_SHARES, "each step reads its batches through 'for batch in loop.shares(loader)'", True),
        # the step's gradient is summed and committed after its last batch: the other group would wait for it
        (BREAK, "the step left 'for batch in loop.shares(loader)' before its end", True),
    ],
    ids=["no Loop", "epochs", "no shares", "break"],
)
def test_a_script_replica_groups_cannot_train_is_one_line_from_group_0_alone(tmp_path, code, fragment, met):
    (tmp_path / "train.py").write_text(code)
    done = run_cli("run", "--replicas", "2", "train.py", cwd=tmp_path)
    said = [line for line in done.stderr.splitlines() if "error:" in line]
    assert done.returncode == 2 and len(said) == 1 and fragment in said[0], done.stderr
    assert "Traceback" not in done.stderr and done.stdout.count("trained") <= 1, done.stdout + done.stderr
    assert (tmp_path / "run-group-1").exists() == met  # group 1 started only once group 0 met the others


def test_a_misuse_one_group_alone_meets_is_said_by_that_group(tmp_path):
    # The final read's finding: group 1 alone broke out of shares() (a decision on its own metrics, say), filed it
    # quiet as if group 0 had said it, and the job ended 0 with "its output above says why" and nothing above
    body = "            model(x).sum().backward()\n            if loop.rank == 1:\n                break"
    (tmp_path / "train.py").write_text(
        BREAK.replace("            break", body).replace("loop.steps(2)", "loop.steps(4)")
    )
    done = run_cli("run", "--replicas", "2", "train.py", cwd=tmp_path)
    said = [line for line in done.stderr.splitlines() if "error:" in line]
    assert len(said) == 1 and said[0].startswith("ddpkit: replica group 1: error:"), done.stderr
    assert "left 'for batch in loop.shares(loader)' before its end" in said[0]
    assert done.returncode == 0 and "replica group 1 ended early (exit 2" in done.stderr  # group 0 finished
