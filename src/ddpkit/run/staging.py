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

On the CPU the copy is made here, in the step, though the step's forward and backward only read most of it: left
to the writer's thread and awaited by the next optimizer step, it held the step 0.61x as long (BENCHMARKS.md), but
parameters do change outside ``step()`` (a forward's ``nn.Embedding(max_norm=...)``, a ``.data`` swap for an
evaluation, which no version counter sees), and the snapshot would then not hold the step's state.

The tree is rebuilt too (dicts, lists, tuples): a state dict may hand out a container the loop changes later
(a scheduler's ``_last_lr``). Leaves that are not tensors are plain values (numbers, strings), which do not
change. A tensor met twice in one tree (tied weights) is copied once and stays one tensor, as ``torch.save``
keeps it.
"""

from __future__ import annotations

import collections
from typing import Any

import torch


class Stager:
    """Host buffers for one rank's snapshot state, reused from one snapshot to the next. One stage at a time:
    the caller waits for the write of the previous one before staging the next (``Checkpointer`` does)."""

    def __init__(self) -> None:
        self._buffers: dict[tuple, torch.Tensor] = {}
        self._used: set[tuple] = set()  # the buffers the last stage() used
        self._event: torch.cuda.Event | None = None

    @property
    def nbytes(self) -> int:
        """Host memory the buffers hold (bytes)."""
        return sum(b.numel() * b.element_size() for b in self._buffers.values())

    def stage(self, tree: Any) -> Any:
        """``tree`` with each tensor replaced by a copy in this stager's buffers, and each container rebuilt."""
        seen: dict[tuple, torch.Tensor] = {}
        cuda = []
        self._used: set[tuple] = set()
        staged = self._copy(tree, (), seen, cuda)
        # A buffer this snapshot did not use is freed: a value whose shape changes from one snapshot to the
        # next (a prefetched batch of another length) would otherwise add a buffer at each
        self._buffers = {k: v for k, v in self._buffers.items() if k in self._used}
        self._event = None
        if cuda:
            self._event = torch.cuda.Event()
            self._event.record()  # on the current stream, after the copies
        return staged

    def ready(self) -> None:
        """Block until the copies of the last :meth:`stage` have landed (a no-op for CPU state)."""
        if self._event is not None:
            self._event.synchronize()

    def _copy(self, tree: Any, path: tuple, seen: dict, cuda: list) -> Any:
        if isinstance(tree, torch.Tensor):
            return self._tensor(tree, path, seen, cuda)
        if isinstance(tree, dict):
            out = type(tree)() if type(tree) in (dict, collections.OrderedDict) else {}
            for k, v in tree.items():
                out[k] = self._copy(v, (*path, k), seen, cuda)
            return out
        if isinstance(tree, (list, tuple)) and type(tree) in (list, tuple):
            return type(tree)(self._copy(v, (*path, i), seen, cuda) for i, v in enumerate(tree))
        return tree

    def _tensor(self, t: torch.Tensor, path: tuple, seen: dict, cuda: list) -> torch.Tensor:
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
            buf.copy_(t, non_blocking=non_blocking)
            if non_blocking:
                cuda.append(t)
            copy = buf
        seen[ident] = copy
        return copy
