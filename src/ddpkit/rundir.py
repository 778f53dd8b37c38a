"""The run directory: what is in it, who may write it, and how nothing in it gets lost.

    RUN_DIR/config.toml      the resolved config (identical keys on resume, or we refuse)
    RUN_DIR/metrics.jsonl    one JSON object per log event
    RUN_DIR/summary.json     final figures
    RUN_DIR/model.pt         final weights: a plain state_dict without "module." prefixes
    RUN_DIR/checkpoints/     snapshots (see checkpoint.py); unreadable ones go to checkpoints/corrupt/
    RUN_DIR/.lock            held (flock) by the one process that owns the run while it runs

Every writer here is called on all ranks and writes only on global rank 0, atomically
(temporary file, fsync, rename). A write that fails removes its temporary file and
becomes a one-line :class:`RunDirError`; :func:`on_rank0` tells every rank, so no rank
is left waiting for one that stopped.
"""

from __future__ import annotations

import errno
import fcntl
import io
import json
import os
import shutil
import socket
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Callable, Iterator

import torch

from .config import TrainConfig
from .dist import DistContext
from .errors import ConfigError, DdpkitError, RunDirError

LOCK_ENV = "DDPKIT_RUN_LOCKED"  # the run dir this process's launcher already holds the lock on
EXPECTED = {"config.toml": "file", "metrics.jsonl": "file", "summary.json": "file", "model.pt": "file",
            "checkpoints": "directory"}


def describe_io_error(exc: OSError, path: Path, size: int | None = None) -> str:
    """An OSError while writing ``path``, said in the user's terms."""
    if exc.errno == errno.ENOSPC or exc.errno == errno.EDQUOT:
        try:
            free = shutil.disk_usage(path.parent).free
        except OSError:
            free = None
        need = f"it needs {size / 2**20:.1f} MiB" if size is not None else "it needs more"
        have = f", {free / 2**20:.1f} MiB are free there" if free is not None else ""
        what = "no space left" if exc.errno == errno.ENOSPC else "disk quota exceeded"
        return (f"{what} writing {path} ({need}{have}); free some space or point --run-dir elsewhere. "
                f"The previous files are intact")
    if exc.errno == errno.EROFS:
        return f"cannot write {path}: the filesystem is read-only; point --run-dir at a writable place"
    if exc.errno in (errno.EACCES, errno.EPERM):
        return f"cannot write {path}: permission denied; point --run-dir at a directory you can write"
    return f"cannot write {path}: {exc.strerror or exc}"


def atomic_write(path: Path, data: bytes) -> None:
    """Write ``data`` to ``path`` through a temporary file, fsync and rename; on failure remove the
    temporary file and raise a one-line RunDirError (the old ``path``, if any, is untouched)."""
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(tmp, "wb") as fh:
            fh.write(data)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
        dir_fd = os.open(path.parent, os.O_RDONLY)
        try:
            os.fsync(dir_fd)  # make the rename itself durable
        finally:
            os.close(dir_fd)
    except OSError as exc:
        try:
            tmp.unlink(missing_ok=True)  # a partial file must not keep holding the space
        except OSError:
            pass
        raise RunDirError(describe_io_error(exc, path, len(data))) from None


def torch_bytes(obj) -> bytes:
    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


def on_rank0(ctx: DistContext, write: Callable[[], object]) -> None:
    """Run ``write`` on global rank 0 only, and let every rank know whether it worked (one all-reduce).

    Without this, a rank-0 write error (full disk, read-only storage) would leave the other
    ranks waiting in their next collective until --timeout-s. Every rank raises on failure;
    rank 0's error carries the reason, which is the one the launcher prints.
    """
    error: DdpkitError | None = None
    if ctx.is_main:
        try:
            write()
        except RunDirError as exc:
            error = exc
    agree(ctx, error)


def agree(ctx: DistContext, error: DdpkitError | None) -> None:
    """Raise on every rank if rank 0 met ``error`` (one all-reduce)."""
    if ctx.world_size > 1:
        flag = torch.tensor([float(error is not None)], device=ctx.device)
        failed = ctx.all_reduce(flag).item() > 0
    else:
        failed = error is not None
    if failed:
        raise error or RunDirError("global rank 0 could not write to the run directory (its message is the one "
                                   "printed)")


# ---------------------------------------------------------------------- before launch
def finished_cli_run(run_dir: str | Path, from_python: str) -> TrainConfig:
    """The config of a finished run whose model the CLI can rebuild (``ddpkit eval``, ``show-data
    --predictions``); else one line. ``from_python``: what to do instead for a run trained from Python."""
    run_dir = Path(run_dir)
    for name in ("config.toml", "model.pt"):
        if not (run_dir / name).exists():
            raise RunDirError(f"{run_dir / name} not found; is {run_dir} a finished ddpkit run?")
    cfg = TrainConfig.from_toml(run_dir / "config.toml")
    custom = [f"{k} {getattr(cfg, k)}" for k in ("model", "dataset", "task")
              if str(getattr(cfg, k)).startswith(("custom:", "model-loss"))]
    if custom:
        raise RunDirError(f"{run_dir} was trained from Python ({', '.join(custom)}), which the CLI cannot rebuild; "
                          f"{from_python}")
    return cfg


def check_run_dir(cfg: TrainConfig) -> dict | None:
    """Refuse a run dir that cannot be used as asked; return its summary if that run already finished.

    Checked before any worker starts: the layout (each entry a file or a directory as ddpkit
    writes it), that it can be written, that it holds the same config. A finished run whose
    summary.json is unreadable is not "finished": it resumes from its last snapshot, which
    writes model.pt and summary.json again.
    """
    run_dir = Path(cfg.run_dir)
    if run_dir.exists() and not run_dir.is_dir():
        raise RunDirError(f"--run-dir {run_dir} exists and is not a directory")
    for name, kind in EXPECTED.items():
        entry = run_dir / name
        if entry.exists() and (entry.is_dir() != (kind == "directory")):
            raise RunDirError(f"{entry} is a {'directory' if entry.is_dir() else 'file'}, where ddpkit keeps its "
                              f"{name} {kind}; move it away, or pass another --run-dir")
    check_writable(run_dir)
    saved_path = run_dir / "config.toml"
    if not saved_path.exists():
        return None
    try:
        saved = TrainConfig.from_toml(saved_path).to_dict()
    except ConfigError as exc:
        raise RunDirError(f"{run_dir} holds a config.toml ddpkit cannot read ({exc}); pass a new --run-dir") from None
    differing = cfg.differing_keys(saved)
    trained = (run_dir / "model.pt").exists() or list((run_dir / "checkpoints").glob("snapshot-*.pt"))
    if differing and trained:
        detail = ", ".join(f"{k}: {saved.get(k)!r} -> {getattr(cfg, k)!r}" for k in differing)
        raise RunDirError(f"run dir {run_dir} holds a run with a different config ({detail}); "
                          f"pass a new --run-dir, or delete {run_dir} to start over")
    if differing:  # an attempt that failed before its first snapshot: nothing trained to lose
        print(f"ddpkit: {run_dir} holds an earlier attempt that saved nothing (config differs in "
              f"{', '.join(differing)}); starting over in it")
        return None
    summary = run_dir / "summary.json"
    if not (summary.exists() and (run_dir / "model.pt").exists()):
        return None
    try:
        return json.loads(summary.read_text())
    except (OSError, ValueError):
        if list((run_dir / "checkpoints").glob("snapshot-*.pt")):
            return None  # resume from the final snapshot: it rewrites summary.json and model.pt
        raise RunDirError(f"{summary} is unreadable (truncated?) and {run_dir} holds no snapshot to rebuild it "
                          f"from; model.pt is intact. Evaluate it with `ddpkit eval {run_dir}`") from None


def check_writable(run_dir: Path) -> None:
    """Write and remove a probe file in ``run_dir`` (or the nearest existing parent it will be made in)."""
    where = run_dir
    while not where.exists():
        where = where.parent
    probe = where / f".ddpkit-probe-{os.getpid()}"
    try:
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as exc:
        raise RunDirError(describe_io_error(exc, run_dir)) from None


# ---------------------------------------------------------------------- one run at a time
@contextmanager
def run_lock(run_dir: str | Path) -> Iterator[None]:
    """Hold an exclusive lock on ``RUN_DIR/.lock`` for the block; a second run gets a one-line
    error naming the holder. ``flock`` is released by the kernel when the holder dies, however
    it dies, so a killed run never leaves a stale lock. On NFS, Linux emulates flock with
    POSIX locks, which hold across nodes when the server supports locking (NFSv4, or NLM)."""
    path = Path(run_dir) / ".lock"
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 200, 0).decode(errors="replace").strip() or "another process"
            raise RunDirError(f"{run_dir} is in use by another ddpkit run ({holder}); wait for it to end, stop "
                              f"it, or pass another --run-dir") from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"pid {os.getpid()} on {socket.gethostname()}, since {time.strftime('%Y-%m-%d %H:%M:%S')}"
                  .encode(), 0)
        yield
    finally:
        os.close(fd)  # releases the lock; the file stays (removing it would race a waiting run)


# ---------------------------------------------------------------------- no restarts into deterministic errors
def fatal_path(run_dir: str | Path) -> Path:
    return Path(run_dir) / ".fatal.json"


def record_fatal(run_dir: str | Path, exc: DdpkitError) -> bool:
    """Note an error a restart would only meet again (bad data, a task mismatch), for the restarted
    workers to report instead of training into it. Returns whether it was written."""
    try:
        atomic_write(fatal_path(run_dir), json.dumps({"message": str(exc), "exit_code": exc.exit_code}).encode())
        return True
    except RunDirError:
        return False


def read_fatal(run_dir: str | Path) -> dict | None:
    try:
        return json.loads(fatal_path(run_dir).read_text())
    except (OSError, ValueError):
        return None


# ---------------------------------------------------------------------- writers
def write_config(cfg: TrainConfig, ctx: DistContext) -> None:
    on_rank0(ctx, lambda: atomic_write(Path(cfg.run_dir) / "config.toml", cfg.to_toml().encode()))


def summary_bytes(summary: dict) -> bytes:
    return (json.dumps(summary, indent=2) + "\n").encode()


def write_summary(run_dir: Path, summary: dict, ctx: DistContext) -> None:
    on_rank0(ctx, lambda: atomic_write(Path(run_dir) / "summary.json", summary_bytes(summary)))


def write_model(run_dir: Path, model: torch.nn.Module, ctx: DistContext) -> None:
    """The unwrapped model's weights, loadable with plain ``model.load_state_dict``."""
    def write():
        state = {k: v.detach().cpu() for k, v in model.state_dict().items()}
        atomic_write(Path(run_dir) / "model.pt", torch_bytes(state))

    on_rank0(ctx, write)
