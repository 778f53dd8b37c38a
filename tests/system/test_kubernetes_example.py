"""examples/kubernetes/trainjob.yaml run as Kubeflow Trainer would run it, on one machine: its command and
arguments in two "nodes" on loopback, with the PET_* variables the operator sets from numNodes and
numProcPerNode (node 0's address as PET_MASTER_ADDR), and CPU-sized data appended (the last flag wins)."""

from __future__ import annotations

import json
import sys

import pytest
import yaml
from clirun import ROOT, free_port, read_jsonl, run_nodes

pytestmark = pytest.mark.multiprocess  # starts processes

SMALL = ["--device", "cpu", "--limit-train", "256", "--limit-test", "64", "--batch-size", "32", "--epochs", "1"]


@pytest.mark.slow
def test_the_trainjob_manifest_trains_one_world_across_its_nodes(tmp_path):
    job = yaml.safe_load((ROOT / "examples" / "kubernetes" / "trainjob.yaml").read_text())
    trainer = job["spec"]["trainer"]
    assert job["kind"] == "TrainJob" and trainer["command"] == ["torchrun"]
    args = list(trainer["args"])
    args[args.index("--run-dir") + 1] = str(tmp_path / "run")  # the shared volume
    cmd = [sys.executable, "-m", "torch.distributed.run", *args, *SMALL, "--no-plots", "--timeout-s", "60"]
    nodes, port = trainer["numNodes"], free_port()
    pet = dict(PET_NNODES=str(nodes), PET_NPROC_PER_NODE=str(trainer["numProcPerNode"]))
    pet.update(PET_MASTER_ADDR="127.0.0.1", PET_MASTER_PORT=str(port))
    results = run_nodes([(cmd, {**pet, "PET_NODE_RANK": str(n)}) for n in range(nodes)])
    for r in results:
        assert r.returncode == 0, r.stderr
    starts = [r for r in read_jsonl(tmp_path / "run" / "metrics.jsonl") if r["event"] == "start"]
    assert [s["world_size"] for s in starts] == [nodes * trainer["numProcPerNode"]] == [2]
    assert json.loads((tmp_path / "run" / "summary.json").read_text())["steps"] == 8
