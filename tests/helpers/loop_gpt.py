"""A character-level GPT loop of the usual kind, on ``ddpkit.Loop`` (tests only): its own iteration loop,
random windows drawn with ``torch.randint`` from a ``np.memmap`` of tokens, dropout, gradient accumulation 2
under ``no_sync``, warm-up plus cosine lr by iteration, evaluation every EVAL_EVERY iterations on random
validation windows, the best checkpoint by validation loss, clipping. Run under torchrun:

    TOKENS=tokens.bin torchrun --standalone --nproc-per-node 2 loop_gpt.py RUN_DIR OUT.pt

Test hooks (environment): ITERS (default 60); SAVE (save_every_steps, default 0); DIE_AT=i with SIG=SIGKILL
or SIGTERM: rank 0 sends itself that signal in iteration i, after its optimizer step."""

from __future__ import annotations

import math
import os
import signal
import sys

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

import ddpkit

BLOCK, BATCH, ACCUM, EVAL_EVERY = 16, 8, 2, 20
MAX_ITERS = int(os.environ.get("ITERS", 60))


class TinyGPT(nn.Module):
    def __init__(self, vocab: int = 32, d: int = 32):
        super().__init__()
        self.emb, self.pos = nn.Embedding(vocab, d), nn.Embedding(BLOCK, d)
        self.mlp = nn.Sequential(nn.Linear(d, 64), nn.GELU(), nn.Dropout(0.1), nn.Linear(64, d))
        self.head = nn.Linear(d, vocab)

    def forward(self, idx, targets):
        x = self.emb(idx) + self.pos(torch.arange(idx.shape[1], device=idx.device))
        logits = self.head(x + self.mlp(x))
        return logits, F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1))


def get_batch(data: np.ndarray):
    ix = torch.randint(len(data) - BLOCK - 1, (BATCH,))
    x = torch.stack([torch.from_numpy(data[i : i + BLOCK].astype(np.int64)) for i in ix])
    y = torch.stack([torch.from_numpy(data[i + 1 : i + 1 + BLOCK].astype(np.int64)) for i in ix])
    return x, y


def lr_at(it: int) -> float:
    if it < 10:
        return 1e-2 * (it + 1) / 10
    return 1e-3 + 0.5 * (1e-2 - 1e-3) * (1 + math.cos(math.pi * (it - 10) / (MAX_ITERS - 10)))


def main(run_dir: str, out: str) -> None:
    with ddpkit.Loop(run_dir, log_every=5, save_every_steps=int(os.environ.get("SAVE", 0))) as loop:
        tokens = np.memmap(os.environ["TOKENS"], dtype=np.uint16, mode="r")
        train, val = tokens[: len(tokens) * 9 // 10], tokens[len(tokens) * 9 // 10 :]
        torch.manual_seed(0)
        model = loop.wrap(TinyGPT())
        torch.manual_seed(1337 + loop.rank)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3, betas=(0.9, 0.95))
        state = loop.resume(model=model, optimizer=opt, best_val=1e9)
        for it in loop.steps(MAX_ITERS):
            for group in opt.param_groups:
                group["lr"] = lr_at(it)
            if it % EVAL_EVERY == 0:
                model.eval()
                with torch.no_grad():
                    losses = torch.stack([model(*get_batch(val))[1] for _ in range(4)]).mean()
                model.train()
                val_loss = loop.reduce(val=losses)["val"]
                if val_loss < state["best_val"]:
                    state["best_val"] = val_loss
                    loop.best("val", val_loss)
            for micro in range(ACCUM):
                x, y = get_batch(train)
                with loop.no_sync(model, enabled=micro < ACCUM - 1):
                    _, loss = model(x, y)
                    (loss / ACCUM).backward()
                loop.log(loss=loss.detach())
            loop.clip_grad_norm_(model, 1.0)
            opt.step()
            opt.zero_grad(set_to_none=True)
            if os.environ.get("DIE_AT") == str(it) and loop.rank == 0:
                os.kill(os.getpid(), getattr(signal, os.environ.get("SIG", "SIGKILL")))
        if loop.is_main:
            torch.save({"model": model.module.state_dict(), "best_val": state["best_val"]}, out)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
    # Test harness only: end without the interpreter's teardown, where gloo's threads (still referenced by the
    # DDP object after destroy_process_group) abort now and then: "terminate called without an active exception",
    # exit -6, in plain DDP and Loop scripts alike (CI, 2026-11-26). Everything is written by now.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
