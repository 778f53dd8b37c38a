"""data/seeds.py: a dataset's ``__getitem__`` draws keyed by the sample (the same at any world size, batch
position and evaluation), a ``collate_fn``'s by the batch, a batched ``__getitems__``'s by the batch; and
the seeds the golden tests and plain-DDP comparisons pin keep their values."""

from __future__ import annotations

import random
from types import SimpleNamespace

import numpy as np
import torch
from torch.utils.data import Subset
from user_code import Draws, drawing_collate

from ddpkit.data import seeds
from ddpkit.data.augment import epoch_params
from ddpkit.data.draws import batched_reader, read_samples
from ddpkit.data.loader import EvalSource, LoaderSource, Preprocess
from ddpkit.ranks.context import DistContext
from ddpkit.run import checkpoint

CPU = torch.device("cpu")


def ctx(rank=0, world=1):
    return DistContext(rank, rank, world, world, CPU, "gloo")


def cfg(**kw):
    return SimpleNamespace(**{**dict(seed=3, channels_last=False, num_workers=0), **kw})


def rows(batches) -> dict[int, list[float]]:
    """Each sample's draws (torch, numpy, python), by its index: what the batches read."""
    out = {}
    for b in batches:
        for row in b[0] if isinstance(b, tuple) else b:
            out[int(row[0])] = row[1:].tolist()
    return out


def own_draws() -> torch.Tensor:
    return torch.tensor([torch.rand(()).item(), np.random.rand(), random.random()])


def test_a_sample_draws_the_same_at_any_world_size_position_and_start():
    one = LoaderSource(Draws(48), None, cfg(), ctx(0, 1), per_rank_batch=8)
    two = [LoaderSource(Draws(48), None, cfg(), ctx(r, 2), per_rank_batch=4) for r in (0, 1)]
    before = torch.get_rng_state()
    alone = rows(one.batches(1))
    assert len(alone) == 48
    assert alone == {**rows(two[0].batches(1)), **rows(two[1].batches(1))}  # the same draws, sample by sample
    assert rows(two[1].batches(1, start_step=3)).items() <= alone.items()  # a mid-epoch resume at world 2
    # each batch of world 1 is both ranks' batches of world 2: the global batch draws what it drew
    for j, (b1, r0, r1) in enumerate(zip(one.batches(1), two[0].batches(1), two[1].batches(1))):
        assert rows([b1]) == {**rows([r0]), **rows([r1])}, j
    other_epoch = rows(one.batches(2))
    assert all(other_epoch[i] != alone[i] for i in alone)  # keyed by epoch too
    other_seed = rows(LoaderSource(Draws(48), None, cfg(seed=4), ctx(0, 1), 8).batches(1))
    assert all(other_seed[i] != alone[i] for i in alone)
    assert torch.equal(torch.get_rng_state(), before)  # the rank's own stream is left alone


def test_the_collate_draws_under_the_batch_key_the_samples_under_their_own():
    src = {r: LoaderSource(Draws(48), None, cfg(), ctx(r, 2), 4, collate_fn=drawing_collate) for r in (0, 1)}
    alone = rows(LoaderSource(Draws(48), None, cfg(), ctx(0, 1), 8).batches(0))
    for rank in (0, 1):
        batches = list(src[rank].batches(0))
        assert rows(batches).items() <= alone.items()  # a drawing collate leaves the samples' draws alone
        batch_key, _ = seeds.train_keys(3, 0, rank)
        for j, (_, drawn) in enumerate(batches):
            with seeds.generators_set_aside():
                seeds.seed_batch((*batch_key, j))  # seeded again for the collate: after the samples, as before them
                assert torch.equal(drawn, own_draws()), (rank, j)
    first = [next(iter(src[r].batches(0)))[1] for r in (0, 1)]
    assert not torch.equal(first[0], first[1])  # each rank's batch its own


def test_evaluation_draws_each_sample_alike_at_every_evaluation_and_world_size():
    pre = Preprocess(None, CPU, False)
    one = rows(EvalSource(Draws(30), pre, cfg(), ctx(0, 1), 8).batches())
    two = [EvalSource(Draws(30), pre, cfg(), ctx(r, 2), 4) for r in (0, 1)]
    assert len(one) == 30 and one == {**rows(two[0].batches()), **rows(two[1].batches())}
    assert rows(two[1].batches()) == rows(two[1].batches())
    training = rows(LoaderSource(Draws(30), None, cfg(), ctx(0, 1), 6).batches(0))
    assert all(training[i] != one[i] for i in training)  # evaluation's keys are not training's


class Batched(Draws):
    """A dataset that reads a whole batch in one call."""

    def __getitems__(self, indices):
        return [self[i] for i in indices]


def test_a_subset_reads_by_sample_and_a_batched_getitems_by_batch():
    batch_key, sample_key = seeds.train_keys(3, 0, 0)
    plain, subset = Draws(8), Subset(Draws(8), [5, 6, 7])  # torch's Subset always has a __getitems__
    assert batched_reader(plain) is None and batched_reader(subset) is None
    assert batched_reader(Batched(8)) is not None and batched_reader(Subset(Batched(8), [1])) is not None
    with seeds.generators_set_aside():
        sub = torch.stack(read_samples(subset, [0, 2], sample_key, (*batch_key, 0)))
        direct = torch.stack(read_samples(plain, [0, 2], sample_key, (*batch_key, 1)))
        assert sub[:, 0].tolist() == [5.0, 7.0] and torch.equal(sub[:, 1:], direct[:, 1:])  # keyed by the index read
        once, again, other = (
            torch.stack(read_samples(Batched(8), [0, 2], sample_key, (*batch_key, j))) for j in (0, 0, 1)
        )
    assert torch.equal(once, again) and not torch.equal(once[:, 1:], other[:, 1:])
    # what the engine says follows each rank's batches at another world size
    assert not LoaderSource(Draws(16), None, cfg(), ctx(), 4).draws_by_batch
    assert LoaderSource(Draws(16), None, cfg(), ctx(), 4, collate_fn=drawing_collate).draws_by_batch
    assert LoaderSource(Batched(16), None, cfg(), ctx(), 4).draws_by_batch


def test_the_seeds_the_golden_runs_pin_keep_their_formulas():
    def state_after(fn) -> tuple:
        with seeds.generators_set_aside():
            fn()
            return torch.get_rng_state(), np.random.get_state()[1].copy(), random.getstate()

    assert torch.equal(state_after(lambda: seeds.seed_weights(11))[0], state_after(lambda: torch.manual_seed(11))[0])
    # the rank's dropout stream: seed + 1 + rank, as the engine seeded it
    assert torch.equal(state_after(lambda: seeds.seed_rank(11, 2))[0], state_after(lambda: torch.manual_seed(14))[0])
    assert torch.equal(seeds.order_generator(5, 2).get_state(), torch.Generator().manual_seed(7).get_state())
    mixed = int(np.random.SeedSequence([5, 2, 0xA06]).generate_state(1)[0])
    assert torch.equal(seeds.augment_generator(5, 2).get_state(), torch.Generator().manual_seed(mixed).get_state())
    offsets, flips = epoch_params(10, 5, 2, "crop-flip")
    gen = torch.Generator().manual_seed(mixed)
    assert torch.equal(offsets, torch.randint(0, 9, (10, 2), generator=gen))
    assert torch.equal(flips, torch.randint(0, 2, (10,), generator=gen).bool())

    def old_reseed():
        m = int(np.random.SeedSequence([5, 40, 1, 0xE1A5]).generate_state(1, np.uint64)[0])
        torch.manual_seed(m)
        np.random.seed(m % 2**32)
        random.seed(m)

    new, old = state_after(lambda: seeds.reseed(5, 40, 1)), state_after(old_reseed)
    assert torch.equal(new[0], old[0]) and np.array_equal(new[1], old[1]) and new[2] == old[2]
    # moved, not copied: the snapshot code uses the very functions
    assert checkpoint.rng_state is seeds.rng_state and checkpoint.reseed is seeds.reseed
