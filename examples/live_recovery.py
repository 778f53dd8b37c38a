"""Live recovery for your own loop: the MNIST ConvNet on ``ddpkit.Loop``, as replica groups that train on while one
is lost, and heal it when it is back, with no sample lost (docs/fault-tolerance.md).

    ddpkit run --replicas 2 --max-restarts 3 examples/live_recovery.py           # 2 groups of 1 process
    ddpkit run --nproc 2 examples/live_recovery.py                               # the same script, plain DDP

Kill a group's worker while it trains (``kill -9`` a process whose environment has ``DDPKIT_REPLICA=1``): group 0
computes that step again with group 1's batch too, and trains on computing both shares; group 1's agent restarts it,
and it is healed from group 0 at the next step (``[replicas]`` lines on the console, and its own run dir's records).
The weights end as a plain DDP run's of 2 ranks: each step is the same global batch.

The one change a step needs: its batches come from ``loop.shares(loader)`` (the step's batch; and, while a group is
gone, that group's), each with its forward and backward; the gradient is summed over the groups and committed when
the loop asks for the next. The schedule reads the step ``loop.steps()`` gives, which a heal has set already.
"""

import argparse
import math

import torch
import torch.nn.functional as F

import ddpkit
from ddpkit import TrainConfig
from ddpkit.data.datasets import load_dataset
from ddpkit.models import ConvNet

p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
p.add_argument("--steps", type=int, default=400, help="optimizer steps (a global batch of 128 each)")
p.add_argument("--lr", type=float, default=0.05, help="peak learning rate, cosine to 0 over --steps")
p.add_argument("--log-every", type=int, default=20)
p.add_argument("--run-dir", default="runs/live-loop", help="group 0's run dir; group g's is RUN_DIR-group-g")
args = p.parse_args()

splits = load_dataset(TrainConfig(dataset="mnist"), download=False)  # bundled: no network
images = (splits.train.images.float() / 255 - 0.1307) / 0.3081
train = torch.utils.data.TensorDataset(images, splits.train.labels)

with ddpkit.Loop(args.run_dir, device="cpu", log_every=args.log_every, save_every_steps=100) as loop:
    torch.manual_seed(0)  # the same initial weights in every rank (every group)
    model = loop.wrap(ConvNet())
    opt = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
    loader = loop.data(train, batch_size=128 // loop.world_size)  # a global batch of 128: each rank's (group's) part
    loop.resume(model=model, optimizer=opt)
    for step in loop.steps(args.steps):
        for group in opt.param_groups:  # from the step: a group healed into a later step reads that step's
            group["lr"] = args.lr * 0.5 * (1 + math.cos(math.pi * step / args.steps))
        opt.zero_grad(set_to_none=True)
        for x, y in loop.shares(loader):
            loss = F.cross_entropy(model(x), y)
            loss.backward()
            loop.log(loss=loss)
        opt.step()
    test = torch.utils.data.TensorDataset((splits.test.images.float() / 255 - 0.1307) / 0.3081, splits.test.labels)

    def measure(net, batch):
        x, y = batch
        return {"accuracy": ((net(x).argmax(1) == y).sum().double(), len(y))}

    result = loop.evaluate(model, test, measure, batch_size=1000)
    loop.print(f"step {loop.state.step}: test accuracy {result['accuracy']:.4f} (run dir: {loop.config.run_dir})")
