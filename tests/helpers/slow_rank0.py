"""Global rank 0 late (tests only).

``python -m slow_rank0 ARGS``: the ddpkit CLI, with global rank 0 starting 2 s late. Under torchrun the
ranks reach a bad flag at about the same time; on a loaded machine rank 0 can be the slow one, and
torchrun stops every rank as soon as the first one exits.

:func:`late_rank0_loop`: a ``ddpkit.Loop`` whose rank 0 spends ``pause_s`` in its own code between two
steps (a rank-0-only ``wandb.log``, as in docs/port.md's MNIST port), for ``ddpkit.launch``.
"""

import os
import time


def rank0_logging(pause_s: float) -> None:
    time.sleep(pause_s)  # an upload to an experiment tracker, say


def late_rank0_loop(_ctx, run_dir: str, pause_s: float) -> int:
    """6 steps of a tiny regression in the group ``ddpkit.launch`` made (its ``timeout_s``); rank 0 spends
    ``pause_s`` in its own logging after step 2, while rank 1 waits for it in DDP's gradient all-reduce of
    step 3. Returns the steps trained."""
    import torch

    import ddpkit

    with ddpkit.Loop(run_dir, device="cpu", log_every=2) as loop:
        model = loop.wrap(torch.nn.Linear(4, 1))
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        loop.resume(model=model, optimizer=opt)
        for step in loop.steps(6):
            loss = model(torch.ones(8, 4)).pow(2).mean()
            loss.backward()
            opt.step()
            opt.zero_grad()
            loop.log(loss=loss.detach())
            if step == 2 and loop.is_main:
                rank0_logging(pause_s)
        return loop.state.step


if __name__ == "__main__":
    from ddpkit.cli import entry

    if os.environ.get("RANK") == "0":
        time.sleep(2)
    entry()
