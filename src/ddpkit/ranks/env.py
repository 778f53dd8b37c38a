"""Every environment variable ddpkit reads or sets, named once.

Set by torchrun or torch's elastic agent for each worker (read here, never set):
``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE``, ``LOCAL_WORLD_SIZE``, ``GROUP_RANK`` (the node's index),
``TORCHELASTIC_RESTART_COUNT``, ``TORCHELASTIC_MAX_RESTARTS``, ``TORCHELASTIC_ERROR_FILE`` (where a
worker leaves its error for the agent), ``TORCHELASTIC_RUN_ID``. Set by ddpkit for the agent during a launch:
``TORCHELASTIC_SIGNALS_TO_HANDLE``.

ddpkit's own, set by the launcher for its workers (private: a user never sets them):
``DDPKIT_T0``, ``DDPKIT_RUN_LOCKED``, ``DDPKIT_LAUNCHER_PID``, ``DDPKIT_FORKED_WORKER``; and by
``ddpkit train --replicas R`` (and ``ddpkit run --replicas R``) for each group's launcher: ``DDPKIT_REPLICA`` (the
group's index), ``DDPKIT_REPLICAS`` (R),
``DDPKIT_LIGHTHOUSE`` (torchft's lighthouse, which holds the groups' quorum), ``DDPKIT_REPLICA_STORE`` (where the
groups meet before their first step), ``DDPKIT_REPLICA_CORES`` (the group's cores).
Set by the user: ``DDPKIT_SHARE_GPU=1`` (every CUDA rank of a node on ``cuda:0``, over gloo: for development).

Set for the workers when the user has not: ``OMP_NUM_THREADS``, ``CUBLAS_WORKSPACE_CONFIG``,
``TORCH_DISABLE_SHARE_RDZV_TCP_STORE``, ``GLOO_SOCKET_IFNAME``, ``NCCL_SOCKET_IFNAME`` (see where each is set).
Read: ``ONEDNN_MAX_CPU_ISA``/``DNNL_MAX_CPU_ISA`` (:mod:`ddpkit.recipes`), ``WANDB_PROJECT``
(:mod:`ddpkit.run.loggers`), ``CUDA_VISIBLE_DEVICES`` and ``MASTER_PORT`` (what ``doctor`` and the flags report).

Torch-free: the CLI reads these before torch loads.
"""

from __future__ import annotations

import os
import re
import time
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
# Set for torch's agent during a launch (the signals it handles itself): SIGTERM and SIGUSR1 are ddpkit's
SIGNALS_TO_HANDLE = "TORCHELASTIC_SIGNALS_TO_HANDLE"

# ddpkit's own
T0 = "DDPKIT_T0"  # when the user launched the run (time.time(), repr), for summary.json's startup_s
RUN_LOCKED = "DDPKIT_RUN_LOCKED"  # the resolved run dir whose lock this job's launcher already holds
LAUNCHER_PID = "DDPKIT_LAUNCHER_PID"  # so a worker can tell its launcher died before it started
FORKED_WORKER = "DDPKIT_FORKED_WORKER"  # "1": forked from the launcher, so one intra-op thread (OpenMP)
# "1" (set by the user, for development): every CUDA rank of a node on cuda:0 over gloo, since NCCL
# refuses two ranks on one GPU; more processes than GPUs is then allowed
SHARE_GPU = "DDPKIT_SHARE_GPU"
# ddpkit train --replicas R: this launcher's group (0..R-1) and the address of torchft's lighthouse
REPLICA = "DDPKIT_REPLICA"
LIGHTHOUSE = "DDPKIT_LIGHTHOUSE"
REPLICA_STORE = "DDPKIT_REPLICA_STORE"  # HOST:PORT of the launcher's store, where the groups meet before step 0
REPLICA_CORES = "DDPKIT_REPLICA_CORES"  # the cores a group runs on, "0,1": set in the group's own process at its start
REPLICAS = "DDPKIT_REPLICAS"  # R, the groups of the run: a Loop's (ddpkit run --replicas), whose script has no flag
# Passed on to the workers: set by the launcher before it launches, or by the user (a forkserver
# started earlier has the environment of its start, not this one's)
TO_WORKERS = (T0, RUN_LOCKED, SHARE_GPU, REPLICA, LIGHTHOUSE, REPLICA_STORE, REPLICAS)

# set for the workers where the user has not
OMP_NUM_THREADS = "OMP_NUM_THREADS"
CUBLAS_WORKSPACE_CONFIG = "CUBLAS_WORKSPACE_CONFIG"
SHARE_RDZV_STORE_OFF = "TORCH_DISABLE_SHARE_RDZV_TCP_STORE"
SOCKET_IFNAMES = ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME")


def under_launcher(env: Mapping[str, str] = os.environ) -> bool:
    """True inside torchrun / an elastic agent's worker (the ranks come from the env)."""
    return all(k in env for k in LAUNCH_VARS)


MASTER_VARS = ("MASTER_ADDR", "MASTER_PORT")  # where torchrun's workers find the rendezvous (env://)
_WHOLE = re.compile(r"[0-9]+")  # ASCII digits only: int() also takes "٣" and " 3 ", which no launcher writes


def int_var(
    env: Mapping[str, str],
    name: str,
    what: str,
    fix: str,
    low: int = 0,
    high: int | None = None,
    default: int | None = None,
) -> int:
    """The variable ``name`` as an integer in ``low``..``high`` (``default`` where unset or empty, if given); else
    one line naming it, its value, ``what`` it should be and the ``fix``."""
    text = env.get(name, "")
    if default is not None and not text:
        return default
    value = int(text) if _WHOLE.fullmatch(text) else None
    if value is None or value < low or (high is not None and value > high):
        raise ConfigError(f"{name}={text!r} is not {what}: {fix}")
    return value


def port_var(env: Mapping[str, str], name: str, fix: str, default: int | None = None) -> int:
    """A TCP port from the variable ``name`` (1 to 65535; ``default`` where unset), or one line naming it."""
    return int_var(env, name, "a TCP port (1 to 65535)", fix, low=1, high=65535, default=default)


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
    if world > 1:  # read by torch's env:// rendezvous, whose int() failed with a 30-line traceback per rank
        port_var(env, MASTER_VARS[1], fix)
    if env.get(LOCAL_WORLD_SIZE):  # optional (torchrun sets it); read by ranks.context as the node's process count
        int_var(env, LOCAL_WORLD_SIZE, "a process count (a whole number >= 1)", fix, low=1)


def env_rank(env: Mapping[str, str] = os.environ) -> int:
    """This worker's global rank as the launcher set it (0 outside a launcher)."""
    return int(env.get(RANK, "0"))


def restart_count(env: Mapping[str, str] = os.environ) -> int:
    """How many times the elastic agent has restarted this job's workers (0 on a fresh launch)."""
    return int(env.get(RESTART_COUNT, "0"))


def restarts_left(env: Mapping[str, str] = os.environ) -> bool:
    return int(env.get(MAX_RESTARTS, "0")) > restart_count(env)


# ---------------------------------------------------------------------- clusters: SLURM and Kubeflow
# Set by srun for each task (read, never set). SLURM_STEP_ID marks a task of a job step: the batch
# script itself, which runs before any srun, has the job's SLURM_NTASKS but is not one of its tasks.
SLURM_PROCID, SLURM_LOCALID, SLURM_NODEID, SLURM_STEP_ID = (
    "SLURM_PROCID",
    "SLURM_LOCALID",
    "SLURM_NODEID",
    "SLURM_STEP_ID",
)
SLURM_NTASKS, SLURM_NNODES, SLURM_JOB_NODELIST = "SLURM_NTASKS", "SLURM_NNODES", "SLURM_JOB_NODELIST"
SLURM_NTASKS_PER_NODE, SLURM_TASKS_PER_NODE = "SLURM_NTASKS_PER_NODE", "SLURM_TASKS_PER_NODE"
# The step's own (an srun inside a larger allocation): preferred to the job's where set
SLURM_STEP_TASKS_PER_NODE, SLURM_STEP_NODELIST, SLURM_JOB_ID = (
    "SLURM_STEP_TASKS_PER_NODE",
    "SLURM_STEP_NODELIST",
    "SLURM_JOB_ID",
)
# torchrun's default master port. Under SLURM one task per GPU (unless --rdzv-endpoint or MASTER_PORT says)
# the job id is added modulo 1000, so that two jobs whose first node is the same do not meet on one port.
DEFAULT_PORT = 29500
# torchrun's own flags as environment variables (torchrun reads PET_<FLAG> as each flag's default): what
# Kubeflow Trainer sets in every node's container. ddpkit reads them only when torchrun is not there.
PET_NNODES, PET_NPROC_PER_NODE, PET_NODE_RANK = "PET_NNODES", "PET_NPROC_PER_NODE", "PET_NODE_RANK"
PET_MASTER_ADDR, PET_MASTER_PORT = "PET_MASTER_ADDR", "PET_MASTER_PORT"
LAUNCHED_BY = "DDPKIT_LAUNCHED_BY"  # "slurm": this process set RANK etc. from srun's variables itself
SLURM_FIX = "srun sets it for each task; if this process is not one of srun's tasks, unset the SLURM_* variables"
PET_FIX = "Kubeflow Trainer sets the PET_* variables as torchrun's flags; correct it, or unset it"


def expand_nodelist(nodelist: str, variable: str = SLURM_JOB_NODELIST) -> list[str]:
    """SLURM's compact host list as host names, in order: ``node[01-03,07],gpu5`` is node01, node02,
    node03, node07, gpu5 (zero padding kept; several bracket groups in one name multiply out), as
    ``scontrol show hostnames`` prints it. ``variable``: the one it was read from, named in an error."""
    hosts: list[str] = []
    for name in _split_top(nodelist, variable):
        hosts.extend(_expand_name(name, nodelist, variable))
    return hosts


def _split_top(text: str, variable: str) -> list[str]:
    """``text`` split at the commas outside brackets."""
    parts, depth, start = [], 0, 0
    for i, ch in enumerate(text):
        depth += {"[": 1, "]": -1}.get(ch, 0)
        if depth < 0 or depth > 1:
            raise ConfigError(f"{variable}={text!r} is not a SLURM host list (unbalanced brackets)")
        if ch == "," and depth == 0:
            parts.append(text[start:i])
            start = i + 1
    if depth:
        raise ConfigError(f"{variable}={text!r} is not a SLURM host list (unbalanced brackets)")
    parts.append(text[start:])
    return [p.strip() for p in parts if p.strip()]


def _expand_name(name: str, nodelist: str, variable: str) -> list[str]:
    if "[" not in name:
        return [name]
    head, rest = name.split("[", 1)
    ranges, tail = rest.split("]", 1)
    numbers: list[str] = []
    for part in ranges.split(","):
        lo, _, hi = part.strip().partition("-")
        if not _WHOLE.fullmatch(lo) or (hi and not _WHOLE.fullmatch(hi)) or (hi and int(hi) < int(lo)):
            raise ConfigError(
                f"{variable}={nodelist!r} is not a SLURM host list: the range [{ranges}] in {name!r} is not of "
                f"the form 01-03,07"
            )
        width = len(lo)  # node[08-10]: 08, 09, 10
        numbers.extend(str(n).zfill(width) for n in range(int(lo), int(hi or lo) + 1))
    return [head + n + t for n in numbers for t in _expand_name(tail, nodelist, variable)]


_TASK_COUNTS = re.compile(r"([0-9]+)(?:\(x([0-9]+)\))?")  # one entry of SLURM's compact form: 2, or 2(x3)


def tasks_on_node(tasks_per_node: str, node: int, variable: str = SLURM_TASKS_PER_NODE) -> int:
    """The ``node``-th entry of SLURM_TASKS_PER_NODE's compact form: ``2(x3),1`` is 2, 2, 2, 1 (a node past
    the end: the last). ``variable``: the one it was read from, named in an error."""
    entries = [_TASK_COUNTS.fullmatch(part.strip()) for part in tasks_per_node.split(",")]
    if not all(e and int(e[1]) >= 1 and int(e[2] or 1) >= 1 for e in entries):
        raise ConfigError(
            f"{variable}={tasks_per_node!r} is not SLURM's tasks per node (counts such as 4 or 2(x3),1): {SLURM_FIX}"
        )
    for entry in entries:  # walked, not expanded: 2(x100000000) is two numbers
        node -= int(entry[2] or 1)
        if node < 0:
            return int(entry[1])
    return int(entries[-1][1])


def slurm_per_gpu(env: Mapping[str, str] = os.environ) -> tuple[int, int] | None:
    """(tasks, nodes) when this process is one of srun's tasks and there are more tasks than nodes: each task
    is then one rank (SLURM one task per GPU); None otherwise (no srun, or one task per node)."""
    if SLURM_PROCID not in env or SLURM_STEP_ID not in env or SLURM_NTASKS not in env:
        return None
    tasks = int_var(env, SLURM_NTASKS, "a task count (a whole number >= 1)", SLURM_FIX, low=1)
    nodes = int_var(env, SLURM_NNODES, "a node count (a whole number >= 1)", SLURM_FIX, low=1, default=1)
    # Only the counts: SLURM_NTASKS_PER_NODE may be the batch script's, inherited by an `srun -n1`
    return (tasks, nodes) if tasks > nodes else None


def slurm_rank_env(endpoint: str = "", env: Mapping[str, str] = os.environ) -> tuple[dict[str, str], str]:
    """The variables torchrun would give this srun task (RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE,
    GROUP_RANK, MASTER_ADDR, MASTER_PORT), and where the address came from. ``endpoint``
    (``--rdzv-endpoint HOST:PORT``) wins over the first host of SLURM_JOB_NODELIST and MASTER_PORT (or 29500)."""
    node = int_var(env, SLURM_NODEID, "a node index (a whole number >= 0)", SLURM_FIX, default=0)
    tasks = int_var(env, SLURM_NTASKS, "a task count (a whole number >= 1)", SLURM_FIX, low=1)
    rank = int_var(env, SLURM_PROCID, f"a task index below SLURM_NTASKS={tasks}", SLURM_FIX, high=tasks - 1)
    for name in (SLURM_STEP_TASKS_PER_NODE, SLURM_TASKS_PER_NODE, SLURM_NTASKS_PER_NODE):  # the step's, then the job's
        if name in env:
            local_world = tasks_on_node(env[name], node, name)
            break
    else:
        local_world = tasks
    where = f"a task index on this node, below its {local_world} tasks"
    local = int_var(env, SLURM_LOCALID, where, SLURM_FIX, high=local_world - 1, default=0)
    job = int_var(env, SLURM_JOB_ID, "a job id (a whole number)", SLURM_FIX, default=0)
    default_port = DEFAULT_PORT + job % 1000
    port_fix = f"set it to a free port on the first node, or unset it (then {default_port}: 29500 + the job id % 1000)"
    if endpoint:
        addr, port = endpoint.rsplit(":", 1) if ":" in endpoint.strip("[]").split("]")[-1] else (endpoint, "")
        addr, port = addr.strip("[]"), port or str(default_port)
        if not addr:
            raise ConfigError(f"--rdzv-endpoint {endpoint!r}: give HOST:PORT, or HOST")
        source = "--rdzv-endpoint"
    elif env.get(MASTER_VARS[0]):
        addr, port = env[MASTER_VARS[0]], str(port_var(env, MASTER_VARS[1], port_fix, default_port))
        source = "MASTER_ADDR"
    else:
        which = SLURM_STEP_NODELIST if env.get(SLURM_STEP_NODELIST) else SLURM_JOB_NODELIST
        nodelist = env.get(which, "")
        hosts = expand_nodelist(nodelist, which)
        if not hosts:
            raise ConfigError(
                f"{which}={nodelist!r} names no host to meet at: give --rdzv-endpoint HOST:PORT (the first node)"
                if nodelist
                else f"{SLURM_STEP_NODELIST} and {SLURM_JOB_NODELIST} are not set: give --rdzv-endpoint HOST:PORT "
                "(the first node)"
            )
        addr, port = hosts[0], str(port_var(env, MASTER_VARS[1], port_fix, default_port))
        source = f"the first host of {which}={nodelist}"
    values = {
        RANK: str(rank),
        LOCAL_RANK: str(local),
        WORLD_SIZE: str(tasks),
        LOCAL_WORLD_SIZE: str(local_world),
        GROUP_RANK: str(node),
        MASTER_VARS[0]: addr,
        MASTER_VARS[1]: port,
        LAUNCHED_BY: "slurm",
    }
    return values, source


def pet_launch(env: Mapping[str, str] = os.environ) -> dict[str, str]:
    """torchrun's PET_* variables (Kubeflow Trainer) as ddpkit's flags: {"--nnodes": "2", ...}; empty where
    none is set. Only outside torchrun: torchrun reads them itself."""
    flags = {}
    if PET_NNODES in env:  # torchrun's MIN:MAX (an elastic range) is not one ddpkit launches
        flags["--nnodes"] = str(int_var(env, PET_NNODES, "a node count (a whole number >= 1)", PET_FIX, low=1))
    if PET_NPROC_PER_NODE in env:
        nproc = env[PET_NPROC_PER_NODE]
        if nproc not in ("auto", "gpu"):
            what = "a process count per node (a whole number >= 1, auto or gpu)"
            nproc = str(int_var(env, PET_NPROC_PER_NODE, what, PET_FIX, low=1))
        flags["--nproc"] = nproc
    if env.get(PET_MASTER_ADDR):
        flags["--rdzv-endpoint"] = f"{env[PET_MASTER_ADDR]}:{port_var(env, PET_MASTER_PORT, PET_FIX, DEFAULT_PORT)}"
    elif env.get(PET_MASTER_PORT):  # read only with PET_MASTER_ADDR, but a bad one is a mistake either way
        port_var(env, PET_MASTER_PORT, PET_FIX)
    if PET_NODE_RANK in env:
        nodes = int(flags.get("--nnodes", "0"))  # checked against --nnodes by the launcher where PET_NNODES is unset
        what = f"a node index below PET_NNODES={nodes}" if nodes else "a node index (a whole number >= 0)"
        flags["node rank"] = str(int_var(env, PET_NODE_RANK, what, PET_FIX, high=nodes - 1 if nodes else None))
    return flags


def replica_group(env: Mapping[str, str] = os.environ) -> tuple[int, str, str] | None:
    """(this group's index, the lighthouse's address, the launcher's store) in a group of ``ddpkit train
    --replicas``; None elsewhere."""
    if REPLICA not in env:
        return None
    index = int_var(env, REPLICA, "a replica group's index", "it is ddpkit's own: unset it", low=0)
    return index, env.get(LIGHTHOUSE, ""), env.get(REPLICA_STORE, "")


def replica_count(env: Mapping[str, str] = os.environ) -> int:
    """R, the replica groups of the run, in a group of ``--replicas R`` (1 elsewhere)."""
    return int_var(env, REPLICAS, "the replica groups' count", "it is ddpkit's own: unset it", low=1, default=1)


def process_started_at(pid: int) -> float:
    """When process ``pid`` started, in seconds since the epoch (Linux's /proc: field 22 of its stat, clock ticks
    after boot, set against the boot clock now: /proc/stat's ``btime`` is whole seconds, up to 1 s early, the size
    of the start-ups this times); infinity where unknown."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            ticks = int(f.read().rsplit(")", 1)[1].split()[19])
        since_boot = time.clock_gettime(time.CLOCK_BOOTTIME)
        return time.time() - (since_boot - ticks / os.sysconf("SC_CLK_TCK"))
    except (OSError, ValueError, IndexError, AttributeError):
        return float("inf")
