"""Your own loss and metric: an MSE regression on 2 processes, with MAE reduced exactly.

    python examples/regression.py

The step contract in one screen: ``loss_fn(model, batch)`` returns the loss (and outputs for
the metrics), and each metric returns a (sum, count) pair, which ddpkit adds up over steps
and ranks, so the reported MAE is the exact mean over every test sample.
"""

import torch
import torch.nn.functional as F
from torch.utils.data import TensorDataset

from ddpkit import TrainConfig, Trainer


def make_data(n: int, seed: int) -> TensorDataset:
    """y = x . w + noise, 8 features: a linear target an MLP learns in a few epochs."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 8, generator=gen)
    w = torch.linspace(-2, 2, 8, dtype=torch.float32).view(8, 1)
    return TensorDataset(x, x @ w + 0.1 * torch.randn(n, 1, generator=gen))


def mse_loss(model, batch):
    """The step contract: the loss to minimise, and the outputs the metrics read."""
    x, y = batch
    prediction = model(x)
    return F.mse_loss(prediction, y), prediction


def mae(prediction, batch):
    """A metric: (sum, count) for this batch; ddpkit reports sum / count over all batches and ranks."""
    y = batch[1]
    return (prediction - y).abs().sum(), y.numel()


def main() -> dict:
    train, test = make_data(4096, 0), make_data(1000, 1)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 64), torch.nn.ReLU(), torch.nn.Linear(64, 1))
    config = TrainConfig(
        nproc="2",
        device="cpu",
        epochs=10,
        batch_size=128,
        lr=0.05,
        progress=False,
        log_every=100,
        run_dir="runs/regression",
    )
    result = Trainer(
        config, model=model, train_data=train, test_data=test, loss_fn=mse_loss, metrics={"mae": mae}
    ).fit()
    y = test.tensors[1]
    baseline = F.mse_loss(torch.full_like(y, train.tensors[1].mean().item()), y).item()
    print(
        f"test MSE {result['test_loss']:.4f} (predicting the training mean: {baseline:.4f}), "
        f"test MAE {result['test_mae']:.4f} over {result['test_samples']} samples"
    )
    return {"test_mse": result["test_loss"], "baseline_mse": baseline, "test_mae": result["test_mae"]}


if __name__ == "__main__":  # workers are spawned and import this file
    main()
