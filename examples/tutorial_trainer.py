"""The PyTorch DDP tutorial series' ``Trainer`` script (multigpu.py) on ddpkit.Loop, on 2 processes.

    python examples/tutorial_trainer.py 3 1     # total_epochs save_every, as the tutorial takes them

The tutorial's random dataset, ``Linear(20, 1)``, SGD at lr 1e-3 and batches of 32, in its own
``Trainer`` class with its own methods. What changed, beside the tutorial's own DDP changes:

- ``ddp_setup``/``mp.spawn``/``destroy_process_group`` -> ``ddpkit.launch(main, ...)`` and a ``Loop``;
- ``DDP(model, device_ids=[gpu_id])`` -> ``loop.wrap(model)``;
- ``DataLoader(..., sampler=DistributedSampler(ds))`` and ``set_epoch`` -> ``loop.data(ds, batch_size=32)``
  and ``loop.epochs(max_epochs)``;
- ``_save_checkpoint``'s ``checkpoint.pt`` -> ddpkit's snapshot, written at every epoch's end (weights,
  optimizer, each rank's random state, the loader's position): rerun the same command to resume, or
  rerun it with more epochs to train on;
- the loss: the tutorial's ``F.cross_entropy`` over one output is 0 whatever the weights (the
  log-softmax of a single value is 0), so nothing trained; mean squared error does.
"""

import sys

import torch
import torch.nn.functional as F
from torch.utils.data import Dataset

import ddpkit


class MyTrainDataset(Dataset):
    def __init__(self, size):
        self.size = size
        self.data = [(torch.rand(20), torch.rand(1)) for _ in range(size)]

    def __len__(self):
        return self.size

    def __getitem__(self, index):
        return self.data[index]


class Trainer:
    def __init__(self, loop: ddpkit.Loop, model, train_data, optimizer, save_every: int):
        self.loop = loop
        self.model = loop.wrap(model)
        self.train_data = loop.data(train_data, batch_size=32)  # each rank's batch, as the tutorial's
        self.optimizer = optimizer
        self.save_every = save_every
        loop.resume(model=self.model, optimizer=self.optimizer)  # reloaded from the newest snapshot, if any

    def _run_batch(self, source, targets):
        self.optimizer.zero_grad()
        output = self.model(source)
        loss = F.mse_loss(output, targets)
        loss.backward()
        self.optimizer.step()
        self.loop.log(loss=loss)
        self.loop.step()

    def _run_epoch(self, epoch):
        b_sz = len(next(iter(self.train_data))[0])  # a peek, as with a DataLoader: the pass below starts at batch 0
        print(f"[rank{self.loop.rank}] Epoch {epoch} | Batchsize: {b_sz} | Steps: {len(self.train_data)}", flush=True)
        for source, targets in self.train_data:  # on the rank's device already
            self._run_batch(source, targets)

    def _save_checkpoint(self, epoch):
        # The Loop writes the snapshot itself when the epoch ends, at every epoch's end: save_every only
        # chooses the epochs that say so.
        self.loop.print(f"Epoch {epoch} | Training snapshot saved at its end in {self.loop.config.run_dir}/checkpoints")

    def train(self, max_epochs: int):
        for epoch in self.loop.epochs(max_epochs):  # set_epoch on the loader, a snapshot at each end
            self._run_epoch(epoch)
            if epoch % self.save_every == 0:
                self._save_checkpoint(epoch)


def load_train_objs():
    train_set = MyTrainDataset(2048)  # load your dataset
    model = torch.nn.Linear(20, 1)  # load your model
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    return train_set, model, optimizer


def main(ctx, total_epochs: int, save_every: int):
    # log_every=0: no records between epochs, so each epoch's record is its mean loss over both ranks.
    with ddpkit.Loop("runs/tutorial", device="cpu", log_every=0) as loop:
        torch.manual_seed(0)  # the same random dataset on every rank (the tutorial drew one per rank)
        dataset, model, optimizer = load_train_objs()
        trainer = Trainer(loop, model, dataset, optimizer, save_every)
        trainer.train(total_epochs)
        if loop.metrics:
            loop.print(f"final loss {loop.metrics['loss']:.6f} (epoch {loop.state.epoch - 1}, mean over both ranks)")
        else:
            loop.print(f"nothing to train: the run dir's snapshot is at epoch {loop.state.epoch} of {total_epochs}")
        loop.print(f"run dir: {loop.config.run_dir}")


if __name__ == "__main__":  # workers are spawned and import this file
    total_epochs = int(sys.argv[1])
    save_every = int(sys.argv[2])
    ddpkit.launch(main, total_epochs, save_every, nproc=2, device="cpu")
