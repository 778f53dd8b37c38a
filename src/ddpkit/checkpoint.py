"""Snapshots: everything needed to continue a run exactly, written by global rank 0.

    ckpt = Checkpointer(run_dir, ctx, cfg, keep=3)
    state = ckpt.load_latest()          # every rank; None when there is nothing to resume
    ckpt.save(trainer_state, step)      # every rank (it gathers RNG states); rank 0 writes

A snapshot file ``checkpoints/snapshot-<global step>.pt`` holds the trainer's state dict
(model, optimizer, schedule, scaler, EMA, data position, metric accumulators), every
rank's RNG states, the resolved config and its hash, and the ddpkit/torch versions. It
is written to a temporary file, fsynced and renamed, so a kill during a save leaves
the previous snapshot intact; a truncated or corrupt one is reported by name and the
one before it is used.

Snapshots are loaded onto the CPU whatever the training device: ``load_state_dict``
copies each tensor to the device anyway, and the RNG states must be CPU tensors
(``.numpy()`` raises on any other device). Per-rank state travels to rank 0 through
``all_gather_object`` (pickle), which would rebuild a CUDA tensor on the *sender's* GPU
index in every receiver; so it must hold CPU tensors and plain numbers only.
"""

from __future__ import annotations

import random
import re
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

from . import __version__
from .dist import DistContext
from .errors import RunDirError
from .rundir import atomic_write, torch_bytes

FORMAT = 1
_NAME = re.compile(r"snapshot-(\d+)\.pt$")


def rng_state(device: torch.device) -> dict:
    """This process's RNGs as tensors and ints (loadable with weights_only=True)."""
    np_state = np.random.get_state()
    py_version, py_internal, py_gauss = random.getstate()
    state = {"torch": torch.get_rng_state(), "numpy_keys": torch.from_numpy(np_state[1].astype(np.int64)),
             "numpy_pos": int(np_state[2]), "numpy_gauss": [int(np_state[3]), float(np_state[4])],
             "python": [py_version, list(py_internal), py_gauss]}
    if device.type == "cuda":
        state["cuda"] = torch.cuda.get_rng_state(device)
    return state


def set_rng_state(state: dict, device: torch.device) -> None:
    torch.set_rng_state(state["torch"].cpu())
    np.random.set_state(("MT19937", state["numpy_keys"].numpy().astype(np.uint32), state["numpy_pos"],
                         state["numpy_gauss"][0], state["numpy_gauss"][1]))
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    if device.type == "cuda" and "cuda" in state:
        torch.cuda.set_rng_state(state["cuda"].cpu(), device)


def check_host_only(tree, what: str) -> None:
    """Raise unless every tensor in ``tree`` (dicts, lists, tuples) is on the CPU."""
    if isinstance(tree, torch.Tensor):
        if tree.device.type != "cpu":
            raise ValueError(f"{what} holds a tensor on {tree.device}; copy it to the CPU (or a float) first")
    elif isinstance(tree, dict):
        for value in tree.values():
            check_host_only(value, what)
    elif isinstance(tree, (list, tuple)):
        for value in tree:
            check_host_only(value, what)


def read_weights(path: str | Path) -> dict:
    """Model weights from a model.pt (a plain state_dict) or a ddpkit snapshot, onto the CPU.

    A ``module.`` prefix (a state_dict saved from a DDP wrapper) is dropped.
    """
    try:
        obj = torch.load(path, map_location="cpu", weights_only=True)
    except FileNotFoundError:
        raise RunDirError(f"--init-from {path}: no such file") from None
    except Exception as exc:  # truncated zip, not a torch file, pickled code
        raise RunDirError(f"--init-from {path}: not a loadable weights file ({type(exc).__name__}: "
                          f"{str(exc).splitlines()[0][:200] if str(exc) else ''})") from None
    if isinstance(obj, dict) and isinstance(obj.get("trainer"), dict) and "model" in obj["trainer"]:
        obj = obj["trainer"]["model"]  # a snapshot
    if not isinstance(obj, dict) or not all(isinstance(v, torch.Tensor) for v in obj.values()):
        raise RunDirError(f"--init-from {path}: expected a state_dict (name -> tensor), as model.pt holds")
    return {k.removeprefix("module."): v for k, v in obj.items()}


class Checkpointer:
    def __init__(self, run_dir: str | Path, ctx: DistContext, cfg, keep: int = 2):
        self.dir = Path(run_dir) / "checkpoints"
        self.ctx, self.cfg, self.keep = ctx, cfg, max(1, keep)

    def snapshots(self) -> list[Path]:
        """Complete snapshot files, newest first (``.tmp`` leftovers of killed saves are ignored)."""
        found = [(int(m.group(1)), p) for p in self.dir.glob("snapshot-*.pt") if (m := _NAME.search(p.name))]
        return [p for _, p in sorted(found, reverse=True)]

    def save(self, trainer_state: dict, global_step: int) -> Path:
        """Call on every rank. Gathers per-rank state, then rank 0 writes; all ranks wait for it."""
        per_rank = {"rng": rng_state(self.ctx.device), "rank_state": trainer_state.pop("rank_state", None)}
        check_host_only(per_rank, "per-rank snapshot state")
        gathered = [None] * self.ctx.world_size
        if self.ctx.world_size > 1:
            dist.all_gather_object(gathered, per_rank)  # a collective: outside any rank-0 branch
        else:
            gathered = [per_rank]
        path = self.dir / f"snapshot-{global_step:09d}.pt"
        if self.ctx.is_main:
            for stale in self.dir.glob("*.tmp"):  # left by a save that was killed part-way
                stale.unlink(missing_ok=True)
            snapshot = {"format": FORMAT, "config": self.cfg.to_dict(), "config_hash": self.cfg.hash(),
                        "world_size": self.ctx.world_size, "versions": {"ddpkit": __version__, "torch": str(torch.__version__)},
                        "global_step": global_step, "trainer": trainer_state, "ranks": gathered}
            atomic_write(path, torch_bytes(snapshot))
            for old in self.snapshots()[self.keep:]:
                old.unlink(missing_ok=True)
        self.ctx.barrier()  # nobody moves on (or reads) before the file is complete
        return path

    def load_latest(self, warn=print) -> dict | None:
        """The newest loadable snapshot for this config, or None. Every rank calls this."""
        for path in self.snapshots():
            try:
                snap = torch.load(path, map_location="cpu", weights_only=True)
                if snap.get("format") != FORMAT:
                    raise ValueError(f"unknown snapshot format {snap.get('format')!r}")
            except Exception as exc:  # truncated zip, bad pickle, wrong layout
                if self.ctx.is_main:
                    warn(f"snapshot {path} is corrupt or truncated ({type(exc).__name__}: {exc}); trying the previous one")
                continue
            self._check_compatible(snap, path)
            return snap
        return None

    def _check_compatible(self, snap: dict, path: Path) -> None:
        if snap["config_hash"] != self.cfg.hash():
            keys = self.cfg.differing_keys(snap["config"])
            raise RunDirError(f"snapshot {path} was made with a different config (differs in: {', '.join(keys)}); "
                              f"pass a new --run-dir to start a new run")
        if snap["world_size"] != self.ctx.world_size:
            raise RunDirError(f"snapshot {path} was made with world size {snap['world_size']}, this run has "
                              f"{self.ctx.world_size}; resume with the same number of processes for an exact continuation")
