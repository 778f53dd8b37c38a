"""A snapshot's state copied aside, so the step goes on while a background thread writes it.

    stager = Stager()
    staged = stager.stage(state)   # every tensor copied into a host buffer of this stager's: the step may go on
    stager.ready()                 # (the writer thread) the copies have landed: serialise ``staged`` now

What a snapshot holds is the live state: a module's ``state_dict`` is its parameters themselves, an optimizer's
its momentum buffers, which the next ``optimizer.step()`` changes in place. Written synchronously that is fine;
written in the background it is not, so each tensor is copied first, into a buffer allocated at the first
snapshot and reused by every later one (the same names and shapes come back each time: one allocation per run,
not one per snapshot). From a CUDA tensor the copy goes to pinned host memory without blocking the host, on the
current stream: the next kernel that writes the parameter (the optimizer's) is queued after it, so the copy
reads the values of the step that was saved; ``ready()`` waits on the event recorded after the copies. From a
CPU tensor it is a plain copy (ResNet-9's 50 MiB with momentum: 8.5 ms alone on the 2-core AVX2 VM, 11-16 ms
with the other rank computing; BENCHMARKS.md, "Snapshots written in the background").

On the CPU, the copies of the tensors only an optimizer's ``step()`` changes (its parameters and its state: the
bulk of a snapshot, ResNet-9's 50 MiB) can be left to the writer thread (``later``): they are made beside the next
step's forward and backward, which only read them, and ``copied()``, which the optimizers' step pre-hooks call
(``train/session.py``), waits until they are made. What a forward changes in place (BatchNorm's running
statistics), and everything else, is copied before ``stage`` returns. A tensor changed in place meanwhile anyway
(a loop's own update of its weights outside ``step()``) is found by its version counter, which every in-place
change moves: :meth:`ready` raises :class:`Moved`, and that snapshot is not written.

The tree is rebuilt too (dicts, lists, tuples): a state dict may hand out a container the loop changes later
(a scheduler's ``_last_lr``). Leaves that are not tensors are plain values (numbers, strings), which do not
change. A tensor met twice in one tree (tied weights) is copied once and stays one tensor, as ``torch.save``
keeps it.
"""

from __future__ import annotations

import collections
import threading
from typing import Any

import torch


class Moved(Exception):
    """A tensor whose copy was left to the writer changed in place before the copy was made."""


class Stager:
    """Host buffers for one rank's snapshot state, reused from one snapshot to the next. One stage at a time:
    the caller waits for the write of the previous one before staging the next (``Checkpointer`` does)."""

    def __init__(self) -> None:
        self._buffers: dict[tuple, torch.Tensor] = {}
        self._used: set[tuple] = set()  # the buffers the last stage() used
        self._event: torch.cuda.Event | None = None
        # (buffer, tensor, its version counter at stage, its place in the tree): the copies the writer makes
        self._later: list[tuple[torch.Tensor, torch.Tensor, int, tuple]] = []
        self._copied = threading.Event()  # set once no copy is left to make
        self._copied.set()

    @property
    def nbytes(self) -> int:
        """Host memory the buffers hold (bytes)."""
        return sum(b.numel() * b.element_size() for b in self._buffers.values())

    def stage(self, tree: Any, later: frozenset[int] = frozenset()) -> Any:
        """``tree`` with each tensor replaced by a copy in this stager's buffers, and each container rebuilt.
        ``later``: the storages (``untyped_storage().data_ptr()``) of CPU tensors whose copies :meth:`ready`
        makes, on the writer's thread; :meth:`copied` waits for them."""
        seen: dict[tuple, torch.Tensor] = {}
        cuda = []
        self._used: set[tuple] = set()
        self._later = []
        try:
            staged = self._copy(tree, (), seen, cuda, later)
        except BaseException:
            self._later = []
            raise
        if self._later:
            self._copied.clear()
        # A buffer this snapshot did not use is freed: a value whose shape changes from one snapshot to the
        # next (a prefetched batch of another length) would otherwise add a buffer at each
        self._buffers = {k: v for k, v in self._buffers.items() if k in self._used}
        self._event = None
        if cuda:
            self._event = torch.cuda.Event()
            self._event.record()  # on the current stream, after the copies
        return staged

    def ready(self) -> None:
        """The writer's thread: make the copies left to it, then block until the copies of the last :meth:`stage`
        have landed (a CUDA event)."""
        try:
            for buf, t, _, _ in self._later:
                buf.copy_(t)
            # after the copies: a change during one is found too
            moved = [path for _, t, version, path in self._later if t._version != version]
        finally:
            self._later = []
            self._copied.set()
        if moved:
            raise Moved("/".join(map(str, moved[0])))
        if self._event is not None:
            self._event.synchronize()

    def copied(self) -> None:
        """Block until the copies left to the writer's thread are made (at once when none are)."""
        self._copied.wait()

    def release(self) -> None:
        """The copies left to the writer will not be made (its thread never started, or a kill in a test): no
        step waits for them."""
        self._later = []
        self._copied.set()

    def _copy(self, tree: Any, path: tuple, seen: dict, cuda: list, later: frozenset[int]) -> Any:
        if isinstance(tree, torch.Tensor):
            return self._tensor(tree, path, seen, cuda, later)
        if isinstance(tree, dict):
            out = type(tree)() if type(tree) in (dict, collections.OrderedDict) else {}
            for k, v in tree.items():
                out[k] = self._copy(v, (*path, k), seen, cuda, later)
            return out
        if isinstance(tree, (list, tuple)) and type(tree) in (list, tuple):
            return type(tree)(self._copy(v, (*path, i), seen, cuda, later) for i, v in enumerate(tree))
        return tree

    def _tensor(self, t: torch.Tensor, path: tuple, seen: dict, cuda: list, later: frozenset[int]) -> torch.Tensor:
        t = t.detach()
        # One tensor met twice (tied weights: a state_dict detaches each name's anew, so not by object but by
        # the memory it views) is copied once and stays one, as torch.save keeps it
        ident = (
            (t.device, t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape), t.stride(), t.dtype)
            if t.layout == torch.strided and not t.is_quantized and not t.is_nested
            else ("object", id(t))
        )
        if ident in seen:
            return seen[ident]
        if t.layout != torch.strided or t.is_quantized or t.is_nested:  # rare: a fresh copy, not a buffer
            copy = t.to("cpu", copy=True)
        else:
            key = (path, tuple(t.shape), t.dtype)
            self._used.add(key)
            buf = self._buffers.get(key)
            if buf is None:
                pin = t.device.type == "cuda"
                buf = self._buffers[key] = torch.empty(t.shape, dtype=t.dtype, device="cpu", pin_memory=pin)
            non_blocking = t.device.type == "cuda" and buf.is_pinned()
            if t.device.type == "cpu" and later and t.untyped_storage().data_ptr() in later:
                self._later.append((buf, t, t._version, path))
            else:
                buf.copy_(t, non_blocking=non_blocking)
            if non_blocking:
                cuda.append(t)
            copy = buf
        seen[ident] = copy
        return copy
