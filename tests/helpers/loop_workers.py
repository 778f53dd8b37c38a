"""Functions run on every rank by tests/api/test_loop.py (importable by the launched processes)."""

from __future__ import annotations

import random

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed import destroy_process_group
from torch.utils.data import DataLoader, Dataset, DistributedSampler, TensorDataset

import ddpkit


class Jittered(Dataset):
    """Each sample drawn at random as it is read, from torch's, numpy's and Python's generators."""

    def __len__(self):
        return 24

    def __getitem__(self, i):
        return torch.tensor([float(i), torch.rand(()).item(), float(np.random.rand()), random.random()])


def batches_as_plain_ddp(_ctx, epochs: int) -> list:
    """What DataLoader + DistributedSampler (its defaults: shuffle, seed 0, padding) give this rank."""
    data = TensorDataset(torch.arange(11.0))
    sampler = DistributedSampler(data)
    loader = DataLoader(data, batch_size=2, sampler=sampler)
    out = []
    for epoch in range(epochs):
        sampler.set_epoch(epoch)
        out.append([b[0].tolist() for b in loader])
    return out


def batches_from_loop(_ctx, run_dir: str, epochs: int) -> list:
    with ddpkit.Loop(run_dir) as loop:
        loader = loop.data(DataLoader(TensorDataset(torch.arange(11.0)), batch_size=2, shuffle=True))
        return [[b[0].tolist() for b in loader] for _ in range(epochs)]


def loader_resumes(_ctx, run_dir: str, workers: int, stop_after: int | None) -> list:
    """Two epochs of a randomly drawn dataset; with ``stop_after`` the run stops (a snapshot, then a Stopped
    as a signal would) after that many steps; rerun, it resumes. Returns every batch this run read."""
    with ddpkit.Loop(run_dir, log_every=1) as loop:
        # Seeded as a user's script seeds them: a fresh process's Python and numpy streams are the OS's
        torch.manual_seed(loop.rank)
        np.random.seed(loop.rank)
        random.seed(loop.rank)
        loader = loop.data(Jittered(), batch_size=3, num_workers=workers)
        counter = nn.Linear(1, 1)
        loop.resume(counter=counter)
        seen = []
        for _ in loop.epochs(2):
            for batch in loader:
                seen.append(batch.tolist())
                if stop_after is not None and loop.state.step + 1 == stop_after:
                    loop.session.signal.received = "SIGTERM"  # what the handler records on a real signal
                loop.step()
        return seen


def logged_means(_ctx, run_dir: str) -> dict:
    """Each rank logs its own values: the record's means are the exact means over every rank and step."""
    with ddpkit.Loop(run_dir, log_every=4) as loop:
        batches = iter(loop.data(TensorDataset(torch.arange(64.0)), batch_size=3))  # each rank's 3 a step
        loop.resume()
        for step in loop.steps(8):
            next(batches)
            value = torch.tensor(float(10 * loop.rank + step), dtype=torch.float64)
            loop.log(v=value, acc=(torch.tensor(loop.rank + 1.0), 4))
        return loop.metrics


def exact_evaluation(_ctx, run_dir: str, n: int) -> dict:
    """A mean over all n samples, with n not a multiple of the world size or the batch."""
    with ddpkit.Loop(run_dir) as loop:
        data = TensorDataset(torch.arange(float(n)).unsqueeze(1), torch.arange(n) % 3)
        model = loop.wrap(nn.Linear(1, 3))
        result = loop.evaluate(
            model,
            data,
            lambda m, b: {"x": (b[0].sum(), len(b[0])), "loss": F.cross_entropy(m(b[0]), b[1])},
            batch_size=2,
        )
        with torch.no_grad():
            x, y = data.tensors
            result["expected_loss"] = F.cross_entropy(model.module(x), y).item()
        # A BatchNorm model after a training forward on each rank's own batch: DDP broadcast rank 0's running
        # statistics before it, and each rank's forward moved its own. The evaluation is of rank 0's model (what a
        # snapshot and best.pt hold), on every rank's slice alike (before: each rank's slice by its own statistics)
        torch.manual_seed(1)
        bn = loop.wrap(nn.Sequential(nn.Linear(1, 4), nn.BatchNorm1d(4), nn.Linear(4, 3)))
        bn(torch.randn(5, 1) * (1 + loop.rank) + loop.rank).sum().backward()
        with torch.no_grad():
            bn.module.eval()
            result["bn_expected_loss"] = F.cross_entropy(bn.module(x), y).item()  # rank 0's model, the whole split
            bn.module.train()
        result["bn_loss"] = loop.evaluate(
            bn, data, lambda m, b: {"loss": F.cross_entropy(m(b[0]), b[1])}, batch_size=2
        )["loss"]
        return result


def best_kept(_ctx, run_dir: str, values: list, stop_at: int | None) -> dict:
    """best() over a sequence of metric values, one per step; stopped at ``stop_at`` and rerun."""
    with ddpkit.Loop(run_dir, log_every=1) as loop:
        torch.manual_seed(0)
        model = loop.wrap(nn.Linear(2, 2))
        loop.resume(model=model)
        for step in loop.steps(len(values)):
            with torch.no_grad():
                model.module.weight.add_(1.0)  # so the best weights tell which step they came from
            loop.best("val", values[step], mode="min")
            if stop_at == step:
                loop.session.signal.received = "SIGTERM"
        return loop.best_so_far


class Branchy(nn.Module):
    """Rank 1's batches never reach ``b``: DDP's gradient sync cannot finish without find_unused_parameters."""

    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(2, 2), nn.Linear(2, 2)

    def forward(self, x, use_b: bool):
        return self.b(self.a(x)) if use_b else self.a(x)


def unused_branch(_ctx, run_dir: str) -> None:
    with ddpkit.Loop(run_dir) as loop:
        model = loop.wrap(Branchy())
        loop.resume(model=model)
        for _ in loop.steps(3):
            model(torch.ones(1, 2), loop.rank == 0).sum().backward()


def deterministic_inside(_ctx, run_dir: str) -> bool:
    with ddpkit.Loop(run_dir, deterministic=True):
        return torch.are_deterministic_algorithms_enabled()


def names_differ(_ctx, run_dir: str) -> None:
    """Rank 2 logs another metric than ranks 0 and 1: their sums would be added slot by slot, wrongly."""
    with ddpkit.Loop(run_dir, log_every=2) as loop:
        loop.resume()
        for _ in loop.steps(4):
            loop.log(**{("b" if loop.rank == 2 else "a"): torch.tensor(1.0)})


def global_batch_regression(_ctx, run_dir: str, stop_at: int | None, per_rank: int | None = None) -> dict:
    """A float64 linear regression whose global batch is 8 at any world size (each rank's batch 8 / world),
    read through loop.data(): a world-1 resume of a world-2 run reads the same samples in each step. With
    ``per_rank``, each rank's batch is that at any world size, as a script that fixes it has."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(52, 3, generator=gen, dtype=torch.float64)
    data = TensorDataset(x, x @ torch.tensor([1.0, -2.0, 0.5], dtype=torch.float64) + 0.1)
    with ddpkit.Loop(run_dir, log_every=1) as loop:
        torch.manual_seed(0)
        model = nn.Linear(3, 1, dtype=torch.float64)
        opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
        loader = loop.data(data, batch_size=per_rank or 8 // loop.world_size, drop_last=True)
        model = loop.wrap(model)
        loop.resume(model=model, optimizer=opt)
        for _ in loop.epochs(2):
            for xb, yb in loader:
                loss = F.mse_loss(model(xb).squeeze(1), yb)
                opt.zero_grad()
                loss.backward()
                opt.step()
                if stop_at is not None and loop.state.step + 1 == stop_at:
                    loop.session.signal.received = "SIGTERM"
                loop.step()
        return {k: v.clone() for k, v in getattr(model, "module", model).state_dict().items()}  # DDP or not


class Cursor:
    """An object of the rank's own with state_dict (a per-rank sampler, a data cursor)."""

    def __init__(self, at: int):
        self.at = at

    def state_dict(self) -> dict:
        return {"at": self.at}

    def load_state_dict(self, sd: dict) -> None:
        self.at = sd["at"]


def per_rank_state(_ctx, run_dir: str, stop_at: int | None) -> dict:
    """nanoGPT's shape and an RNN's: each rank prefetches its next batch (X) before the step ends, a hidden
    state (h) carries from step to step, and a cursor of the rank's own moves on: all three differ by rank
    and are named in resume(). Stopped after ``stop_at`` steps (a snapshot, then Stopped); rerun, it resumes."""
    return _per_rank_loop(run_dir, 8, stop_at)


def _per_rank_loop(run_dir: str, steps: int, stop_at: int | None, save_every_steps: int = 0, momentum=0.0) -> dict:
    with ddpkit.Loop(run_dir, log_every=1, save_every_steps=save_every_steps) as loop:
        torch.manual_seed(0)
        model = loop.wrap(nn.Linear(4, 4).double())
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=momentum)
        torch.manual_seed(1 + loop.rank)
        cursor = Cursor(100 * loop.rank)
        x, h = torch.randn(8, 4, dtype=torch.float64), torch.zeros(8, 4, dtype=torch.float64)
        state = loop.resume(model=model, optimizer=opt, cursor=cursor, X=x, h=h)
        for step in loop.steps(steps):
            out = model(state["X"] + 0.01 * cursor.at)
            loss = (out + state["h"]).pow(2).mean()
            loss.backward()
            opt.step()
            opt.zero_grad()
            state["h"] = torch.tanh(out + state["h"]).detach()
            cursor.at += 1
            state["X"] = torch.randn(8, 4, dtype=torch.float64)  # the next batch, fetched before the step ends
            if stop_at is not None and step + 1 == stop_at:
                loop.session.signal.received = "SIGTERM"  # what the handler records on a real signal
        weights = {k: v.clone() for k, v in model.module.state_dict().items()}
        ranks = [None] * loop.world_size  # every rank's own values, to rank 0's return
        torch.distributed.all_gather_object(ranks, {"cursor": cursor.at, "h": state["h"], "X": state["X"]})
        return {"weights": weights, "ranks": ranks}


def names_count_differs(_ctx, run_dir: str) -> None:
    """Rank 1 logs one metric more than rank 0: the totals differ in length (gloo aborted in C++ before)."""
    with ddpkit.Loop(run_dir, log_every=2) as loop:
        loop.resume()
        for _ in loop.steps(4):
            loop.log(a=torch.tensor(1.0), **({"b": torch.tensor(2.0)} if loop.rank == 1 else {}))


def reduce_skipped(_ctx, run_dir: str) -> None:
    """Rank 1 skips loop.reduce() and goes on to the safe point: the ranks meet in different collectives."""
    with ddpkit.Loop(run_dir, log_every=1) as loop:
        loop.resume()
        for _ in loop.steps(2):
            if loop.rank == 0:
                loop.reduce(val=torch.tensor(1.0), loss=torch.tensor(2.0), acc=(3.0, 4))
            loop.log(a=torch.tensor(1.0))


def bn_named_unwrapped(_ctx, run_dir: str) -> list:
    """A BatchNorm model named in resume() by its unwrapped module (model.module): DDP keeps it equal where it
    counts (rank 0's buffers broadcast at each forward), so it is saved once, not once per rank."""
    with ddpkit.Loop(run_dir, save_every_steps=2) as loop:
        torch.manual_seed(0)
        model = loop.wrap(nn.Sequential(nn.Linear(2, 4), nn.BatchNorm1d(4)))
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        loop.resume(model=model.module, optimizer=opt)
        torch.manual_seed(loop.rank)
        for _ in loop.steps(2):
            model(torch.randn(8, 2)).sum().backward()  # each rank's own batch: its running stats differ
            opt.step()
            opt.zero_grad()
    snap = torch.load(sorted((__import__("pathlib").Path(run_dir) / "checkpoints").glob("snapshot-*.pt"))[-1])
    return snap["trainer"]["per_rank"]


def snapshot_every_2_steps(_ctx, run_dir: str) -> dict:
    """``per_rank_state``'s loop (each rank's prefetched batch, hidden state and cursor named in resume()) for 12
    steps with SGD's momentum and a snapshot every 2: the run tests/system/test_fault_tolerance.py kills inside
    snapshot writes."""
    return _per_rank_loop(run_dir, 12, None, save_every_steps=2, momentum=0.9)


def started_then_destroyed(_ctx, run_dir: str) -> int:
    """An mp.spawn script's main kept under ddpkit.launch: ``Loop.start()`` in it, and its own
    ``destroy_process_group()`` as its last line (the porter's seed-001 port)."""
    loop = ddpkit.Loop.start(run_dir, log_every=1)
    torch.manual_seed(0)
    model = loop.wrap(nn.Linear(2, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    loop.resume(model=model, optimizer=opt)
    for _ in loop.steps(2):
        opt.zero_grad()
        model(torch.ones(4, 2)).sum().backward()
        opt.step()
    step = loop.state.step
    dist.destroy_process_group()
    return step


def destroy_inside_the_block(_ctx, run_dir: str) -> list:
    """The tutorial's main() ported into a with-block, its destroy_process_group() kept as the block's last line (the
    tutorial imports it at the top of the script, as this module does)."""
    with ddpkit.Loop(run_dir, device="cpu") as loop:
        model = loop.wrap(nn.Linear(2, 1))
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        loop.resume(model=model, optimizer=opt)
        for _ in loop.steps(3):
            model(torch.ones(4, 2)).sum().backward()
            opt.step()
        destroy_process_group()
        gone = not dist.is_initialized()
    return [gone]


def epochs_over(_ctx, run_dir: str, through: bool) -> str:
    """An epoch loop over a DataLoader of its own (the porter's seed 003 forgot loop.data()), or through it; what
    rank 0 said on stderr."""
    import contextlib
    import io

    data = DataLoader(TensorDataset(torch.arange(8.0)), batch_size=2)
    said = io.StringIO()
    with contextlib.redirect_stderr(said), ddpkit.Loop(run_dir, device="cpu", log_every=100) as loop:
        loader = loop.data(data) if through else data
        loop.resume()
        for _ in loop.epochs(2):
            for _batch in loader:
                loop.step()
    return said.getvalue()
