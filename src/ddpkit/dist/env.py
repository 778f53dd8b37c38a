"""Every environment variable ddpkit reads or sets, named once.

Set by torchrun or torch's elastic agent for each worker (read here, never set):
``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE``, ``LOCAL_WORLD_SIZE``, ``GROUP_RANK`` (the node's index),
``TORCHELASTIC_RESTART_COUNT``, ``TORCHELASTIC_MAX_RESTARTS``, ``TORCHELASTIC_ERROR_FILE`` (where a
worker leaves its error for the agent), ``TORCHELASTIC_RUN_ID``.

ddpkit's own, set by the launcher for its workers (private: a user never sets them):
``DDPKIT_T0``, ``DDPKIT_RUN_LOCKED``, ``DDPKIT_LAUNCHER_PID``, ``DDPKIT_FORKED_WORKER``.

Set for the workers when the user has not: ``OMP_NUM_THREADS``, ``CUBLAS_WORKSPACE_CONFIG``,
``TORCH_DISABLE_SHARE_RDZV_TCP_STORE``, ``GLOO_SOCKET_IFNAME``, ``NCCL_SOCKET_IFNAME`` (see where each is set).
Read: ``ONEDNN_MAX_CPU_ISA``/``DNNL_MAX_CPU_ISA`` (:mod:`ddpkit.recipes`), ``WANDB_PROJECT``
(:mod:`ddpkit.run.loggers`), ``CUDA_VISIBLE_DEVICES`` and ``MASTER_PORT`` (what ``doctor`` and the flags report).

Torch-free: the CLI reads these before torch loads.
"""

from __future__ import annotations

import os
from typing import Mapping

from ..errors import ConfigError

# torchrun / the elastic agent
RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE, GROUP_RANK = (
    "RANK",
    "LOCAL_RANK",
    "WORLD_SIZE",
    "LOCAL_WORLD_SIZE",
    "GROUP_RANK",
)
LAUNCH_VARS = (RANK, LOCAL_RANK, WORLD_SIZE)  # all three set: this process is a launched worker
RESTART_COUNT = "TORCHELASTIC_RESTART_COUNT"
MAX_RESTARTS = "TORCHELASTIC_MAX_RESTARTS"
ERROR_FILE = "TORCHELASTIC_ERROR_FILE"
RUN_ID = "TORCHELASTIC_RUN_ID"

# ddpkit's own
T0 = "DDPKIT_T0"  # when the user launched the run (time.time(), repr), for summary.json's startup_s
RUN_LOCKED = "DDPKIT_RUN_LOCKED"  # the resolved run dir whose lock this job's launcher already holds
LAUNCHER_PID = "DDPKIT_LAUNCHER_PID"  # so a worker can tell its launcher died before it started
FORKED_WORKER = "DDPKIT_FORKED_WORKER"  # "1": forked from the launcher, so one intra-op thread (OpenMP)
TO_WORKERS = (T0, RUN_LOCKED)  # set by the launcher before it launches; passed on to the workers

# set for the workers where the user has not
OMP_NUM_THREADS = "OMP_NUM_THREADS"
CUBLAS_WORKSPACE_CONFIG = "CUBLAS_WORKSPACE_CONFIG"
SHARE_RDZV_STORE_OFF = "TORCH_DISABLE_SHARE_RDZV_TCP_STORE"
SOCKET_IFNAMES = ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME")


def under_launcher(env: Mapping[str, str] = os.environ) -> bool:
    """True inside torchrun / an elastic agent's worker (the ranks come from the env)."""
    return all(k in env for k in LAUNCH_VARS)


MASTER_VARS = ("MASTER_ADDR", "MASTER_PORT")  # where torchrun's workers find the rendezvous (env://)


def check_launcher_env(env: Mapping[str, str] = os.environ) -> None:
    """One line for launcher variables set by hand and set half-way, before anything starts: without it,
    RANK and WORLD_SIZE without LOCAL_RANK trained silently at world 1, a missing MASTER_ADDR was a
    47-line traceback, and RANK >= WORLD_SIZE waited at the rendezvous until the timeout."""
    present = [k for k in LAUNCH_VARS if k in env]
    if not present:
        return
    fix = "start the job with torchrun (which sets them all), or unset them to let ddpkit launch"
    if len(present) < len(LAUNCH_VARS):
        missing = [k for k in LAUNCH_VARS if k not in env]
        raise ConfigError(f"{', '.join(present)} set without {', '.join(missing)}: {fix}")
    try:
        rank, local, world = (int(env[k]) for k in LAUNCH_VARS)
    except ValueError:
        raise ConfigError(
            f"RANK={env[RANK]!r}, LOCAL_RANK={env[LOCAL_RANK]!r}, WORLD_SIZE={env[WORLD_SIZE]!r} must be "
            f"integers; {fix}"
        ) from None
    if not (world > 0 and 0 <= rank < world and 0 <= local <= rank):
        raise ConfigError(
            f"RANK={rank}, LOCAL_RANK={local}, WORLD_SIZE={world}: a rank must be in 0..WORLD_SIZE-1 "
            f"(and LOCAL_RANK at most RANK); {fix}"
        )
    unset = [k for k in MASTER_VARS if not env.get(k)]
    if unset and world > 1:
        verb = "is" if len(unset) == 1 else "are"
        raise ConfigError(f"RANK, LOCAL_RANK and WORLD_SIZE are set but {' and '.join(unset)} {verb} not: {fix}")


def env_rank(env: Mapping[str, str] = os.environ) -> int:
    """This worker's global rank as the launcher set it (0 outside a launcher)."""
    return int(env.get(RANK, "0"))


def restart_count(env: Mapping[str, str] = os.environ) -> int:
    """How many times the elastic agent has restarted this job's workers (0 on a fresh launch)."""
    return int(env.get(RESTART_COUNT, "0"))


def restarts_left(env: Mapping[str, str] = os.environ) -> bool:
    return int(env.get(MAX_RESTARTS, "0")) > restart_count(env)
