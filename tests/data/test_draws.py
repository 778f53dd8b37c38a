"""A dataset's random draws on the DataLoader path (``data/draws.py``): each batch's the same after a
mid-epoch resume, with 0 or 2 workers, in every rerun, and different on each rank; the rank's own
generators left to it."""

from __future__ import annotations

import random
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from user_code import Draws, drawing_collate

from ddpkit.data.loader import EvalSource, LoaderSource, Preprocess
from ddpkit.ranks.context import DistContext
from ddpkit.run.checkpoint import rng_state, set_rng_state

CPU = torch.device("cpu")


def ctx(rank=0, world=1):
    return DistContext(rank, rank, world, world, CPU, "gloo")


def cfg(**kw):
    return SimpleNamespace(**{**dict(seed=3, channels_last=False, num_workers=0), **kw})


def same_state_everywhere(seed: int = 0) -> None:
    """The global generators as every rank holds them when forked from one process (a new one per run)."""
    torch.manual_seed(seed)
    np.random.seed(seed)
    random.seed(seed)


def draws(batches) -> torch.Tensor:
    """[samples, (index, torch, numpy, python)], the batches' in order."""
    return torch.cat([b[0] if isinstance(b, tuple) else b for b in batches])


def test_a_resume_mid_epoch_draws_what_the_uninterrupted_epoch_drew():
    """Regression: with no workers, starting the DataLoader's iteration drew a number from the rank's
    torch generator, so a resumed epoch's draws were shifted by one from the snapshot's state on."""
    src = LoaderSource(Draws(48), None, cfg(), ctx(), per_rank_batch=4)
    before = rng_state(CPU)
    epoch = src.batches(1)
    head = [next(epoch) for _ in range(5)]
    saved = rng_state(CPU)  # what a snapshot after step 5 holds
    rest = list(epoch)
    assert len(rest) == src.steps_per_epoch - 5 > 0

    same_state_everywhere(7)  # a new process ...
    set_rng_state(saved, CPU)  # ... that loads the snapshot
    resumed = list(src.batches(1, start_step=5))
    assert torch.equal(draws(resumed), draws(rest))
    assert not set(draws(head)[:, 1].tolist()) & set(draws(rest)[:, 1].tolist())  # they are draws
    # The fetches left the rank's own generators alone: its dropout stream is its own, and the snapshot's
    assert torch.equal(before["numpy_keys"], saved["numpy_keys"]) and before["numpy_pos"] == saved["numpy_pos"]
    assert torch.equal(before["torch"], saved["torch"]) and before["python"] == saved["python"]


def test_each_rank_draws_its_own_numbers_and_every_rerun_the_same():
    """Regression: forked ranks began with one numpy and Python state, so every rank drew the same
    numbers, and other numbers in each run, whatever --seed said."""

    def run(state: int) -> list[torch.Tensor]:
        out = []
        for rank in (0, 1):
            same_state_everywhere(state)
            src = LoaderSource(Draws(48), None, cfg(), ctx(rank, 2), per_rank_batch=4)
            out.append(draws(src.batches(0)))
        return out

    first, again = run(0), run(1)
    for rank in (0, 1):
        assert torch.equal(first[rank], again[rank])
    r0, r1 = first
    for lib in (1, 2, 3):  # torch, numpy, python: no draw of rank 0's equal to any of rank 1's
        assert not set(r0[:, lib].tolist()) & set(r1[:, lib].tolist())
    other_seed = LoaderSource(Draws(48), None, cfg(seed=4), ctx(0, 2), per_rank_batch=4)
    assert not torch.equal(draws(other_seed.batches(0))[:, 1:], r0[:, 1:])


@pytest.mark.multiprocess  # DataLoader workers
def test_two_workers_draw_what_the_rank_draws_alone_from_any_step():
    """Regression: workers were seeded once, when they started, from the rank's generator, and ran on
    through the batches each was sent, so a resumed run's workers drew other numbers. Each batch's
    draws are now its own: the same from 2 workers as from none, from a mid-epoch start, in the
    collate_fn too, and the test split's the same at every evaluation."""
    train = {
        w: LoaderSource(Draws(60), None, cfg(num_workers=w), ctx(1, 2), 4, collate_fn=drawing_collate) for w in (0, 2)
    }
    alone = list(train[0].batches(2))
    for start in (0, 3):
        pooled = list(train[2].batches(2, start_step=start))
        assert len(pooled) == len(alone) - start > 0
        for (x0, c0), (x2, c2) in zip(alone[start:], pooled):
            assert torch.equal(x0, x2) and torch.equal(c0, c2)

    pre = Preprocess(None, CPU, False)
    evals = {w: EvalSource(Draws(30), pre, cfg(num_workers=w), ctx(1, 2), 4) for w in (0, 2)}
    first = draws(evals[2].batches())
    assert torch.equal(first, draws(evals[2].batches())) and torch.equal(first, draws(evals[0].batches()))
    assert first[:, 0].tolist() == [float(i) for i in range(1, 30, 2)]
