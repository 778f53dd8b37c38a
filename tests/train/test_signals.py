"""SIGTERM is latched, not fatal, inside StopSignal, and the previous handler comes back after."""

import os
import signal

from ddpkit.train.signals import StopSignal


def test_sigterm_is_recorded_and_the_handler_restored():
    before = signal.getsignal(signal.SIGTERM)
    with StopSignal() as stop:
        assert stop.received is None
        os.kill(os.getpid(), signal.SIGTERM)  # delivered to this (main) thread before kill returns
        assert stop.received == "SIGTERM"
    assert signal.getsignal(signal.SIGTERM) is before
