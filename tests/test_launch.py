"""--nproc resolution, the CPU thread budget, launch specs and the agent's configuration."""

import dataclasses
import subprocess
import sys

import pytest
import torch

from ddpkit.config import TrainConfig

from ddpkit import dist, launch
from ddpkit.errors import ConfigError
from conftest import cli_env


def test_auto_is_one_process_on_cpu(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert launch.resolve_nproc("auto", "auto") == 1
    assert launch.resolve_nproc("3", "cpu") == 3


def test_more_processes_than_gpus_is_refused(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    assert launch.resolve_nproc("auto", "auto") == 2
    with pytest.raises(ConfigError, match=r"--nproc 4 asks for more processes than the 2 visible GPU\(s\)"):
        launch.resolve_nproc("4", "cuda")


def test_threads_never_oversubscribe(monkeypatch):
    monkeypatch.setattr(dist, "cpu_cores", lambda: 2)
    assert [dist.cpu_threads(n) for n in (1, 2, 3)] == [2, 1, 1]


def test_under_torchrun_nothing_is_relaunched(monkeypatch):
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("LOCAL_RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    assert launch.resolve_nproc("auto", "cpu") == 2 and launch.LaunchSpec(nproc=2).world_size == 4
    assert launch.launch(lambda x: x + 1, (1,), 2) == 2  # ran here, in this process


def test_under_torchrun_launch_flags_belong_to_torchrun(monkeypatch):
    for k, v in dict(RANK="0", LOCAL_RANK="0", WORLD_SIZE="2", LOCAL_WORLD_SIZE="2").items():
        monkeypatch.setenv(k, v)
    with pytest.raises(ConfigError, match="started by torchrun, which owns --max-restarts"):
        launch.LaunchSpec.from_config(TrainConfig(max_restarts=2))


def test_single_node_launch_needs_no_agent_unless_restarts_are_asked_for():
    assert launch.LaunchSpec(nproc=1).in_process
    assert not launch.LaunchSpec(nproc=1, max_restarts=1).in_process  # the agent does the restarting
    assert launch.LaunchSpec(nproc=2, nnodes=3).world_size == 6


def test_multi_node_run_id_is_the_same_for_the_same_command_on_every_node():
    cfg = TrainConfig(nnodes=2, rdzv_endpoint="127.0.0.1:29500", nproc="1")
    a, b = launch.LaunchSpec.from_config(cfg), launch.LaunchSpec.from_config(dataclasses.replace(cfg))
    assert a.rdzv_id == b.rdzv_id and a.rdzv_id.startswith("ddpkit-")
    assert launch.LaunchSpec.from_config(dataclasses.replace(cfg, epochs=3)).rdzv_id != a.rdzv_id


def test_agent_config_for_restarts_and_nodes(monkeypatch):
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setattr(dist, "cpu_cores", lambda: 16)
    config, env = launch._launch_config(launch.LaunchSpec(nproc=2, max_restarts=2))
    assert config.max_restarts == 2 and config.rdzv_endpoint == "localhost:0"
    assert env == {"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1",  # pytorch/pytorch#135712
                   "OMP_NUM_THREADS": "8"}  # what torchrun would set, which elastic_launch does not
    config, env = launch._launch_config(launch.LaunchSpec(nproc=1, nnodes=2, rdzv_endpoint="127.0.0.1:29500",
                                                          rdzv_id="job"))
    assert (config.min_nodes, config.max_nodes, config.run_id) == (2, 2, "job")
    assert config.rdzv_endpoint == "127.0.0.1:29500" and "is_host" not in config.rdzv_configs  # loopback: torch's own
    assert getattr(config, "local_addr", "127.0.0.1") == "127.0.0.1"
    # Both backends are pointed at the interface that reaches the other nodes.
    assert env["GLOO_SOCKET_IFNAME"] == env["NCCL_SOCKET_IFNAME"] == "lo"


def test_a_users_socket_interfaces_and_threads_are_left_alone(monkeypatch):
    for var, value in (("GLOO_SOCKET_IFNAME", "eth9"), ("NCCL_SOCKET_IFNAME", "ib0"), ("OMP_NUM_THREADS", "3")):
        monkeypatch.setenv(var, value)
    _, env = launch._launch_config(launch.LaunchSpec(nproc=1, nnodes=2, rdzv_endpoint="127.0.0.1:29500"))
    assert not {"GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME", "OMP_NUM_THREADS"} & set(env)


@pytest.mark.parametrize("codes,kind,fragments", [
    ({1: -6}, "CollectiveTimeout", ["rank 1 was aborted (SIGABRT)", "NCCL's watchdog", "--timeout-s 30 s"]),
    ({0: -6, 1: -9}, "CollectiveTimeout", ["rank 0 was aborted"]),
    ({1: -9}, "PeerLost", ["rank 1 was killed (SIGKILL)", "out-of-memory killer"]),
    ({0: -11}, "PeerLost", ["rank 0 died of SIGSEGV"]),
])
def test_workers_ended_by_a_signal_are_said_in_the_users_terms(codes, kind, fragments):
    err = launch.signal_failure(codes, timeout_s=30)
    assert type(err).__name__ == kind and err.exit_code in (3, 4)
    for fragment in fragments:
        assert fragment in str(err)
    assert launch.signal_failure({0: 1, 1: 2}, 30) is None  # ordinary exits keep their own reporting


def test_a_worker_aborted_like_ncccls_watchdog_is_one_line_naming_the_timeout():
    code = ("import sys; from ddpkit.cli import run_reporting_errors; from ddpkit.launch import launch; "
            "from workers import abort_on; sys.exit(run_reporting_errors(lambda: launch(abort_on, (1,), 2)))")
    proc = subprocess.run([sys.executable, "-c", code], env=cli_env(), capture_output=True, text=True, timeout=120)
    assert proc.returncode == 3, proc.stderr
    assert "Traceback" not in proc.stderr
    errors = [line for line in proc.stderr.splitlines() if line.startswith("ddpkit: error:")]
    assert any("rank 1 was aborted (SIGABRT)" in e and "--timeout-s 600 s" in e for e in errors), proc.stderr
