"""Two process groups one after the other in one process (two ``ddpkit.Loop``s in one script): the second
meets in the same job store as the first, and must not read what the first left there."""

from __future__ import annotations

import json

import pytest
import torch.distributed as dist
from clirun import ROOT, run_python

from ddpkit.ranks import env
from ddpkit.ranks.context import distributed


def test_each_group_a_process_makes_has_its_own_keys_in_the_jobs_store(monkeypatch):
    """Regression (issue 41): torch names a default group "0" again after ``destroy_process_group``, so a
    second group in torchrun's store found the first one's gloo addresses (``default_pg/0//cpu//0/<rank>``),
    and a rank that read its peer's old address failed to connect (3 runs in 8 failed under torchrun). A key
    the first group left in its store is not seen by the second. World 1, with torchrun's agent store played
    by a TCPStore in this process."""
    agent_store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    launcher = {env.RANK: "0", env.LOCAL_RANK: "0", env.WORLD_SIZE: "1", env.LOCAL_WORLD_SIZE: "1"}
    for name, value in {**launcher, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(agent_store.port)}.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setenv("TORCHELASTIC_USE_AGENT_STORE", "True")
    with distributed("cpu", timeout_s=30):
        dist.distributed_c10d._get_default_store().set("left-by-the-first-group", "1")
    with distributed("cpu", timeout_s=30):
        assert not dist.distributed_c10d._get_default_store().check(["left-by-the-first-group"])


def records(run_dir) -> list[tuple[str, int | None]]:
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [(r["event"], r.get("step")) for r in map(json.loads, lines)]


@pytest.mark.slow
@pytest.mark.multiprocess
def test_two_loops_one_after_the_other_under_torchrun_both_train(tmp_path):
    """The Loop destroys the group it made on leaving its ``with``; a second Loop in the same script makes
    a new one (tests/helpers/two_loops.py, 3 steps each, 2 gloo ranks)."""
    proc = run_python(
        *("-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2"),
        *(ROOT / "tests" / "helpers" / "two_loops.py", tmp_path / "a", tmp_path / "b"),
        cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    trained = [("start", None), ("step", 1), ("step", 2), ("step", 3), ("end", 3)]
    assert records(tmp_path / "a") == trained and records(tmp_path / "b") == trained
