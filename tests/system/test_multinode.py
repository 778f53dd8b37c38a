"""Two "nodes" on one machine: two ddpkit launches meet through c10d rendezvous.

First over loopback, then with each node in its own Linux network namespace joined by a
veth pair, so they can reach each other only through the rendezvous address given.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import uuid

import pytest
from clirun import free_port, read_jsonl, run_nodes, run_python

pytestmark = pytest.mark.multiprocess  # every test here starts processes

TRAIN = [
    "train",
    "--dataset",
    "mnist",
    "--recipe",
    "mnist",
    "--limit-train",
    "1000",
    "--limit-test",
    "500",
    "--batch-size",
    "100",
    "--lr",
    "0.05",
    "--epochs",
    "1",
    "--device",
    "cpu",
    "--nproc",
    "1",
    "--nnodes",
    "2",
    "--no-progress",
    "--timeout-s",
    "60",
    "--no-plots",
]  # plots are tested in test_loggers.py


def check_two_node_run(run_dir, results) -> None:
    for r in results:
        assert r.returncode == 0, r.stderr
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["world_size"] == 2 and summary["test_samples"] == 500
    start = [r for r in read_jsonl(run_dir / "metrics.jsonl") if r["event"] == "start"]
    assert len(start) == 1  # global rank 0 alone writes, not each node's local rank 0
    assert start[0]["per_rank_batch"] == 50


@pytest.mark.slow
def test_two_launches_on_loopback_form_one_world(tmp_path):
    run_dir = tmp_path / "run"  # one directory both "nodes" see, as a shared filesystem gives
    endpoint = f"127.0.0.1:{free_port()}"
    cmd = [sys.executable, "-m", "ddpkit", *TRAIN, "--rdzv-endpoint", endpoint, "--run-dir", str(run_dir)]
    check_two_node_run(run_dir, run_nodes([cmd, cmd]))


@pytest.mark.slow
def test_nnodes_without_an_endpoint_is_refused_before_launch(tmp_path):
    proc = run_python("-m", "ddpkit", *TRAIN, "--run-dir", tmp_path / "r")
    assert proc.returncode == 2
    assert proc.stderr.count("--nnodes 2 needs --rdzv-endpoint HOST:PORT") == 1
    assert not (tmp_path / "r").exists()


@pytest.fixture
def netns_pair():
    """Two network namespaces joined by a veth pair: 10.231.0.1 <-> 10.231.0.2. Skips where not allowed."""
    if shutil.which("ip") is None:
        pytest.skip("iproute2 `ip` is not installed")
    tag = uuid.uuid4().hex[:6]
    a, b = f"ddpkA{tag}", f"ddpkB{tag}"
    va, vb = f"va{tag}", f"vb{tag}"

    def ip(*args):
        return subprocess.run(["ip", *args], capture_output=True, text=True)

    setup = [
        ("netns", "add", a),
        ("netns", "add", b),
        ("link", "add", va, "type", "veth", "peer", "name", vb),
        ("link", "set", va, "netns", a),
        ("link", "set", vb, "netns", b),
        ("-n", a, "addr", "add", "10.231.0.1/24", "dev", va),
        ("-n", b, "addr", "add", "10.231.0.2/24", "dev", vb),
        ("-n", a, "link", "set", va, "up"),
        ("-n", b, "link", "set", vb, "up"),
        ("-n", a, "link", "set", "lo", "up"),
        ("-n", b, "link", "set", "lo", "up"),
    ]
    try:
        for step in setup:
            r = ip(*step)
            if r.returncode != 0:
                pytest.skip(f"network namespaces not permitted here: ip {' '.join(step)}: {r.stderr.strip()}")
        yield a, b
    finally:
        ip("netns", "del", a)
        ip("netns", "del", b)


@pytest.mark.slow
def test_two_nodes_in_separate_network_namespaces(tmp_path, netns_pair):
    ns_a, ns_b = netns_pair
    run_dir = tmp_path / "run"
    endpoint = "10.231.0.1:29531"  # node A's veth address; a fresh namespace has every port free
    base = [sys.executable, "-m", "ddpkit", *TRAIN, "--rdzv-endpoint", endpoint, "--run-dir", str(run_dir)]
    results = run_nodes([["ip", "netns", "exec", ns_a, *base], ["ip", "netns", "exec", ns_b, *base]])
    check_two_node_run(run_dir, results)
