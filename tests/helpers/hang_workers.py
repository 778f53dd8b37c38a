"""Three ways a job hangs, for the hang report (tests/ranks/test_hangwatch.py): run as
``python hang_workers.py CASE`` with TMPDIR set, it launches 2 gloo ranks with a 6 s timeout."""

from __future__ import annotations

import sys
import time

import torch

from ddpkit import launch


def slow_user_code():
    time.sleep(60)  # HANG: sleep


def sleeper(ctx):
    t = torch.ones(2)
    ctx.all_reduce(t)
    if ctx.rank == 1:
        slow_user_code()
    ctx.all_reduce(t)  # HANG: rank 0 waits


def skipper(ctx):
    t = torch.ones(2)
    ctx.all_reduce(t)
    if ctx.rank == 0:
        ctx.all_reduce(t)  # HANG: rank 1 skips this one
    ctx.all_gather(t)  # HANG: rank 1 goes on


def extra(ctx):
    t = torch.ones(2)
    ctx.all_reduce(t)
    if ctx.rank == 1:
        ctx.all_reduce(t)  # HANG: only rank 1 calls this
    ctx.barrier()  # HANG: rank 0 goes on


CALLS = [0]


def slow_loss(model, batch):
    """mse, but rank 1 stops in it at its 4th call: rank 0 waits in DDP's all-reduce in the backward."""
    import os

    import torch.nn.functional as F

    x, y = batch
    CALLS[0] += x.device.type != "meta"  # not the engine's FLOP count (train/flops.py), on meta copies
    if CALLS[0] == 4 and os.environ.get("RANK") == "1":
        time.sleep(60)  # HANG: loss
    return F.mse_loss(model(x), y)


def train(run_dir: str):
    from user_code import RegressionMLP, regression_data

    from ddpkit import TrainConfig, Trainer

    cfg = TrainConfig(
        nproc="2", device="cpu", batch_size=16, epochs=1, timeout_s=6.0, run_dir=run_dir, num_workers=0, progress=False
    )
    Trainer(
        cfg,
        model=RegressionMLP(),
        train_data=regression_data(256, 0),
        test_data=regression_data(32, 1),
        loss_fn=slow_loss,
    ).fit()


def slow_step():
    time.sleep(60)  # HANG: loop step


def own_loop(ctx, run_dir: str):
    """A user's own loop on ddpkit.Loop: rank 1 stops in its own code at step 3, so rank 0 waits in DDP's
    gradient all-reduce in the backward; the Loop's safe points are the heartbeat."""
    from ddpkit import Loop

    with Loop(run_dir) as loop:
        model = loop.wrap(torch.nn.Linear(4, 1))
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        loop.resume(model=model, optimizer=opt)
        for step in loop.steps(10):
            if step == 3 and loop.rank == 1:
                slow_step()
            model(torch.ones(8, 4)).sum().backward()
            opt.step()
            opt.zero_grad()


CASES = {"sleep": sleeper, "skip": skipper, "extra": extra}

if __name__ == "__main__":
    if sys.argv[1] == "train":
        train(sys.argv[2])
    elif sys.argv[1] == "loop":
        launch(own_loop, sys.argv[2], nproc=2, device="cpu", timeout_s=6.0)
    else:
        launch(CASES[sys.argv[1]], nproc=2, device="cpu", timeout_s=6.0)
