"""``run_cli``'s warm interpreter (tests/helpers/zygote.py) gives what a fresh ``python -m`` gives: the output,
the exit status (a signal's as ``-N``), the working directory, the environment and the arguments."""

from __future__ import annotations

import signal
import subprocess

import pytest
from clirun import run_cli

pytestmark = pytest.mark.multiprocess

PROBE = """
import os, sys
print("cwd", os.getcwd(), "argv", sys.argv[1:], "path0", sys.path[0] == os.getcwd(), "env", os.environ["PROBE"])
print("to stderr", file=sys.stderr)
if sys.argv[1] == "signal":
    os.kill(os.getpid(), 15)
raise SystemExit(3 if sys.argv[1] == "code" else "a message")
"""


@pytest.mark.parametrize("how", ["code", "message", "signal"])
def test_a_forked_run_gives_what_a_fresh_interpreter_gives(tmp_path, monkeypatch, how):
    monkeypatch.setenv("PROBE", "set")  # set after the warm interpreter started: each child takes the caller's
    (tmp_path / "probe_mod.py").write_text(PROBE)
    fresh = run_cli(how, cwd=tmp_path, module="probe_mod", fresh=True)
    forked = run_cli(how, cwd=tmp_path, module="probe_mod")
    assert (forked.returncode, forked.stdout, forked.stderr) == (fresh.returncode, fresh.stdout, fresh.stderr)
    assert fresh.returncode == {"code": 3, "message": 1, "signal": -signal.SIGTERM}[how]
    assert f"cwd {tmp_path} argv ['{how}'] path0 True env set" in fresh.stdout


def test_a_forked_run_past_its_timeout_is_killed_and_raises_as_subprocess_does(tmp_path):
    (tmp_path / "sleeper_mod.py").write_text("import time\nprint('started', flush=True)\ntime.sleep(600)\n")
    with pytest.raises(subprocess.TimeoutExpired) as raised:
        run_cli(cwd=tmp_path, module="sleeper_mod", timeout=3)
    assert "started" in raised.value.output
    (tmp_path / "probe_mod.py").write_text(PROBE)
    assert run_cli("code", cwd=tmp_path, module="probe_mod").returncode == 1  # no PROBE: a KeyError; served on
