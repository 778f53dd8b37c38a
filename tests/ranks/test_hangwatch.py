"""When a job hangs: the report names the rank that is behind and where, before the timeout."""

from __future__ import annotations

import json
import re
import subprocess
import time
from pathlib import Path

import pytest
from clirun import run_python

from ddpkit.ranks.hangwatch import summary

HELPER = Path(__file__).parents[1] / "helpers" / "hang_workers.py"


def line_of(marker: str) -> str:
    """tests/helpers/hang_workers.py:N of the line carrying ``# HANG: marker``."""
    for n, text in enumerate(HELPER.read_text().splitlines(), 1):
        if f"# HANG: {marker}" in text:
            return f"hang_workers.py:{n}"
    raise AssertionError(marker)


def hang(case: str, tmp_path: Path, *extra: str) -> tuple[subprocess.CompletedProcess, dict]:
    proc = run_python(HELPER, case, *extra, cwd=tmp_path, TMPDIR=str(tmp_path))
    reports = list(tmp_path.glob("ddpkit-hang-*.json")) + list(tmp_path.glob("*/hang-report.json"))
    assert len(reports) == 1, proc.stderr[-3000:]
    return proc, json.loads(reports[0].read_text())


@pytest.mark.slow
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


@pytest.mark.slow
@pytest.mark.multiprocess
def test_a_rank_stopped_in_its_loss_is_named_while_the_other_waits_in_ddps_backward(tmp_path):
    """DDP's gradient all-reduce runs in C++, outside ddpkit's record: the step heartbeat raises the flag."""
    proc, report = hang("train", tmp_path, str(tmp_path / "run"))
    assert (tmp_path / "run" / "hang-report.json").exists()
    line = next(line for line in proc.stderr.splitlines() if "ddpkit: hang:" in line)
    assert re.search(r"rank 1 is behind: in `slow_loss` at \S*" + re.escape(f"{line_of('loss')} (step 3"), line), line
    assert "rank 0 waits in DDP's gradient all-reduce in the backward (step 3" in line, line
    assert re.match(r"rank [01] made no train step for \d+ s", report["why"]), report["why"]


@pytest.mark.slow
@pytest.mark.multiprocess
def test_a_rank_late_in_its_own_loop_on_ddpkit_loop_is_named_with_its_line(tmp_path):
    """A user's own loop (ddpkit.Loop): its safe points are the heartbeat, its run dir holds the report."""
    proc, report = hang("loop", tmp_path, str(tmp_path / "run"))
    assert (tmp_path / "run" / "hang-report.json").exists()
    line = next(line for line in proc.stderr.splitlines() if "ddpkit: hang:" in line)
    assert re.search(r"rank 1 is behind: in `slow_step` at \S*" + re.escape(f"{line_of('loop step')} (step 3"), line), (
        line
    )
    assert "rank 0 waits in DDP's gradient all-reduce in the backward (step 3" in line, line


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

    from ddpkit.ranks.hangwatch import HangWatch

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


BUSY = Path(__file__).parents[1] / "helpers" / "busy_workers.py"
PAUSES = {
    "step": "every rank in one step slower than the threshold (no rank waits in a collective)",
    "save": "rank 0 writing a snapshot while rank 1 waits for it in a collective",
    "end": "rank 0's end of the run (its loggers' close), after the last collective, longer than the whole timeout",
}


@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.parametrize("case", PAUSES)
def test_a_healthy_run_slower_than_the_threshold_reports_no_hang_and_exits_0(tmp_path, case):
    """Regression: each of these printed `ddpkit: hang:` (and wrote hang-report.json) on a run that was
    fine, and the slow plots at the end turned the finished run into a collective timeout (exit 3 from the
    CLI): the other rank waited for them in the group's final barrier. 2 gloo ranks, --timeout-s 10."""
    paused = PAUSES[case]
    proc = run_python(BUSY, case, tmp_path / "run", cwd=tmp_path, TMPDIR=str(tmp_path))
    assert proc.returncode == 0, (paused, proc.stderr[-3000:])
    assert "ddpkit: hang" not in proc.stderr, (paused, proc.stderr[-3000:])
    assert not list(tmp_path.rglob("*hang*.json")), paused
    assert (tmp_path / "run" / "summary.json").exists()
    if case == "end":
        assert (tmp_path / "run" / "plots" / "loss.png").exists()  # the slow work was done, not cut short


def test_the_verdict_tells_ranks_at_work_from_a_hang():
    """A flag is a question: ranks in their own compute, in the same backward, or waiting for a rank busy in
    ddpkit's own work are no hang; a rank waiting for one that is elsewhere, or for a silent one, is."""
    from ddpkit.ranks.hangwatch import verdict

    ar = {"op": "all_reduce", "seq": 7, "called_at": "checkpoint.py:188"}
    backward = ("engine.py:408 in _step", "autograd/__init__.py:353 in backward", "graph.py:829 in run_backward")
    computing = [answer(0, step=3, where=("loss", "train.py", 9)), answer(1, step=3, where=("loss", "train.py", 9))]
    assert verdict(computing, 2) is None
    assert verdict([answer(0, step=3, stack=backward), answer(1, step=3, stack=backward)], 2) is None
    saving = {**answer(0, step=2, where=("atomic_write", "files.py", 51)), "busy": {"what": "saving", "for_s": 3}}
    assert verdict([saving, answer(1, ar, step=2)], 2) is None
    assert verdict([answer(1, ar, step=2)], 2, announced={0: "saving snapshot-000000002.pt"}) is None
    # a hang: rank 1 waits, rank 0 is elsewhere (or says nothing)
    assert verdict([answer(0, step=3, where=("loss", "train.py", 9)), answer(1, step=3, stack=backward)], 2) == (
        "rank 0 is behind: in `loss` at train.py:9 (step 3, 40 s since its last step); "
        "rank 1 waits in DDP's gradient all-reduce in the backward (step 3, at `user_fn` at train.py:7)"
    )
    assert verdict([answer(1, ar, step=2)], 2).endswith("rank 0 did not answer (dead, or stuck outside Python)")
    assert verdict([answer(0, step=3, stack=backward), answer(1, step=4, stack=backward)], 2)  # other steps


class FakePeer:
    """Rank 1 of a 2-rank watch, played by the test through the store: answers each round as told."""

    def __init__(self, watch, store):
        self.watch, self.store = watch, store

    def answers(self, n: int, moved: list, timeout: float = 10.0) -> None:
        """Wait for round ``n``'s flag, then answer it: in its own code at step 5, having ``moved`` so far."""
        flag = f"{self.watch.prefix}/{n}/flag"
        deadline = time.monotonic() + timeout
        while not self.store.check([flag]):
            assert time.monotonic() < deadline, f"round {n} never began"
            time.sleep(0.02)
        mine = {**answer(1, step=5, where=("slow_user_code", "train.py", 42)), "moved": moved}
        self.store.set(f"{self.watch.prefix}/{n}/rank1", json.dumps(mine))

    def verdict(self, n: int, timeout: float = 10.0) -> str:
        key = f"{self.watch.prefix}/{n}/verdict"
        deadline = time.monotonic() + timeout
        while not self.store.check([key]):
            assert time.monotonic() < deadline, f"round {n} had no verdict"
            time.sleep(0.02)
        return self.store.get(key).decode()


def waiting_watch(tmp_path):
    """Rank 0's watch (started), in an all_reduce for 10 s already: over the threshold at once."""
    import torch
    import torch.distributed as dist

    from ddpkit.ranks.hangwatch import HangWatch

    store = dist.HashStore()
    watch = HangWatch(rank=0, world_size=2, timeout_s=3.0, store=store)  # threshold 1.5 s, rounds 0.375 s apart
    watch.run_dir = str(tmp_path)
    return watch, store, FakePeer(watch, store), watch.collective("all_reduce", torch.ones(2))


def test_a_hang_is_reported_only_when_a_second_round_finds_nothing_moved(tmp_path, capsys):
    """One look can catch a rank a moment before it joins the others: a rank behind in round 0 that has
    moved by round 1 is no hang; the same state twice is, and is reported when the wait times out."""
    watch, store, peer, collective = waiting_watch(tmp_path)
    with collective as entry:
        entry["started"] -= 10.0
        watch.start()
        try:
            peer.answers(0, moved=[100.0, 0.0, 4])
            assert peer.verdict(0).startswith("again ")  # seen once: not yet reported
            peer.answers(1, moved=[101.0, 0.0, 5])  # it made a step meanwhile
            assert peer.verdict(1).startswith("again ")
            assert "ddpkit: hang" not in capsys.readouterr().err
            peer.answers(2, moved=[101.0, 0.0, 5])  # nothing moved since round 1
            assert peer.verdict(2).startswith("hang ")
            assert "ddpkit: hang" not in capsys.readouterr().err  # kept, until the wait times out
            watch.publish()  # what the group's error path does when this rank's collective timed out
        finally:
            watch.stop()
    line = capsys.readouterr().err
    assert line.startswith("ddpkit: hang: rank 1 is behind: in `slow_user_code` at train.py:42 (step 5"), line
    assert (tmp_path / "hang-report.json").exists()


def test_a_report_being_gathered_when_the_run_ends_is_abandoned(tmp_path, capsys):
    """Regression: stop() (the group's teardown, after the run finished) returned while the watch was still
    gathering, and the report came after it: a completed run printed a hang line."""
    watch, store, peer, collective = waiting_watch(tmp_path)
    with collective as entry:
        entry["started"] -= 10.0
        watch.start()
        try:
            peer.answers(0, moved=[100.0, 0.0, 4])
            assert peer.verdict(0).startswith("again ")
            deadline = time.monotonic() + 10
            while not store.check([f"{watch.prefix}/1/flag"]):  # round 1: the watch waits for rank 1's answer
                assert time.monotonic() < deadline
                time.sleep(0.02)
        finally:
            watch.stop()  # the run ended meanwhile
    peer.answers(1, moved=[100.0, 0.0, 4])  # the answer that would confirm the hang, too late
    time.sleep(1.0)  # 10 of the watch's polls
    assert "ddpkit: hang" not in capsys.readouterr().err
    assert not (tmp_path / "hang-report.json").exists()
    assert not store.check([f"{watch.prefix}/1/verdict"])


def test_a_confirmed_hang_that_moves_on_is_never_reported(tmp_path, capsys):
    """Regression (issue 41): a wait confirmed twice that then completes (the late rank arrived before the
    timeout) was reported; it is no hang. A later timeout of this rank in another collective does not print
    the old one's report."""
    watch, store, peer, collective = waiting_watch(tmp_path)
    try:
        with collective as entry:
            entry["started"] -= 10.0
            watch.start()
            peer.answers(0, moved=[100.0, 0.0, 4])
            assert peer.verdict(0).startswith("again ")
            peer.answers(1, moved=[100.0, 0.0, 4])
            assert peer.verdict(1).startswith("hang ")  # confirmed: kept in the store
        watch.progress(1)  # the collective completed: rank 1 arrived, and this rank stepped on
        with watch.collective("all_reduce"):
            watch.publish()  # as if this next one timed out
    finally:
        watch.stop()
    assert "ddpkit: hang" not in capsys.readouterr().err
    assert not (tmp_path / "hang-report.json").exists()


def test_where_the_backend_ends_the_process_at_the_timeout_the_watch_reports_just_before(tmp_path, capsys):
    """NCCL's watchdog ends the waiting process at the timeout without returning to Python: there the watch
    writes the confirmed hang's report itself, lead_s before the timeout."""
    import torch
    import torch.distributed as dist

    from ddpkit.ranks.hangwatch import HangWatch

    store = dist.HashStore()
    watch = HangWatch(rank=0, world_size=2, timeout_s=3.0, store=store, abrupt=True)
    watch.run_dir = str(tmp_path)
    peer = FakePeer(watch, store)
    with watch.collective("all_reduce", torch.ones(2)) as entry:
        entry["started"] -= 10.0  # past timeout_s - lead_s already
        watch.start()
        try:
            peer.answers(0, moved=[100.0, 0.0, 4])
            assert peer.verdict(0).startswith("again ")
            peer.answers(1, moved=[100.0, 0.0, 4])
            assert peer.verdict(1).startswith("hang ")
            deadline = time.monotonic() + 10
            while not (tmp_path / "hang-report.json").exists():
                assert time.monotonic() < deadline, "no report"
                time.sleep(0.02)
        finally:
            watch.stop()
    assert capsys.readouterr().err.startswith("ddpkit: hang: rank 1 is behind: in `slow_user_code`")


@pytest.mark.multiprocess
def test_a_run_that_completes_reports_no_hang_however_long_rank_0_logs_between_steps(tmp_path, capfd):
    """Regression (issue 41): rank 0 4.5 s in its own logging between two steps at --timeout-s 6 (a rank-0
    ``wandb.log``, as in docs/port.md's MNIST port) while rank 1 waits for it in DDP's backward: the watch
    confirmed a hang at 0.625 of the timeout and wrote a report for a run that went on to exit 0. A wait
    shorter than the timeout is one the job tolerates: no report, no line."""
    import slow_rank0

    import ddpkit

    steps = ddpkit.launch(slow_rank0.late_rank0_loop, str(tmp_path / "run"), 4.5, nproc=2, device="cpu", timeout_s=6.0)
    assert steps == 6
    assert "ddpkit: hang" not in capfd.readouterr().err
    assert not list(tmp_path.rglob("*hang*"))
