"""One job, launched four ways on one machine, trains the same: ddpkit's own launcher at --nproc 2, and two
"nodes" of one process each on loopback started as Kubeflow Trainer would (PET_* variables, under torchrun and
with ``ddpkit train`` as the container's command) and as SLURM one task per GPU would (srun's variables).

Each run is float64, so the same world size and the same samples at every step give the same accuracy counts
at every log interval and losses and weights equal to float64 rounding (~1e-15): not to the bit, since a
one-process "node" gets both cores' intra-op threads where each of ddpkit's two workers gets one, and a
convolution's sums split by thread differ in their last bit.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch
from clirun import free_port, read_jsonl, run_nodes
from once import once

pytestmark = pytest.mark.multiprocess  # every test here starts processes

TRAIN = [
    *("train", "--dataset", "mnist", "--recipe", "mnist", "--device", "cpu", "--dtype", "float64"),
    *("--limit-train", "256", "--limit-test", "64", "--batch-size", "32", "--epochs", "1", "--lr", "0.05"),
    *("--log-every", "2", "--no-progress", "--no-plots", "--timeout-s", "60"),
]
DDPKIT = [sys.executable, "-m", "ddpkit"]
TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "-m", "ddpkit"]


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> Path:
    """ddpkit's own launcher at world 2: once per pytest run, for the cases on any worker (tests/helpers/once.py)."""

    def make(where: Path) -> None:
        (proc,) = run_nodes([([*DDPKIT, *TRAIN, "--nproc", "2", "--run-dir", str(where / "run")], {})])
        assert proc.returncode == 0, proc.stderr

    return once(tmp_path_factory, "launch-envs-reference", make) / "run"


def pet(node: int, port: int) -> dict:
    """What Kubeflow Trainer sets in node ``node``'s container (node 0's service name is an address here)."""
    return dict(
        PET_NNODES="2",
        PET_NPROC_PER_NODE="1",
        PET_NODE_RANK=str(node),
        PET_MASTER_ADDR="127.0.0.1",
        PET_MASTER_PORT=str(port),
    )


def slurm(task: int, port: int) -> dict:
    """What srun sets for task ``task`` of `srun --nodes 1 --ntasks 2` (one task per GPU)."""
    return dict(
        SLURM_JOB_ID="4242",
        SLURM_STEP_ID="0",
        SLURM_PROCID=str(task),
        SLURM_LOCALID=str(task),
        SLURM_NODEID="0",
        SLURM_NTASKS="2",
        SLURM_NNODES="1",
        SLURM_NTASKS_PER_NODE="2",
        SLURM_TASKS_PER_NODE="2",
        SLURM_JOB_NODELIST="127.0.0.1",
        MASTER_PORT=str(port),
    )


def slurm_node(node: int) -> dict:
    """What srun sets for the task on node ``node`` of `srun --nodes 2 --ntasks-per-node 1` (one task per node)."""
    return dict(
        SLURM_JOB_ID="4243",
        SLURM_STEP_ID="0",
        SLURM_PROCID=str(node),
        SLURM_LOCALID="0",
        SLURM_NODEID=str(node),
        SLURM_NTASKS="2",
        SLURM_NNODES="2",
        SLURM_NTASKS_PER_NODE="1",
        SLURM_TASKS_PER_NODE="1(x2)",
        SLURM_JOB_NODELIST="127.0.0.1,localhost",
    )


@pytest.mark.slow
@pytest.mark.parametrize("how", ["kubeflow ddpkit", "kubeflow torchrun", "slurm per gpu", "slurm per node"])
def test_each_cluster_launch_trains_like_ddpkits_own_launcher(tmp_path, reference, how):
    run_dir, port = tmp_path / "run", free_port()
    args = [*TRAIN, "--run-dir", str(run_dir)]
    if how == "kubeflow ddpkit":
        nodes = [([*DDPKIT, *args], pet(n, port)) for n in (0, 1)]
        said = "launch taken from torchrun's PET_* variables"
    elif how == "kubeflow torchrun":
        nodes = [([*TORCHRUN, *args], pet(n, port)) for n in (0, 1)]
        said = ""
    elif how == "slurm per gpu":
        nodes = [([*DDPKIT, *args], slurm(n, port)) for n in (0, 1)]
        said = "SLURM one task per GPU (SLURM_NTASKS=2 > SLURM_NNODES=1): each task is one rank, world size 2"
    else:  # examples/slurm/train.sbatch's per-node command: each task's launcher starts its node's workers
        per_node = ["--nnodes", "2", "--nproc", "1", "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", "ddpkit-4243"]
        nodes = [([*DDPKIT, *args, *per_node], slurm_node(n)) for n in (0, 1)]
        said = "SLURM one task per node (SLURM_NTASKS=2, SLURM_NNODES=2)"
    results = run_nodes(nodes)
    for r in results:
        assert r.returncode == 0, r.stderr
    err = "".join(r.stderr for r in results)
    if said:
        assert err.count(said) == (2 if how == "kubeflow ddpkit" else 1), err  # each node / the first task
    starts = [r for r in read_jsonl(run_dir / "metrics.jsonl") if r["event"] == "start"]
    assert [s["world_size"] for s in starts] == [2] and starts[0]["per_rank_batch"] == 16
    ours, ref = (torch.load(d / "model.pt", map_location="cpu", weights_only=True) for d in (run_dir, reference))
    assert ours.keys() == ref.keys()
    for k in ref:
        torch.testing.assert_close(ours[k], ref[k], rtol=1e-10, atol=1e-12, msg=k)
    records = [[r for r in read_jsonl(d / "metrics.jsonl") if r["event"] == "step"] for d in (run_dir, reference)]
    assert [(r["step"], r["accuracy"]) for r in records[0]] == [(r["step"], r["accuracy"]) for r in records[1]]
    assert [r["loss"] for r in records[0]] == pytest.approx([r["loss"] for r in records[1]], rel=1e-12)
    assert json.loads((run_dir / "summary.json").read_text())["world_size"] == 2
