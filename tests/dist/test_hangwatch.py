"""When a job hangs: the report names the rank that is behind and where, before the timeout."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
from clirun import cli_env

from ddpkit.dist.hangwatch import summary

HELPER = Path(__file__).parents[1] / "helpers" / "hang_workers.py"


def line_of(marker: str) -> str:
    """tests/helpers/hang_workers.py:N of the line carrying ``# HANG: marker``."""
    for n, text in enumerate(HELPER.read_text().splitlines(), 1):
        if f"# HANG: {marker}" in text:
            return f"hang_workers.py:{n}"
    raise AssertionError(marker)


def hang(case: str, tmp_path: Path, *extra: str) -> tuple[subprocess.CompletedProcess, dict]:
    proc = subprocess.run(
        [sys.executable, str(HELPER), case, *extra],
        env=cli_env(TMPDIR=str(tmp_path)),
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
    )
    reports = list(tmp_path.glob("ddpkit-hang-*.json")) + list(tmp_path.glob("*/hang-report.json"))
    assert len(reports) == 1, proc.stderr[-3000:]
    return proc, json.loads(reports[0].read_text())


@pytest.mark.multiprocess
@pytest.mark.parametrize(
    "case,expected",
    [
        (
            "sleep",
            ["rank 1 is behind: in `slow_user_code` at {sleep}", "rank 0 waits in all_reduce #2 (at {rank 0 waits}"],
        ),
        (
            "skip",
            [
                "rank 0 waits in all_reduce #2 (at {rank 1 skips this one}",
                "rank 1 waits in all_gather #2 (at {rank 1 goes on}",
            ],
        ),
        (
            "extra",
            [
                "rank 1 waits in all_reduce #2 (at {only rank 1 calls this}",
                "rank 0 waits in barrier #2 (at {rank 0 goes on}",
            ],
        ),
    ],
)
def test_a_hang_is_reported_naming_the_rank_and_the_line_before_the_timeout(tmp_path, case, expected):
    """A rank still in its own code, one that skipped a collective, one that called an extra one: gloo
    waits out --timeout-s (6 s here) and used to say only that a collective timed out."""
    proc, report = hang(case, tmp_path)
    assert proc.returncode != 0 and "did not complete within --timeout-s 6 s" in proc.stderr
    lines = [line for line in proc.stderr.splitlines() if "ddpkit: hang:" in line]
    assert len(lines) == 1, proc.stderr[-3000:]  # once, from rank 0
    for words in expected:
        marker = words[words.index("{") + 1 : words.index("}")]
        head, tail = words.split("{" + marker + "}")
        assert re.search(re.escape(head) + r"\S*" + re.escape(line_of(marker) + tail), lines[0]), (words, lines[0])
    # written before the timeout ended the job, with every rank's answer
    assert proc.stderr.index(lines[0]) < proc.stderr.index("did not complete")
    assert sorted(a["rank"] for a in report["ranks"]) == [0, 1] and report["summary"] in lines[0]
    assert all(a["stack"] and a["recent"] for a in report["ranks"])


@pytest.mark.multiprocess
def test_a_rank_stopped_in_its_loss_is_named_while_the_other_waits_in_ddps_backward(tmp_path):
    """DDP's gradient all-reduce runs in C++, outside ddpkit's record: the step heartbeat raises the flag."""
    proc, report = hang("train", tmp_path, str(tmp_path / "run"))
    assert (tmp_path / "run" / "hang-report.json").exists()
    line = next(line for line in proc.stderr.splitlines() if "ddpkit: hang:" in line)
    assert re.search(r"rank 1 is behind: in `slow_loss` at \S*" + re.escape(f"{line_of('loss')} (step 3"), line), line
    assert "rank 0 waits in DDP's gradient all-reduce in the backward (step 3" in line, line
    assert re.match(r"rank [01] made no train step for \d+ s", report["why"]), report["why"]


def answer(rank, collective=None, where=("user_fn", "train.py", 7), step=None, stack=("train.py:7 in user_fn",)):
    return {
        "rank": rank,
        "step": step,
        "since_progress_s": 40.0,
        "since_collective_s": 31.0,
        "collective": collective,
        "where": {"function": where[0], "file": where[1], "line": where[2]},
        "stack": list(stack),
    }


def test_the_summary_names_the_odd_rank_out_and_the_silent_ones():
    ar = {"op": "all_reduce", "seq": 12, "called_at": "train.py:30"}
    ag = {"op": "all_gather", "seq": 12, "called_at": "train.py:31"}
    four = [answer(0, ar), answer(1, ar), answer(2, ar), answer(3, ag)]
    assert summary(four, 4) == (
        "rank 3 waits in all_gather #12 (at train.py:31), a collective the others did not call; "
        "ranks 0-2 wait in all_reduce #12 (at train.py:30)"
    )
    behind = [answer(0, ar), answer(1, ar), answer(2, step=1207, where=("loss_fn", "my_script.py", 42))]
    assert summary(behind, 4) == (
        "rank 2 is behind: in `loss_fn` at my_script.py:42 (step 1207, 40 s since its last step); "
        "ranks 0, 1 wait in all_reduce #12 (at train.py:30); rank 3 did not answer (dead, or stuck outside Python)"
    )
    assert summary([answer(0, ar), answer(1, ar)], 2).endswith("and none completes")


def test_a_queued_collective_that_has_not_completed_is_waited_in():
    """On NCCL the host returns once a collective is queued; the rank still waits in it until its work
    completes (the watch once saw nothing there, and said no rank waited)."""
    import torch

    from ddpkit.dist.hangwatch import HangWatch

    class Work:
        done = False

        def is_completed(self):
            return self.done

    watch = HangWatch(rank=2, world_size=4, timeout_s=2.0, store=None)  # not started: no thread, no store
    work = Work()
    with watch.collective("all_reduce", torch.ones(3)) as entry:
        entry["work"] = work
    watch.recent[-1]["started"] -= 5.0  # queued 5 s ago
    assert watch._late() == "rank 2 waited 5 s in all_reduce #1"
    assert watch.answer()["collective"]["op"] == "all_reduce" and watch.answer()["collective"]["waited_s"] >= 5
    work.done = True
    assert watch._late() == "" and watch.answer()["collective"] is None
    assert "work" not in watch.answer()["recent"][0]  # the report holds plain values
