"""Time to the first step of a dataset over every window offset of a token memmap (issue 35, item 4):

    python benchmarks/lazy_windows.py RUN_DIR 1000000          # as ddpkit runs it now
    python benchmarks/lazy_windows.py RUN_DIR 1000000 old      # read whole before launch, as before

Prints the wall time of fit(), summary.json's startup_s (launch to first step) and the data path.
"""

import sys
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import Dataset

from ddpkit import TrainConfig, Trainer


class Windows(Dataset):
    def __init__(self, path, n):
        self.tokens, self.n = np.memmap(path, dtype=np.uint16, mode="r"), n

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        w = torch.from_numpy(self.tokens[i : i + 33].astype(np.int64))
        return w[:-1], w[1:]


class LM(nn.Module):
    def __init__(self):
        super().__init__()
        self.e = nn.Embedding(64, 32)
        self.o = nn.Linear(32, 64)

    def forward(self, x):
        return self.o(self.e(x))


def loss_fn(model, batch):
    x, y = batch
    return F.cross_entropy(model(x).flatten(0, 1), y.flatten())


if __name__ == "__main__":
    n = int(sys.argv[2])
    if len(sys.argv) > 3:
        import ddpkit.data.materialize as m

        m.READ_LIMIT_S = float("inf")  # the old behaviour: read it all
    tokens = str(Path(sys.argv[1]).parent / "tokens.bin")  # beside the run dir
    np.random.default_rng(0).integers(0, 64, n + 40).astype(np.uint16).tofile(tokens)
    t0 = time.time()
    r = Trainer(
        TrainConfig(
            nproc="2",
            device="cpu",
            batch_size=64,
            epochs=1,
            max_steps=20,
            progress=False,
            log_every=10,
            num_workers=0,
            run_dir=sys.argv[1],
            plots=False,
        ),
        model=LM(),
        train_data=Windows(tokens, n),
        test_data=Windows(tokens, 256),
        loss_fn=loss_fn,
    ).fit()
    print("wall", round(time.time() - t0, 1), "startup_s", r["startup_s"], "path", r["data_path"])
