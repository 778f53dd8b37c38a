"""Train a test-only model through the public API, in its own process, as a user script would.

    python tests/helpers/custom_train.py '{"fault": "slow", "seconds": 0.04, "config": {...}}'
    custom_train.trainer(spec).fit()     # the same run, launched from the test's own process

The JSON gives the :class:`workers.FaultyConvNet` arguments and the TrainConfig fields.
Exit status and stderr are the CLI's (one line per user error).
"""

import json
import sys

import torch
from workers import FaultyConvNet

from ddpkit import TrainConfig, Trainer
from ddpkit.cli import run_reporting_errors

# The fault-tolerance tests' run (tests/system/test_fault_tolerance.py, benchmarks/launch_cost.py): 2,000 MNIST
# images, global batch 100: 20 steps per epoch at world 2. Plots are tested in test_loggers.py.
BASE = dict(
    dataset="mnist",
    recipe="mnist",
    limit_train=2000,
    limit_test=500,
    batch_size=100,
    lr=0.05,
    epochs=2,
    progress=False,
    device="cpu",
    nproc="2",
    plots=False,
)


def trainer(spec: dict) -> Trainer:
    """The Trainer ``spec`` describes: called here, and by a test in its own process for a run whose files,
    not its launcher's exit status or output, are what it checks (no interpreter and torch import to pay)."""
    torch.manual_seed(spec.get("seed", 0))  # identical initial weights in every run of a test
    model = FaultyConvNet(
        spec.get("fault", "none"), spec.get("at_step", 0), spec.get("rank", -1), spec.get("seconds", 0.0)
    )
    return Trainer(TrainConfig(**spec["config"]), model=model)


def main() -> int:
    spec = json.loads(sys.argv[1])
    return run_reporting_errors(lambda: trainer(spec).fit() and 0)


if __name__ == "__main__":
    sys.exit(main())
