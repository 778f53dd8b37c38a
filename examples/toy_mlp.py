"""The 5-sample toy problem of LLMs-from-scratch appendix A on 2 processes: per-rank and exact global
train/test accuracy.

    python examples/toy_mlp.py

The 2-feature, 5-sample toy set and the 2-30-20-2 ``NeuralNetwork`` of the DDP appendix
script (LLMs-from-scratch, appendix A), trained with ddpkit instead of ``mp.spawn`` +
``DistributedSampler`` by hand. Copy it, and swap in your own model and data.
"""

import torch
from torch.utils.data import TensorDataset

from ddpkit import TrainConfig, Trainer


class NeuralNetwork(torch.nn.Module):
    def __init__(self, num_inputs: int, num_outputs: int):
        super().__init__()
        self.layers = torch.nn.Sequential(
            torch.nn.Linear(num_inputs, 30),
            torch.nn.ReLU(),
            torch.nn.Linear(30, 20),
            torch.nn.ReLU(),
            torch.nn.Linear(20, num_outputs),
        )

    def forward(self, x):
        return self.layers(x)


def main() -> dict:
    X_train = torch.tensor([[-1.2, 3.1], [-0.9, 2.9], [-0.5, 2.6], [2.3, -1.1], [2.7, -1.5]])
    y_train = torch.tensor([0, 0, 0, 1, 1])
    X_test = torch.tensor([[-0.8, 2.8], [2.6, -1.6]])
    y_test = torch.tensor([0, 1])
    train, test = TensorDataset(X_train, y_train), TensorDataset(X_test, y_test)

    torch.manual_seed(123)
    model = NeuralNetwork(num_inputs=2, num_outputs=2)
    # The appendix script's settings: plain SGD at lr 0.5, 2 samples per rank per step, 3 epochs. The
    # global batch is 4, so each epoch is one step on 4 of the 5 samples (drop_last, as
    # DistributedSampler's even split needs); labels are class indices, so the default
    # classification task (cross-entropy, accuracy) applies unchanged.
    config = TrainConfig(
        nproc="2",
        device="cpu",
        epochs=3,
        batch_size=4,
        optimizer="sgd",
        lr=0.5,
        momentum=0.0,
        nesterov=False,
        weight_decay=0.0,
        schedule="constant",
        progress=False,
        log_every=1,
        run_dir="runs/toy-mlp",
    )
    result = Trainer(config, model=model, train_data=train, test_data=test).fit()

    for r in result.per_rank:
        print(
            f"rank {r['rank']}: train accuracy {r['train_accuracy']:.2f} (its samples of the last epoch), "
            f"test accuracy {r['test_accuracy']:.2f} ({r['test_samples']} of {len(test)} test samples)"
        )
    # Exact global figures: the trained model (fit() leaves it in `model`), evaluated on every
    # sample once, split over the same 2 processes.
    on_train = Trainer(config, model=model, test_data=train).evaluate()
    print(
        f"global: train accuracy {on_train['test_accuracy']:.4f} over all {on_train['test_samples']} training "
        f"samples, test accuracy {result['test_accuracy']:.4f} over {result['test_samples']} test samples"
    )
    return {"train_accuracy": on_train["test_accuracy"], "test_accuracy": result["test_accuracy"]}


if __name__ == "__main__":  # workers are spawned and import this file
    main()
