"""The three training loops ddpkit started from, each three ways, for tests/system/test_seed_ports.py
and docs/port.md:

- ``single_*``: the loop on one process, as its author wrote it before DDP;
- ``plain_*``: as the author runs it under torchrun with plain DDP (init_process_group, DDP(model),
  DistributedSampler, set_epoch, destroy_process_group);
- ``ported_*``: the single-process loop ported to :class:`ddpkit.Loop`, changing as few lines as it can.

The loops: ``train`` is the DDP-with-MNIST notebook's (its ConvNet, SGD at lr 1e-4, global batch 200);
``main`` and ``Trainer`` are the PyTorch DDP tutorial series' (single_gpu.py, multigpu.py: Linear(20, 1),
SGD at lr 1e-3, 32 per device); ``toy_main`` is LLMs-from-scratch appendix A's (its NeuralNetwork, SGD at
lr 0.5, batch 2, drop_last). Kept as the authors wrote them but for CPU/gloo, in-memory data of the same
shapes and a few steps; each deviation says why at its line.

    torchrun --standalone --nproc-per-node 2 tests/helpers/seed_loops.py NAME OUT   # NAME in ENTRIES

writes rank 0's final weights (the model's own state_dict, without DDP's ``module.`` prefix) to OUT.
The ported loops keep their run dir where a ``Loop()`` keeps it by default: ``runs/loop`` in the cwd.
"""

from __future__ import annotations

import atexit
import difflib
import inspect
import os
import re
import sys
import time
import types
from statistics import mean

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed import destroy_process_group, init_process_group
from torch.nn.parallel import DistributedDataParallel
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, TensorDataset
from torch.utils.data.distributed import DistributedSampler

import ddpkit

# ---------------------------------------------------------------------------------------------- stand-ins
# wandb needs an account and the network: a stand-in with its three calls, so the loops keep those lines.
wandb = types.SimpleNamespace(init=lambda **kw: None, log=lambda metrics: None, finish=lambda: None)
transforms = types.SimpleNamespace(ToTensor=lambda: None)


def MNIST(root, train, transform, download):
    """torchvision's MNIST as the notebook calls it, in memory: 800 images of 1x28x28 in [0, 1), 10 classes
    (4 steps an epoch at the notebook's global batch of 200)."""
    gen = torch.Generator().manual_seed(0)
    return TensorDataset(torch.rand(800, 1, 28, 28, generator=gen), torch.randint(0, 10, (800,), generator=gen))


class MyTrainDataset(Dataset):
    """The tutorial's datautils.MyTrainDataset, drawn from its own generator: the tutorial's draws from
    each rank's unseeded stream, so two runs (and two ranks) would train on different data."""

    def __init__(self, size):
        self.size = size
        gen = torch.Generator().manual_seed(size)
        self.data = [(torch.rand(20, generator=gen), torch.rand(1, generator=gen)) for _ in range(size)]

    def __len__(self):
        return self.size

    def __getitem__(self, index):
        return self.data[index]


# ------------------------------------------------------------------------ 000: the DDP-with-MNIST notebook
class ConvNet(nn.Module):
    def __init__(self, num_classes=10):
        super(ConvNet, self).__init__()
        self.layer1 = nn.Sequential(
            nn.Conv2d(1, 16, kernel_size=5, stride=1, padding=2),
            nn.BatchNorm2d(16),
            nn.ReLU(),
            nn.MaxPool2d(kernel_size=2, stride=2),
        )
        self.layer2 = nn.Sequential(
            nn.Conv2d(16, 32, kernel_size=5, stride=1, padding=2),
            nn.BatchNorm2d(32),
            nn.ReLU(),
            nn.MaxPool2d(kernel_size=2, stride=2),
        )
        self.fc = nn.Linear(7 * 7 * 32, num_classes)

    def forward(self, x):
        out = self.layer1(x)
        out = self.layer2(out)
        out = out.reshape(out.size(0), -1)
        out = self.fc(out)
        return out


# Gather any object from the other GPUs and return a list
def ddp_gather(o):
    o_all = [None for _ in range(dist.get_world_size())]
    dist.all_gather_object(o_all, o)
    return o_all


def single_train():
    seed = 42
    torch.manual_seed(seed)

    device = torch.device("cpu")  # CPU: was "cuda"
    num_epochs = 2  # the notebook's 10, shortened for a test
    batch_size = 200
    lr = 1e-4
    log_steps = 2  # the notebook's 50: a record within the test's 8 steps

    wandb.init(project="MiNiST-DDP", name="1-GPU")

    model = ConvNet().to(device)
    criterion = nn.CrossEntropyLoss().to(device)
    optimizer = torch.optim.SGD(model.parameters(), lr)

    train_dataset = MNIST(root="./data", train=True, transform=transforms.ToTensor(), download=True)
    train_loader = DataLoader(
        dataset=train_dataset,
        batch_size=batch_size,
        shuffle=True,
        num_workers=0,
        pin_memory=True,
    )

    losses = []
    step = 0
    sample_count = 0
    last_step_time = time.time()
    for epoch in range(num_epochs):
        for images, labels in train_loader:
            images = images.to(device, non_blocking=True)
            labels = labels.to(device, non_blocking=True)

            outputs = model(images)
            loss = criterion(outputs, labels)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()

            step += 1
            sample_count += len(images)
            losses.append(loss.item())

            if step % log_steps == 0:
                sample_tp = (batch_size * log_steps) / (time.time() - last_step_time)
                metrics = dict(
                    step=step,
                    loss=mean(losses),
                    sample_count=sample_count,
                    sample_tp=sample_tp,
                )
                wandb.log(metrics)
                print(", ".join(f"{k}: {round(v, 2) if type(v) is float else v}" for k, v in metrics.items()))
                losses = []
                last_step_time = time.time()

    wandb.finish()
    return model


def plain_train():
    dist.init_process_group(backend="gloo")  # CPU: was "nccl"

    seed = 42
    torch.manual_seed(seed)

    is_master = dist.get_rank() == 0
    world_size = dist.get_world_size()
    device = torch.device("cpu")  # CPU: was local_rank = dist.get_rank(); torch.cuda.set_device(local_rank)
    num_epochs = 2  # the notebook's 10, shortened for a test
    batch_size = 200
    batch_size_per_device = batch_size // world_size
    lr = 1e-4
    log_steps = 2  # the notebook's 50: a record within the test's 8 steps

    if is_master:
        wandb.init(project="MiNiST-DDP", name=f"{world_size}-GPUs")

    model = ConvNet().to(device)
    criterion = nn.CrossEntropyLoss().to(device)
    optimizer = torch.optim.SGD(model.parameters(), lr)

    # Wrap model AFTER optimizer setup
    model = DistributedDataParallel(model)  # CPU: no device_ids=[local_rank]

    train_dataset = MNIST(root="./data", train=True, transform=transforms.ToTensor(), download=True)
    train_sampler = DistributedSampler(
        train_dataset,
        shuffle=True,
        seed=seed,
    )
    train_loader = DataLoader(
        dataset=train_dataset,
        batch_size=batch_size_per_device,
        sampler=train_sampler,
        shuffle=False,
        num_workers=0,
        pin_memory=True,
    )

    losses = []
    step = 0
    sample_count = 0
    last_step_time = time.time()
    for epoch in range(num_epochs):
        # Not in the notebook, which reads epoch 0's order in every epoch: the tutorial's set_epoch, which
        # the port's loader does for it, so the two read the same batches and can be compared.
        train_sampler.set_epoch(epoch)
        for images, labels in train_loader:
            images = images.to(device, non_blocking=True)
            labels = labels.to(device, non_blocking=True)

            outputs = model(images)
            loss = criterion(outputs, labels)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()

            step += 1
            sample_count += len(images)
            losses.append(loss.item())  # losses = local (per GPU) losses

            if step % log_steps == 0:
                loss_world = ddp_gather(losses)  # all losses = list of lists = [[GPU1], [GPU2], ..]
                if is_master:
                    loss_world = [l for loss_gpu in loss_world for l in loss_gpu]  # noqa: E741 (flatten)
                    sample_tp = (batch_size_per_device * world_size * log_steps) / (time.time() - last_step_time)
                    metrics = dict(
                        step=step,
                        loss=mean(loss_world),
                        sample_count=sample_count * world_size,  # sample count is the same on every process
                        sample_tp=sample_tp,
                    )
                    wandb.log(metrics)
                    print(", ".join(f"{k}: {round(v, 2) if type(v) is float else v}" for k, v in metrics.items()))
                # reset losses on every log step
                losses = []
                last_step_time = time.time()

    if is_master:
        wandb.finish()
    dist.barrier()  # CPU fix: gloo aborts a rank whose peer tears down mid-collective ("terminate called")
    dist.destroy_process_group()
    return model


def ported_train():
    seed = 42
    torch.manual_seed(seed)

    device = torch.device("cpu")  # CPU: was "cuda"
    num_epochs = 2  # the notebook's 10, shortened for a test
    batch_size = 200
    lr = 1e-4
    log_steps = 2  # the notebook's 50: a record within the test's 8 steps

    loop = ddpkit.Loop.start(device=device.type)
    if loop.is_main:
        wandb.init(project="MiNiST-DDP", name=f"{loop.world_size}-GPUs")

    model = loop.wrap(ConvNet().to(device))
    criterion = nn.CrossEntropyLoss().to(device)
    optimizer = torch.optim.SGD(model.parameters(), lr)

    train_dataset = MNIST(root="./data", train=True, transform=transforms.ToTensor(), download=True)
    train_loader = DataLoader(
        dataset=train_dataset,
        batch_size=batch_size // loop.world_size,
        shuffle=True,
        num_workers=0,
        pin_memory=True,
    )
    train_loader = loop.data(train_loader, seed=seed)
    state = loop.resume(model=model, optimizer=optimizer)

    losses = []
    step = state.step
    sample_count = step * (batch_size // loop.world_size)
    last_step_time = time.time()
    for epoch in loop.epochs(num_epochs):
        for images, labels in train_loader:
            images = images.to(device, non_blocking=True)
            labels = labels.to(device, non_blocking=True)

            outputs = model(images)
            loss = criterion(outputs, labels)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            loop.step()

            step += 1
            sample_count += len(images)
            losses.append(loss.item())

            if step % log_steps == 0:
                sample_tp = (batch_size * log_steps) / (time.time() - last_step_time)
                metrics = dict(
                    step=step,
                    loss=loop.reduce(loss=(sum(losses), len(losses)))["loss"],
                    sample_count=sample_count * loop.world_size,
                    sample_tp=sample_tp,
                )
                if loop.is_main:
                    wandb.log(metrics)
                    print(", ".join(f"{k}: {round(v, 2) if type(v) is float else v}" for k, v in metrics.items()))
                losses = []
                last_step_time = time.time()

    if loop.is_main:
        wandb.finish()
    return model


# ------------------------------------------------------------------ 003: the PyTorch DDP tutorial series
def load_train_objs():
    torch.manual_seed(0)  # not in the tutorial: the same initial weights in every run, to compare them
    train_set = MyTrainDataset(256)  # load your dataset (the tutorial's 2048: 4 steps an epoch on 2 ranks)
    model = torch.nn.Linear(20, 1)  # load your model
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    return train_set, model, optimizer


class SingleTrainer:
    def __init__(
        self,
        model: torch.nn.Module,
        train_data: DataLoader,
        optimizer: torch.optim.Optimizer,
        gpu_id: int,
        save_every: int,
    ) -> None:
        self.gpu_id = gpu_id
        self.model = model.to(gpu_id)
        self.train_data = train_data
        self.optimizer = optimizer
        self.save_every = save_every

    def _run_batch(self, source, targets):
        self.optimizer.zero_grad()
        output = self.model(source)
        # The tutorial's F.cross_entropy over Linear(20, 1)'s one column is a one-class softmax: its
        # gradient is 0 and nothing trains, so a comparison of weights would prove nothing.
        loss = F.mse_loss(output, targets)
        loss.backward()
        self.optimizer.step()

    def _run_epoch(self, epoch):
        b_sz = len(next(iter(self.train_data))[0])
        print(f"[GPU{self.gpu_id}] Epoch {epoch} | Batchsize: {b_sz} | Steps: {len(self.train_data)}")
        for source, targets in self.train_data:
            source = source.to(self.gpu_id)
            targets = targets.to(self.gpu_id)
            self._run_batch(source, targets)

    def _save_checkpoint(self, epoch):
        ckp = self.model.state_dict()
        PATH = "checkpoint.pt"
        torch.save(ckp, PATH)
        print(f"Epoch {epoch} | Training checkpoint saved at {PATH}")

    def train(self, max_epochs: int):
        for epoch in range(max_epochs):
            self._run_epoch(epoch)
            if epoch % self.save_every == 0:
                self._save_checkpoint(epoch)


def single_prepare_dataloader(dataset: Dataset, batch_size: int):
    return DataLoader(
        dataset,
        batch_size=batch_size,
        pin_memory=True,
        shuffle=True,
    )


def single_main(device, total_epochs, save_every, batch_size):
    dataset, model, optimizer = load_train_objs()
    train_data = single_prepare_dataloader(dataset, batch_size)
    trainer = SingleTrainer(model, train_data, optimizer, device, save_every)
    trainer.train(total_epochs)
    return trainer.model


def plain_ddp_setup():
    init_process_group(backend="gloo")  # torchrun's variables; CPU: no set_device, gloo for nccl


class PlainTrainer:
    def __init__(
        self,
        model: torch.nn.Module,
        train_data: DataLoader,
        optimizer: torch.optim.Optimizer,
        gpu_id: int,
        save_every: int,
    ) -> None:
        self.gpu_id = gpu_id
        self.model = model.to(gpu_id)
        self.train_data = train_data
        self.optimizer = optimizer
        self.save_every = save_every
        self.model = DDP(self.model)  # CPU: no device_ids=[gpu_id]

    def _run_batch(self, source, targets):
        self.optimizer.zero_grad()
        output = self.model(source)
        # The tutorial's F.cross_entropy over Linear(20, 1)'s one column is a one-class softmax: its
        # gradient is 0 and nothing trains, so a comparison of weights would prove nothing.
        loss = F.mse_loss(output, targets)
        loss.backward()
        self.optimizer.step()

    def _run_epoch(self, epoch):
        b_sz = len(next(iter(self.train_data))[0])
        print(f"[GPU{self.gpu_id}] Epoch {epoch} | Batchsize: {b_sz} | Steps: {len(self.train_data)}")
        self.train_data.sampler.set_epoch(epoch)
        for source, targets in self.train_data:
            source = source.to(self.gpu_id)
            targets = targets.to(self.gpu_id)
            self._run_batch(source, targets)

    def _save_checkpoint(self, epoch):
        ckp = self.model.module.state_dict()
        PATH = "checkpoint.pt"
        torch.save(ckp, PATH)
        print(f"Epoch {epoch} | Training checkpoint saved at {PATH}")

    def train(self, max_epochs: int):
        for epoch in range(max_epochs):
            self._run_epoch(epoch)
            if dist.get_rank() == 0 and epoch % self.save_every == 0:  # CPU: gpu_id is "cpu", not the rank
                self._save_checkpoint(epoch)


def plain_prepare_dataloader(dataset: Dataset, batch_size: int):
    return DataLoader(
        dataset,
        batch_size=batch_size,
        pin_memory=True,
        shuffle=False,
        sampler=DistributedSampler(dataset),
    )


def plain_main(device, total_epochs, save_every, batch_size):
    plain_ddp_setup()
    dataset, model, optimizer = load_train_objs()
    train_data = plain_prepare_dataloader(dataset, batch_size)
    trainer = PlainTrainer(model, train_data, optimizer, device, save_every)
    trainer.train(total_epochs)
    torch.distributed.barrier()  # CPU fix: gloo aborts a rank whose peer tears down mid-collective
    destroy_process_group()
    return trainer.model


class PortedTrainer:
    def __init__(
        self,
        model: torch.nn.Module,
        train_data: DataLoader,
        optimizer: torch.optim.Optimizer,
        loop: ddpkit.Loop,
        save_every: int,
    ) -> None:
        self.gpu_id, self.loop = loop.device, loop
        self.model = loop.wrap(model)
        self.train_data = loop.data(train_data)
        self.optimizer = optimizer
        self.save_every = save_every
        loop.resume(model=self.model, optimizer=self.optimizer)

    def _run_batch(self, source, targets):
        self.optimizer.zero_grad()
        output = self.model(source)
        # The tutorial's F.cross_entropy over Linear(20, 1)'s one column is a one-class softmax: its
        # gradient is 0 and nothing trains, so a comparison of weights would prove nothing.
        loss = F.mse_loss(output, targets)
        loss.backward()
        self.optimizer.step()
        self.loop.step()

    def _run_epoch(self, epoch):
        b_sz = len(next(iter(self.train_data))[0])
        print(f"[GPU{self.gpu_id}] Epoch {epoch} | Batchsize: {b_sz} | Steps: {len(self.train_data)}")
        for source, targets in self.train_data:
            source = source.to(self.gpu_id)
            targets = targets.to(self.gpu_id)
            self._run_batch(source, targets)

    def _save_checkpoint(self, epoch):
        ckp = self.model.module.state_dict()
        PATH = "checkpoint.pt"
        torch.save(ckp, PATH)
        print(f"Epoch {epoch} | Training checkpoint saved at {PATH}")

    def train(self, max_epochs: int):
        for epoch in self.loop.epochs(max_epochs):
            self._run_epoch(epoch)
            if self.loop.is_main and epoch % self.save_every == 0:
                self._save_checkpoint(epoch)


def ported_prepare_dataloader(dataset: Dataset, batch_size: int):
    return DataLoader(
        dataset,
        batch_size=batch_size,
        pin_memory=True,
        shuffle=True,
    )


def ported_main(device, total_epochs, save_every, batch_size):
    loop = ddpkit.Loop.start(device=device)
    dataset, model, optimizer = load_train_objs()
    train_data = ported_prepare_dataloader(dataset, batch_size)
    trainer = PortedTrainer(model, train_data, optimizer, loop, save_every)
    trainer.train(total_epochs)
    return trainer.model


# --------------------------------------------------------------------- 004: LLMs-from-scratch appendix A
class ToyDataset(Dataset):
    def __init__(self, X, y):
        self.features = X
        self.labels = y

    def __getitem__(self, index):
        one_x = self.features[index]
        one_y = self.labels[index]
        return one_x, one_y

    def __len__(self):
        return self.labels.shape[0]


class NeuralNetwork(torch.nn.Module):
    def __init__(self, num_inputs, num_outputs):
        super().__init__()

        self.layers = torch.nn.Sequential(
            # 1st hidden layer
            torch.nn.Linear(num_inputs, 30),
            torch.nn.ReLU(),
            # 2nd hidden layer
            torch.nn.Linear(30, 20),
            torch.nn.ReLU(),
            # output layer
            torch.nn.Linear(20, num_outputs),
        )

    def forward(self, x):
        logits = self.layers(x)
        return logits


def toy_datasets():
    X_train = torch.tensor([[-1.2, 3.1], [-0.9, 2.9], [-0.5, 2.6], [2.3, -1.1], [2.7, -1.5]])
    y_train = torch.tensor([0, 0, 0, 1, 1])
    X_test = torch.tensor([[-0.8, 2.8], [2.6, -1.6]])
    y_test = torch.tensor([0, 1])
    return ToyDataset(X_train, y_train), ToyDataset(X_test, y_test)


def compute_accuracy(model, dataloader, device):
    model = model.eval()
    correct = 0.0
    total_examples = 0

    for idx, (features, labels) in enumerate(dataloader):
        features, labels = features.to(device), labels.to(device)

        with torch.no_grad():
            logits = model(features)
        predictions = torch.argmax(logits, dim=1)
        compare = labels == predictions
        correct += torch.sum(compare)
        total_examples += len(compare)
    return (correct / total_examples).item()


def single_toy_prepare_dataset():
    train_ds, test_ds = toy_datasets()
    train_loader = DataLoader(
        dataset=train_ds,
        batch_size=2,
        shuffle=True,
        pin_memory=True,
        drop_last=True,
    )
    test_loader = DataLoader(
        dataset=test_ds,
        batch_size=2,
        shuffle=False,
    )
    return train_loader, test_loader


def single_toy_main(device, num_epochs):
    torch.manual_seed(123)
    train_loader, test_loader = single_toy_prepare_dataset()
    model = NeuralNetwork(num_inputs=2, num_outputs=2)
    model.to(device)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    for epoch in range(num_epochs):
        model.train()
        for features, labels in train_loader:
            features, labels = features.to(device), labels.to(device)
            logits = model(features)
            loss = F.cross_entropy(logits, labels)  # Loss function

            optimizer.zero_grad()
            loss.backward()
            optimizer.step()

            # LOGGING
            print(
                f"Epoch: {epoch + 1:03d}/{num_epochs:03d}"
                f" | Batchsize {labels.shape[0]:03d}"
                f" | Train/Val Loss: {loss:.2f}"
            )

    model.eval()
    train_acc = compute_accuracy(model, train_loader, device=device)
    print("Training accuracy", train_acc)
    test_acc = compute_accuracy(model, test_loader, device=device)
    print("Test accuracy", test_acc)
    return model


def plain_toy_ddp_setup(rank, world_size):
    # torchrun's MASTER_ADDR and MASTER_PORT (the book sets its own, for mp.spawn); CPU: gloo, no set_device
    init_process_group(backend="gloo", rank=rank, world_size=world_size)


def plain_toy_prepare_dataset():
    train_ds, test_ds = toy_datasets()
    train_loader = DataLoader(
        dataset=train_ds,
        batch_size=2,
        shuffle=False,  # NEW: False because of DistributedSampler below
        pin_memory=True,
        drop_last=True,
        # NEW: chunk batches across GPUs without overlapping samples:
        sampler=DistributedSampler(train_ds),  # NEW
    )
    test_loader = DataLoader(
        dataset=test_ds,
        batch_size=2,
        shuffle=False,
    )
    return train_loader, test_loader


def plain_toy_main(rank, world_size, num_epochs):
    torch.manual_seed(123)
    plain_toy_ddp_setup(rank, world_size)  # NEW: initialize process groups
    device = torch.device("cpu")  # CPU: the book puts rank on GPU rank
    train_loader, test_loader = plain_toy_prepare_dataset()
    model = NeuralNetwork(num_inputs=2, num_outputs=2)
    model.to(device)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    model = DDP(model)  # NEW: wrap model with DDP (CPU: no device_ids=[rank])
    for epoch in range(num_epochs):
        train_loader.sampler.set_epoch(epoch)
        model.train()
        for features, labels in train_loader:
            features, labels = features.to(device), labels.to(device)
            logits = model(features)
            loss = F.cross_entropy(logits, labels)  # Loss function

            optimizer.zero_grad()
            loss.backward()
            optimizer.step()

            # LOGGING
            print(
                f"[GPU{rank}] Epoch: {epoch + 1:03d}/{num_epochs:03d}"
                f" | Batchsize {labels.shape[0]:03d}"
                f" | Train/Val Loss: {loss:.2f}"
            )

    model.eval()
    train_acc = compute_accuracy(model, train_loader, device=device)
    print(f"[GPU{rank}] Training accuracy", train_acc)
    test_acc = compute_accuracy(model, test_loader, device=device)
    print(f"[GPU{rank}] Test accuracy", test_acc)
    torch.distributed.barrier()  # CPU fix: gloo aborts a rank whose peer tears down mid-collective
    destroy_process_group()  # NEW: cleanly exit distributed mode
    return model


def ported_toy_prepare_dataset():
    train_ds, test_ds = toy_datasets()
    train_loader = DataLoader(
        dataset=train_ds,
        batch_size=2,
        shuffle=True,
        pin_memory=True,
        drop_last=True,
    )
    test_loader = DataLoader(
        dataset=test_ds,
        batch_size=2,
        shuffle=False,
    )
    return train_loader, test_loader


def ported_toy_main(device, num_epochs):
    torch.manual_seed(123)
    loop = ddpkit.Loop.start(device=device)
    train_loader, test_loader = ported_toy_prepare_dataset()
    train_loader = loop.data(train_loader)
    model = NeuralNetwork(num_inputs=2, num_outputs=2)
    model = loop.wrap(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    loop.resume(model=model, optimizer=optimizer)
    for epoch in loop.epochs(num_epochs):
        model.train()
        for features, labels in train_loader:
            features, labels = features.to(device), labels.to(device)
            logits = model(features)
            loss = F.cross_entropy(logits, labels)  # Loss function

            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            loop.step()

            # LOGGING
            print(
                f"Epoch: {epoch + 1:03d}/{num_epochs:03d}"
                f" | Batchsize {labels.shape[0]:03d}"
                f" | Train/Val Loss: {loss:.2f}"
            )

    model.eval()
    train_acc = compute_accuracy(model, train_loader, device=device)
    print("Training accuracy", train_acc)
    test_acc = compute_accuracy(model, test_loader, device=device)
    print("Test accuracy", test_acc)
    return model


# ------------------------------------------------------------------------------ the versions, and diffs
# What each seed's loop is made of, in each version (the parts all three share are not listed).
PARTS = {
    "mnist": {"single": [single_train], "plain": [ddp_gather, plain_train], "ported": [ported_train]},
    "tutorial": {
        "single": [SingleTrainer, single_prepare_dataloader, single_main],
        "plain": [plain_ddp_setup, PlainTrainer, plain_prepare_dataloader, plain_main],
        "ported": [PortedTrainer, ported_prepare_dataloader, ported_main],
    },
    "appendix": {
        "single": [single_toy_prepare_dataset, single_toy_main],
        "plain": [plain_toy_ddp_setup, plain_toy_prepare_dataset, plain_toy_main],
        "ported": [ported_toy_prepare_dataset, ported_toy_main],
    },
}

# The PyTorch tutorial's own diff from single_gpu.py to multigpu.py, as its page shows it ("Diff for
# single_gpu.py v/s multigpu.py"): 8 lines removed and 27 added (imports, ddp_setup, mp.spawn included).
TUTORIAL_DIFF_LINES = 35

# How each seed runs: its loop's entry point and arguments (the tutorial: 2 epochs, a checkpoint every
# epoch, 32 per device; the appendix: its 3 epochs).
ENTRIES = {
    "single_mnist": lambda: single_train(),
    "plain_mnist": lambda: plain_train(),
    "ported_mnist": lambda: ported_train(),
    "single_tutorial": lambda: single_main("cpu", 2, 1, 32),
    "plain_tutorial": lambda: plain_main("cpu", 2, 1, 32),
    "ported_tutorial": lambda: ported_main("cpu", 2, 1, 32),
    "single_appendix": lambda: single_toy_main("cpu", 3),
    "plain_appendix": lambda: plain_toy_main(int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), 3),
    "ported_appendix": lambda: ported_toy_main("cpu", 3),
}


def initial_weights(seed: str) -> dict:
    """The weights each seed's model starts from, as rank 0 makes them (and DDP broadcasts them)."""
    if seed == "tutorial":
        return load_train_objs()[1].state_dict()
    torch.manual_seed(42 if seed == "mnist" else 123)
    return (ConvNet() if seed == "mnist" else NeuralNetwork(num_inputs=2, num_outputs=2)).state_dict()


def source(seed: str, version: str) -> list[str]:
    """The lines of a version's parts, with the version's name taken out of every name (``ported_main``,
    ``PortedTrainer``: ``main``, ``Trainer``), so a diff shows what the port changed, not what it is called."""
    text = "\n\n".join(inspect.getsource(part) for part in PARTS[seed][version])
    text = re.sub(r"\b(single|plain|ported)_", "", text)
    return re.sub(r"\b(Single|Plain|Ported)(?=[A-Z])", "", text).splitlines()


def diff(seed: str, old: str = "single", new: str = "ported", context: int = 1) -> list[str]:
    """A unified diff (difflib's format) of two versions, every changed line counted as a plain ``git diff``
    counts it (a line whose indentation changed too: the ports start their Loop with ``Loop.start()``, so
    nothing is re-indented)."""
    a, b = source(seed, old), source(seed, new)
    matcher = difflib.SequenceMatcher(None, a, b, False)
    out = [f"--- {old}", f"+++ {new}"]
    for group in matcher.get_grouped_opcodes(context):
        (_, i1, _, j1, _), (_, _, i2, _, j2) = group[0], group[-1]
        out.append(f"@@ -{i1 + 1},{i2 - i1} +{j1 + 1},{j2 - j1} @@")
        for tag, a1, a2, b1, b2 in group:
            if tag == "equal":
                out += [" " + line for line in b[b1:b2]]
                continue
            out += ["-" + line for line in a[a1:a2]]
            out += ["+" + line for line in b[b1:b2]]
    return out


def changed_lines(seed: str, old: str = "single", new: str = "ported") -> int:
    """Lines removed plus lines added, as ``git diff --numstat`` adds them up."""
    return sum(1 for line in diff(seed, old, new)[2:] if line[:1] in "+-")


def run(name: str, out: str) -> None:
    model = ENTRIES[name]()
    if int(os.environ.get("RANK", 0)) == 0:  # torchrun's RANK: a plain loop's process group is gone by now
        torch.save(getattr(model, "module", model).state_dict(), out)


if __name__ == "__main__":
    run(sys.argv[1], sys.argv[2])
    # Test harness only: end without the interpreter's teardown, where gloo's threads (still referenced by the
    # DDP object after destroy_process_group) abort now and then: "terminate called without an active exception",
    # exit -6, in plain DDP and Loop scripts alike (CI, 2026-11-26). The exit handlers run first: a port's
    # Loop.start()-ed loop closes there (its last snapshot and record), as at a script's normal end.
    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
