"""DDP against FSDP2 on the same ``ddpkit.Loop``, interleaved in the same processes: each rank's bytes of
parameters, gradients and optimizer state, and samples/s.

    python benchmarks/strategies.py [--steps 40] [--rounds 3] [--width 512] [--blocks 4] [--nproc 2]
                                    [--device cpu] [--out strategies.json]

A GPT of ``--blocks`` transformer blocks of ``--width`` (vocabulary 512, context 64: 12.9M parameters at
the defaults), AdamW, 8 sequences per rank per step, float32, on random tokens. Each round runs the DDP
loop and the FSDP2 loop (each block a unit of its own), alternating which goes first; the first 5 steps
of each are warm-up and not timed. The bytes are counted from the tensors each rank holds after an
optimizer step (a DTensor: its shard), not from peak memory, which on a CPU is the allocator's. Run it on
a quiet machine: nothing else may use the cores while it runs.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time

import torch
import torch.nn.functional as F
from torch import nn

import ddpkit

VOCAB, CONTEXT, BATCH, WARMUP = 512, 64, 8, 5


class Block(nn.Module):
    def __init__(self, d: int):
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.attn = nn.MultiheadAttention(d, 8, batch_first=True)
        self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))

    def forward(self, x):
        h = self.ln1(x)
        mask = torch.triu(torch.ones(x.shape[1], x.shape[1], dtype=torch.bool, device=x.device), 1)
        x = x + self.attn(h, h, h, attn_mask=mask, need_weights=False)[0]
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    def __init__(self, d: int, blocks: int):
        super().__init__()
        self.emb, self.pos = nn.Embedding(VOCAB, d), nn.Embedding(CONTEXT, d)
        self.blocks = nn.ModuleList([Block(d) for _ in range(blocks)])
        self.ln, self.head = nn.LayerNorm(d), nn.Linear(d, VOCAB)

    def forward(self, idx):
        x = self.emb(idx) + self.pos(torch.arange(idx.shape[1], device=idx.device))
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln(x))


def held_bytes(model: nn.Module, opt: torch.optim.Optimizer) -> dict:
    local = lambda t: t.to_local() if hasattr(t, "to_local") else t  # noqa: E731 - a DTensor's shard
    size = lambda t: local(t).numel() * local(t).element_size()  # noqa: E731
    return {
        "params": sum(size(p) for p in model.parameters()),
        "grads": sum(size(p.grad) for p in model.parameters() if p.grad is not None),
        "optimizer": sum(size(v) for s in opt.state.values() for v in s.values() if torch.is_tensor(v) and v.dim()),
    }


def one(ctx, strategy: str, steps: int, width: int, blocks: int) -> dict:
    with ddpkit.Loop(tempfile.mkdtemp(prefix="ddpkit-bench-"), strategy=strategy, log_every=0) as loop:
        torch.manual_seed(0)
        model = loop.wrap(
            GPT(width, blocks), **({"shard": lambda m: isinstance(m, Block)} if strategy == "fsdp2" else {})
        )
        opt = torch.optim.AdamW(model.parameters(), lr=3e-4)
        loop.resume(model=model, optimizer=opt)
        gen = torch.Generator().manual_seed(loop.rank)
        t0, held = None, {}
        for step in loop.steps(WARMUP + steps):
            if step == WARMUP:
                torch.cuda.synchronize() if loop.device.type == "cuda" else None
                t0 = time.perf_counter()
            tokens = torch.randint(VOCAB, (BATCH, CONTEXT + 1), generator=gen).to(loop.device)
            logits = model(tokens[:, :-1])
            loss = F.cross_entropy(logits.reshape(-1, VOCAB), tokens[:, 1:].reshape(-1))
            loss.backward()
            opt.step()
            if step == WARMUP:
                held = held_bytes(model, opt)  # after a step: the optimizer state exists, the gradients too
            opt.zero_grad(set_to_none=True)
        torch.cuda.synchronize() if loop.device.type == "cuda" else None
        elapsed = time.perf_counter() - t0
        return {"samples_per_s": steps * BATCH * loop.world_size / elapsed, **held}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--width", type=int, default=512)
    ap.add_argument("--blocks", type=int, default=4)
    ap.add_argument("--nproc", type=int, default=2)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--out", default="")
    args = ap.parse_args()
    rounds = []
    for r in range(args.rounds):
        order = ("ddp", "fsdp2") if r % 2 == 0 else ("fsdp2", "ddp")
        got = {}
        for strategy in order:
            got[strategy] = ddpkit.launch(
                one, strategy, args.steps, args.width, args.blocks, nproc=args.nproc, device=args.device
            )
        rounds.append(got)
        d, f = got["ddp"], got["fsdp2"]
        print(
            f"round {r}: samples/s ddp {d['samples_per_s']:.1f} fsdp2 {f['samples_per_s']:.1f}; rank 0 MiB "
            f"(params+grads+optimizer) ddp {sum(d[k] for k in ('params', 'grads', 'optimizer')) / 2**20:.1f} "
            f"fsdp2 {sum(f[k] for k in ('params', 'grads', 'optimizer')) / 2**20:.1f}"
        )
    held = {s: sum(rounds[0][s][k] for k in ("params", "grads", "optimizer")) for s in ("ddp", "fsdp2")}
    speed = statistics.median(r["fsdp2"]["samples_per_s"] / r["ddp"]["samples_per_s"] for r in rounds)
    print(
        f"rank 0 holds {held['fsdp2'] / held['ddp']:.3f} of DDP's bytes under FSDP2; samples/s ratio "
        f"fsdp2/ddp (median of {args.rounds}): {speed:.3f}"
    )
    if args.out:
        with open(args.out, "w") as f:
            json.dump(
                {"args": vars(args), "rounds": rounds, "bytes_ratio": held["fsdp2"] / held["ddp"], "speed": speed}, f
            )


if __name__ == "__main__":
    main()
