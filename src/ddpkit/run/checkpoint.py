"""Snapshots: everything needed to continue a run exactly, written by global rank 0.

    ckpt = Checkpointer(run_dir, ctx, key, keep=3)   # key: a TrainConfig, or a Loop's (run/runkey.py)
    state = ckpt.load_latest()          # every rank; None when there is nothing to resume
    ckpt.save(trainer_state, step)      # every rank (it gathers RNG states); rank 0 writes
    trainer_state = ckpt.restore(snap)  # every rank: what save() was given; then ckpt.restore_rng(snap, seed)

``Checkpointer(..., background=True)`` (``--async-snapshots``, the default): ``save`` copies the state aside
(``run/staging.py``) and returns, and a thread on rank 0 writes it while the steps go on (under FSDP2, each
rank's shards too: copied aside by every rank and written by a thread of its own); one write is in
flight at a time. ``wait()`` (every rank: the next save, a stop, the run's end) finishes it and raises a
failure on every rank; a face's safe point learns of one sooner (``write_error``, carried by its one
all-reduce). What the writer does is what the synchronous save does, in the same order.

A snapshot file ``checkpoints/snapshot-<global step>.pt`` holds the trainer's state dict
(model, optimizer, schedule, scaler, EMA, data position, metric accumulators, where the log
interval began), every rank's RNG states, the resolved config and its hash, the
ddpkit/torch versions, and checksums of all of it (``run/checksums.py``; older snapshots have
none and load unchecked). It is written to a temporary file, fsynced and renamed,
so a kill during a save leaves the previous snapshot intact; a truncated, corrupt or damaged one
(a checksum differs) is reported by name and the one before it is used; when none is left, resuming
is refused in one line.

Snapshots are loaded onto the CPU whatever the training device: ``load_state_dict``
copies each tensor to the device anyway, and the RNG states must be CPU tensors
(``.numpy()`` raises on any other device). Per-rank state travels to rank 0 through
``all_gather_object`` (pickle), which would rebuild a CUDA tensor on the *sender's* GPU
index in every receiver; so it must hold CPU tensors and plain numbers only.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import signal
import sys
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from torch import nn

from ..data.seeds import reseed, rng_state, set_rng_state  # every seed and generator state is data/seeds.py's
from ..errors import ConfigError, RunDirError, article
from ..files import atomic_write, torch_bytes
from ..ranks import hangwatch
from ..ranks.context import DistContext, agree, on_rank0
from ..version import __version__
from . import shards
from .checksums import checksums, first_difference
from .paths import RunFiles
from .staging import Stager

if TYPE_CHECKING:
    from .runkey import RunKey

FORMAT = 2  # 2: per-rank metric sums as floats, final_train metrics (ddpkit 0.2)
_NAME = re.compile(r"snapshot-(\d+)\.pt$")
NEWEST = "newest"  # checkpoints/newest: the step of the newest snapshot written, to say when it has gone


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


def weights_mismatch(mine: dict, theirs: dict) -> str:
    """How ``theirs`` (a state dict) fails to fit ``mine``, name for name and shape for shape; "" if it fits."""
    missing, unexpected = sorted(set(mine) - set(theirs)), sorted(set(theirs) - set(mine))
    shapes = sorted(k for k in set(mine) & set(theirs) if tuple(mine[k].shape) != tuple(theirs[k].shape))
    parts = [
        f"missing {missing[:5]}" if missing else "",
        f"unexpected {unexpected[:5]}" if unexpected else "",
        f"other shapes {shapes[:5]}" if shapes else "",
    ]
    return "; ".join(p for p in parts if p)


def read_weights(path: str | Path, what: str = "weights file") -> dict:
    """Model weights from a model.pt (a plain state_dict) or a ddpkit snapshot, onto the CPU.

    A ``module.`` prefix (a state_dict saved from a DDP wrapper) is dropped. ``what`` names the
    file in errors (``--init-from``, ``model.pt``).
    """
    try:
        obj = torch.load(path, map_location="cpu", weights_only=True)
    except FileNotFoundError:
        raise RunDirError(f"{what} {path}: no such file") from None
    except Exception as exc:  # truncated zip, not a torch file, pickled code
        raise RunDirError(
            f"{what} {path}: not a loadable weights file, truncated or damaged "
            f"({type(exc).__name__}: {_first_line(exc)})"
        ) from None
    if isinstance(obj, dict) and isinstance(obj.get("trainer"), dict) and "model" in obj["trainer"]:
        damage = _damage(obj)
        if damage:
            raise RunDirError(
                f"{what} {path} is a damaged snapshot ({damage}): its bytes changed after ddpkit wrote it; "
                f"pass an intact copy, or the snapshot before it"
            )
        folder = shards.folder_of(Path(path))
        damage = shards.damage_of(obj["trainer"], folder)
        if damage:
            raise RunDirError(
                f"{what} {path} is a damaged snapshot ({damage}); pass an intact copy, or the snapshot before it"
            )
        obj = obj["trainer"]["model"]  # a snapshot
        if shards.is_ref(obj):  # its model in shards beside it: read whole, in this process alone
            try:
                obj = shards.read_whole(folder, obj[shards.REF])
            except Exception as exc:  # noqa: BLE001 - DCP's own errors (a folder without metadata, bad bytes)
                raise RunDirError(
                    f"{what} {path}: its shards in {folder.name} cannot be read ({type(exc).__name__}: "
                    f"{_first_line(exc)}); pass an intact copy, or the snapshot before it"
                ) from None
    if not isinstance(obj, dict) or not all(isinstance(v, torch.Tensor) for v in obj.values()):
        raise RunDirError(f"{what} {path}: expected a state_dict (name -> tensor), as model.pt holds")
    return {k.removeprefix("module."): v for k, v in obj.items()}


def check_weights_fit(model: nn.Module, path: str | Path, what: str = "--init-from") -> None:
    """The file's tensors must be the model's, name for name and shape for shape."""
    problem = weights_mismatch(model.state_dict(), read_weights(path, what))
    if problem:
        raise ConfigError(f"{what} {path} does not fit the model: {problem}")


def split_by_rank(ctx: DistContext, values: dict, replicated: frozenset = frozenset()) -> tuple[dict, dict]:
    """``values`` (name -> host tree) as (shared, per_rank): what is the same on every rank, saved once, and
    what differs by rank (a prefetched batch, an RNN's hidden state, a sampler of the rank's own), which each
    rank keeps and a snapshot saves per rank, as it saves the RNG states. Decided anew at every snapshot
    from a CRC32 digest per value per rank (``run/checksums.py``; one ``all_gather_object`` of the digests).
    Names in ``replicated`` are equal by construction (a DDP module: gradients all-reduced from the same
    start, buffers broadcast from rank 0) and are not hashed. Every rank, with the same names."""
    if ctx.world_size == 1:
        return dict(values), {}
    digests = {
        name: (sums["values"], tuple(crc for _, crc in sums["tensors"]))
        for name, value in values.items()
        if name not in replicated
        for sums in (checksums(value),)
    }
    every = [None] * ctx.world_size
    dist.all_gather_object(every, digests)  # a collective: every rank, the same names
    differ = {name for name in digests if len({d.get(name) for d in every}) > 1}  # the same set on every rank
    return {n: v for n, v in values.items() if n not in differ}, {n: v for n, v in values.items() if n in differ}


class Checkpointer:
    def __init__(
        self,
        run_dir: str | Path,
        ctx: DistContext,
        key: RunKey,
        keep: int = 2,
        new_run: str = "pass a new --run-dir",
        background: bool = False,
    ):
        """``key``: what a snapshot is matched on (``run/runkey.py``: a ``TrainConfig``, or a Loop's key).
        When a snapshot is due is the session's to decide (``train/session.py``), not the checkpointer's.
        ``background``: written by a thread on rank 0 while the steps go on (the module docstring)."""
        self.new_run = new_run  # how the user starts a new run, in their interface's words (CLI, Trainer, Loop)
        self.dir = RunFiles(run_dir).checkpoints
        self.ctx, self.key, self.keep = ctx, key, max(1, keep)
        self.valid: set[Path] = set()  # snapshots known whole: written by this run, or loaded and checked
        self.background = background
        self._stager = Stager()
        self._writing: _Write | None = None  # rank 0's write in flight (or finished, its outcome not yet said),
        # and every rank's part of a sharded one
        self._shard_group = self._shard_stager = None  # made at the first sharded snapshot written in the background
        self.write_s: list[float] = []  # per background write ended, its seconds from start to end (rank 0)

    def snapshots(self) -> list[Path]:
        """Snapshot files by name, newest first (``.tmp`` leftovers of killed saves are ignored)."""
        found = [(int(m.group(1)), p) for p in self.dir.glob("snapshot-*.pt") if (m := _NAME.search(p.name))]
        return [p for _, p in sorted(found, reverse=True)]

    def save(self, trainer_state: dict, global_step: int) -> Path:
        """Call on every rank. Gathers per-rank state, then rank 0 writes (in the background, it starts the
        write and returns); every rank learns whether it did, at once or at the next :meth:`wait`."""
        # One write in flight: each rank ends its previous one first (rank 0's, and every rank's part of sharded
        # ones), and rank 0's failure travels with the gather below (no collective of its own), so every rank
        # raises it here, before anything new is staged
        failed = self._end_write()
        path = self.path_of(global_step)
        # The sharded parts (FSDP2's, run/shards.py): written by every rank into the snapshot's own folder (a
        # collective), each file's CRC32 travelling to rank 0; the snapshot file, written after, holds references
        # to them and stays the one commit marker. In the step they are written now; in the background they are
        # copied aside once every rank knows the previous write succeeded (below), and written by a thread of each
        # rank's, over a group of their own (shards.writer_group)
        found = shards.find(trainer_state)
        crcs, entries = {}, None
        if found:
            keys = {id(part): f"s{i}" for i, (_, part) in enumerate(found)}
            entries = {keys[id(p)]: p.state for _, p in found}
            trainer_state = shards.replace_found(trainer_state, keys)
            if not self.background:
                crcs = shards.save_shards(entries, shards.folder_of(path), self.ctx)
                if self.ctx.is_main:
                    _kill_hook(global_step)("sharded")
        per_rank = {"rng": rng_state(self.ctx.device), "rank_state": trainer_state.pop("rank_state", None)}
        check_host_only(per_rank, "per-rank snapshot state")
        told = [None] * self.ctx.world_size
        if self.ctx.world_size > 1:  # a collective: outside any rank-0 branch
            dist.all_gather_object(told, (failed is not None, per_rank, crcs))
        else:
            told = [(failed is not None, per_rank, crcs)]
        if told[0][0]:
            raise failed if self.ctx.is_main else RunDirError(_OTHERS_FAILED)
        gathered = [mine for _, mine, _ in told]
        if not self.background:
            if found:  # every rank's files, by name: the snapshot file records them
                trainer_state = {**trainer_state, shards.FILES: {n: crc for _, _, c in told for n, crc in c.items()}}
            # also the barrier: nobody moves on (or reads) before the file is complete
            on_rank0(self.ctx, lambda: self._write(path, trainer_state, gathered, global_step), f"saving {path.name}")
            return path
        pending = None
        if entries is not None:
            if self._shard_group is None:
                self._shard_group = shards.writer_group()
            if self._shard_stager is None:
                self._shard_stager = shards.host_stager(self.ctx.device)
            pending = shards.start_save(entries, shards.folder_of(path), self._shard_group, self._shard_stager)
        if self.ctx.is_main or pending is not None:
            self._writing = _Write(self, path, trainer_state, gathered, global_step, pending)
        return path

    def _write(self, path: Path, trainer_state: dict, gathered: list, global_step: int, moment=None) -> None:
        """Rank 0: the snapshot file, whole or not at all, then ``newest``, then the pruning."""
        moment = moment or (lambda name: None)
        for stale in self.dir.glob("*.tmp"):  # left by a save that was killed part-way
            stale.unlink(missing_ok=True)
        # Shards no snapshot names (a save killed part-way), older than this one: a newer folder may be the next
        # save's, which the other ranks start writing while this thread still writes (background snapshots)
        for folder in self.dir.glob(f"*{shards.SUFFIX}"):
            if _step(folder.with_suffix(".pt")) < global_step and not folder.with_suffix(".pt").exists():
                shutil.rmtree(folder, ignore_errors=True)
        snapshot = {
            "format": FORMAT,
            "config": self.key.to_dict(),
            "config_hash": self.key.hash(),
            "world_size": self.ctx.world_size,
            "versions": {"ddpkit": __version__, "torch": str(torch.__version__)},
            "global_step": global_step,
            "trainer": trainer_state,
            "ranks": gathered,
        }
        snapshot["checksums"] = checksums(snapshot)  # of everything above, on what is written
        data = torch_bytes(snapshot)
        moment("serialised")
        atomic_write(path, data, moment=moment)
        atomic_write(self.dir / NEWEST, str(global_step).encode())  # after it: never names a file not whole
        moment("newest")
        self.valid.add(path)
        self._prune()
        moment("pruned")

    @property
    def staging_bytes(self) -> int:
        """Host memory the copies aside hold (background writes; 0 otherwise): rank 0's of the snapshot file, and
        this rank's of its shards."""
        return self._stager.nbytes + shards.staged_bytes(self._shard_stager)

    def wait(self) -> None:
        """Every rank: the background write in flight, if any, finished; its failure raised on every rank as
        ``RunDirError`` (rank 0's says why). One all-reduce; nothing at all for synchronous saves."""
        if not self.background:
            return
        agree(self.ctx, self._end_write())

    def _end_write(self) -> RunDirError | None:
        """The write in flight, if any, ended (rank 0's; another rank's part of a sharded one); its failure, if it
        failed (rank 0 alone learns of one: another rank's part tells it)."""
        if self._writing is None:
            return None
        with hangwatch.busy(f"finishing {self._writing.path.name}", announce=True):  # the others wait
            error = self._writing.finish()
        self._writing = None
        return error

    def write_error(self) -> RunDirError | None:
        """Rank 0: the failure of a background write that has ended, without waiting (None otherwise; None on
        the other ranks, whose part of a sharded write tells its failure to rank 0). A safe point's all-reduce
        carries it, so every rank stops at the same step."""
        writing = self._writing
        if writing is None or writing.running:
            return None
        if writing.error is not None:
            self._writing = None  # handed to the safe point, which raises it: said once, not again by the next save
        return writing.error

    def close(self, warn=None) -> None:
        """This rank's write in flight finished (a run ending on an error, where the other ranks may be gone):
        the snapshot is whole or not there, and a failure of it is said in a warning line (the run's own error
        is the one raised). No collective of the steps' group; under FSDP2 the writer threads' own collectives
        end with the other ranks' writers (a dead peer breaks them at once; a stalled one holds them up to
        ``--timeout-s``). The shards' host copies are released."""
        if self._writing is not None:
            error = self._writing.finish()
            self._writing = None
            if error is not None:
                (warn or _stderr)(f"ddpkit: warning: {error}")
        if self._shard_stager is not None:  # its host copies released
            self._shard_stager.close()
            self._shard_stager = None

    def path_of(self, global_step: int) -> Path:
        """The snapshot file of ``global_step`` (named alike on every rank, whether it sees the run dir or not)."""
        return self.dir / f"snapshot-{global_step:09d}.pt"

    def restore(self, snap: dict) -> dict:
        """What :meth:`save` was given on this rank, from a snapshot :meth:`load_latest` chose: the global
        state with this rank's own ``rank_state``, ``rank_states`` (every old rank's, for a caller that merges
        them at another world size) and ``same_world``. The RNG streams are :meth:`restore_rng`'s, called
        after everything is loaded, so nothing a ``load_state_dict`` draws moves them."""
        ranks = snap["ranks"]
        same = len(ranks) == self.ctx.world_size
        state = dict(snap["trainer"])
        state["rank_states"] = [r.get("rank_state") for r in ranks]
        state["rank_state"] = ranks[self.ctx.rank].get("rank_state") if same else None
        state["same_world"] = same
        state["world_size"], state["global_step"] = snap["world_size"], snap["global_step"]
        return state

    def restore_rng(self, snap: dict, seed: int) -> None:
        """This rank's RNG states as the snapshot saved them; at another world size (an elastic resume), where
        no rank's streams can be continued (there is no rank 2 to take over from a world of 2), fresh ones
        from (seed, step, rank)."""
        ranks = snap["ranks"]
        if len(ranks) == self.ctx.world_size:
            set_rng_state(ranks[self.ctx.rank]["rng"], self.ctx.device)
        else:
            reseed(seed, snap["global_step"], self.ctx.rank)

    def _prune(self) -> None:
        """Delete what ``keep`` newer valid snapshots supersede. A file never validated (a stray or
        damaged one) neither counts toward ``keep`` nor is deleted unless superseded."""
        files = self.snapshots()
        valid = [p for p in files if p in self.valid]
        if len(valid) <= self.keep:
            return
        oldest_kept = _step(valid[self.keep - 1])
        for p in files:
            if _step(p) < oldest_kept:
                p.unlink(missing_ok=True)
                shutil.rmtree(shards.folder_of(p), ignore_errors=True)
                self.valid.discard(p)

    def load_latest(self, fits=lambda snap: None, warn=print) -> dict | None:
        """The newest snapshot for this config that loads and ``fits`` (a check that raises on a
        snapshot this run cannot use: another model's weights, missing parts). Every rank calls
        this and makes the same choice (checked with one all-reduce); rank 0 moves the ones it
        skipped to ``checkpoints/corrupt/`` with one warning each. None: nothing to resume. When there
        are snapshots and none can be used, a RunDirError on every rank, and nothing is moved."""
        skipped: list[tuple[Path, str]] = []
        candidates = self._candidates(fits, skipped)
        while True:
            chosen = next(candidates)
            step = _step(chosen[0]) if chosen else -1
            self._agree_on(step)
            # Its shards' CRC32s, each file read by one rank: the same verdict on every rank, or the next one
            damage = self._shards_damage(chosen)
            if not damage:
                break
            skipped.append((chosen[0], f"is damaged ({damage})"))
        if chosen is None and skipped:  # the same list on every rank: each read the same files
            listed = "; ".join(f"{path.name} {why}" for path, why in skipped[:3])
            more = f"; and {len(skipped) - 3} more" if len(skipped) > 3 else ""
            one, them = ("it", "it") if len(skipped) == 1 else ("one", "them")
            raise RunDirError(
                f"no snapshot in {self.dir} can be resumed: {listed}{more}. Restore an intact copy of {one}, "
                f"or move {them} into {self.dir / 'corrupt'} to train again from the start, or {self.new_run}"
            )
        if self.ctx.is_main:
            for path, why in skipped:
                warn(
                    f"ddpkit: warning: snapshot {path} {why}; moved to {self.dir / 'corrupt'}, "
                    f"resuming from {chosen[0].name}"
                )
                _move_aside(path, self.dir / "corrupt")
            gone = self._newest_gone(step)
            if gone:
                then = f"resuming from {chosen[0].name}" if chosen else "training from the start"
                warn(f"ddpkit: warning: {gone}, the newest snapshot written in {self.dir}, is gone; {then}")
        if chosen is None:
            return None
        self.valid.add(chosen[0])
        return chosen[1]

    def _candidates(self, fits, skipped: list):
        """The snapshots this rank can read and that fit, newest first (then None), each file's own checks made;
        the ones it skips added to ``skipped`` with why. Their shards' CRC32s are :meth:`_shards_damage`'s."""
        for path in self.snapshots():
            try:
                snap = torch.load(path, map_location="cpu", weights_only=True)
                _check_layout(snap)
            except Exception as exc:  # truncated zip, bad pickle, wrong layout
                skipped.append((path, f"is corrupt or truncated ({type(exc).__name__}: {_first_line(exc)})"))
                continue
            # (before the config checks: damage there is damage, not another config. Of its shards, every rank
            # checks here that each file is there and DCP's metadata, which the fit reads; the data files' bytes
            # are read once the ranks agree on this snapshot, each file by one rank: _shards_damage)
            damage = _damage(snap) or shards.damage_of(snap["trainer"], shards.folder_of(path), share=(0, 0))
            if damage:
                skipped.append((path, f"is damaged ({damage})"))
                continue
            snap["trainer"] = shards.resolved(snap["trainer"], shards.folder_of(path))  # its parts loadable
            self._check_compatible(snap, path)  # another config or version is not damage: refuse, move nothing
            try:
                fits(snap)
            except Exception as exc:
                skipped.append((path, f"does not fit this run ({type(exc).__name__}: {_first_line(exc)})"))
                continue
            yield path, snap
        while True:
            yield None

    def _shards_damage(self, chosen: tuple[Path, dict] | None) -> str:
        """Every rank, on the snapshot they agreed on: how its shard files differ from their CRC32s ("" when
        whole, or it has none), each file read by one rank, what any rank found told to all (one gather)."""
        crcs = chosen[1]["trainer"].get(shards.FILES) if chosen else None
        if not crcs:
            return ""
        # (DCP's metadata was checked by every rank already: _candidates)
        share = (self.ctx.rank, self.ctx.world_size)
        mine = shards.damage(shards.folder_of(chosen[0]), crcs, share=share, metadata=False)
        if self.ctx.world_size == 1:
            return mine
        found = [None] * self.ctx.world_size
        dist.all_gather_object(found, mine)
        return next((said for said in found if said), "")

    def _newest_gone(self, step: int) -> str:
        """The name of the newest snapshot ever written here (``checkpoints/newest``) when it is newer than
        ``step`` and no longer there, nor moved aside as damaged: a file deleted by hand, or lost with its
        storage. "" otherwise (a dir from before the record: nothing to compare)."""
        try:
            newest = int((self.dir / NEWEST).read_text())
        except (OSError, ValueError):
            return ""
        name = f"snapshot-{newest:09d}.pt"
        if newest <= step or (self.dir / name).exists() or (self.dir / "corrupt" / name).exists():
            return ""
        return name

    def _agree_on(self, step: int) -> None:
        """Every rank must resume from the same snapshot (a rank that could not read a file would not)."""
        if self.ctx.world_size == 1:
            return
        # int64: float32 holds steps exactly only up to 2**24. MAX of (step, -step) is (hi, -lo): one all-reduce.
        both = self.ctx.all_reduce(
            torch.tensor([step, -step], dtype=torch.int64, device=self.ctx.device), op=dist.ReduceOp.MAX
        )
        hi, neg_lo = both.tolist()
        if hi != -neg_lo:
            raise RunDirError(
                f"ranks disagree on the newest readable snapshot in {self.dir} (steps {-neg_lo} and "
                f"{hi}): some rank cannot read a file the others can; check that every node sees "
                f"the same run directory"
            )

    def _check_compatible(self, snap: dict, path: Path) -> None:
        if snap["format"] != FORMAT:
            raise RunDirError(
                f"snapshot {path} was written by another ddpkit version (snapshot format "
                f"{snap['format']}, this one reads {FORMAT}); {self.new_run}"
            )
        # By key, not by hash alone: a snapshot from before a key was recorded matches on the rest
        keys = self.key.differing_keys(snap["config"]) if snap["config_hash"] != self.key.hash() else []
        if keys:
            raise RunDirError(
                f"snapshot {path} was made with a different config (differs in: {', '.join(keys)}); "
                f"{self.new_run} to start a new run"
            )
        refused = self.key.world_change(snap["world_size"], self.ctx.world_size)
        if snap["world_size"] != self.ctx.world_size and refused:
            raise RunDirError(f"snapshot {path} was made at world size {snap['world_size']} {refused}")


class _Write:
    """One snapshot written in the background: rank 0's file, from the state staged now (``run/staging.py``),
    written by a thread as :meth:`Checkpointer._write` writes it; and, of a sharded snapshot, every rank's part
    (``pending``: its shards, copied aside and being written by DCP), whose thread then sends rank 0 its files'
    CRC32s, or its failure, over the writers' group: rank 0 writes the file naming them once every rank's are
    written. Not a daemon: an interpreter that exits (an error in the step) lets the write end first, so the
    snapshot is whole or not there."""

    def __init__(
        self, ckpt: Checkpointer, path: Path, trainer_state: dict, gathered: list, global_step: int, pending=None
    ):
        self.path, self.error, self.thread = path, None, None
        main = ckpt.ctx.is_main
        try:
            staged = ckpt._stager.stage({"trainer": trainer_state, "ranks": gathered}) if main else None
        except Exception as exc:  # noqa: BLE001 - said at the next safe point, on every rank
            self.error = RunDirError(f"global rank 0 failed copying {path.name} aside: {type(exc).__name__}: {exc}")
            staged = None  # the shards' thread still runs: the other ranks' wait for rank 0's part of the gather

        def write() -> None:
            if not main:
                # This rank's part of a sharded snapshot: its failure travels to rank 0 in the gather, and rank 0
                # says it; a gather that breaks (a peer gone) is said by the steps' own collectives, which break too
                with contextlib.suppress(Exception):
                    _shards_written(ckpt, path, pending)
                return
            moment, t0 = _kill_hook(global_step), time.perf_counter()
            try:
                if staged is not None:
                    moment("staged")
                    ckpt._stager.ready()
                # (even when rank 0's copy failed: the other ranks' threads wait for its part of the gather)
                files = _shards_written(ckpt, path, pending) if pending is not None else None
                if staged is None:
                    return
                if files is not None:
                    moment("sharded")
                    staged["trainer"] = {**staged["trainer"], shards.FILES: files}
                ckpt._write(path, staged["trainer"], staged["ranks"], global_step, moment)
            except RunDirError as exc:
                self.error = exc
            except Exception as exc:  # noqa: BLE001 - any failure: the run stops at its next safe point
                self.error = RunDirError(f"global rank 0 failed saving {path.name}: {type(exc).__name__}: {exc}")
            finally:
                if staged is not None:
                    ckpt.write_s.append(time.perf_counter() - t0)

        self.thread = threading.Thread(target=write, name=f"ddpkit-write-{path.name}")
        self.thread.start()

    @property
    def running(self) -> bool:
        return self.thread is not None and self.thread.is_alive()

    def finish(self) -> RunDirError | None:
        if self.thread is not None:
            self.thread.join()
        return self.error


def _shards_written(ckpt: Checkpointer, path: Path, pending) -> dict[str, int] | None:
    """A writer thread, every rank: this rank's shards of ``path`` written (``pending``, DCP's future), then each
    rank's CRC32s, or its failure, sent to rank 0 over the writers' group (a collective of the writer threads).
    Rank 0: every rank's files, by name, or the first failure raised; None elsewhere."""
    ctx, folder = ckpt.ctx, shards.folder_of(path)
    try:
        with shards.dcp_errors(f"writing its shards of {path.name}"):  # DCP's failure, on every rank alike
            pending.result()
        mine = (None, shards.own_crcs(folder, ctx))
    except RunDirError as exc:
        mine = (str(exc), {})
    except BaseException as exc:  # noqa: BLE001 - a broken collective of the writers (a peer gone), or this rank's own
        mine = (f"global rank {ctx.rank} could not write its shards of {path.name}: {type(exc).__name__}: {exc}", {})
    every = [None] * ctx.world_size
    if ctx.world_size > 1:
        dist.gather_object(mine, every if ctx.is_main else None, dst=0, group=ckpt._shard_group)
    else:
        every = [mine]
    if not ctx.is_main:
        return None
    failures = [why for why, _ in every if why]
    if failures:
        raise RunDirError(failures[0])
    return {name: crc for _, crcs in every for name, crc in crcs.items()}


_OTHERS_FAILED = "global rank 0 could not write a snapshot in the background (its message is the one printed)"


# A test hook, for the kill-anywhere-in-a-write tests (tests/system/test_fault_tolerance.py):
# DDPKIT_TEST_KILL_WRITE="FOLDER:FIRST_STEP:MOMENT,MOMENT,..." SIGKILLs this process at the first listed moment
# of a background write of a snapshot at FIRST_STEP or later that FOLDER has no file of yet (it writes one
# first), so each restart of the job is killed one moment further on.
_KILL_ENV = "DDPKIT_TEST_KILL_WRITE"


def _kill_hook(global_step: int):
    spec = os.environ.get(_KILL_ENV)
    if not spec:
        return lambda name: None
    folder, first, moments = spec.rsplit(":", 2)
    if global_step < int(first):
        return lambda name: None

    def moment(name: str) -> None:
        mark = Path(folder) / name
        if name in moments.split(",") and not mark.exists():
            mark.write_text(str(global_step))
            os.kill(os.getpid(), signal.SIGKILL)

    return moment


def _stderr(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def _step(path: Path) -> int:
    return int(_NAME.search(path.name).group(1))


def _first_line(exc: Exception) -> str:
    text = str(exc).strip()
    return text.splitlines()[0][:200] if text else ""


def _damage(snap: dict) -> str:
    """What differs from the checksums written with ``snap``; "" when nothing does, or when it has
    none (written before snapshots had checksums: nothing to check it against)."""
    if "checksums" not in snap:
        return ""
    return first_difference({k: v for k, v in snap.items() if k != "checksums"}, snap["checksums"])


def _check_layout(snap) -> None:
    """A snapshot's top level, as :meth:`Checkpointer.save` writes it."""
    if not isinstance(snap, dict):
        raise ValueError(f"not a snapshot ({article(type(snap).__name__)})")
    if not isinstance(snap.get("format"), int):
        raise ValueError("no snapshot format")
    for key, kind in (
        ("config", dict),
        ("config_hash", str),
        ("world_size", int),
        ("global_step", int),
        ("trainer", dict),
        ("ranks", list),
    ):
        if not isinstance(snap.get(key), kind):
            raise ValueError(f"missing or malformed {key!r}")


def _move_aside(path: Path, folder: Path) -> None:
    try:
        folder.mkdir(exist_ok=True)
        os.replace(path, folder / path.name)
        if shards.folder_of(path).is_dir():
            os.replace(shards.folder_of(path), folder / shards.folder_of(path).name)
    except OSError:  # read-only storage: leave it; it is skipped again next time
        pass
