"""``ddpkit doctor``: the real CLI on this machine (a real 2-process gloo all-reduce), and its checks one by one."""

from __future__ import annotations

import argparse
import json
import socket

import pytest
from clirun import WAIT_S, run_cli


@pytest.mark.slow
@pytest.mark.multiprocess
def test_doctor_reports_and_passes_on_this_machine():
    import torch

    proc = run_cli("doctor", timeout=WAIT_S)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    out = proc.stdout
    assert torch.__version__ in out
    lines = {line.split(":")[0].split()[-1]: line for line in out.splitlines() if ":" in line}
    assert lines["gloo"].split()[0] == "ok", out
    assert "ok    gloo all-reduce:" in out and "exact" in lines["all-reduce"], out
    assert "0 FAIL" in out.splitlines()[-1]


@pytest.mark.multiprocess
def test_doctor_json_has_the_all_reduce_figures(capsys):
    from ddpkit.cli import main

    # In this process (the CLI's main, as the subprocess above runs it): one torch import fewer, ~3 s.
    assert main(["doctor", "--json"]) == 0
    rep = json.loads(capsys.readouterr().out)
    assert rep["failed"] == 0
    smoke = rep["sections"]["smoke test"]
    assert smoke["gloo all-reduce"]["status"] == "ok"
    assert smoke["gloo latency"]["unit"] == "us" and smoke["gloo latency"]["value"] > 0
    assert smoke["gloo bandwidth"]["unit"] == "GB/s" and smoke["gloo bandwidth"]["value"] > 0
    assert 0 < smoke["gloo first result"]["value"] < 120
    assert rep["sections"]["versions"]["gloo"]["status"] == "ok"


def test_a_port_held_by_a_listening_socket_is_in_use():
    from ddpkit.tools.doctor import port_check

    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = held.getsockname()[1]
        default, named = port_check("", port, named=False), port_check("127.0.0.1", port, named=True)
    assert default["value"].startswith("in use") and default["status"] == "warn"
    assert "picks a free port" in default["note"]
    assert named["value"].startswith("in use") and named["status"] == "FAIL"
    assert port_check("", port, named=True)["status"] == "ok"  # released: free again


def test_env_listing_picks_up_distributed_variables(monkeypatch):
    from ddpkit.tools.doctor import env_vars

    monkeypatch.setenv("NCCL_DEBUG", "INFO")
    monkeypatch.setenv("TORCH_NCCL_ASYNC_ERROR_HANDLING", "1")
    monkeypatch.setenv("UNRELATED_DOCTOR_VAR", "x")
    found = env_vars()
    assert found["NCCL_DEBUG"] == {"value": "INFO"}
    assert found["TORCH_NCCL_ASYNC_ERROR_HANDLING"]["value"] == "1"
    assert "UNRELATED_DOCTOR_VAR" not in found


def test_stray_launch_variables_are_a_warning():
    from ddpkit.tools.doctor import env_vars

    found = env_vars({"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "2"})
    assert found["RANK"]["status"] == "warn"
    assert "status" not in env_vars({"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "2", "GROUP_RANK": "0"})["RANK"]


def test_oversubscribed_threads_warn():
    from ddpkit.ranks.context import cpu_cores
    from ddpkit.tools.doctor import cpu

    cores = cpu_cores()
    rows = cpu(2, {"OMP_NUM_THREADS": str(cores)})
    assert rows["threads"]["status"] == "warn" and rows["threads"]["value"].startswith(f"{cores} x 2 processes")
    assert cpu(1, {})["threads"]["status"] == "ok"


def test_a_wrong_all_reduce_result_fails(monkeypatch, capsys):
    from ddpkit.commands import doctor as command
    from ddpkit.tools import doctor

    right = {
        "world": 2.0,
        "sum": 3.0,
        "big_min": 3.0,
        "big_max": 3.0,
        "first_s": 1.0,
        "latency_us": 50.0,
        "bandwidth_gbs": 1.0,
    }
    assert doctor.smoke_verdict(right, 2)[0] == "ok"
    for wrong in ({"sum": 4.0}, {"big_min": 2.0}, {"world": 1.0}):
        status, why = doctor.smoke_verdict({**right, **wrong}, 2)
        assert status == "FAIL" and "expected world 2 and sums 3" in why
    # The command turns such a verdict into exit 1 and a FAIL line.
    status, why = doctor.smoke_verdict({**right, "sum": 4.0}, 2)
    rep = {"smoke test": {"gloo all-reduce": doctor.row("2 process(es)", status, why)}}
    monkeypatch.setattr(doctor, "report", lambda *a: rep)
    args = argparse.Namespace(nproc=1, rdzv_endpoint="", json=False, timeout_s=60.0)
    assert command.run(args) == 1
    out = capsys.readouterr().out
    assert "FAIL  gloo all-reduce:" in out and "1 FAIL" in out


def test_a_malformed_endpoint_is_one_line_error(capsys):
    from ddpkit.cli import main

    assert main(["doctor", "--rdzv-endpoint", "node0"]) == 2
    assert "expected HOST:PORT" in capsys.readouterr().err
