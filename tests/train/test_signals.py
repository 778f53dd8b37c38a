"""SIGTERM is latched, not fatal, inside StopSignal, and the previous handler comes back after; a launched rank
whose launcher is gone stops as if signalled."""

import os
import signal

import pytest

from ddpkit.train.signals import LAUNCHER_GONE, StopSignal


def test_sigterm_is_recorded_and_the_handler_restored():
    before = signal.getsignal(signal.SIGTERM)
    with StopSignal(watch_parent=False) as stop:
        assert stop.received is None
        os.kill(os.getpid(), signal.SIGTERM)  # delivered to this (main) thread before kill returns
        assert stop.received == "SIGTERM"
    assert signal.getsignal(signal.SIGTERM) is before


def test_a_launched_rank_stopped_by_a_signal_keeps_noting_the_launchers_repeats_on_its_way_out(monkeypatch):
    """Regression (a loaded clean-clone run, test_random_resume[0]): the agent of a launcher sent SIGTERM sends it
    to the workers again every 0.5 s while they stop; the default action restored on leaving the block let a
    repeat end rank 0 between its stop and its saying it, and the job said it stopped before any snapshot."""
    for name, value in (("RANK", "0"), ("LOCAL_RANK", "0"), ("WORLD_SIZE", "2"), ("TORCHELASTIC_RUN_ID", "x")):
        monkeypatch.setenv(name, value)
    before = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT)}
    try:
        with StopSignal(watch_parent=False) as stop:
            os.kill(os.getpid(), signal.SIGTERM)
        os.kill(os.getpid(), signal.SIGTERM)  # the agent's repeat: noted, not the end of this process
        assert stop.received == "SIGTERM" and signal.getsignal(signal.SIGTERM) == stop._handle
    finally:
        for sig, handler in before.items():
            signal.signal(sig, handler)
    with StopSignal(watch_parent=False):  # a block that was not stopped gives the handlers back
        pass
    assert signal.getsignal(signal.SIGTERM) == before[signal.SIGTERM]


@pytest.fixture
def parent(monkeypatch):
    """os.getppid() as StopSignal sees it: the launcher's pid, until the test sets ``parent[0] = 1`` (init)."""
    pid = [4242]
    monkeypatch.setattr(os, "getppid", lambda: pid[0])
    return pid


def test_a_rank_whose_launcher_is_gone_stops_as_if_signalled(parent, monkeypatch):
    for name, value in (("RANK", "0"), ("LOCAL_RANK", "0"), ("WORLD_SIZE", "2"), ("TORCHELASTIC_RUN_ID", "x")):
        monkeypatch.setenv(name, value)
    with StopSignal() as stop:  # under a launcher: watched
        assert stop.received is None  # the launcher is still there
        parent[0] = 1  # SIGKILLed: the kernel hands the rank to init
        assert stop.received == LAUNCHER_GONE
    parent[0] = 4242
    with StopSignal() as stop:  # a new block watches the parent it starts under
        assert stop.received is None


def test_a_signal_received_first_is_what_the_stop_names(parent):
    with StopSignal(watch_parent=True) as stop:
        os.kill(os.getpid(), signal.SIGUSR1)
        parent[0] = 1
        assert stop.received == "SIGUSR1"


def test_plain_python_is_not_watched(parent, monkeypatch):
    """A script run by hand (no launcher) whose shell goes away (nohup) trains on."""
    for name in ("RANK", "LOCAL_RANK", "WORLD_SIZE"):
        monkeypatch.delenv(name, raising=False)
    with StopSignal() as stop:
        parent[0] = 1
        assert stop.received is None


def test_a_rank_started_by_hand_or_by_srun_is_not_watched(parent, monkeypatch):
    """Found in review: RANK and WORLD_SIZE set by hand (or by srun), the parent a shell that a nohup run
    outlives on purpose: only a worker of torch's elastic agent (TORCHELASTIC_RUN_ID) is watched."""
    for name, value in (("RANK", "0"), ("LOCAL_RANK", "0"), ("WORLD_SIZE", "2")):
        monkeypatch.setenv(name, value)
    monkeypatch.delenv("TORCHELASTIC_RUN_ID", raising=False)
    with StopSignal() as stop:
        parent[0] = 1
        assert stop.received is None
