"""A character-level GPT trained with plain DDP, as a user writes it for torchrun (nanoGPT's train.py in
small: ~30 k parameters, so it trains in seconds on CPU). tests/system/test_gpt_port.py compares it with
its port onto ``ddpkit.Loop`` (gpt_ported.py) line by line and weight by weight.

    TOKENS=tokens.bin ddpkit run --nproc 2 gpt_ported.py RUN_DIR OUT.pt   # or, as plain DDP runs it:
    TOKENS=tokens.bin torchrun --standalone --nproc-per-node 2 gpt_ported.py RUN_DIR OUT.pt

TOKENS is a uint16 token file (ids < 32); ITERS the iteration count (60). Rank 0 writes its best checkpoint
to RUN_DIR/best.pt and {"model": state_dict, "best_val": float} to OUT.pt at the end. As nanoGPT does, each
rank fetches its next batch while the model computes (``X, Y = get_batch("train")`` after the forward), so
the batch a step trains on was drawn in the step before. Test hook: DIE_AT=i with SIG=SIGTERM or SIGKILL:
rank 0 sends itself that signal at the end of iteration i.
"""

import math
import os
import signal
import sys
from contextlib import nullcontext

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

import ddpkit

# -----------------------------------------------------------------------------
out_dir = sys.argv[1]
vocab_size, block_size, n_layer, n_head, n_embd, dropout = 32, 32, 2, 4, 32, 0.1
batch_size = 8  # windows per micro-step, per rank
gradient_accumulation_steps = 2  # micro-steps per optimizer step
max_iters = int(os.environ.get("ITERS", 60))
eval_interval, eval_iters = 20, 4
learning_rate, min_lr, warmup_iters = 1e-2, 1e-3, 10  # lr rises to its peak over warmup_iters, then cosine
device = "cpu"
# -----------------------------------------------------------------------------


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.ln_1, self.ln_2 = nn.LayerNorm(n_embd), nn.LayerNorm(n_embd)
        self.c_attn, self.c_proj = nn.Linear(n_embd, 3 * n_embd), nn.Linear(n_embd, n_embd)
        self.mlp = nn.Sequential(nn.Linear(n_embd, 4 * n_embd), nn.GELU(), nn.Linear(4 * n_embd, n_embd))
        self.drop = nn.Dropout(dropout)

    def attn(self, x):
        B, T, C = x.size()
        q, k, v = (t.view(B, T, n_head, C // n_head).transpose(1, 2) for t in self.c_attn(x).split(n_embd, dim=2))
        p = dropout if self.training else 0.0
        y = F.scaled_dot_product_attention(q, k, v, dropout_p=p, is_causal=True)
        return self.drop(self.c_proj(y.transpose(1, 2).contiguous().view(B, T, C)))

    def forward(self, x):
        x = x + self.attn(self.ln_1(x))
        return x + self.drop(self.mlp(self.ln_2(x)))


class GPT(nn.Module):
    def __init__(self):
        super().__init__()
        self.wte, self.wpe = nn.Embedding(vocab_size, n_embd), nn.Embedding(block_size, n_embd)
        self.drop = nn.Dropout(dropout)
        self.blocks = nn.ModuleList(Block() for _ in range(n_layer))
        self.ln_f = nn.LayerNorm(n_embd)
        self.lm_head = nn.Linear(n_embd, vocab_size, bias=False)

    def forward(self, idx, targets):
        pos = torch.arange(idx.size(1), device=idx.device)
        x = self.drop(self.wte(idx) + self.wpe(pos))
        for block in self.blocks:
            x = block(x)
        logits = self.lm_head(self.ln_f(x))
        return logits, F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1))


def get_batch(split):
    # a fresh memmap each call, as nanoGPT does, so no pages are held between batches
    data = np.memmap(os.environ["TOKENS"], dtype=np.uint16, mode="r")
    n = len(data) * 9 // 10
    data = data[:n] if split == "train" else data[n:]
    ix = torch.randint(len(data) - block_size, (batch_size,))
    x = torch.stack([torch.from_numpy(data[i : i + block_size].astype(np.int64)) for i in ix])
    y = torch.stack([torch.from_numpy(data[i + 1 : i + 1 + block_size].astype(np.int64)) for i in ix])
    return x.to(device), y.to(device)


@torch.no_grad()
def estimate_loss(model):
    model.eval()
    losses = torch.zeros(eval_iters)
    for k in range(eval_iters):
        _, loss = model(*get_batch("val"))
        losses[k] = loss
    model.train()
    return losses.mean()


def get_lr(it):
    if it < warmup_iters:
        return learning_rate * (it + 1) / warmup_iters
    ratio = (it - warmup_iters) / (max_iters - warmup_iters)
    return min_lr + 0.5 * (1.0 + math.cos(math.pi * ratio)) * (learning_rate - min_lr)


loop = ddpkit.Loop.start(out_dir, device="cpu", log_every=10, save_every_steps=20)  # closed at exit
rank, world_size = dist.get_rank(), dist.get_world_size()
torch.manual_seed(1337 + rank)  # each rank draws its own windows; DDP broadcasts rank 0's weights
os.makedirs(out_dir, exist_ok=True)

model = loop.wrap(GPT().to(device))
optimizer = torch.optim.AdamW(model.parameters(), lr=learning_rate, betas=(0.9, 0.95), weight_decay=0.1)
X, Y = get_batch("train")  # fetch the very first batch
state = loop.resume(model=model, optimizer=optimizer, X=X, Y=Y)  # a rerun carries on from the newest snapshot
X, Y = state["X"], state["Y"]  # each rank's own next batch, as the snapshot kept it

for it in loop.steps(max_iters):
    lr = get_lr(it)
    for param_group in optimizer.param_groups:
        param_group["lr"] = lr

    if it % eval_interval == 0:
        val = estimate_loss(model)
        dist.all_reduce(val)  # each rank's estimate, then their mean
        val = (val / world_size).item()
        loop.best("val", val)  # rank 0 writes RUN_DIR/best.pt when val is the lowest so far

    for micro_step in range(gradient_accumulation_steps):
        # the gradients' all-reduce waits for the last micro-step
        with model.no_sync() if micro_step < gradient_accumulation_steps - 1 else nullcontext():
            _, loss = model(X, Y)
            X, Y = get_batch("train")  # the next batch, fetched while the model computes, as nanoGPT does
            (loss / gradient_accumulation_steps).backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    state.update(X=X, Y=Y)  # what a snapshot at this step saves, rank by rank
    loop.log(loss=loss.detach())

    if it % 10 == 0 and rank == 0:
        print(f"iter {it}: loss {loss.item():.4f}, lr {lr:.2e}")
    if os.environ.get("DIE_AT") == str(it) and rank == 0:  # test hook
        os.kill(os.getpid(), getattr(signal, os.environ.get("SIG", "SIGKILL")))

if rank == 0:
    torch.save({"model": model.module.state_dict(), "best_val": loop.best_so_far["val"]["value"]}, sys.argv[2])
