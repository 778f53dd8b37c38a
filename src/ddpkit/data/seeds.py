"""Every seed ddpkit sets and every generator state it saves, in one room.

Streams and what seeds them (the key each is mixed from, with a tag that keeps each use's apart):

* **The initial weights**: torch's global generator from ``--seed`` itself (:func:`seed_weights`), on
  every rank alike, before the model is built.
* **Each rank's own streams** (dropout, a draw in the model's forward or the loss): torch's from
  ``seed + 1 + rank``, numpy's and Python's from (seed, rank) (:func:`seed_rank`); saved in every
  snapshot (:func:`rng_state`, :func:`set_rng_state`) and, at another world size, where no rank's
  stream can be continued, started afresh from (seed, step, rank) (:func:`reseed`).
* **The epoch order**: torch's ``DistributedSampler`` itself (``data/loader.epoch_order``); its seed + epoch
  (:func:`order_generator`) for ddpkit's two variants of it.
* **Built-in augmentation** (crop offsets, flips): (seed, epoch), drawn for every sample index at once
  (:func:`augment_generator`); the held-out split (``--val-fraction``): --seed (:func:`holdout_generator`);
  the synthetic dataset: a constant (:func:`synthetic_generator`).
* **A user's data on the DataLoader path** (``data/draws.py`` carries the keys to whichever process
  reads): ``__getitem__`` reads each sample under generators seeded for that sample alone, (seed, epoch,
  sample index) in training, (seed, sample index) in evaluation (:func:`seed_sample`); so a global
  batch draws the same numbers at any world size, any ``--num-workers`` and after a resume at any step.
  What belongs to the batch, a ``collate_fn`` that draws (MixUp) or a dataset's own batched
  ``__getitems__``, is read under the batch's key, (seed, epoch, rank, batch index) (seed, rank, batch
  index in evaluation) (:func:`seed_batch`): each rank draws its own, and at another world size the
  ranks' batches, so their draws, are other ones. The DataLoader's own generator, which seeds its
  workers as they start: (seed, rank), then (seed, epoch, rank) each epoch (:func:`loader_generator`,
  :func:`seed_loader_epoch`).
* **An IterableDataset's shards**: (seed, epoch, rank, worker) (:func:`stream_key`), in the worker or,
  with no workers, in the rank with its own streams set aside (:class:`PrivateGenerators`).

One mixing scheme for every key: ``np.random.SeedSequence`` over the key's ints (:func:`seed_of`,
:func:`seed_generators`). Four formulas predate it and are kept as they are, each for the values it
pins: the initial weights' (``--seed`` itself) and the epoch order's (seed + epoch, torch's
``DistributedSampler``'s: the golden digests and the tests that compare with plain DDP bitwise hold
both), the rank's torch stream's (seed + 1 + rank: every rerun's dropout is what it was), the built-in
augmentation's and the elastic reseed's (SeedSequence already, in their own word layout: a run resumed
by this version draws what it drew before).

Cost. A sample read through :func:`seed_sample` seeds torch's CPU generator, numpy's and Python's:
50 µs per sample measured on a shared 2-core machine at load 3 (SeedSequence 18 µs, numpy's legacy seed
from 128 bits 14 µs, Python's 5 µs, torch's 1.4 µs), 60-110 µs at load 8-10; paid in the DataLoader
worker that reads the sample (in the rank at ``--num-workers 0``). Small beside decoding an image, and
the price of draws that do not depend on which rank or worker reads.

Not here: ``importpath.seeded`` (``--dataset``/``--model`` functions called with the three generators
seeded with ``--seed``, and ``generators_kept``) sits below the data layer, which may not be imported
from there; and a generator object a dataset keeps itself (``np.random.default_rng()`` made in
``__init__``), which is its own to seed.
"""

from __future__ import annotations

import random
from contextlib import contextmanager
from typing import Iterator

import numpy as np
import torch

# What the [start] line says of a DataLoader path: how a user's __getitem__ and collate_fn draw (below)
DRAWS_NOTE = (
    "each sample read under its own seeds (seed, epoch, sample), each batch collated under its own (seed, epoch, rank, "
    "batch)"
)

# Tags that keep each use's seeds apart from every other's drawn from the same numbers
TRAIN, EVAL, RANK, LOADER, STREAM = 0x7EA1, 0xE7A1, 0x5A4C, 0x10AD, 0x57EA  # batches, rank, loader, stream
SAMPLE, EVAL_SAMPLE, ITEMS = 0x5A3E, 0xE5A3, 0x17E5  # a sample's read (training, evaluation); a batched read
AUGMENT, RESEED = 0xA06, 0xE1A5  # in their own formulas (see the module docstring)
SYNTHETIC = 1234  # the synthetic dataset's images and labels: the same for every rank and seed


# ---------------------------------------------------------------------- the one mixing scheme
def _words(key: tuple[int, ...], n: int) -> np.ndarray:
    """``n`` uint32 words mixed from ``key`` (any ints; a negative --seed is taken modulo 2**64)."""
    return np.random.SeedSequence([k % 2**64 for k in key]).generate_state(n, np.uint32)


def seed_of(key: tuple[int, ...]) -> int:
    """One 64-bit seed mixed from ``key``."""
    w = _words(key, 2)
    return int(w[0]) | int(w[1]) << 32


def seed_generators(key: tuple[int, ...]) -> None:
    """Seed this process's torch (CPU), numpy and Python global generators from ``key``, each its own
    number. torch's CPU generator alone: ``torch.manual_seed`` would also reseed the rank's CUDA
    generators, which the fetch at ``--num-workers 0`` does not set aside."""
    w = _words(key, 8)
    torch.default_generator.manual_seed(int(w[0]) | int(w[1]) << 32)
    np.random.seed(w[2:6])
    random.seed(int(w[6]) | int(w[7]) << 32)


# ---------------------------------------------------------------------- the rank's own streams
def seed_weights(seed: int) -> None:
    """torch's global generator (CPU and every CUDA device) from ``seed`` itself: identical initial weights
    on every rank. The formula is kept as it was: the golden digests pin the initial weights."""
    torch.manual_seed(seed)


def seed_all(seed: int) -> None:
    """torch's (every device), numpy's and Python's global generators from ``seed`` itself, as
    ``importpath.seeded`` seeds them: for probes that compare two runs seeded apart (``ddpkit check``)."""
    torch.manual_seed(seed)
    np.random.seed(seed % 2**32)
    random.seed(seed)


def seed_rank(seed: int, rank: int) -> None:
    """This rank's own streams (dropout, a draw in the forward): distinct per rank, the same at every rerun.
    torch's (CPU and every CUDA device) from ``seed + 1 + rank``, a formula kept as it was: every rerun's
    dropout masks stay what they were. numpy's and Python's from (seed, rank): a rank started from a
    forked process holds its parent's numpy state, the same on every rank and new at every run."""
    torch.manual_seed(seed + 1 + rank)
    w = _words((seed, rank, RANK), 6)
    np.random.seed(w[:4])
    random.seed(int(w[4]) | int(w[5]) << 32)


def reseed(seed: int, global_step: int, rank: int) -> None:
    """Fresh random streams for ``rank`` after a resume at another world size, where the saved
    per-rank streams cannot be continued (there is no rank 2 to take over from a world of 2).
    A function of (seed, step, rank): distinct per rank, the same on every rerun. Its word layout (one
    uint64 for all three) predates :func:`seed_generators`'s and is kept: a resume draws what it drew."""
    mixed = int(np.random.SeedSequence([seed, global_step, rank, RESEED]).generate_state(1, np.uint64)[0])
    torch.manual_seed(mixed)  # also every CUDA device's generator
    np.random.seed(mixed % 2**32)
    random.seed(mixed)


def rng_state(device: torch.device) -> dict:
    """This process's RNGs as tensors and ints (loadable with weights_only=True): what a snapshot saves."""
    np_state = np.random.get_state()
    py_version, py_internal, py_gauss = random.getstate()
    state = {
        "torch": torch.get_rng_state(),
        "numpy_keys": torch.from_numpy(np_state[1].astype(np.int64)),
        "numpy_pos": int(np_state[2]),
        "numpy_gauss": [int(np_state[3]), float(np_state[4])],
        "python": [py_version, list(py_internal), py_gauss],
    }
    if device.type == "cuda":
        state["cuda"] = torch.cuda.get_rng_state(device)
    return state


def set_rng_state(state: dict, device: torch.device) -> None:
    """The RNGs as :func:`rng_state` saved them."""
    torch.set_rng_state(state["torch"].cpu())
    np.random.set_state(
        (
            "MT19937",
            state["numpy_keys"].numpy().astype(np.uint32),
            state["numpy_pos"],
            state["numpy_gauss"][0],
            state["numpy_gauss"][1],
        )
    )
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    if device.type == "cuda" and "cuda" in state:
        torch.cuda.set_rng_state(state["cuda"].cpu(), device)


def _states():
    return torch.default_generator.get_state(), np.random.get_state(), random.getstate()


def _restore(states) -> None:
    torch.default_generator.set_state(states[0])
    np.random.set_state(states[1])
    random.setstate(states[2])


@contextmanager
def generators_set_aside() -> Iterator[None]:
    """This process's torch (CPU), numpy and Python global generators as they were, afterwards."""
    saved = _states()
    try:
        yield
    finally:
        _restore(saved)


class PrivateGenerators:
    """torch's (CPU), numpy's and Python's global generators for one stream, seeded from ``key``, swapped in
    around each read (:meth:`read`) and out again: the rank's own streams are not moved by the data's draws."""

    def __init__(self, key: tuple[int, ...]):
        with generators_set_aside():
            seed_generators(key)
            self.states = _states()

    def read(self, it: Iterator):
        with generators_set_aside():
            _restore(self.states)
            try:
                return next(it)
            finally:
                self.states = _states()


def discarded_generator() -> torch.Generator:
    """A generator whose draws nothing uses: a DataLoader given one draws its workers' base seed from it,
    not from the rank's own stream (where ddpkit makes that draw itself, :func:`plain_loader_draw`)."""
    return torch.Generator()


def plain_loader_draw() -> None:
    """The one number a plain DataLoader draws from the rank's torch generator as a pass starts (its
    workers' base seed, ``torch.utils.data.dataloader._BaseDataLoaderIter``): made where ddpkit's loader
    stands in for one, so that the rank's stream is the plain loop's."""
    torch.empty((), dtype=torch.int64).random_()


# ---------------------------------------------------------------------- the order, augmentation, datasets
def order_generator(seed: int, epoch: int) -> torch.Generator:
    """The epoch's permutation's generator: seed + epoch, as ``DistributedSampler``'s (kept as it is: the
    golden digests and the bitwise comparisons with plain DDP pin the epoch order)."""
    return torch.Generator().manual_seed(seed + epoch)


def augment_generator(seed: int, epoch: int) -> torch.Generator:
    """The generator of an epoch's built-in augmentation draws (every sample's crop and flip at once)."""
    mixed = int(np.random.SeedSequence([seed, epoch, AUGMENT]).generate_state(1)[0])  # as it was: golden digests
    return torch.Generator().manual_seed(mixed)


def holdout_generator(seed: int) -> torch.Generator:
    """The generator that picks ``--val-fraction``'s held-out samples: the same at every world size and rerun."""
    return torch.Generator().manual_seed(seed)


def synthetic_generator() -> torch.Generator:
    """The synthetic dataset's: the same images and labels for every rank and seed."""
    return torch.Generator().manual_seed(SYNTHETIC)


# ---------------------------------------------------------------------- the DataLoader path
def train_keys(seed: int, epoch: int, rank: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(the batches' key, the samples' key) of a training epoch: batch j is keyed ``(*batch_key, j)``,
    sample i ``(*sample_key, i)``."""
    return (seed, epoch, rank, TRAIN), (seed, epoch, SAMPLE)


def eval_keys(seed: int, rank: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(the batches' key, the samples' key) of every evaluation: the same draws at each one, and a sample's
    the same at any world size."""
    return (seed, rank, EVAL), (seed, EVAL_SAMPLE)


def seed_sample(sample_key: tuple[int, ...], index: int) -> None:
    """The three generators for reading sample ``index`` (its index in the dataset) alone."""
    seed_generators((*sample_key, index))


def seed_batch(batch_key: tuple[int, ...], batched: bool = False) -> None:
    """The three generators for what belongs to one batch: its ``collate_fn``, or (``batched``) a
    dataset's own ``__getitems__`` read of the whole batch, under a key of its own."""
    seed_generators((*batch_key, ITEMS) if batched else batch_key)


def loader_generator(seed: int, rank: int) -> torch.Generator:
    """A DataLoader's own generator (what its workers are seeded from as they start), never the rank's."""
    return torch.Generator().manual_seed(seed_of((seed, rank, LOADER)))


def seed_loader_epoch(generator: torch.Generator, seed: int, epoch: int, rank: int) -> None:
    """A DataLoader's generator as an epoch's pass starts: the workers started now are the epoch's."""
    generator.manual_seed(seed_of((seed, epoch, rank, LOADER)))


def stream_key(seed: int, epoch: int, rank: int, worker: int) -> tuple[int, ...]:
    """The key of an IterableDataset's shard read by ``worker`` of ``rank`` in ``epoch``."""
    return (seed, epoch, rank, worker, STREAM)
