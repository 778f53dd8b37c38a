"""The run directory: what is in it, and who may write it.

    RUN_DIR/config.toml      the resolved config (identical keys on resume, or we refuse)
    RUN_DIR/metrics.jsonl    one JSON object per log event
    RUN_DIR/summary.json     final figures
    RUN_DIR/model.pt         final weights: a plain state_dict without "module." prefixes
    RUN_DIR/checkpoints/     snapshots (see checkpoint.py)

Every writer here is called on all ranks and writes only on global rank 0, atomically
(temporary file, fsync, rename), so a crash never leaves a half-written file behind.
"""

from __future__ import annotations

import io
import json
import os
from pathlib import Path

import torch

from .config import TrainConfig, read_toml
from .dist import DistContext
from .errors import RunDirError


def atomic_write(path: Path, data: bytes) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
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


def torch_bytes(obj) -> bytes:
    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


def check_run_dir(cfg: TrainConfig) -> dict | None:
    """Refuse a run dir that holds another config; return its summary if that run already finished."""
    run_dir = Path(cfg.run_dir)
    saved_path = run_dir / "config.toml"
    if run_dir.exists() and not run_dir.is_dir():
        raise RunDirError(f"--run-dir {run_dir} exists and is not a directory")
    if not saved_path.exists():
        return None
    saved = TrainConfig.from_dict(read_toml(saved_path)).to_dict()
    differing = cfg.differing_keys(saved)
    if differing:
        detail = ", ".join(f"{k}: {saved.get(k)!r} -> {getattr(cfg, k)!r}" for k in differing)
        raise RunDirError(f"run dir {run_dir} holds a run with a different config ({detail}); "
                          f"pass a new --run-dir, or delete {run_dir} to start over")
    summary = run_dir / "summary.json"
    return json.loads(summary.read_text()) if summary.exists() and (run_dir / "model.pt").exists() else None


def write_config(cfg: TrainConfig, ctx: DistContext) -> None:
    if ctx.is_main:
        atomic_write(Path(cfg.run_dir) / "config.toml", cfg.to_toml().encode())


def write_summary(run_dir: Path, summary: dict, ctx: DistContext) -> None:
    if ctx.is_main:
        atomic_write(Path(run_dir) / "summary.json", (json.dumps(summary, indent=2) + "\n").encode())


def write_model(run_dir: Path, model: torch.nn.Module, ctx: DistContext) -> None:
    """The unwrapped model's weights, loadable with plain ``model.load_state_dict``."""
    if ctx.is_main:
        state = {k: v.detach().cpu() for k, v in model.state_dict().items()}
        atomic_write(Path(run_dir) / "model.pt", torch_bytes(state))
