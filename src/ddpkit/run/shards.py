"""A snapshot's sharded parts: each rank writes its own shards (``torch.distributed.checkpoint``, DCP), and the
snapshot file (``run/checkpoint.py``) holds a reference to them, so that file stays the commit marker.

    state = {"model": Sharded(get_model_state_dict(fsdp_model))}   # what a strategy gives a snapshot
    crcs = save_shards({"s0": state["model"].state}, folder, ctx)  # every rank: its files, checksummed
    ...the snapshot file written with {"model": ref("s0")} and every rank's crcs...
    load_model(model, ref)                                          # resharded to this run's ranks

The layout on disk: ``checkpoints/snapshot-000000010.pt`` (written last) and ``snapshot-000000010.shards/``
(DCP's files: ``.metadata`` and one ``__<rank>_0.distcp`` per rank). A kill before the snapshot file is
whole leaves a folder no snapshot names, removed at the next write; a shard file whose bytes changed is
found by its CRC32 before anything loads, and the snapshot skipped for the one before it. DCP reshards on
load: a world-2 snapshot loads into 1 or 3 ranks, into FSDP2 or into a whole (DDP) model alike.
"""

from __future__ import annotations

import zlib
from collections.abc import Iterator
from concurrent.futures import Future
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ..errors import RunDirError
from ..ranks.context import DistContext

REF = "__shards__"  # the key that makes a dict in a snapshot a reference to its shards
FILES = "shard_files"  # the snapshot's record of every shard file's CRC32, by name
SUFFIX = ".shards"
METADATA = ".metadata"  # DCP's index of a checkpoint's files, written by rank 0


@dataclass
class Sharded:
    """A state dict of DTensors (each rank's own shards), to be written by every rank with DCP."""

    state: dict


def ref(key: str) -> dict:
    """What the snapshot file holds in a sharded part's place (the folder is the snapshot's own)."""
    return {REF: key}


def is_ref(value: Any) -> bool:
    return isinstance(value, dict) and REF in value


def folder_of(snapshot: Path) -> Path:
    """``snapshot-000000010.pt`` -> ``snapshot-000000010.shards``."""
    return snapshot.with_suffix(SUFFIX)


def find(tree: Any, path: str = "") -> list[tuple[str, Any]]:
    """Every :class:`Sharded` in ``tree`` (dicts), with where it is; in the tree's order, the same on every rank."""
    if isinstance(tree, Sharded):
        return [(path, tree)]
    if isinstance(tree, dict):
        return [found for k, v in tree.items() for found in find(v, f"{path}/{k}")]
    return []


def replace_found(tree: Any, keys: dict[int, str]) -> Any:
    """``tree`` with each :class:`Sharded` (by id) replaced by its reference."""
    if isinstance(tree, Sharded):
        return ref(keys[id(tree)])
    if isinstance(tree, dict):
        return {k: replace_found(v, keys) for k, v in tree.items()}
    return tree


def damage_of(trainer: dict, folder: Path, share: tuple[int, int] = (0, 1)) -> str:
    """A snapshot's shards against the CRCs its file records ("" when it has none, or they are whole); ``share``
    as for :func:`damage`."""
    crcs = trainer.get(FILES)
    return damage(folder, crcs, share) if crcs else ""


def resolved(tree: Any, folder: Path) -> Any:
    """``tree`` with each reference made loadable: ``{"key": its part, "folder": the shards' path}``."""
    if is_ref(tree):
        return {"key": tree[REF], "folder": str(folder), REF: tree[REF]}
    if isinstance(tree, dict):
        return {k: resolved(v, folder) for k, v in tree.items()}
    return tree


def owner(optimizer: torch.optim.Optimizer, models: list[nn.Module]) -> nn.Module:
    """The model among ``models`` whose parameters ``optimizer`` steps (DCP keys its state by their names)."""
    mine = {id(p) for group in optimizer.param_groups for p in group["params"]}
    for model in models:
        if mine <= {id(p) for p in model.parameters()}:
            return model
    raise RunDirError(
        "a snapshot's sharded optimizer state is keyed by parameter names, and this optimizer steps the parameters "
        "of no one model passed to the loop (or of several): build one optimizer per model"
    )


def save_shards(entries: dict[str, dict], folder: Path, ctx: DistContext) -> dict[str, int]:
    """Every rank: ``entries`` (key -> a state dict of shards) written into ``folder`` by DCP (a collective).
    Returns the CRC32 of each file this rank wrote (rank 0: with the metadata)."""
    import torch.distributed.checkpoint as dcp

    with dcp_errors(f"writing its shards of {folder.with_suffix('.pt').name}"):
        dcp.save(entries, checkpoint_id=str(folder), planner=_planner())
    return own_crcs(folder, ctx)


def start_save(entries: dict[str, dict], folder: Path, group, stager) -> Future:
    """Every rank: ``entries`` copied to host memory now (``stager``, :func:`host_stager`: once this returns, the
    step may change the tensors), then written into ``folder`` by a thread of DCP's, whose collectives (the plan,
    then the gather of what each rank wrote, after which rank 0 writes the metadata) go over ``group``
    (:func:`writer_group`). The future ends when this rank's part of it has."""
    import torch.distributed.checkpoint as dcp

    return dcp.async_save(
        entries, checkpoint_id=str(folder), process_group=group, planner=_planner(), async_stager=stager
    )


def host_stager(device: torch.device):
    """DCP's stager for :func:`start_save`, one per run: it keeps the host copy of each tensor it staged and
    copies into it again at the next snapshot (one allocation per run, as ``run/staging.py``'s buffers), in
    pinned memory from a GPU. The copy is a blocking one: the shards are on the host when the step goes on.
    ``close()`` it at the run's end."""
    from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

    return DefaultStager(
        StagingOptions(
            use_pinned_memory=device.type == "cuda",
            use_shared_memory=False,
            use_async_staging=False,
            use_non_blocking_copy=False,
        )
    )


def writer_group():
    """A gloo group of every rank, for the collectives of shards written in the background (:func:`start_save`):
    a writer thread's collectives must not go over the group the steps use, whose collectives the main thread
    issues meanwhile, in an order the thread cannot keep to. Every rank, at the same point (a collective); the
    default group's timeout (``--timeout-s``)."""
    import torch.distributed as dist

    default = dist.distributed_c10d._get_default_group()
    timeout = None
    for kind in ("cpu", "cuda"):  # gloo answers for the CPU, NCCL for CUDA
        try:
            timeout = default._get_backend(torch.device(kind)).options._timeout
            break
        except Exception:  # noqa: BLE001 - no backend of that kind in this group
            continue
    return dist.new_group(backend="gloo", timeout=timeout)


def staged_bytes(stager) -> int:
    """The host memory :func:`host_stager`'s copies hold (0 for None, or for a torch whose stager keeps them
    elsewhere)."""
    cache = getattr(getattr(stager, "_state_dict_stager", None), "_cached_storage_mapping", None)
    return sum(storage.nbytes() for storage in cache.values()) if cache is not None else 0


@contextmanager
def dcp_errors(what: str) -> Iterator[None]:
    """DCP's failure (``CheckpointException``, a ``BaseException``: ``except Exception`` lets it through, and each
    rank ended with its traceback) as a :class:`RunDirError` naming the first failed rank's own error. DCP gives
    every rank the same failures, so every rank raises the same line, said once."""
    try:
        yield
    except BaseException as exc:
        failures = getattr(exc, "failures", None)
        if not isinstance(failures, dict) or not failures:
            raise
        rank, cause = min(failures.items(), key=lambda item: item[0])
        cause = cause[0] if isinstance(cause, tuple) else cause  # DCP keeps (exception, traceback)
        raise RunDirError(f"global rank {rank} failed {what}: {type(cause).__name__}: {cause}") from None


def _planner():
    import torch.distributed.checkpoint as dcp

    # A tensor every rank holds whole (a buffer: BatchNorm's running statistics) is written once, and by global
    # rank 0, whose buffers are the model's (DDP broadcasts them from rank 0; model.pt holds rank 0's): DCP's
    # default spreads such writes over the ranks, so a resume gave rank 0 rank 1's statistics
    return dcp.DefaultSavePlanner(dedup_save_to_lowest_rank=True)


def own_crcs(folder: Path, ctx: DistContext) -> dict[str, int]:
    """The CRC32 of each file of ``folder`` this rank wrote (rank 0: with DCP's metadata)."""
    mine = sorted(folder.glob(f"__{ctx.rank}_*.distcp")) + ([folder / METADATA] if ctx.is_main else [])
    return {p.name: file_crc(p) for p in mine}


def file_crc(path: Path) -> int:
    crc = 0
    with open(path, "rb") as f:
        while chunk := f.read(1 << 22):
            crc = zlib.crc32(chunk, crc)
    return crc


def damage(folder: Path, crcs: dict[str, int], share: tuple[int, int] = (0, 1), metadata: bool = True) -> str:
    """How the shards in ``folder`` differ from their recorded CRCs ("" when whole). ``share``: (this rank, of
    how many ranks) read the data files, each file by one rank (by name, dealt in turn), so that a resume reads
    a snapshot once in all, not once per rank (of 0 ranks: none). Every rank checks that each file is there,
    and (``metadata``) DCP's metadata: small, and read by every rank to load."""
    if not folder.is_dir():
        return f"its shards folder {folder.name} is gone"
    index, count = share
    data = sorted(name for name in crcs if name != METADATA)
    for name in sorted(crcs):
        path = folder / name
        if not path.exists():
            return f"its shard file {folder.name}/{name} is gone"
        mine = metadata if name == METADATA else bool(count) and data.index(name) % count == index
        try:
            if mine and file_crc(path) != crcs[name]:
                return f"the CRC32 of its shard file {folder.name}/{name} differs from the one written with it"
        except OSError as exc:  # said as damage, on the rank that read it: the others learn it from the verdict
            return f"its shard file {folder.name}/{name} cannot be read ({exc})"
    return ""


def saved_shapes(folder: Path, key: str) -> dict[str, tuple]:
    """The tensors a sharded part holds, by name (within the part) -> whole shape, from DCP's metadata."""
    import torch.distributed.checkpoint as dcp

    meta = dcp.FileSystemReader(str(folder)).read_metadata().state_dict_metadata
    prefix = f"{key}."
    return {k[len(prefix) :]: tuple(m.size) for k, m in meta.items() if k.startswith(prefix) and hasattr(m, "size")}


def read_whole(folder: Path, key: str) -> dict:
    """A sharded part as whole tensors on the CPU, in this process alone (no process group: ``--init-from``
    a snapshot, or ``ddpkit eval``)."""
    import torch.distributed.checkpoint as dcp

    meta = dcp.FileSystemReader(str(folder)).read_metadata().state_dict_metadata
    prefix = f"{key}."
    target = {
        k[len(prefix) :]: torch.empty(tuple(m.size), dtype=m.properties.dtype)
        for k, m in meta.items()
        if k.startswith(prefix) and hasattr(m, "size")
    }
    with dcp_errors(f"reading the shards of {folder.name}"):
        dcp.load({key: target}, checkpoint_id=str(folder), no_dist=True)
    return target


def load_model(model: nn.Module, part: dict) -> None:
    """A sharded part (``part``: a reference :meth:`Checkpointer.restore` made absolute) into ``model``,
    sharded or whole: DCP reads what this rank's tensors cover."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, set_model_state_dict

    state = get_model_state_dict(model)
    with dcp_errors(f"loading the model's shards from {Path(part['folder']).name}"):
        dcp.load({part["key"]: state}, checkpoint_id=part["folder"])
    set_model_state_dict(model, state)


def load_optimizer(model: nn.Module, optimizer: torch.optim.Optimizer, part: dict) -> None:
    """As :func:`load_model`, for the optimizer of ``model`` (its state made first, to be read into)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict, set_optimizer_state_dict

    state = get_optimizer_state_dict(model, optimizer)  # torch makes state for every parameter to read into
    key, folder = part["key"], part["folder"]
    saved = dcp.FileSystemReader(folder).read_metadata().state_dict_metadata
    # A parameter the saved run had no state for (no gradient yet: an unused head, a branch not taken) is
    # not read, and has none again after the load, as in the run that saved it
    missing = [name for name in state["state"] if not any(k.startswith(f"{key}.state.{name}.") for k in saved)]
    loadable = {**state, "state": {n: v for n, v in state["state"].items() if n not in missing}}
    with dcp_errors(f"loading the optimizer's shards from {Path(folder).name}"):
        dcp.load({key: loadable}, checkpoint_id=folder)  # into the same per-parameter dicts, and the groups
    set_optimizer_state_dict(model, optimizer, state)
    drop_state(model, optimizer, missing)


def drop_state(model: nn.Module, optimizer: torch.optim.Optimizer, names: list[str]) -> None:
    """The optimizer's state of the parameters ``names`` removed (what torch's state-dict API made up)."""
    params = dict(model.named_parameters())
    for name in names:
        optimizer.state.pop(params[name], None)
