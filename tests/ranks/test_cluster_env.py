"""The cluster variables ddpkit reads (ddpkit.ranks.env): SLURM's compact host lists and task counts, which
srun task is one rank (one task per GPU) and which starts ddpkit's launcher (one per node), and Kubeflow's
PET_* variables against the flags. No process starts here: tests/system/test_launch_envs.py trains under each."""

from __future__ import annotations

import re

import pytest

from ddpkit import TrainConfig
from ddpkit.errors import ConfigError
from ddpkit.ranks import env
from ddpkit.ranks.launcher import LaunchSpec


@pytest.mark.parametrize(
    "nodelist,hosts",
    [
        ("node[01-03,07],gpu5", ["node01", "node02", "node03", "node07", "gpu5"]),
        ("localhost", ["localhost"]),
        ("127.0.0.1", ["127.0.0.1"]),
        ("a[8-10]", ["a8", "a9", "a10"]),
        ("n[098-101]", ["n098", "n099", "n100", "n101"]),
        ("rack[1-2]-gpu[0-1]", ["rack1-gpu0", "rack1-gpu1", "rack2-gpu0", "rack2-gpu1"]),
        ("x1,y[3],z", ["x1", "y3", "z"]),
    ],
)
def test_compact_nodelists_expand_as_scontrol_show_hostnames_does(nodelist, hosts):
    assert env.expand_nodelist(nodelist) == hosts


@pytest.mark.parametrize("bad", ["node[01-03", "node]1[", "node[3-1]", "node[a-b]", "n[[1]]"])
def test_a_malformed_nodelist_is_one_config_error(bad):
    with pytest.raises(ConfigError, match="SLURM"):
        env.expand_nodelist(bad)


def test_tasks_per_node_compact_form():
    assert [env.tasks_on_node("2(x3),1", n) for n in range(4)] == [2, 2, 2, 1]
    assert env.tasks_on_node("4", 0) == 4


SRUN = {"SLURM_STEP_ID": "0", "SLURM_JOB_NODELIST": "node[01-02]", "SLURM_NNODES": "2"}


def test_which_srun_tasks_are_one_rank_each():
    per_gpu = {**SRUN, "SLURM_PROCID": "5", "SLURM_LOCALID": "1", "SLURM_NODEID": "1", "SLURM_NTASKS": "8"}
    assert env.slurm_per_gpu(per_gpu) == (8, 2)
    assert env.slurm_per_gpu({**SRUN, "SLURM_PROCID": "1", "SLURM_NTASKS": "2"}) is None  # one task per node
    batch_script = {k: v for k, v in per_gpu.items() if k != "SLURM_STEP_ID"}
    assert env.slurm_per_gpu(batch_script) is None  # not an srun task
    values, source = env.slurm_rank_env("", {**per_gpu, "SLURM_TASKS_PER_NODE": "4(x2)"})
    assert {k: values[k] for k in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK")} == {
        "RANK": "5",
        "LOCAL_RANK": "1",
        "WORLD_SIZE": "8",
        "LOCAL_WORLD_SIZE": "4",
        "GROUP_RANK": "1",
    }
    assert (values["MASTER_ADDR"], values["MASTER_PORT"]) == ("node01", "29500") and "node[01-02]" in source
    values, source = env.slurm_rank_env("head:1234", per_gpu)
    assert (values["MASTER_ADDR"], values["MASTER_PORT"], source) == ("head", "1234", "--rdzv-endpoint")


PET = {"PET_NNODES": "2", "PET_NPROC_PER_NODE": "1", "PET_NODE_RANK": "1", "PET_MASTER_ADDR": "trainer-node-0-0"}


def test_pet_variables_become_the_launch_and_a_conflicting_flag_is_one_line(monkeypatch):
    for k, v in {**PET, "PET_MASTER_PORT": "29400"}.items():
        monkeypatch.setenv(k, v)
    spec = LaunchSpec.from_config(TrainConfig(device="cpu"))
    assert (spec.nnodes, spec.nproc, spec.rdzv_endpoint, spec.node_rank) == (2, 1, "trainer-node-0-0:29400", 1)
    assert spec.rdzv_id.startswith("ddpkit-")  # the same on every node: a hash of the config
    same = LaunchSpec.from_config(TrainConfig(device="cpu", nnodes=2, nproc="1"))
    assert (same.nnodes, same.nproc) == (2, 1)
    with pytest.raises(ConfigError, match="--nnodes 3 but PET_NNODES says 2"):
        LaunchSpec.from_config(TrainConfig(device="cpu", nnodes=3, rdzv_endpoint="trainer-node-0-0:29400"))
    with pytest.raises(ConfigError, match="--rdzv-endpoint other:1 but PET_MASTER_ADDR says"):
        LaunchSpec.from_config(TrainConfig(device="cpu", rdzv_endpoint="other:1"))


TASK = dict(SLURM_PROCID="3", SLURM_STEP_ID="0", SLURM_LOCALID="1", SLURM_NODEID="1", SLURM_JOB_ID="12345")


def test_an_srun_of_one_task_is_not_taken_for_one_task_per_gpu():
    """SLURM_NTASKS_PER_NODE=8 inherited from the batch script made `srun -n1 ddpkit train --nproc 8` a
    world of one, silently."""
    assert env.slurm_per_gpu(dict(TASK, SLURM_NTASKS="1", SLURM_NNODES="1", SLURM_NTASKS_PER_NODE="8")) is None
    assert env.slurm_per_gpu(dict(TASK, SLURM_NTASKS="8", SLURM_NNODES="2")) == (8, 2)


def test_the_rendezvous_of_one_task_per_gpu_prefers_the_steps_own_and_a_job_port():
    job = dict(TASK, SLURM_NTASKS="8", SLURM_NNODES="2", SLURM_JOB_NODELIST="a[1-4]", SLURM_TASKS_PER_NODE="4(x4)")
    values, source = env.slurm_rank_env("", dict(job, SLURM_STEP_NODELIST="a[3-4]", SLURM_STEP_TASKS_PER_NODE="2,6"))
    assert (values["MASTER_ADDR"], values["MASTER_PORT"], values["LOCAL_WORLD_SIZE"]) == ("a3", "29845", "6")
    assert "SLURM_STEP_NODELIST" in source  # 29500 + job id 12345 % 1000
    values, source = env.slurm_rank_env("", dict(job, MASTER_ADDR="head", MASTER_PORT="4000"))
    assert (values["MASTER_ADDR"], values["MASTER_PORT"], source) == ("head", "4000", "MASTER_ADDR")
    values, _ = env.slurm_rank_env("head", job)  # a host without a port: the job's port
    assert (values["MASTER_ADDR"], values["MASTER_PORT"]) == ("head", "29845")
    values, _ = env.slurm_rank_env("[::1]:7000", job)
    assert (values["MASTER_ADDR"], values["MASTER_PORT"]) == ("::1", "7000")


def test_each_srun_variable_is_named_when_it_is_not_what_srun_writes():
    """Issue 33, case 15/16: int() tracebacks, and SLURM_JOB_NODELIST blamed for a bad SLURM_STEP_NODELIST."""
    job = dict(TASK, SLURM_NTASKS="8", SLURM_NNODES="2", SLURM_JOB_NODELIST="a[1-2]")
    for variable, value, said in [
        ("SLURM_TASKS_PER_NODE", "4(x", "SLURM_TASKS_PER_NODE='4(x' is not SLURM's tasks per node"),
        ("SLURM_STEP_TASKS_PER_NODE", "0", "SLURM_STEP_TASKS_PER_NODE='0' is not SLURM's tasks per node"),
        ("SLURM_LOCALID", "9", "SLURM_LOCALID='9' is not a task index on this node, below its 8 tasks"),
        ("SLURM_NODEID", "-1", "SLURM_NODEID='-1' is not a node index"),
        ("SLURM_STEP_NODELIST", "a[x-y]", "SLURM_STEP_NODELIST='a[x-y]' is not a SLURM host list: the range [x-y]"),
    ]:
        with pytest.raises(ConfigError, match=re.escape(said)):
            env.slurm_rank_env("", dict(job, **{variable: value}))
    with pytest.raises(ConfigError, match="SLURM_NNODES='0' is not a node count"):
        env.slurm_per_gpu(dict(job, SLURM_NNODES="0"))


def test_nnodes_without_an_endpoint_is_refused_where_no_cluster_gives_one(monkeypatch):
    """The check moved from the config to the launch (issue 33, case 16): under srun it said "needs
    --rdzv-endpoint" for --nnodes 3 against SLURM_NNODES=1, where the endpoint comes from the host list."""
    with pytest.raises(ConfigError, match="--nnodes 2 needs --rdzv-endpoint HOST:PORT"):
        LaunchSpec.from_config(TrainConfig(device="cpu", nnodes=2).resolved())
    for k, v in dict(TASK, SLURM_NTASKS="2", SLURM_NNODES="1", SLURM_JOB_NODELIST="n1").items():
        monkeypatch.setenv(k, v)
    with pytest.raises(ConfigError, match="--nnodes 3 but SLURM_NNODES=1: drop --nnodes under srun"):
        LaunchSpec.from_config(TrainConfig(device="cpu", nnodes=3).resolved())
