"""Atomic file writes, shared by everything that writes (the run dir, snapshots, the imagefolder cache).

    atomic_write(path, data)     # temporary file, fsync, rename, fsync of the directory

A write that fails removes its temporary file and becomes a one-line :class:`RunDirError`
(said in the user's terms by :func:`describe_io_error`); the old file, if any, is untouched.
"""

from __future__ import annotations

import errno
import io
import os
import shutil
import tempfile
from pathlib import Path

from .errors import ConfigError, RunDirError


def size_text(nbytes: int) -> str:
    """A size in bytes, in the largest binary unit it fills, to three significant digits: 612 bytes,
    1.5 KiB, 48.9 MiB (a snapshot of a few KiB on a full disk was "0.0 MiB")."""
    if nbytes < 1024:
        return f"{nbytes} byte{'' if nbytes == 1 else 's'}"
    value = float(nbytes)
    for unit in ("KiB", "MiB", "GiB", "TiB"):
        value /= 1024
        if value < 1024:
            break
    return f"{value:.3g} {unit}" if value < 1000 else f"{value:.0f} {unit}"


def describe_io_error(exc: OSError, path: Path, size: int | None = None, flag: str = "--run-dir") -> str:
    """An OSError while writing ``path``, said in the user's terms; ``flag`` is the command's flag
    that chooses where it goes."""
    if exc.errno == errno.ENOSPC or exc.errno == errno.EDQUOT:
        try:
            free = shutil.disk_usage(path.parent).free
        except OSError:
            free = None
        need = f"it needs {size_text(size)}" if size is not None else "it needs more"
        have = f", {size_text(free)} {'is' if free == 1 else 'are'} free there" if free is not None else ""
        what = "no space left" if exc.errno == errno.ENOSPC else "disk quota exceeded"
        return (
            f"{what} writing {path} ({need}{have}); free some space or point {flag} elsewhere. "
            f"The previous files are intact"
        )
    if exc.errno == errno.EROFS:
        return f"cannot write {path}: the filesystem is read-only; point {flag} at a writable place"
    if exc.errno in (errno.EACCES, errno.EPERM):
        return f"cannot write {path}: permission denied; point {flag} at a directory you can write"
    if exc.errno in (errno.EEXIST, errno.ENOTDIR):
        # A file where a folder is wanted (the porter's seed 003 passed a script's path as the run dir)
        file = next((p for p in (path, *path.parents) if p.exists() and not p.is_dir()), None)
        if file is not None:
            return (
                f"cannot write {path}: {file} is a file, not a directory; point {flag} at a directory (or a new path)"
            )
    return f"cannot write {path}: {exc.strerror or exc}"


def atomic_write(path: Path, data: bytes, flag: str = "--run-dir", moment=None, durable: bool = True) -> None:
    """Write ``data`` to ``path`` through a temporary file, fsync and rename; on failure remove the
    temporary file and raise a one-line RunDirError (the old ``path``, if any, is untouched). ``moment``
    (a test hook: run/checkpoint.py's kill-anywhere tests) is called with the name of each point passed.
    ``durable=False``: no fsync, for a file read back on this machine by a process that outlives a crash of
    this one only (a rank's error file, written as the agent may be about to kill the rank: fast matters)."""
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    moment = moment or (lambda name: None)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(tmp, "wb") as fh:
            moment("opened")
            view, half = memoryview(data), len(data) // 2  # halves without a copy
            fh.write(view[:half])
            fh.flush()
            moment("half-written")
            fh.write(view[half:])
            fh.flush()
            moment("written")
            if durable:
                os.fsync(fh.fileno())
        moment("fsynced")
        os.replace(tmp, path)
        moment("renamed")
        if durable:
            dir_fd = os.open(path.parent, os.O_RDONLY)
            try:
                os.fsync(dir_fd)  # make the rename itself durable
            finally:
                os.close(dir_fd)
        moment("dir-synced")
    except OSError as exc:
        try:
            tmp.unlink(missing_ok=True)  # a partial file must not keep holding the space
        except OSError:
            pass
        raise RunDirError(describe_io_error(exc, path, len(data), flag)) from None


def check_writable(path: str | Path, flag: str, directory: bool = False) -> Path:
    """Before any work: that ``path`` (a file, or with ``directory`` a folder to write files in) can be
    written, creating its folder, by writing and removing a temporary file there; else a one-line
    ConfigError naming ``flag``. (check --json and bench --out once ran everything, then failed.)"""
    path = Path(path)
    folder = path if directory else path.parent
    if directory and path.exists() and not path.is_dir():
        raise ConfigError(f"{flag} {path} is a file; give a directory for the outputs")
    if not directory and path.is_dir():
        raise ConfigError(f"{flag} {path} is a directory; give a file path")
    above = next((p for p in folder.parents if p.exists()), None) if not folder.exists() else folder
    if above is not None and not above.is_dir():
        raise ConfigError(f"{flag} {path}: {above} is a file, not a directory; choose another path")
    try:
        folder.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=folder, prefix=".ddpkit-write-check-"):
            pass
    except OSError as exc:
        raise ConfigError(describe_io_error(exc, path, flag=flag)) from None
    return path


def torch_bytes(obj) -> bytes:
    """``obj`` as ``torch.save`` writes it."""
    import torch  # here, not at the top: ``ddpkit plot`` writes files without loading torch

    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()
