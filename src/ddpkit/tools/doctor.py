"""``ddpkit doctor``: what this machine offers distributed training, and a real 2-process all-reduce.

    ddpkit doctor                                # report; exit 1 if anything is FAIL
    ddpkit doctor --json                         # the same facts as JSON
    ddpkit doctor --nproc 4 --rdzv-endpoint node0:29400

    from ddpkit import doctor                    # each section alone, as data
    doctor.port_check("", 29500, named=False)    # {"value": "free", "status": "ok", ...}

Every section function returns ``{name: row}``; a row is ``{"value": ..., "status": "ok" | "warn"
| "FAIL", "unit": ..., "note": ...}`` with the keys that apply (no status: a plain fact).
:func:`render` turns the report into text; warnings never fail, a FAIL exits 1.
"""

from __future__ import annotations

import os
import platform
import socket
import sys
import time

import torch
import torch.distributed as dist

from ..ranks import hangwatch
from ..ranks.context import DistContext, cpu_cores, cpu_threads
from ..ranks.env import under_launcher
from ..ranks.launcher import launch
from ..ranks.netinfo import is_local, is_loopback
from ..version import __version__

DEFAULT_PORT = 29500  # torchrun's MASTER_PORT when none is given
CONNECT_TIMEOUT_S = 2.0  # for a rendezvous host elsewhere: long enough for a LAN, short enough to wait for
SMALL_FLOATS = 256  # latency probe: 256 float32 = 1 KiB, so the time is per-message overhead, not bytes
BIG_BYTES = 8 << 20  # bandwidth probe: one 8 MiB all-reduce, large enough that latency is a small share
ITERS = 20  # all-reduces averaged for the latency
ENV_PREFIXES = ("NCCL_", "TORCH_NCCL_")
ENV_NAMES = (
    "TORCH_DISTRIBUTED_DEBUG",
    "CUDA_VISIBLE_DEVICES",
    "OMP_NUM_THREADS",
    "MASTER_ADDR",
    "MASTER_PORT",
    "GLOO_SOCKET_IFNAME",
    "WORLD_SIZE",
    "RANK",
    "LOCAL_RANK",
)


def row(value, status: str | None = None, note: str = "", unit: str = "") -> dict:
    extra = {"status": status, "unit": unit, "note": note}
    return {"value": value, **{k: v for k, v in extra.items() if v}}


def versions() -> dict:
    cuda = torch.cuda.is_available()
    nccl_built = dist.is_nccl_available()
    nccl = ".".join(map(str, torch.cuda.nccl.version())) if cuda and nccl_built else None
    try:  # a torchvision built for another torch fails here ("operator torchvision::nms does not exist")
        import torchvision

        vision = row(torchvision.__version__, "ok")
    except Exception as exc:  # noqa: BLE001 - any import failure is the finding
        vision = row(
            f"broken ({type(exc).__name__}: {str(exc)[:120]})",
            "FAIL",
            "install the torchvision release built for this torch (the Makefile pins a matched pair)",
        )
    return {
        "python": row(platform.python_version()),
        "ddpkit": row(__version__),
        "torch": row(torch.__version__),
        "torchvision": vision,
        "CUDA build": row(torch.version.cuda or "none (CPU-only torch)"),
        "CUDA available": row(cuda),
        "gloo": row("available", "ok")
        if dist.is_gloo_available()
        else row("missing", "FAIL", "ddpkit's CPU runs need gloo: reinstall torch"),
        # NCCL matters only where there are GPUs to use it with.
        "nccl": row(
            nccl or ("built in" if nccl_built else "missing"), ("ok" if nccl_built else "FAIL") if cuda else None
        ),
    }


def gpus() -> dict:
    if not torch.cuda.is_available():
        return {"visible GPUs": row(0)}
    n = torch.cuda.device_count()
    out = {"visible GPUs": row(n)}
    for i in range(n):
        p = torch.cuda.get_device_properties(i)
        out[f"GPU {i}"] = row(f"{p.name}, {p.total_memory / 2**30:.1f} GiB")
    for i in range(n if n > 1 else 0):
        # Without P2P, NCCL stages GPU-to-GPU traffic through host memory: slower, not wrong.
        peers = [j for j in range(n) if j != i and not torch.cuda.can_device_access_peer(i, j)]
        out[f"P2P from GPU {i}"] = row(
            "all peers" if not peers else f"no access to {peers}", "ok" if not peers else "warn"
        )
    return out


def port_check(host: str, port: int, named: bool) -> dict:
    """Can a rendezvous store listen on ``port`` here (host local), or be reached (host elsewhere)?

    The rule: on this host a port in use FAILs when the user named it (MASTER_PORT or
    --rdzv-endpoint), since a job hosting its rendezvous there would fail to start; torchrun's
    default 29500 in use is only a warning, since ddpkit picks a free port itself for one-node
    runs (as torchrun --standalone does). A host elsewhere that does not answer is a warning:
    its store may simply not be started yet.
    """
    if not host or is_loopback(host) or is_local(host):
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            # SO_REUSEADDR, as torch's TCPStore sets it: a port left in TIME_WAIT is usable, one listened on is not.
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                s.bind(("", port))  # every interface, as the store listens
                return row("free", "ok")
            except OSError as exc:
                if named:
                    return row(
                        f"in use ({exc.strerror})",
                        "FAIL",
                        "a rendezvous hosted here cannot listen on it: stop what holds it or pick another port",
                    )
                return row(
                    f"in use ({exc.strerror})",
                    "warn",
                    "ddpkit picks a free port itself for one-node runs; "
                    "plain torchrun and multi-node jobs need MASTER_PORT or --rdzv-endpoint set to a free one",
                )
    try:
        with socket.create_connection((host, port), timeout=CONNECT_TIMEOUT_S):
            return row("reachable", "ok")
    except OSError as exc:
        return row(
            f"unreachable ({exc.strerror or exc})",
            "warn",
            "fine if the node hosting the rendezvous is not started yet; else check the address and firewall",
        )


def ports(rdzv_endpoint: str = "", environ=os.environ) -> dict:
    if under_launcher(environ):
        return {"MASTER_PORT": row(environ.get("MASTER_PORT"), note="in use by the torchrun job this runs in")}
    named = "MASTER_PORT" in environ
    if not environ.get("MASTER_PORT", str(DEFAULT_PORT)).isdecimal():
        return {"MASTER_PORT": row(environ["MASTER_PORT"], "FAIL", "not a port number")}
    port = int(environ.get("MASTER_PORT", DEFAULT_PORT))
    out = {f"MASTER_PORT {port}": port_check(environ.get("MASTER_ADDR", ""), port, named)}
    if rdzv_endpoint:
        host, _, p = rdzv_endpoint.rpartition(":")
        out[f"--rdzv-endpoint {rdzv_endpoint}"] = port_check(host.strip("[]"), int(p), named=True)
    return out


def env_vars(environ=os.environ) -> dict:
    names = sorted(k for k in environ if k.startswith(ENV_PREFIXES) or k in ENV_NAMES)
    out = {k: row(environ[k]) for k in names}
    if under_launcher(environ) and "TORCHELASTIC_RUN_ID" not in environ and "GROUP_RANK" not in environ:
        out["RANK"] = row(
            environ["RANK"],
            "warn",
            "RANK, LOCAL_RANK and WORLD_SIZE are set but no launcher is: "
            "ddpkit will act as one rank of a torchrun job; unset them",
        )
    return out


def cpu(nproc: int, environ=os.environ) -> dict:
    cores = cpu_cores()  # the cores this process may run on (affinity), not the machine's
    load1, _, _ = os.getloadavg()  # runnable processes, averaged over the last minute
    busy = "more runnable processes than cores: timings will be slow and noisy" if load1 > cores else ""
    out = {"cores (affinity)": row(cores), "load average 1 min": row(round(load1, 2), "warn" if busy else "ok", busy)}
    omp = environ.get("OMP_NUM_THREADS")
    threads = int(omp) if omp and omp.isdecimal() else cpu_threads(nproc, cores)  # ddpkit's default per process
    total = threads * nproc
    note = f"OMP_NUM_THREADS={omp}" if omp else "OMP_NUM_THREADS unset: ddpkit gives each process cores/nproc"
    over = total > cores
    out["threads"] = row(
        f"{threads} x {nproc} processes = {total} on {cores} cores",
        "warn" if over else "ok",
        note + ("; oversubscribed: fewer threads or processes" if over else ""),
    )
    return out


def smoke_worker(ctx: DistContext, t0: float, iters: int = ITERS, big_bytes: int = BIG_BYTES) -> dict:
    """On every rank: exact all-reduces of rank+1, timed. Returns plain floats (rank 0's are reported).

    ``torch.distributed.all_reduce`` directly, not ``ctx.all_reduce``: the latter skips a world of
    one, and a 1-GPU NCCL test should still go through NCCL.
    """
    sync = torch.cuda.synchronize if ctx.device.type == "cuda" else (lambda: None)
    x = torch.full((1,), float(ctx.rank + 1), dtype=torch.float64, device=ctx.device)
    dist.all_reduce(x)
    sync()
    first_s = time.time() - t0  # launch to first result: process start, rendezvous, group setup, one all-reduce
    small = torch.ones(SMALL_FLOATS, device=ctx.device)
    dist.all_reduce(small)  # warm-up
    sync()
    start = time.perf_counter()
    for _ in range(iters):
        dist.all_reduce(small)
    sync()
    latency_s = (time.perf_counter() - start) / iters
    big = torch.full((big_bytes // 4,), float(ctx.rank + 1), device=ctx.device)  # float32: small int sums are exact
    dist.all_reduce(big)  # warm-up; also checked below once refilled
    big.fill_(float(ctx.rank + 1))
    ctx.barrier()  # all ranks start the timed all-reduce together
    sync()
    start = time.perf_counter()
    dist.all_reduce(big)
    sync()
    big_s = time.perf_counter() - start
    return {
        "world": float(ctx.world_size),
        "sum": float(x.item()),
        "big_min": float(big.min()),
        "big_max": float(big.max()),
        "first_s": first_s,
        "latency_us": latency_s * 1e6,
        "bandwidth_gbs": big_bytes / big_s / 1e9,
    }


def smoke_verdict(result: dict, nproc: int) -> tuple[str, str]:
    """``("ok", ...)`` when every rank's rank+1 summed exactly to nproc(nproc+1)/2, else ``("FAIL", why)``."""
    expect = nproc * (nproc + 1) / 2
    got = (result.get("world"), result.get("sum"), result.get("big_min"), result.get("big_max"))
    if got == (float(nproc), expect, expect, expect):
        return "ok", f"sum of rank+1 over {nproc} ranks = {expect:g}, exact"
    return "FAIL", (
        f"expected world {nproc} and sums {expect:g}; got world {got[0]}, sum {got[1]}, 8 MiB tensor {got[2]}..{got[3]}"
    )


def smoke(backend: str, nproc: int, timeout_s: float) -> dict:
    device = "cuda" if backend == "nccl" else "cpu"
    t0 = time.time()  # wall clock: the workers compare against it, on this same host
    try:
        result = launch(smoke_worker, t0, nproc=nproc, device=device, timeout_s=timeout_s)
    except Exception as exc:  # a user error, failed workers, or a bug: each is this check failing
        return {f"{backend} all-reduce": row(f"{nproc} process(es)", "FAIL", f"{type(exc).__name__}: {exc}")}
    if under_launcher():  # run by torchrun: launch() ran here, as one rank of torchrun's world
        nproc = int(os.environ["WORLD_SIZE"])
    status, note = smoke_verdict(result, nproc)
    out = {f"{backend} all-reduce": row(f"{nproc} process(es)", status, note)}
    if status == "ok":
        out[f"{backend} first result"] = row(
            round(result["first_s"], 2), unit="s", note="launch, rendezvous, group setup and one all-reduce"
        )
        out[f"{backend} latency"] = row(
            round(result["latency_us"], 1), unit="us", note=f"mean of {ITERS} all-reduces of {SMALL_FLOATS * 4} bytes"
        )
        out[f"{backend} bandwidth"] = row(
            round(result["bandwidth_gbs"], 3),
            unit="GB/s",
            note=f"one {BIG_BYTES >> 20} MiB all-reduce, size / time"
            + (": 1 process, a local copy, not a link's speed" if nproc == 1 else ""),
        )
    return out


def hang_reports() -> dict:
    """What a hang's report will hold here: ddpkit's own record always; torch's NCCL Flight Recorder where
    this torch has it (:mod:`ddpkit.ranks.hangwatch`)."""
    available, how = hangwatch.flight_recorder_status()
    return {
        "ddpkit's hang report": row(
            f"on: stacks and ddpkit's collectives of every rank at {hangwatch.TRIGGER_FRACTION:g} x --timeout-s"
        ),
        "NCCL Flight Recorder": row(
            "available" if available else "not in this torch (or no NCCL)",
            "ok",
            how if available else "the report holds ddpkit's record and the stacks only",
        ),
    }


def report(nproc: int = 2, rdzv_endpoint: str = "", timeout_s: float = 60.0) -> dict:
    out = {
        "versions": versions(),
        "GPUs": gpus(),
        "hang reports": hang_reports(),
        "rendezvous ports": ports(rdzv_endpoint),
        "environment": env_vars(),
        "CPU": cpu(nproc),
        "smoke test": smoke("gloo", nproc, timeout_s),
    }
    if torch.cuda.is_available():
        out["smoke test"].update(smoke("nccl", max(1, torch.cuda.device_count()), timeout_s))
    return out


def failed(rep: dict) -> int:
    return sum(r.get("status") == "FAIL" for section in rep.values() for r in section.values())


def render(rep: dict) -> str:
    width = max(len(name) for section in rep.values() for name in section) + 1
    lines = []
    for title, section in rep.items():
        lines.append(title if section else f"{title}: (none)")
        for name, r in section.items():
            value = f"{r['value'] if r['value'] != '' else '(empty)'} {r.get('unit', '')}".rstrip()
            note = f"  ({r['note']})" if r.get("note") else ""
            lines.append(f"  {r.get('status', ''):<4}  {name + ':':<{width}} {value}{note}")
        lines.append("")
    warns = sum(r.get("status") == "warn" for section in rep.values() for r in section.values())
    lines.append(f"{failed(rep)} FAIL, {warns} warn on {socket.gethostname()} ({sys.platform})")
    return "\n".join(lines)
