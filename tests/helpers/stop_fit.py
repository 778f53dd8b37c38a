"""A user's script that calls Trainer.fit() at world 2 and lets whatever it raises propagate (tests only):
``python stop_fit.py RUN_DIR``, trained long enough to be stopped by a signal."""

import sys

import torch.nn.functional as F
from user_code import RegressionMLP, regression_data

from ddpkit import TrainConfig, Trainer


def mse(model, batch):
    x, y = batch
    return F.mse_loss(model(x), y)


if __name__ == "__main__":
    cfg = TrainConfig(nproc="2", device="cpu", batch_size=16, epochs=200, run_dir=sys.argv[1], num_workers=0)
    Trainer(
        cfg, model=RegressionMLP(), train_data=regression_data(2048, 0), test_data=regression_data(32, 1), loss_fn=mse
    ).fit()
