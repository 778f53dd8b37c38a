"""What ``Trainer.fit()`` raises for a failure: the same public ``ddpkit.errors`` class, with the same
message, whether the failure happened in this process (world size 1) or in a launched worker (2)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from workers import FaultyConvNet

from ddpkit import TrainConfig, Trainer
from ddpkit.errors import (
    AlreadyReported,
    CollectiveTimeout,
    NonFiniteLoss,
    PeerLost,
    Stopped,
    TaskError,
    WorkersFailed,
)
from ddpkit.ranks.failures import Failure, public_kind, rebuilt, returned_failure

# 400 MNIST images, global batch 50: 8 steps per epoch at any world size.
SMALL = dict(
    dataset="mnist",
    recipe="mnist",
    limit_train=400,
    limit_test=100,
    batch_size=50,
    lr=0.05,
    epochs=1,
    log_every=1,
    progress=False,
    plots=False,
    device="cpu",
    num_workers=0,
)


class BreaksAtStep3:
    """A metric that raises at its third call inside a process group (every training step calls it):
    preflight's trial step, before launch and outside a group, passes, so only the workers meet it."""

    def __init__(self):
        self.calls = 0

    def __call__(self, logits, batch):
        if dist.is_initialized():
            self.calls += 1
            if self.calls == 3:
                raise ValueError("the third batch is not what this metric expects")
        return (logits.argmax(1) == batch[1]).sum(), len(batch[1])


def nan_at_step_2() -> dict:
    return dict(model=FaultyConvNet("nan", at_step=2))  # every rank: --on-nan stop, met by all ranks alike


def metric_raising_at_step_3() -> dict:
    return dict(model=FaultyConvNet(), metrics={"fit": BreaksAtStep3()})  # one rank's error, filed by each


@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.parametrize(
    "make,cls,fragment",
    [
        (nan_at_step_2, NonFiniteLoss, "NaN or Inf"),
        (metric_raising_at_step_3, TaskError, "metric 'fit' raised ValueError: the third batch"),
    ],
    ids=["NonFiniteLoss", "TaskError"],
)
def test_fit_raises_the_same_public_class_and_message_at_world_1_and_2(tmp_path, make, cls, fragment):
    """Regression: at world 1 fit() raised NonFiniteLoss, at world 2 a private class of
    ddpkit.ranks.failures (and WorkersFailed for a rank's TaskError), so a caller could not catch by class."""
    said = {}
    for nproc in ("1", "2"):
        torch.manual_seed(0)
        cfg = TrainConfig(nproc=nproc, run_dir=str(tmp_path / nproc), **SMALL)
        with pytest.raises(cls) as err:
            Trainer(cfg, **make()).fit()
        assert type(err.value) is cls and fragment in str(err.value), (nproc, repr(err.value))
        said[nproc] = (str(err.value), err.value.exit_code)
    assert said["1"] == said["2"]


def test_the_launcher_rebuilds_only_public_ddpkit_errors_by_name():
    stopped = returned_failure(Failure("stopped on SIGINT at step 7", 130, True, "Stopped"))
    assert type(stopped) is Stopped and stopped.exit_code == 130 and stopped.reported
    assert str(stopped) == "stopped on SIGINT at step 7"
    lost = rebuilt("PeerLost", "another rank left", 4, False, rank=1)
    assert type(lost) is PeerLost and lost.rank == 1 and str(lost) == "another rank left"
    assert type(rebuilt("AlreadyReported", "bad data", 2, True)) is AlreadyReported
    # Anything not a public ddpkit error class stays WorkersFailed, naming the rank.
    for kind in ("_Exit", "ValueError", "raised_at", "__builtins__", ""):
        other = rebuilt(kind, "called sys.exit(3)", 3, True, rank=1)
        assert type(other) is WorkersFailed and str(other) == "rank 1: called sys.exit(3)" and other.exit_code == 3
    assert public_kind(CollectiveTimeout("x")) == "CollectiveTimeout"
    assert public_kind(type("Mine", (TaskError,), {})("x")) == ""  # a subclass of the user's own is not rebuilt


def test_a_stop_in_an_interactive_session_goes_to_the_previous_hook(monkeypatch):
    """Found in review: the exit-143 hook ended a REPL (or python -i) on a Ctrl-C during fit()."""
    import sys

    from ddpkit.ranks import failures

    seen = []
    monkeypatch.setattr(sys, "excepthook", lambda kind, exc, tb: seen.append(kind))
    monkeypatch.setattr(failures, "_STOP_HOOK", [False])
    failures.stop_exits_with_its_status()
    monkeypatch.setattr(sys, "ps1", ">>> ", raising=False)
    sys.excepthook(Stopped, Stopped("stopped on SIGINT", "SIGINT"), None)
    assert seen == [Stopped]


def test_of_two_ranks_lines_the_launcher_says_the_timeout_not_the_peer_it_broke(tmp_path, monkeypatch):
    """Regression (clean-clone CI runs, test_hangwatch[extra], 2 runs in 3 on 2026-11-28): in a hang, rank 1's
    collective timed out and gloo closed its connections, which broke rank 0's barrier at once ("Connection
    closed by peer"); rank 0 filed that before rank 1, which wrote the hang report first, filed its timeout. The
    launcher said rank 0's lost peer, not the timeout that caused it."""
    import types

    from ddpkit.ranks import env
    from ddpkit.ranks.failures import launch_failure, write_error_file

    files = {rank: tmp_path / str(rank) / "error.json" for rank in (0, 1)}
    for path in files.values():
        path.parent.mkdir()
    for rank, error in ((0, PeerLost("connection closed")), (1, CollectiveTimeout("the barrier timed out"))):
        monkeypatch.setenv(env.ERROR_FILE, str(files[rank]))  # rank 0's first, though rank 1 failed first
        write_error_file(
            f"rank {rank}: {error}",
            False,
            error.exit_code,
            kind=public_kind(error),
            text=str(error),
            rank=rank,
            consequence=True,
        )
    failures = {rank: types.SimpleNamespace(error_file=str(path), exitcode=3) for rank, path in files.items()}
    said = launch_failure(failures, 6.0)
    assert isinstance(said, CollectiveTimeout) and "the barrier timed out" in str(said)


def test_an_error_file_is_whole_or_not_there_when_its_rank_is_stopped_while_writing_it(tmp_path, monkeypatch):
    """Regression (a clean-clone run): the error file was opened in place, so a rank stopped between the
    truncation and the write (the agent's SIGTERM to a rank filing a lost peer) left an empty file, and torch's
    agent failed reading it with a JSONDecodeError traceback wall instead of the job's one line."""
    import json

    from ddpkit.ranks import env, failures

    path = tmp_path / "error.json"
    monkeypatch.setenv(env.ERROR_FILE, str(path))

    def stopped(*args, **kwargs):
        raise KeyboardInterrupt  # what a stop signal's handler raises, once the file is open and written to

    monkeypatch.setattr(failures.os, "replace", stopped)
    with pytest.raises(KeyboardInterrupt):
        failures.write_error_file("rank 0: lost a peer", False, 4, consequence=True)
    assert not path.exists()  # not an empty file for the agent to choke on
    monkeypatch.undo()
    monkeypatch.setenv(env.ERROR_FILE, str(path))
    failures.write_error_file("rank 0: lost a peer", False, 4, consequence=True)
    assert json.loads(path.read_text())["message"] == "rank 0: lost a peer"
    assert [p.name for p in tmp_path.iterdir()] == ["error.json"]


def test_a_timeout_filed_after_the_peer_it_broke_is_not_silenced_by_that_peer(tmp_path, monkeypatch):
    """Regression (a clean clone of 9b0d5d2, test_hangwatch[extra], exit 4 for 3): rank 1's collective timed out
    and gloo closed its connections; rank 0's barrier broke at once ("Connection closed by peer") and rank 0 filed
    its lost peer first, which marked the job's cause as said in the store. Rank 1 then found a cause said, filed
    its timeout as quiet, and the launcher, which skips quiet lines, said the lost peer (exit 4), not the timeout
    that caused it (exit 3). A lost peer is a consequence: it silences another lost peer, never a timeout."""
    import types

    from ddpkit.ranks import env
    from ddpkit.ranks.failures import launch_failure, report_failure, worker_failure

    monkeypatch.setenv(env.LAUNCHER_PID, "1")  # under ddpkit's launcher: a lost peer is left to it (deferred)
    store = dist.HashStore()
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)  # the job's store, as both ranks see it
    try:
        files = {rank: tmp_path / str(rank) / "error.json" for rank in (0, 1)}
        broke = {
            0: RuntimeError("[../gloo/transport/tcp/pair.cc:534] Connection closed by peer [127.0.0.1]:4242"),
            1: RuntimeError("[../gloo/transport/tcp/unbound_buffer.cc:81] Timed out waiting 6000ms for recv"),
        }
        said = {}
        for rank in (0, 1):  # rank 0's lost peer is filed first
            files[rank].parent.mkdir()
            monkeypatch.setenv(env.ERROR_FILE, str(files[rank]))
            said[rank] = worker_failure(broke[rank], 2, 6.0)
            report_failure(said[rank], rank)
        assert isinstance(said[0], PeerLost) and isinstance(said[1], CollectiveTimeout)
        assert not said[1].quiet
        # a second lost peer (a third rank) is still one line for the job
        assert worker_failure(RuntimeError(str(broke[0])), 2, 6.0).quiet
    finally:
        dist.destroy_process_group()
    failures = {rank: types.SimpleNamespace(error_file=str(path), exitcode=4 - rank) for rank, path in files.items()}
    job = launch_failure(failures, 6.0)
    assert isinstance(job, CollectiveTimeout) and job.exit_code == 3, job


def test_a_line_is_written_with_its_newline_in_one_write(monkeypatch):
    """The porter's seed 003 (1 run in 4, under python -u): print() wrote the text and its newline apart, and
    another rank's line landed between them: ``...snapshots=backgroundddpkit: error: rank 1: ...``."""
    import sys

    from ddpkit.errors import ConfigError
    from ddpkit.ranks.failures import exit_status
    from ddpkit.run.display import Display

    writes = []

    class Recorded:
        def write(self, text):
            writes.append(text)

        def flush(self):
            pass

    monkeypatch.setattr(sys, "stderr", Recorded())
    monkeypatch.setattr(sys, "stdout", Recorded())
    assert exit_status(ConfigError("Loop.resume() was called twice")) == 2
    Display(1, progress=False).print("[start] world_size=2")
    assert writes == ["ddpkit: error: Loop.resume() was called twice\n", "[start] world_size=2\n"], writes


def test_a_launch_stopped_in_its_teardown_ends_a_script_with_the_stops_status(monkeypatch):
    """Review finding: with the hook taking WorkersFailed, a launch() stopped by SIGTERM in the workers' teardown
    (their work done: the ddpkit command exits 0) ended a script with 0, though its code after launch() never ran."""
    import sys

    from ddpkit.ranks import failures

    monkeypatch.setattr(failures, "_STOP_HOOK", [False])
    monkeypatch.setattr(sys, "excepthook", lambda *a: None)
    failures.stop_exits_with_its_status()
    stopped = WorkersFailed("the launcher received SIGTERM after every worker had finished", False, 143, {0: None})
    with pytest.raises(SystemExit) as ended:
        sys.excepthook(WorkersFailed, stopped, None)
    assert ended.value.code == 143
