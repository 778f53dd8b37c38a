"""A char-GPT-style script on ``Trainer``, as a user would write it (tests/system/test_validation.py).

    python tests/helpers/gpt_trainer.py '{"run_dir": ..., "tokens": "tokens.bin", "config": {...}}'

Next-token prediction over windows of a token file read through ``np.memmap``; a 10% validation split held
out of the training windows; evaluated every few steps, the best checkpoint kept, stopped early on a plateau.
The learning rate falls to 0 after ``flat_after`` steps (a LambdaLR of the user's own), so the validation
loss plateaus there on any CPU: when the run stops early is known. ``sleep_s`` per training step gives a
test time to signal it. float64: no dependence on the CPU kind.
"""

import json
import sys
import time

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import Dataset

from ddpkit import TrainConfig, Trainer
from ddpkit.cli import run_reporting_errors

VOCAB, CONTEXT = 32, 8


class Windows(Dataset):
    """Every window of CONTEXT + 1 tokens at a stride of CONTEXT, read from the memmap when asked."""

    def __init__(self, path: str):
        self.tokens = np.memmap(path, dtype=np.uint16, mode="r")

    def __len__(self):
        return (len(self.tokens) - 1) // CONTEXT

    def __getitem__(self, i):
        chunk = torch.from_numpy(self.tokens[i * CONTEXT : i * CONTEXT + CONTEXT + 1].astype(np.int64))
        return chunk[:-1], chunk[1:]


class CharLM(nn.Module):
    def __init__(self, sleep_s: float = 0.0):
        super().__init__()
        self.emb = nn.Embedding(VOCAB, 24, dtype=torch.float64)
        self.mix = nn.Linear(24, 24, dtype=torch.float64)
        self.out = nn.Linear(24, VOCAB, dtype=torch.float64)
        self.sleep_s = sleep_s

    def forward(self, tokens):
        if self.training and self.sleep_s:
            time.sleep(self.sleep_s)
        return self.out(torch.tanh(self.mix(self.emb(tokens))))


def next_token_loss(model, batch):
    tokens, targets = batch
    logits = model(tokens)
    return F.cross_entropy(logits.reshape(-1, VOCAB), targets.reshape(-1))


def main() -> int:
    spec = json.loads(sys.argv[1])
    torch.manual_seed(0)
    model = CharLM(spec.get("sleep_s", 0.0))
    flat_after = spec["flat_after"]
    cfg = TrainConfig(**spec["config"], run_dir=spec["run_dir"])
    trainer = Trainer(
        cfg,
        model=model,
        train_data=Windows(spec["tokens"]),
        test_data=Windows(spec["tokens"]),
        loss_fn=next_token_loss,
        optimizer=lambda m: torch.optim.SGD(m.parameters(), lr=0.5, momentum=0.9),
        scheduler=lambda opt: torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 if s < flat_after else 0.0),
    )
    return run_reporting_errors(lambda: trainer.fit() and 0)


if __name__ == "__main__":
    sys.exit(main())
