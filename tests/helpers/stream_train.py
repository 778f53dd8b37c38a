"""Train a linear model on a :class:`user_code.Rows` stream through ``Trainer``, as a user script would
(tests/api/test_stream.py):

    python stream_train.py '{"run_dir": ..., "log_dir": ..., "rows": {...}, "config": {...}}'

Prints its own pid first (its reads are preflight's, not training's)."""

import json
import os
import sys

import torch
import torch.nn.functional as F
from torch.utils.data import TensorDataset
from user_code import Rows

from ddpkit import TrainConfig, Trainer
from ddpkit.cli import run_reporting_errors


def mse(model, batch):
    x, y = batch
    return F.mse_loss(model(x), y)


def trainer(spec: dict) -> Trainer:
    """The Trainer ``spec`` describes (called here, and by a test that launches it from its own process)."""
    torch.manual_seed(0)
    test = TensorDataset(torch.randn(16, 4, generator=torch.Generator().manual_seed(1)), torch.zeros(16, 1))
    return Trainer(
        TrainConfig(**spec["config"], run_dir=spec["run_dir"]),
        model=torch.nn.Linear(4, 1),
        train_data=Rows(log_dir=spec["log_dir"], **spec["rows"]),
        test_data=test,
        loss_fn=mse,
    )


def main() -> int:
    spec = json.loads(sys.argv[1])
    print(f"pid {os.getpid()}", flush=True)
    return run_reporting_errors(lambda: trainer(spec).fit() and 0)


if __name__ == "__main__":
    sys.exit(main())
