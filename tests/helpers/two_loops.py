"""Two ``ddpkit.Loop``s one after the other in one process (tests only): 3 steps in RUN_A, leave the ``with``
(the Loop destroys the process group it made), then a second Loop makes a new group and trains 3 steps in
RUN_B. Run under torchrun, as tests/ranks/test_two_groups.py does:

    python -m torch.distributed.run --standalone --nproc-per-node 2 two_loops.py RUN_A RUN_B [TIMEOUT_S]
"""

from __future__ import annotations

import sys

import torch

import ddpkit


def train(run_dir: str, timeout_s: float) -> None:
    with ddpkit.Loop(run_dir, device="cpu", log_every=1, timeout_s=timeout_s) as loop:
        torch.manual_seed(0)
        model = loop.wrap(torch.nn.Linear(4, 1))
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        loop.resume(model=model, optimizer=opt)
        x = torch.randn(8, 4, generator=torch.Generator().manual_seed(loop.rank))
        for _ in loop.steps(3):
            loss = model(x).pow(2).mean()
            loss.backward()
            opt.step()
            opt.zero_grad()
            loop.log(loss=loss.detach())


if __name__ == "__main__":
    timeout_s = float(sys.argv[3]) if len(sys.argv) > 3 else 20.0
    train(sys.argv[1], timeout_s)
    train(sys.argv[2], timeout_s)
