"""A user's own loop on ddpkit.Loop that runs until it is stopped (tests only), letting what it raises propagate:
``python stop_loop.py plain RUN_DIR`` (one process: the Loop makes its group) or ``launch RUN_DIR``
(ddpkit.launch, 2 processes)."""

import sys
import time

import torch

import ddpkit


def main(_ctx=None, run_dir="runs/stop"):
    with ddpkit.Loop(run_dir, log_every=5, device="cpu") as loop:
        model = loop.wrap(torch.nn.Linear(4, 1))
        opt = torch.optim.SGD(model.parameters(), lr=0.01)
        loop.resume(model=model, optimizer=opt)
        for _ in loop.steps(100_000):
            model(torch.ones(8, 4)).sum().backward()
            opt.step()
            opt.zero_grad()
            time.sleep(0.01)


if __name__ == "__main__":
    if sys.argv[1] == "plain":
        main(None, sys.argv[2])
    else:
        ddpkit.launch(main, sys.argv[2], nproc=2, device="cpu")
