"""A small GAN on 2 processes with ddpkit.Loop: a generator learns points on a ring.

    python examples/gan.py                          # runs/gan: rerun the same command to resume
    python examples/gan.py --save-weights gan.pt    # also write rank 0's final G and D

Two models and two optimizers in your own loop, each model wrapped by ``loop.wrap`` (DDP), the
ring's points read through ``loop.data`` (this rank's share, its position in every snapshot), the
noise drawn from the global torch generator (each rank's state is in every snapshot too), and
everything else a snapshot needs named in ``loop.resume``. Kill it at any moment (even with
SIGKILL) and rerun the same command: it carries on from the newest snapshot, and ends with the
same weights, to the bit, as a run that was never interrupted.
"""

import argparse
import math

import torch
from torch import nn
from torch.utils.data import TensorDataset

import ddpkit

NOISE = 8  # the generator's input size


def ring(n: int, radius: float = 2.0, width: float = 0.05) -> TensorDataset:
    """``n`` points near a circle: the distribution the generator learns."""
    g = torch.Generator().manual_seed(0)  # its own generator: every rank builds the same dataset
    angle = 2 * math.pi * torch.rand(n, generator=g)
    r = radius + width * torch.randn(n, generator=g)
    return TensorDataset(torch.stack([r * angle.cos(), r * angle.sin()], dim=1))


def mlp(n_in: int, n_out: int, hidden: int = 32) -> nn.Sequential:
    return nn.Sequential(
        nn.Linear(n_in, hidden),
        nn.LeakyReLU(0.2),
        nn.Linear(hidden, hidden),
        nn.LeakyReLU(0.2),
        nn.Linear(hidden, n_out),
    )


def train(ctx, args) -> None:
    with ddpkit.Loop(args.run_dir, device="cpu", log_every=100, save_every_steps=args.save_every) as loop:
        torch.manual_seed(0)  # the same initial weights on every rank (DDP would broadcast rank 0's anyway)
        G = loop.wrap(mlp(NOISE, 2))
        D = loop.wrap(mlp(2, 1))
        optG = torch.optim.Adam(G.parameters(), lr=2e-3, betas=(0.5, 0.999))
        optD = torch.optim.Adam(D.parameters(), lr=2e-3, betas=(0.5, 0.999))
        loader = loop.data(ring(4096), batch_size=args.batch_size)
        torch.manual_seed(1 + loop.rank)  # each rank its own noise; a resume restores each rank's stream
        loop.resume(G=G, D=D, optG=optG, optD=optD)
        bce = nn.BCEWithLogitsLoss()
        batches = forever(loader)
        for _ in loop.steps(args.steps):
            (real,) = next(batches)
            fake = G(torch.randn(len(real), NOISE, device=loop.device))
            ones, zeros = torch.ones(len(real), 1, device=loop.device), torch.zeros(len(real), 1, device=loop.device)

            # D: two forwards (real, then the detached fakes) and one backward; DDP reduces D's gradients once.
            loss_d = bce(D(real), ones) + bce(D(fake.detach()), zeros)
            optD.zero_grad(set_to_none=True)
            loss_d.backward()
            optD.step()

            # G: through D, which is left as it is (its gradients from here are zeroed before its next step).
            loss_g = bce(D(fake), ones)
            optG.zero_grad(set_to_none=True)
            loss_g.backward()
            optG.step()

            loop.log(loss_d=loss_d, loss_g=loss_g)

        # How close the generator got: the mean distance of its points from the centre, over both ranks.
        with torch.no_grad():
            r = G.module(torch.randn(1024, NOISE, device=loop.device)).norm(dim=1)
        got = loop.reduce(radius=r.mean(), spread=r.std())
        if loop.metrics:  # empty when the run was finished already and this rerun had nothing left to do
            m = loop.metrics
            loop.print(f"step {loop.state.step}: loss_d {m['loss_d']:.4f}, loss_g {m['loss_g']:.4f}")
        loop.print(f"generated radius {got['radius']:.3f} (target 2.0), spread {got['spread']:.3f}")
        loop.print(f"run dir: {args.run_dir}")
        if args.save_weights and loop.is_main:
            torch.save({"G": G.module.state_dict(), "D": D.module.state_dict()}, args.save_weights)


def forever(loader):
    """The loader's batches, epoch after epoch (each pass is the next epoch's order)."""
    while True:
        yield from loader


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=600)
    parser.add_argument("--batch-size", type=int, default=64, help="each rank's")
    parser.add_argument("--save-every", type=int, default=100, help="steps between snapshots")
    parser.add_argument("--run-dir", default="runs/gan")
    parser.add_argument("--save-weights", default="", help="write rank 0's final G and D state_dicts here")
    args = parser.parse_args()
    ddpkit.launch(train, args, nproc=2, device="cpu")


if __name__ == "__main__":  # workers are spawned and import this file
    main()
