"""``ddpkit train --replicas R``: R replica groups on this node, each a ``ddpkit train`` of its own under its own
elastic agent (so a lost group is restarted by its agent, ``--max-restarts``, while the others train on), and
torchft's lighthouse between them, which holds the groups' quorum (train/replicas.py is a group's side).

    lighthouse = LighthouseServer(...)           # in a process of its own, for the job's life
    ddpkit train ARGS --run-dir RUN_DIR          # group 0 (DDPKIT_REPLICA=0), and group g with
    ddpkit train ARGS --run-dir RUN_DIR-group-g  # its own run dir: its records and snapshots

Each group writes its own run dir: a group's snapshots go on while another is gone, and a rerun of the command
resumes every group from its own (the quorum then heals any that is behind). Group 0's is the run's.
"""

from __future__ import annotations

import importlib.util
import os
import signal
import subprocess
import sys
import time
from typing import Callable

from ..config import TrainConfig
from ..errors import ConfigError
from . import env

NEEDS_FT = "--replicas needs torchft: pip install 'ddpkit[ft]' (or pip install torchft)"

# A group is out of the quorum once its heartbeats (every 100 ms, torchft's Manager) stop for this long (ms): the
# groups present stall that long at most before the next step's quorum leaves it out. A lost group's process is
# gone at once (its sockets close, so the step in flight fails at once); a live one that misses ten beats is slow.
HEARTBEAT_TIMEOUT_MS = 1000
# How long the lighthouse waits for more groups to join a quorum once the first ones have asked (ms): a group
# coming back joins the next step's quorum instead of holding this one
JOIN_TIMEOUT_MS = 100


def here_key(group: int) -> str:
    """The launcher's store key that group ``group`` sets when it reaches the groups' meeting (train/replicas.py), in
    every attempt: a group whose first attempt failed before it got there is counted when its restart does."""
    return f"ddpkit/replicas/here/{group}"


def quorum_key(group: int) -> str:
    """The launcher's store key where group ``group`` says where it is with the quorums, as "WORD STEP TIME" (TIME:
    the wall clock's seconds then): "asked" a step's quorum, once it has "formed", "starting" (each attempt, at the
    meeting), "done" (the run ended). How a group outside its step learns that another waits for it, and how a
    quorum that did not form names where the others were (train/replicas.py)."""
    return f"ddpkit/replicas/quorum/{group}"


def all_here(store, count: int) -> bool:
    """Whether every one of the ``count`` groups has reached the meeting (training has begun)."""
    return store.check([here_key(g) for g in range(count)])


def group_dir(run_dir: str, group: int) -> str:
    """Group ``group``'s run dir: the run's own for group 0."""
    return run_dir if group == 0 else f"{run_dir}-group-{group}"


def run_groups(cfg: TrainConfig, argv: list[str]) -> int:
    """``ddpkit train --replicas R`` (``argv``: its arguments as given): each group is that command again, with
    one process and its own run dir."""
    run_dir = str(cfg.resolved().run_dir)  # every group is named from the one config

    def command(g: int) -> list[str]:
        quiet = ["--quiet"] if g else []  # the console shows group 0's records; each group's are in its run dir
        # One process a group (--nproc auto would start one per GPU): argparse takes the last --nproc given
        return ["train", *argv, "--nproc", "1", "--run-dir", group_dir(run_dir, g), *quiet]

    return start_groups(cfg.replicas, command, run_dir)


def start_groups(count: int, command: Callable[[int], list[str]], run_dir: str | None, unmet: str = "") -> int:
    """Start the lighthouse and the ``count`` groups (group ``g``: ``ddpkit COMMAND(g)``), wait for every group, and
    return the job's exit status: 0 when every group ended well, else the first failure's. ``run_dir``: group 0's,
    said at the end (None: a script's, which its Loop names). ``unmet``: the error when group 0 ended well without
    meeting the others (a script with no ddpkit.Loop: it ran as a world of its own), exit 2."""
    if importlib.util.find_spec("torchft") is None:
        raise ConfigError(NEEDS_FT)
    # torchft's Rust side logs every quorum (a line per step and group): its errors only
    os.environ.setdefault("RUST_LOG", "error")
    lighthouse = subprocess.Popen(
        [sys.executable, "-c", LIGHTHOUSE, str(JOIN_TIMEOUT_MS), str(HEARTBEAT_TIMEOUT_MS)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,  # its log is of every quorum, at any RUST_LOG
        text=True,
    )
    from torch.distributed import TCPStore  # after the lighthouse's start, which its import of torch then overlaps

    store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)  # where the groups meet before step 0
    groups: list[subprocess.Popen] = []
    try:
        address = lighthouse.stdout.readline().strip()
        if not address:
            raise ConfigError(
                f"torchft's lighthouse did not start (exit {lighthouse.wait()}): is torchft installed whole?"
            )
        shares = core_shares(sorted(os.sched_getaffinity(0)), count)
        import torch

        gpus = gpu_shares(count, os.environ.get("CUDA_VISIBLE_DEVICES"), torch.cuda.device_count())
        with _forwarded(groups) as signals:  # the list as it grows
            for g in range(count):
                if signals.received:  # stopped while the groups start: the ones started stop, no more start
                    break
                if g == 1 and not _first_met(groups[0], store):
                    code = _status(groups[0].wait())  # its error is the job's, said once, before the others start
                    if code == 0 and unmet:
                        print(f"ddpkit: error: {unmet}", file=sys.stderr, flush=True)
                        return 2
                    return code
                child_env = {
                    **os.environ,
                    env.REPLICA: str(g),
                    env.REPLICAS: str(count),
                    env.LIGHTHOUSE: address,
                    env.REPLICA_STORE: f"127.0.0.1:{store.port}",
                    # Each group on its own cores (its processes inherit them, and size their threads to them):
                    # groups that each took every core would oversubscribe the node, 4x slower per step on 2 cores.
                    # Set by the group itself (enter_group): a preexec_fn is not safe beside the store's thread
                    env.REPLICA_CORES: ",".join(map(str, shares[g])),
                    # and on its own GPU, its cuda:0 (each group is one process: a world of its own)
                    **({"CUDA_VISIBLE_DEVICES": gpus[g]} if gpus[g] is not None else {}),
                }
                groups.append(subprocess.Popen([sys.executable, "-m", "ddpkit", *command(g)], env=child_env))
            return _ended(_wait(groups, count, store, lighthouse, signals), run_dir)
    finally:
        _stop(groups)
        lighthouse.stdin.close()  # it ends when its input does
        try:
            lighthouse.wait(timeout=10)
        except subprocess.TimeoutExpired:
            lighthouse.kill()


def enter_group() -> None:
    """In a group's own process, first thing: its cores (``DDPKIT_REPLICA_CORES``, from :func:`core_shares`), and
    SIGTERM when the launcher that started it dies (Linux's parent-death signal), as from the launcher itself: the
    group stops at its next safe point, with a snapshot, instead of training on without its lighthouse."""
    cores = os.environ.get(env.REPLICA_CORES)
    if cores:
        os.sched_setaffinity(0, [int(c) for c in cores.split(",")])
    if sys.platform.startswith("linux"):
        import ctypes

        PR_SET_PDEATHSIG = 1  # prctl(2)
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)


# How long the groups have to stop at their next safe point when the launcher ends them (seconds), before SIGKILL
STOP_GRACE_S = 30.0
# After a stop signal, how long the launcher waits for the groups (seconds): a group's own agent gives its workers
# 30 s before it kills them; a group of one process without restarts has no agent, and one stuck in its own code
# would not stop
STOP_WAIT_S = 2 * STOP_GRACE_S


def _stop(groups: list[subprocess.Popen], grace_s: float = STOP_GRACE_S) -> None:
    """End every group still running: SIGTERM (each stops at its next safe point, with a snapshot, and its agent
    stops its workers), then SIGKILL after ``grace_s``. (A SIGKILL first would leave a group's workers running.)"""
    running = [p for p in groups if p.poll() is None]
    for p in running:
        p.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    for p in running:
        try:
            p.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()


def core_shares(cores: list[int], groups: int) -> list[list[int]]:
    """The node's ``cores`` dealt to ``groups`` replica groups: equal runs of them, or one each, in turn, where there
    are fewer cores than groups."""
    if len(cores) < groups:
        return [[cores[g % len(cores)]] for g in range(groups)]
    return [cores[g * len(cores) // groups : (g + 1) * len(cores) // groups] for g in range(groups)]


def gpu_shares(groups: int, visible: str | None, count: int) -> list[str | None]:
    """Each group's ``CUDA_VISIBLE_DEVICES``: one of the node's GPUs (``visible``, the launcher's own
    ``CUDA_VISIBLE_DEVICES``, else the ``count`` GPUs torch sees), in turn where there are fewer GPUs than groups
    (groups sharing one each hold a copy of the model there); None, left as it is, on a node without."""
    ids = [v.strip() for v in visible.split(",") if v.strip()] if visible is not None else list(map(str, range(count)))
    return [ids[g % len(ids)] if ids else None for g in range(groups)]


def _first_met(group: subprocess.Popen, store) -> bool:
    """Wait until group 0 has reached the groups' meeting (past its checks, its data and model loaded and its
    trial step run: train/replicas.py) or has ended; whether it got there. The others start only then, so that a
    failure every group would meet (unreadable data, a model that does not build) is said once, by group 0."""
    while group.poll() is None:
        if store.check([here_key(0)]):
            return True
        time.sleep(0.1)
    return False


def _status(code: int) -> int:
    """A group's exit status as the job's: a group ended by signal N is 128 + N, as a shell says it."""
    return 128 - code if code < 0 else code


def _wait(
    groups: list[subprocess.Popen], count: int, store, lighthouse: subprocess.Popen, signals: _forwarded | None = None
) -> tuple[list[int], list[int]]:
    """Every group's exit status (as a shell says it), in the order the groups ended, once all have. A group that
    fails before all ``count`` groups have met (the store's keys: train/replicas.py) met a failure the others would
    meet too: they are stopped, not left waiting for it. Once training has begun, a lost group is its own agent's to
    restart (--max-restarts), and the others train on. The lighthouse lost: no group can step again, and each is
    stopped at its next safe point (a rerun of the command resumes every group from its own snapshot). Stopped by a
    signal (``signals``), a group still running ``STOP_WAIT_S`` later (one stuck in its own code, which no safe
    point reaches) is killed."""
    ended: dict[int, int] = {}
    while True:
        for g, p in enumerate(groups):
            if g not in ended and p.poll() is not None:
                ended[g] = _status(p.returncode)
        if len(ended) == len(groups):
            return [ended[g] for g in range(len(groups))], list(ended)
        if signals is not None and signals.received and time.monotonic() - signals.first_at > STOP_WAIT_S:
            for p in groups:
                if p.poll() is None:
                    p.kill()
        failed_early = any(ended.values()) and not all_here(store, count)
        if failed_early or lighthouse.poll() is not None:
            if not failed_early:
                print(
                    f"ddpkit: torchft's lighthouse ended (exit {lighthouse.returncode}), and with it the groups' "
                    f"quorum: every group is stopped; run the same command again to resume",
                    file=sys.stderr,
                    flush=True,
                )
            _stop(groups)
            return [_status(p.returncode) for p in groups], [*ended, *(g for g in range(len(groups)) if g not in ended)]
        time.sleep(0.2)


def _ended(result: tuple[list[int], list[int]], run_dir: str | None) -> int:
    """The job's exit status from its groups' (``result``: their statuses by group, and the order they ended in):
    0 when a group finished the run, however many were lost on the way (their losses said in one line, with where
    the finished run is); else the first failure's, which its group has said."""
    codes, order = result
    finished = [g for g, c in enumerate(codes) if c == 0]
    lost = [g for g, c in enumerate(codes) if c != 0]
    if finished and lost:
        where = group_dir(run_dir, finished[0]) if run_dir else f"replica group {finished[0]}'s run dir"
        print(
            f"ddpkit: replica group{'s' if len(lost) > 1 else ''} {', '.join(map(str, lost))} ended early "
            f"(exit {', '.join(str(codes[g]) for g in lost)}; its output above says why) and the other"
            f"{'s' if len(finished) > 1 else ''} trained on: the run finished in {where}",
            file=sys.stderr,
            flush=True,
        )
        return 0
    return next((codes[g] for g in order if codes[g]), 0)


# The lighthouse, in a process of its own: its address on stdout, then it serves until its stdin closes (the
# launcher ended, however it ended). Deaf to SIGTERM, SIGUSR1 and Ctrl-C, which reach the whole job (SLURM signals every
# process of a step): the groups stop at their next safe point, and need the quorum's steps until then.
LIGHTHOUSE = """
import signal, sys
signal.signal(signal.SIGTERM, signal.SIG_IGN)
signal.signal(signal.SIGINT, signal.SIG_IGN)
signal.signal(signal.SIGUSR1, signal.SIG_IGN)
from torchft._torchft import LighthouseServer
server = LighthouseServer(bind="[::]:0", min_replicas=1, join_timeout_ms=int(sys.argv[1]),
                          heartbeat_timeout_ms=int(sys.argv[2]))
print(server.address(), flush=True)
sys.stdin.read()
server.shutdown()
"""


class _forwarded:
    """SIGTERM and SIGUSR1 to this process passed on to every group (each stops at its next safe point, with a
    snapshot); Ctrl-C reaches them from the terminal itself, as they share its process group."""

    SIGNALS = (signal.SIGTERM, signal.SIGUSR1)

    def __init__(self, groups: list[subprocess.Popen]):
        self.groups, self.previous = groups, {}
        self.received: list[int] = []  # the signals passed on: a group started after one would not have had it
        self.first_at = 0.0  # when the first came (time.monotonic)

    def __enter__(self):
        for sig in self.SIGNALS:
            self.previous[sig] = signal.signal(sig, self._send)
        # the groups stop and say so; this one waits for them
        self.previous[signal.SIGINT] = signal.signal(signal.SIGINT, signal.SIG_IGN)
        return self

    def _send(self, signum, _frame) -> None:
        if not self.received:
            self.first_at = time.monotonic()
        self.received.append(signum)
        for p in self.groups:
            if p.poll() is None:
                p.send_signal(signum)

    def __exit__(self, *exc) -> None:
        for sig, handler in self.previous.items():
            signal.signal(sig, handler)
