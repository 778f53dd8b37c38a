"""Process launch: hand off to torch's elastic agent, never manage processes ourselves.

    result = launch(fn, *args, nproc=2)       # public: fn(ctx, *args) on every rank, rank 0's result
    result = run_workers(fn, args, spec)      # ddpkit's own: fn(*args), spec = LaunchSpec.from_config(cfg)
    run_script("train.py", ["--lr", "0.1"], spec)   # `ddpkit run`: python train.py --lr 0.1 on every rank

* Already under torchrun (RANK/LOCAL_RANK/WORLD_SIZE set): run ``fn`` here, no relaunch;
  torchrun's own flags decide nodes and restarts.
* One process, one node, no restarts: run ``fn`` here.
* Otherwise ``elastic_launch`` starts ``nproc`` workers on this node with c10d rendezvous:
  on ``localhost:0`` (a free port, as ``torchrun --standalone``) for one node, or on
  ``--rdzv-endpoint`` where ``--nnodes`` agents meet. ``--max-restarts`` is the agent's:
  after a worker fails it restarts the whole group, which resumes from the newest snapshot.

Workers are forked from a forkserver (see :mod:`ddpkit.ranks.prestart`), which imported torch
once, and unpickle ``fn`` and its arguments, as ``spawn`` would but without importing
torch again (``spawn`` where a platform has no forkserver). Where neither can import
``fn`` (a function or class defined in a notebook, ``python -c`` or a lambda), workers
are forked from this process if that is safe: on CPU, with CUDA not initialised here, as
Lightning's ``ddp_notebook`` and Accelerate's ``notebook_launcher`` do; each then runs
one intra-op thread, since OpenMP cannot run in a child forked after its parent used it.
"""

from __future__ import annotations

import ast
import dataclasses
import functools
import hashlib
import inspect
import io
import json
import logging
import multiprocessing
import os
import pickle
import shutil
import signal
import sys
import tempfile
import threading
import types
import uuid
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator

import numpy as np
import torch

from ..config import TrainConfig, check_timeout_s
from ..device import resolve_device_type
from ..errors import ConfigError, PeerLost, WorkersFailed
from . import env as names
from .child import worker_entry
from .context import cpu_threads, distributed
from .endnotes import read_returned, read_run_end
from .env import check_launcher_env, under_launcher
from .failures import (
    Failure,
    interrupted,
    launch_failure,
    restart_note,
    returned_failure,
    stopped_report,
)
from .netinfo import interface_of, is_local, is_loopback, route_addr, split_endpoint
from .prestart import forkserver_available, prestart_workers, start_resource_tracker


@dataclass(frozen=True)
class LaunchSpec:
    nproc: int = 1
    nnodes: int = 1
    rdzv_endpoint: str = ""
    rdzv_id: str = ""
    local_addr: str = ""
    max_restarts: int = 0
    timeout_s: float = 600.0  # --timeout-s: collectives, and how long an agent waits at rendezvous for the other nodes
    device_type: str = "cpu"  # decides whether fork is a safe fallback for spawn
    resumable: bool = False  # a training run: an interrupted one saves a snapshot and can be resumed

    node_rank: int = -1  # PET_NODE_RANK (Kubeflow): node 0 hosts the rendezvous store; -1: torch decides

    @classmethod
    def from_config(cls, cfg: TrainConfig, resumable: bool = True) -> "LaunchSpec":
        check_launcher_env()
        defaults = type(cfg)()
        set_here = {
            f"--{n.replace('_', '-')}": getattr(cfg, n)
            for n in ("nnodes", "rdzv_endpoint", "rdzv_id", "local_addr", "max_restarts")
            if getattr(cfg, n) != getattr(defaults, n)
        }
        adopt_slurm_task(cfg.rdzv_endpoint, cfg.nnodes if "--nnodes" in set_here else 0)
        if os.environ.get(names.LAUNCHED_BY) == "slurm":  # each srun task is one rank; the endpoint was used
            owner = "SLURM one task per GPU, where no elastic agent runs,"
            set_here = {k: v for k, v in set_here.items() if k not in ("--nnodes", "--rdzv-endpoint")}
        else:
            owner = "torchrun, which"
        if under_launcher() and set_here:
            raise ConfigError(
                f"this process was started by {owner} owns {', '.join(set_here)}: "
                f"give them to torchrun instead (or launch with ddpkit alone)"
            )
        nproc, nnodes, endpoint, node_rank = cfg.nproc, cfg.nnodes, cfg.rdzv_endpoint, -1
        if not under_launcher():
            nproc, nnodes, endpoint, node_rank = _from_pet(cfg, set_here)
            if nnodes > 1 and not endpoint:  # here, not in the config: SLURM and PET_* can give the endpoint
                raise ConfigError(
                    f"--nnodes {nnodes} needs --rdzv-endpoint HOST:PORT (an address of one node "
                    f"that every node can reach, with a free port), the same on every node"
                )
        run_id = cfg.rdzv_id
        if not run_id and nnodes > 1:
            # Every node runs the same command, so a hash of the config is an id they all agree on.
            blob = json.dumps(cfg.to_dict(), sort_keys=True, default=str).encode()
            run_id = "ddpkit-" + hashlib.sha256(blob).hexdigest()[:16]
        return cls(
            resolve_nproc(nproc, cfg.device),
            nnodes,
            endpoint,
            run_id,
            cfg.local_addr,
            cfg.max_restarts,
            cfg.timeout_s,
            resolve_device_type(cfg.device),
            resumable,
            node_rank,
        )

    @property
    def in_process(self) -> bool:
        return under_launcher() or (self.nproc == 1 and self.nnodes == 1 and self.max_restarts == 0)

    @property
    def world_size(self) -> int:
        return int(os.environ[names.WORLD_SIZE]) if under_launcher() else self.nproc * self.nnodes


_said: set[str] = set()  # the cluster lines already printed by this process (from_config runs more than once)


def _say_once(line: str) -> None:
    if line not in _said:
        _said.add(line)
        print(line, file=sys.stderr, flush=True)


def adopt_slurm_task(endpoint: str = "", nnodes: int = 0) -> None:
    """Under srun, say which SLURM mode this is; with more tasks than nodes (one task per GPU), make this task
    one rank as torchrun would (RANK=SLURM_PROCID, WORLD_SIZE=SLURM_NTASKS, LOCAL_RANK=SLURM_LOCALID, the
    first host of SLURM_JOB_NODELIST as MASTER_ADDR), so that it trains here, with no agent and no relaunch.
    ``nnodes``: an explicit --nnodes, which must agree with SLURM_NNODES (0: none given)."""
    if under_launcher() or names.SLURM_STEP_ID not in os.environ or names.SLURM_PROCID not in os.environ:
        return
    first = os.environ[names.SLURM_PROCID] == "0"  # only the first task says the mode
    per_gpu = names.slurm_per_gpu()
    if per_gpu is None:
        if first:
            _say_once(
                f"ddpkit: SLURM one task per node (SLURM_NTASKS={os.environ.get(names.SLURM_NTASKS, '?')}, "
                f"SLURM_NNODES={os.environ.get(names.SLURM_NNODES, '?')}): each task's launcher starts --nproc workers"
            )
        return
    tasks, nodes = per_gpu
    if nnodes and nnodes != nodes:
        raise ConfigError(f"--nnodes {nnodes} but SLURM_NNODES={nodes}: drop --nnodes under srun")
    values, source = names.slurm_rank_env(endpoint)
    check_launcher_env(values)
    os.environ.update(values)
    if first:
        _say_once(
            f"ddpkit: SLURM one task per GPU (SLURM_NTASKS={tasks} > SLURM_NNODES={nodes}): each task is one rank, "
            f"world size {tasks}, meeting at {values['MASTER_ADDR']}:{values['MASTER_PORT']} ({source})"
        )


def _from_pet(cfg: TrainConfig, set_here: dict) -> tuple[str, int, str, int]:
    """(nproc, nnodes, rdzv_endpoint, node_rank) from torchrun's PET_* variables (Kubeflow Trainer runs
    ``ddpkit train`` directly in each node's container) where set; a flag given explicitly wins, and one that
    disagrees with its variable is refused."""
    pet = names.pet_launch()
    nproc, nnodes, endpoint, node_rank = cfg.nproc, cfg.nnodes, cfg.rdzv_endpoint, -1
    if not pet:
        return nproc, nnodes, endpoint, node_rank
    nproc_given = cfg.nproc != type(cfg)().nproc
    given = {**set_here, **({"--nproc": cfg.nproc} if nproc_given else {})}
    env_name = {"--nnodes": "PET_NNODES", "--nproc": "PET_NPROC_PER_NODE", "--rdzv-endpoint": "PET_MASTER_ADDR"}
    for flag, value in pet.items():
        if flag in given and str(given[flag]) != value:
            raise ConfigError(f"{flag} {given[flag]} but {env_name[flag]} says {value}: give one or make them agree")
    nnodes = int(pet.get("--nnodes", nnodes))  # whole numbers: names.pet_launch checked them
    node_rank = int(pet.get("node rank", -1))
    if node_rank >= nnodes:
        raise ConfigError(
            f"PET_NODE_RANK={node_rank} but --nnodes {nnodes}: a node index is 0 to {nnodes - 1}; "
            f"give --nnodes (or PET_NNODES) the job's node count"
        )
    nproc = pet.get("--nproc", nproc)
    nproc = "auto" if nproc == "gpu" else nproc  # torchrun's words for one per GPU
    endpoint = pet.get("--rdzv-endpoint", endpoint)
    if nnodes > 1 and not endpoint:
        raise ConfigError(
            f"PET_NNODES={nnodes} without PET_MASTER_ADDR: set it to node 0's address (or --rdzv-endpoint)"
        )
    shown = ", ".join(f"{k} {v}" for k, v in pet.items())
    _say_once(f"ddpkit: launch taken from torchrun's PET_* variables (Kubeflow Trainer, no torchrun here): {shown}")
    return nproc, nnodes, endpoint, node_rank


def resolve_nproc(nproc: str, device: str) -> int:
    """``--nproc`` as a number: auto is one per visible GPU, or 1 on CPU."""
    if under_launcher():
        return int(os.environ.get(names.LOCAL_WORLD_SIZE, os.environ[names.WORLD_SIZE]))
    gpus = torch.cuda.device_count() if resolve_device_type(device) == "cuda" else 0
    if nproc == "auto":
        return max(1, gpus)
    n = int(nproc)
    if gpus and n > gpus and os.environ.get(names.SHARE_GPU) != "1":  # shared: every rank on cuda:0 (ranks.context)
        raise ConfigError(
            f"--nproc {n} asks for more processes than the {gpus} visible GPU(s); use --nproc {gpus} or --nproc auto "
            f"(or, for testing, {names.SHARE_GPU}=1: every rank on cuda:0, over gloo)"
        )
    return n


def launch(
    fn: Callable,
    *args,
    nproc: int | str = "auto",
    device: str = "auto",
    timeout_s: float = 600.0,
    max_restarts: int = 0,
    **unknown: Any,
) -> Any:
    """Run ``fn(ctx, *args)`` in ``nproc`` processes, each inside its process group; return rank 0's result.
    (``unknown``: mp.spawn's keywords in a port, ``args=`` and ``nprocs=``, refused in one line naming these.)

    ``ctx`` is a :class:`ddpkit.ranks.context.DistContext` (rank, local_rank, world_size, device,
    backend, and all_reduce/broadcast/all_gather/barrier helpers). The process group is
    destroyed even on error. For users who write their own loop (as a script that calls
    ``mp.spawn`` itself does). Under torchrun ``nproc`` is torchrun's, and each process gets its own
    result. ``fn``'s return value must be picklable.
    """
    if unknown:  # mp.spawn's words (args=, nprocs=, join=) in a port: the mapping, not a bare TypeError
        raise ConfigError(
            f"ddpkit.launch() got {', '.join(f'{k}=' for k in unknown)}: it is launch(fn, *args, nproc=N, "
            f"device=, timeout_s=, max_restarts=); mp.spawn(fn, args=(a, b), nprocs=N) is launch(fn, a, b, "
            f"nproc=N), and fn is called as fn(ctx, a, b) with the rank in ctx.rank"
        )
    _check_call(fn, args)
    check_timeout_s(timeout_s, "timeout_s")  # 1e30 was an OverflowError on every rank
    refuse_if_importing_main()
    adopt_slurm_task()
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        error = ConfigError(
            "ddpkit.launch() was called inside a launched function, where every rank already runs it in its "
            "process group: call the inner function directly, with the ctx you were given"
        )
        error.all_ranks = True  # every rank meets it: said once, by the launcher
        raise error
    spec = LaunchSpec(
        nproc=resolve_nproc(str(nproc), device),
        max_restarts=max_restarts,
        timeout_s=timeout_s,
        device_type=resolve_device_type(device),
    )
    return run_workers(_in_process_group, (fn, device, timeout_s, *args), spec)


def _check_call(fn: Callable, args: tuple) -> None:
    """``fn(ctx, *args)`` can be called as written, or one line before any worker starts (before, a missing
    argument was a TypeError on every rank after the workers had started: the porter's seed-001 port)."""
    try:
        # fn's own, not what it wraps: a decorator may supply an argument (functools.wraps sets __wrapped__)
        signature = inspect.signature(fn, follow_wrapped=False)
    except (TypeError, ValueError):  # a builtin or C function: no signature to read
        return
    try:
        signature.bind(None, *args)
    except TypeError as exc:
        name = getattr(fn, "__qualname__", repr(fn))
        raise ConfigError(
            f"ddpkit.launch calls {name}(ctx, *args) on every rank, and {name}{signature} cannot take "
            f"({', '.join(['ctx', *map(_short, args)])}): {exc}"
        ) from None


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


def _in_process_group(fn: Callable, device: str, timeout_s: float, *args) -> Any:
    with distributed(device, timeout_s) as ctx:
        result = fn(ctx, *args)
        if os.environ.get(names.LAUNCHER_PID):  # spawned by run_workers: the result travels back pickled
            check_returnable(result, ctx)
        return result


def check_returnable(result: Any, ctx) -> None:
    """Every rank's return value must pickle (torch's agent sends each back to the launcher); if one
    does not, every rank says which, once (a collective: every rank calls this)."""
    try:
        pickle.dumps(result)
        problem = None
    except Exception as exc:  # noqa: BLE001 - pickle raises TypeError, AttributeError, PicklingError, ...
        problem = f"a {type(result).__module__}.{type(result).__qualname__} ({type(exc).__name__}: {exc})"
    gathered = ctx.world_size > 1 and torch.distributed.is_initialized()
    if gathered:
        problems = [None] * ctx.world_size
        torch.distributed.all_gather_object(problems, problem)
        bad = [(rank, p) for rank, p in enumerate(problems) if p]
    else:  # one rank, or fn destroyed its group itself (an mp.spawn script's main ends so): this rank's own
        bad = [(ctx.rank, problem)] if problem else []
    if bad:
        rank, what = bad[0]
        error = ConfigError(
            f"rank {rank}'s return value cannot be sent back to the launcher: {what} does not pickle; "
            f"return plain data (numbers, strings, tensors, lists and dicts of them)"
        )
        error.all_ranks = gathered  # every rank knows it from the gather: said once, by the launcher
        raise error


def prestart_for(spec: LaunchSpec) -> None:
    """Start the forkserver now if ``spec``'s workers will be forked from it, so that its import of torch
    (and dynamo, ~4 s on a 2-core machine) overlaps the data load and the checks before launch. The CLI
    starts it before importing torch; a script on the Python API has imported torch already, and without
    this waited at launch for the whole import (appendix A's toy: 4.6 s from launch to the workers' first
    line). Code with no file to import (``python -c``, a notebook) has its workers forked from here instead."""
    script = getattr(sys.modules.get("__main__"), "__file__", None)
    if spec.in_process or not script or str(script).startswith("<"):
        return
    prestart_workers()


def run_workers(fn: Callable, args: tuple, spec: LaunchSpec | int) -> Any:
    """Run ``fn(*args)`` on every rank; return global rank 0's result (on another node, that
    node's lowest rank's). An int ``spec`` is ``nproc``."""
    refuse_if_importing_main()
    check_launcher_env()
    if isinstance(spec, int):
        spec = LaunchSpec(nproc=spec)
    if spec.in_process:
        return fn(*args)
    start = start_method(fn, args, spec.device_type, spec.nproc)
    if start != "fork":  # spawned and forkserver workers import the script again
        refuse_unguarded_main()
    if start == "forkserver":
        prestart_workers()  # no-op when the launcher already started it, early
    results = _hand_off(spec, start, worker_entry, (fn, *args))
    result = results[min(results)]  # global rank 0's, or on other nodes this node's first rank's
    if isinstance(result, Failure):
        raise returned_failure(result)
    return result


SCRIPT_ENTRY = "ddpkit.ranks.script_child"  # python -m SCRIPT_ENTRY script.py ARGS: one rank of `ddpkit run`


def run_script(script: str, args: list[str], spec: LaunchSpec) -> None:
    """``python script.py ARGS`` on every rank (``ddpkit run``): torch's agent starts each rank as
    ``python -u -m ddpkit.ranks.script_child script.py ARGS``, as torchrun starts ``python -u script.py``, and
    the job's failure or stop is raised here, said once. One process too: it gets the variables torchrun sets
    (RANK, MASTER_ADDR, ...), which a script's own ``init_process_group()`` reads. Where this process is
    already one rank (of torchrun, or an srun task made one by :func:`adopt_slurm_task`) it becomes the
    script's rank instead (``exec``): its pid, and so the signals sent to it, are the script's."""
    command = ["-m", SCRIPT_ENTRY, script, *args]
    if under_launcher():
        sys.stdout.flush()
        sys.stderr.flush()
        os.execv(sys.executable, [sys.executable, *command])
    _hand_off(spec, "spawn", sys.executable, ("-u", *command))


def _hand_off(spec: LaunchSpec, start: str, entry: Callable | str, args: tuple) -> dict[int, Any]:
    """torch's elastic agent runs ``entry(*args)`` on every rank and returns their results by rank: a function
    (given the workers' variables first: a forkserver's children have its environment, not this one's), or
    a command (``sys.executable``: it inherits them). A failed or stopped job is raised as one error."""
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.elastic.rendezvous.api import RendezvousConnectionError, RendezvousTimeoutError
    from torch.distributed.launcher.api import elastic_launch

    start_resource_tracker()  # before anything of torch's starts it, deaf to a job step's SIGUSR1
    log_dir = tempfile.mkdtemp(prefix="ddpkit-agent-")  # the agent's per-worker error files; removed after
    config, env = _launch_config(spec, start, log_dir)
    # torch's agent leaves SIGTERM and SIGUSR1 to ddpkit's own handler (_stop_signals), which keeps one that
    # comes while the workers are being started, and forwards it once they exist
    own = {names.SIGNALS_TO_HANDLE: AGENT_SIGNALS}
    try:
        with _environ({**env, **own}), _quiet_agent_logs(), _tensors_shared_for(args), _stop_signals() as stops:
            # A command's workers never ignore a stop signal, as a forkserver's children do until their entry
            # restores it: sent once, as torch sends it (sent again, it could end a rank after its Loop stopped
            # and before it filed its stop)
            stops.resend = callable(entry)
            with _our_agent(spec, stops):
                return elastic_launch(config, entry)(*((env, *args) if callable(entry) else args))
    except ChildFailedError as exc:
        raise launch_failure(first_failures(exc.failures), spec.timeout_s, spec.device_type) from None
    except SignalException as exc:
        # The workers are gone (the agent waited for them): one that stopped cleanly said so, and left its stop
        sig = signal.Signals(exc.sigval)
        stopped = stopped_report(log_dir)
        if stopped is not None:
            raise stopped from None
        returned = read_returned(log_dir, spec.nproc)
        if returned is not None:  # the stop came in the workers' teardown, after their work: nothing was lost
            # Raised all the same, with their results: a Python caller was asked to stop (the ddpkit command
            # exits 0, its work done: failures.exit_status)
            raise WorkersFailed(
                f"the launcher received {sig.name} after every worker had finished its work: only their teardown "
                f"was stopped, and nothing was lost",
                False,
                128 + sig.value,
                results=returned,
            ) from None
        raise interrupted(sig, spec.resumable, read_run_end(log_dir)) from None
    except RendezvousTimeoutError:
        raise PeerLost(
            f"the other node(s) did not join within --timeout-s {spec.timeout_s:g} s at --rdzv-endpoint "
            f"{spec.rdzv_endpoint} (--rdzv-id {spec.rdzv_id}): start the same command on all {spec.nnodes} "
            f"nodes, with the same --rdzv-id, and check that each reaches the endpoint"
        ) from None
    except RendezvousConnectionError as exc:  # this node is not the store's host, and the host never answered
        raise PeerLost(
            f"could not reach the rendezvous store at --rdzv-endpoint {spec.rdzv_endpoint} (--rdzv-id "
            f"{spec.rdzv_id}): the node that hosts it (node rank 0, at that address) has not started or has "
            f"exited, or this node cannot reach that address; start the same command on all {spec.nnodes} nodes "
            f"and check the address, the port and any firewall between them ({exc.__cause__ or exc})"
        ) from None
    finally:
        shutil.rmtree(log_dir, ignore_errors=True)  # torch's default leaves one in /tmp per launch


def first_failures(failures: dict) -> dict:
    """The agent's failed workers (``{global rank: ProcessFailure}``) less those it stopped itself: after the
    first failure torch's agent stops a command's other workers with SIGTERM and records them too, and a rank
    it stopped is no cause. All of them where every rank died of SIGTERM (the stop came from outside)."""
    own = {rank: f for rank, f in failures.items() if f.exitcode != -signal.SIGTERM}
    return own or failures


@contextmanager
def _environ(values: dict[str, str]) -> Iterator[None]:
    """Set environment variables for the agent and the workers it starts, then restore them."""
    saved = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


# Storages handed to a worker in file descriptors (torch's default sharing strategy) at most: a forkserver child
# takes at most 256 descriptors in all (``multiprocessing.forkserver.MAXFDS_TO_SEND``), a few of them its own.
FDS_FOR_TENSORS = 128


@contextmanager
def _tensors_shared_for(args: tuple) -> Iterator[None]:
    """Hand the arguments' tensors to the workers without a copy, for the whole launch (restarts included):
    in file descriptors, torch's default, or where there are too many for that, as named shared memory; then
    restore the caller's strategy.

    A forkserver child takes at most 256 file descriptors: torchvision's resnet50 holds 320 tensors, and it
    failed with "ValueError: too many fds". ``file_system`` names each storage's shared memory instead
    (torch's own remedy for "too many open files"), and torch's ``torch_shm_manager`` unlinks the names when
    the last process holding them exits, however it exits. Only where needed: that manager holds this
    process's stderr and outlives its last client by 2 s (libshm's SHUTDOWN_TIMEOUT), so whatever reads the
    launcher's output to its end (``subprocess.run(capture_output=True)``, ``| tee``) waited 2 s more.
    """
    import torch.multiprocessing as tmp

    before = tmp.get_sharing_strategy()
    if cpu_storages(args) > FDS_FOR_TENSORS and "file_system" in tmp.get_all_sharing_strategies():
        tmp.set_sharing_strategy("file_system")
    try:
        yield
    finally:
        tmp.set_sharing_strategy(before)


def cpu_storages(obj: Any) -> int:
    """How many file descriptors pickling ``obj`` for a worker takes under torch's default strategy: one per
    distinct CPU tensor storage (a CUDA tensor goes through CUDA IPC instead), counted high where unsure (a
    sparse or nested tensor: one per part; a tensor whose storage cannot be read). A walk like
    :class:`_Probe`'s into a discarding sink: no tensor data is read or copied. A walk that fails counts as
    too many, so the launch keeps named shared memory, which takes any number."""
    seen: set = set()

    class Sink:
        def write(self, data) -> None:
            pass

    class Count(pickle.Pickler):
        def reducer_override(self, o):
            if isinstance(o, torch.Tensor):
                if o.device.type == "cpu":
                    try:
                        if o.layout != torch.strided or o.is_nested:
                            raise ValueError("several storages")
                        seen.add(o.untyped_storage()._cdata)  # the storage object: two over one buffer are two
                    except Exception:  # noqa: BLE001 - sparse, nested, lazy or a subclass: counted high
                        seen.update((id(o), i) for i in range(4))
                return tuple, ()
            if isinstance(o, np.ndarray):
                return tuple, ()
            return NotImplemented

    try:
        Count(Sink(), protocol=pickle.HIGHEST_PROTOCOL).dump(obj)
    except Exception:  # noqa: BLE001 - what cannot be pickled fails at launch with its own error
        return FDS_FOR_TENSORS + 1
    return len(seen)


STOP_SIGNALS = (signal.SIGTERM, signal.SIGUSR1)  # a scheduler's "stop and save": forwarded to the workers
AGENT_SIGNALS = "SIGINT,SIGHUP,SIGQUIT"  # the ones torch's agent handles itself (its default, less SIGTERM)
RESEND_S = 0.5  # while the agent waits for its workers to stop, each stop signal is sent again this often (s)
# After a function's worker failed, how long the survivors get to exit, and again after SIGTERM, before SIGKILL
# (s; torch's ProcessContext.join waits 30 after SIGTERM). A survivor cannot snapshot (that needs every rank): it
# closes its loggers and says its error. One held in its own code or a C++ wait (a hung rank; its StopSignal only
# notes a SIGTERM, where a plain worker would die of it) kept the job, or its restart, 30 s longer (a hang test:
# 45 s, now 21 s). The cost: rank 0 in the middle of writing a large snapshot when a peer dies is killed after 6 s,
# not 30; the write is atomic, so the snapshot before it stays, and that save is lost.
FAILED_GRACE_S = 3


@dataclass
class _Stops:
    """The launcher's stop signals: whether the workers are being started, a signal kept meanwhile, and
    whether one came at all (then the agent's shutdown sends it again until the workers are gone)."""

    starting: bool = False
    kept: signal.Signals | None = None
    received: signal.Signals | None = None
    resend: bool = True  # sent again to the workers every RESEND_S while the agent waits for them to stop


@contextmanager
def _stop_signals() -> Iterator[_Stops]:
    """SIGTERM and SIGUSR1 (SLURM's ``--signal=USR1@90`` before the time limit) to the launcher, handled as
    torch's agent handles SIGTERM: the handler raises the agent's ``SignalException``, the agent sends the
    signal on to the workers and waits its grace period while they snapshot, and the launcher exits 143 or
    138. Without it SIGUSR1's default action ended the launcher at once, its workers with it, unsaved. While
    the workers are being started (``_Stops.starting``) the signal is kept instead, and raised by the agent
    once they exist (:func:`_our_agent`): raised in the middle of starting them, it reached none of them."""
    from torch.distributed.elastic.multiprocessing.api import SignalException

    stops = _Stops()

    def handle(signum, frame):
        sig = signal.Signals(signum)
        stops.received = sig
        if stops.starting:
            stops.kept = stops.kept or sig
            return
        raise SignalException(f"Process {os.getpid()} got signal: {sig.name}", sigval=sig)

    if threading.current_thread() is not threading.main_thread():  # handlers are the main thread's only
        yield stops
        return
    previous = {sig: signal.signal(sig, handle) for sig in STOP_SIGNALS}
    try:
        yield stops
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


# torch's loggers that speak of a failed worker in their own terms, muted during a launch: the agent
# logs each failed worker with the traceback of its own ``join``, and torch.multiprocessing's join
# warns "Terminating process N via signal SIGTERM" for each peer it stops, which reads as a cause.
# Workers report their own errors (ddpkit.ranks.child.worker_entry), and the launcher names a rank
# that died without a word (ddpkit.ranks.failures.launch_failure).
AGENT_LOGGERS = ("torch.distributed.elastic.multiprocessing.api", "torch.multiprocessing.spawn")


@contextmanager
def _quiet_agent_logs() -> Iterator[None]:
    """Mute :data:`AGENT_LOGGERS` for the launch, and the agent's "Received 15 death signal, shutting down
    workers" (a stop signal is ddpkit's to say: the workers' one ``stopped on SIGTERM`` line); then restore."""
    logs = [logging.getLogger(name) for name in AGENT_LOGGERS]
    levels = [log.level for log in logs]
    for log in logs:
        log.setLevel(logging.CRITICAL)
    agent = logging.getLogger(AGENT_SERVER_LOGGER)
    agent.addFilter(_no_death_signal)
    try:
        yield
    finally:
        agent.removeFilter(_no_death_signal)
        for log, level in zip(logs, levels):
            log.setLevel(level)


AGENT_SERVER_LOGGER = "torch.distributed.elastic.agent.server.api"  # logs a stop signal as a "death signal"


def _no_death_signal(record: logging.LogRecord) -> bool:
    return "death signal" not in str(record.msg)


@contextmanager
def _our_agent(spec: LaunchSpec, stops: _Stops) -> Iterator[None]:
    """torch's agent, as :func:`_reporting_agent` makes it, for the launch. ``elastic_launch`` builds its
    ``LocalElasticAgent`` itself, so the name it looks up is swapped for a subclass for the launch; if torch
    no longer has it there, restarts go unexplained and a stop signal is sent to the workers once."""
    import torch.distributed.launcher.api as launcher_api

    agent_cls = getattr(launcher_api, "LocalElasticAgent", None)
    if agent_cls is None:
        yield
        return
    launcher_api.LocalElasticAgent = _reporting_agent(agent_cls, spec, stops)
    try:
        yield
    finally:
        launcher_api.LocalElasticAgent = agent_cls


def _reporting_agent(base: type, spec: LaunchSpec, stops: _Stops | None = None) -> type:
    """``base`` (torch's LocalElasticAgent), which

    * under ``--max-restarts``, prints :func:`ddpkit.ranks.failures.restart_note` before each restart that a
      failure caused (not those for nodes joining): why it restarts the workers (a rank killed by a signal,
      which printed nothing; a peer's timeout), as the launcher says a failure that ends the job;
    * raises a stop signal kept while it started the workers (``stops``) once they exist;
    * sends a stop signal to the workers again every ``RESEND_S`` while it waits for them to stop: a worker
      forked from the forkserver ignores SIGTERM and SIGUSR1 (as the forkserver does) until its entry
      restores them, so one that was still starting ignored the agent's one signal, and the agent waited its
      30 s grace period for it, then killed it.
    * gives the survivors of a failed group of functions ``FAILED_GRACE_S``, not 30 s, to exit before it kills
      them (to end the job, or to restart it). A script's workers (``ddpkit run``) keep torch's 30 s: torch's
      SubprocessContext closes them itself, and a script's rank that stopped on a signal exits 143 while its
      peers may still be closing, which a shorter grace would cut short.

    ``_monitor_workers``, ``_restart_workers``, ``_start_workers`` and ``_shutdown`` are the methods torch's
    ``SimpleElasticAgent`` asks its subclasses for and calls."""
    from torch.distributed.elastic.multiprocessing.api import SignalException

    class ReportingAgent(base):
        _failures: dict | None = None
        _restarts = 0

        def _start_workers(self, worker_group):
            if stops is None:
                return self._started(worker_group)
            stops.starting = True
            try:
                return self._started(worker_group)
            finally:
                stops.starting, kept, stops.kept = False, stops.kept, None
                if kept is not None:  # the workers exist now: stop them as if it came now
                    raise SignalException(f"Process {os.getpid()} got signal: {kept.name}", sigval=kept)

        def _started(self, worker_group):
            pids = super()._start_workers(worker_group)
            # Workers started by multiprocessing (a function): the agent's look at them is torch's
            # ProcessContext.join, which on a failure SIGTERMs the survivors and waits 30 s before SIGKILL
            pc = getattr(getattr(self, "_pcontext", None), "_pc", None)
            if pc is not None and "grace_period" in inspect.signature(type(pc).join).parameters:
                pc.join = functools.partial(type(pc).join, pc, grace_period=FAILED_GRACE_S)
            return pids

        def _shutdown(self, death_sig=signal.SIGTERM, *args, **kwargs):
            done = threading.Event()
            # Only a stop the launcher was sent: a restart's or the job's end shuts workers down as torch does
            if stops is not None and stops.resend and stops.received is not None and death_sig in STOP_SIGNALS:
                threading.Thread(target=self._send_again, args=(death_sig, done), daemon=True).start()
            try:
                return super()._shutdown(death_sig, *args, **kwargs)
            finally:
                done.set()

        def _send_again(self, sig: signal.Signals, done: threading.Event) -> None:
            while not done.wait(RESEND_S):
                context = getattr(self, "_pcontext", None)
                for pid in context.pids().values() if context is not None else ():
                    try:
                        os.kill(pid, sig)
                    except (ProcessLookupError, PermissionError):  # exited (or its pid reused)
                        pass

        def _monitor_workers(self, worker_group):
            result = super()._monitor_workers(worker_group)
            self._failures = first_failures(result.failures) if result.is_failed() else None
            return result

        def _restart_workers(self, worker_group):
            if self._failures and spec.max_restarts:
                self._restarts += 1
                note = restart_note(self._failures, spec.timeout_s, self._restarts, spec.max_restarts, spec.device_type)
                if note:
                    print(note, file=sys.stderr, flush=True)
                self._failures = None
            return super()._restart_workers(worker_group)

    return ReportingAgent


def refuse_if_importing_main() -> None:
    """A spawned worker imports the user's script as ``__mp_main__``. If the script starts training at
    import time (no ``if __name__ == "__main__":`` guard), say so in one line, instead of
    multiprocessing's bootstrap traceback on every rank."""
    import multiprocessing

    # multiprocessing's own test for "still bootstrapping" (it refuses to start processes then, with a traceback)
    if not getattr(multiprocessing.current_process(), "_inheriting", False):
        return
    print(
        "ddpkit: error: this script starts training when it is imported, and worker processes import it: put "
        'the code that calls Trainer(...).fit() or ddpkit.launch(...) under `if __name__ == "__main__":`',
        file=sys.stderr,
        flush=True,
    )
    os._exit(ConfigError.exit_code)  # a reported exit: the launcher adds nothing


def refuse_unguarded_main() -> None:
    """Before launch, in the launcher: the script runs this call at import time, outside
    ``if __name__ == "__main__":``. Each spawned worker imports the script again and would start
    training itself (refused there, once per rank, by :func:`refuse_if_importing_main`); said here
    once instead, naming the line. Read from the script's own source: the innermost frame running
    the script's top level, and whether its line lies inside a test of ``__name__`` against
    ``"__main__"``. Run as ``python -m pkg`` (a ``__main__`` module the workers never re-run), from
    a notebook or ``python -c``, nothing is refused."""
    main = sys.modules.get("__main__")
    path = getattr(main, "__file__", None)
    spec_name = getattr(getattr(main, "__spec__", None), "name", "") or ""
    if not path or not str(path).endswith(".py") or spec_name == "__main__" or spec_name.endswith(".__main__"):
        return
    script = os.path.realpath(path)
    frame = sys._getframe()
    while frame is not None:  # innermost first: a runpy or pdb wrapper's own frames lie further out
        if frame.f_code.co_name == "<module>" and os.path.realpath(frame.f_code.co_filename) == script:
            break
        frame = frame.f_back
    if frame is None:
        return
    try:
        tree = ast.parse(Path(script).read_text())
    except (OSError, SyntaxError, ValueError):
        return
    line = frame.f_lineno
    if any(
        isinstance(node, ast.If) and _tests_main(node.test) and node.lineno <= line <= node.end_lineno
        for node in ast.walk(tree)
    ):
        return
    shown = os.path.relpath(path)
    shown = path if shown.startswith("..") else shown
    raise ConfigError(
        f"{shown}:{line} starts the workers when the script is imported, and every worker "
        f"imports it again: put the code that calls Trainer(...).fit() or ddpkit.launch(...) under "
        f'`if __name__ == "__main__":`'
    )


def _tests_main(test: ast.expr) -> bool:
    """Whether an ``if`` test compares ``__name__`` with ``"__main__"`` anywhere in it (``and`` included)."""
    for node in ast.walk(test):
        if isinstance(node, ast.Compare):
            names = [node.left, *node.comparators]
            if any(isinstance(n, ast.Name) and n.id == "__name__" for n in names) and any(
                isinstance(n, ast.Constant) and n.value == "__main__" for n in names
            ):
                return True
    return False


def start_method(fn: Callable, args: tuple, device_type: str, nproc: int = 1) -> str:
    """How workers start.

    * the forkserver (:mod:`ddpkit.ranks.prestart`) when it can import ``fn`` and its arguments: a
      single-threaded process that imported torch once, so each fork is safe and quick. The
      CLI starts it first thing, so its import of torch overlaps the launcher's.
    * ``spawn`` where a platform has no forkserver.
    * ``fork`` from this process only where nothing else can import ``fn`` (a notebook's or
      ``python -c``'s code, a lambda), and only on CPU with CUDA untouched here. It is the last
      resort because this process is multi-threaded by then (the elastic agent's store server
      and keep-alive timer, OpenMP's pool), and a child forked while another thread holds a
      lock can deadlock: once in ~1500 forks a rank hung before joining the process group, in
      CI. Python 3.14 moved its own default from fork to forkserver for the same reason.
    """
    problem = unspawnable(fn, args)
    if problem is None:
        return "forkserver" if forkserver_available() else "spawn"
    if device_type == "cpu" and not torch.cuda.is_initialized() and "fork" in multiprocessing.get_all_start_methods():
        return "fork"
    raise ConfigError(
        f"{problem}, so new processes cannot import it, and with CUDA in use only 'spawn' is safe. "
        f"Move it into a .py file and import it from there"
    )


def unspawnable(fn: Callable, args: tuple) -> str | None:
    """Why a spawned interpreter could not rebuild ``(fn, args)``, or None if it can."""
    main = sys.modules.get("__main__")
    main_importable = bool(getattr(main, "__file__", None)) and not str(main.__file__).startswith("<")
    probe = _Probe(main_importable)
    try:
        probe.dump((fn, args))
    except Exception as exc:  # a lambda, a local function or class, an open file, ...
        return f"{getattr(fn, '__qualname__', fn)!r} or its arguments cannot be pickled ({exc})"
    if probe.found is not None:
        return f"{probe.found.__qualname__!r} is defined in __main__ of an interactive session or `python -c`"
    return None


class _Probe(pickle.Pickler):
    """Pickles to nowhere, noting anything defined in a __main__ that has no file to import.

    Tensors and arrays are stood in for by an empty reduction: the probe looks at what the
    objects reference, not at their data, so a large dataset costs nothing to check.
    """

    def __init__(self, main_importable: bool):
        super().__init__(io.BytesIO(), protocol=pickle.HIGHEST_PROTOCOL)
        self.main_importable, self.found = main_importable, None

    def reducer_override(self, obj):
        if isinstance(obj, (torch.Tensor, np.ndarray)):
            return tuple, ()
        if (
            isinstance(obj, (type, types.FunctionType))
            and getattr(obj, "__module__", None) == "__main__"
            and not self.main_importable
            and self.found is None
        ):
            self.found = obj
        return NotImplemented


def _launch_config(spec: LaunchSpec, start: str = "spawn", log_dir: str | None = None):
    """The agent's LaunchConfig, and the environment variables it and the workers need."""
    from torch.distributed.elastic.multiprocessing.api import DefaultLogsSpecs
    from torch.distributed.launcher.api import LaunchConfig

    endpoint, rdzv_configs, extra, env = "localhost:0", {}, {}, {}
    env[names.LAUNCHER_PID] = str(os.getpid())  # so a worker can tell its launcher died before it started
    if start == "fork":
        env[names.FORKED_WORKER] = (
            "1"  # one intra-op thread each: OpenMP hangs in a child forked after its parent used it
        )
    for var in names.TO_WORKERS:  # set by the launcher before it launches
        if var in os.environ:
            env[var] = os.environ[var]
    if names.OMP_NUM_THREADS not in os.environ:
        # What torchrun sets and elastic_launch does not: each worker's share of the cores,
        # read by torch and by numpy's BLAS when they load.
        env[names.OMP_NUM_THREADS] = str(cpu_threads(spec.nproc))
    if spec.max_restarts and names.SHARE_RDZV_STORE_OFF not in os.environ:
        # With the agent's TCPStore shared into the workers (torch >= 2.5's default), restarted
        # workers read the previous attempt's gloo/NCCL addresses from it and fail to connect
        # (pytorch/pytorch#135712). A store per rendezvous round avoids that.
        env[names.SHARE_RDZV_STORE_OFF] = "1"
    if spec.nnodes > 1:
        endpoint = spec.rdzv_endpoint
        host, _ = split_endpoint(endpoint)
        local_addr = spec.local_addr or route_addr(host)
        rdzv_configs["join_timeout"] = max(1, int(spec.timeout_s))
        if spec.node_rank >= 0:  # PET_NODE_RANK: the operator says which node's address the endpoint is
            rdzv_configs["is_host"] = spec.node_rank == 0
        elif not is_loopback(host) and is_local(host):
            # torch recognises its store host by hostname; an address on a secondary interface
            # (or in a network namespace) is missed, and then no node would host the store.
            rdzv_configs["is_host"] = True
        if "local_addr" in {f.name for f in dataclasses.fields(LaunchConfig)}:
            extra["local_addr"] = local_addr
        # gloo binds to whatever the hostname resolves to unless told, and NCCL's bootstrap
        # may pick a docker or virtual bridge: use the interface that reaches the other nodes.
        # (NCCL's data path over InfiniBand is chosen by NCCL itself and not affected.)
        iface = interface_of(local_addr)
        for var in names.SOCKET_IFNAMES:
            if iface and var not in os.environ:
                env[var] = iface
    if "signals_to_handle" in {f.name for f in dataclasses.fields(LaunchConfig)}:
        # torch's agent writes it to TORCHELASTIC_SIGNALS_TO_HANDLE (run_workers sets that too, for a torch
        # without the field): SIGTERM and SIGUSR1 are ddpkit's own (_stop_signals)
        extra["signals_to_handle"] = AGENT_SIGNALS
    config = LaunchConfig(
        min_nodes=spec.nnodes,
        max_nodes=spec.nnodes,
        nproc_per_node=spec.nproc,
        run_id=spec.rdzv_id or str(uuid.uuid4()),
        rdzv_backend="c10d",
        rdzv_endpoint=endpoint,
        rdzv_configs=rdzv_configs,
        max_restarts=spec.max_restarts,
        start_method=start,
        logs_specs=DefaultLogsSpecs(log_dir=log_dir),
        **extra,
    )
    return config, env
