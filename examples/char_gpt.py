"""A minGPT-style character transformer on a text that ships with Python, on 2 processes.

    python examples/char_gpt.py              # bf16 autocast where the hardware has it
    python examples/char_gpt.py --amp none   # float32 everywhere

Sequence models under ddpkit: batches are (tokens, targets), logits are [B, T, V], and
the loss is the user's own (``loss_fn``), as is a per-token metric reported exactly:
each batch gives (sum of token losses, token count) and ddpkit adds both over steps and
ranks. Gradient accumulation (2 micro-batches per step, DDP's all-reduce only on the
second), parameter groups through an optimizer factory, and bf16 autocast where the
hardware does bf16 natively. At the end the trained model (fit() leaves it in ``model``)
writes some text, and the test loss is printed beside the unigram baseline.
"""

from __future__ import annotations

import argparse
import math

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import Dataset

from ddpkit import TrainConfig, Trainer
from ddpkit.recipes import native_cpu_bf16

CONTEXT = 64  # characters of context per sample


def corpus() -> str:
    """pydoc's help topics: ~460 KB of English prose and code that every CPython carries."""
    from pydoc_data.topics import topics

    return "\n".join(topics[k] for k in sorted(topics))


class Chunks(Dataset):
    """Non-overlapping windows of CONTEXT + 1 characters: (tokens, next tokens)."""

    def __init__(self, ids: torch.Tensor):
        self.ids = ids

    def __len__(self):
        return (len(self.ids) - 1) // CONTEXT

    def __getitem__(self, i):
        chunk = self.ids[i * CONTEXT : (i + 1) * CONTEXT + 1]
        return chunk[:-1], chunk[1:]


class Block(nn.Module):
    def __init__(self, dim: int, heads: int):
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.qkv, self.proj = nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, t, 3, self.heads, d // self.heads).unbind(2)
        y = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True)
        x = x + self.proj(y.transpose(1, 2).reshape(b, t, d))
        return x + self.mlp(self.ln2(x))


class CharGPT(nn.Module):
    def __init__(self, vocab: int, dim: int = 96, heads: int = 4, layers: int = 2):
        super().__init__()
        self.tok, self.pos = nn.Embedding(vocab, dim), nn.Embedding(CONTEXT, dim)
        self.blocks = nn.Sequential(*[Block(dim, heads) for _ in range(layers)])
        self.ln, self.head = nn.LayerNorm(dim), nn.Linear(dim, vocab)

    def forward(self, tokens):  # [B, T] -> logits [B, T, V]
        x = self.tok(tokens) + self.pos(torch.arange(tokens.shape[1], device=tokens.device))
        return self.head(self.ln(self.blocks(x)))


def next_char_loss(model, batch):
    """The step contract: mean loss over every token of the batch, and per-token losses for the metric."""
    tokens, targets = batch
    logits = model(tokens)
    losses = F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), targets.reshape(-1), reduction="none")
    return losses.mean(), (losses, logits)


def per_token_loss(outputs, batch):
    losses, _ = outputs
    return losses.sum(), losses.numel()  # nats summed, tokens counted: exact across ranks


def next_char_accuracy(outputs, batch):
    _, logits = outputs
    return (logits.argmax(-1) == batch[1]).sum(), batch[1].numel()


def adamw_with_groups(model):
    """minGPT's parameter groups: weight decay on matrices only, none on biases, norms and embeddings."""
    decay = [p for n, p in model.named_parameters() if p.dim() == 2 and "tok" not in n and "pos" not in n]
    rest = [p for n, p in model.named_parameters() if not (p.dim() == 2 and "tok" not in n and "pos" not in n)]
    return torch.optim.AdamW(
        [{"params": decay, "weight_decay": 0.1}, {"params": rest, "weight_decay": 0.0}], lr=3e-3, betas=(0.9, 0.95)
    )


def native_bf16() -> bool:
    """bf16 autocast pays off on CUDA and on CPUs with bf16 instructions; elsewhere it is emulated (slower)."""
    return torch.cuda.is_available() or native_cpu_bf16("cpu")


@torch.no_grad()
def sample(model, stoi: dict, itos: list, prompt: str, n: int = 200, seed: int = 0) -> str:
    gen = torch.Generator().manual_seed(seed)
    ids = torch.tensor([[stoi[c] for c in prompt]])
    model.eval()
    for _ in range(n):
        logits = model(ids[:, -CONTEXT:])[0, -1] / 0.8  # temperature 0.8
        ids = torch.cat([ids, torch.multinomial(logits.softmax(-1), 1, generator=gen)[None]], dim=1)
    return "".join(itos[i] for i in ids[0].tolist())


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--amp",
        choices=("auto", "bf16", "none"),
        default="auto",
        help="bf16 autocast; auto: where the hardware does bf16 natively",
    )
    args = parser.parse_args(argv)
    text = corpus()
    itos = sorted(set(text))
    stoi = {c: i for i, c in enumerate(itos)}
    ids = torch.tensor([stoi[c] for c in text])
    split = int(0.9 * len(ids))
    train, test = Chunks(ids[:split]), Chunks(ids[split:])

    counts = torch.bincount(ids[:split], minlength=len(itos)).double() + 1  # unigram model, add-one
    unigram = -(counts / counts.sum()).log()[ids[split:]].mean().item()  # its loss on the test text

    amp = args.amp if args.amp != "auto" else ("bf16" if native_bf16() else "none")
    if args.amp == "auto" and amp == "none":
        print("bf16 autocast off: this CPU has no native bf16 (AVX512-BF16 or AMX), where it runs ~7x slower")
    torch.manual_seed(0)
    model = CharGPT(len(itos))
    config = TrainConfig(
        nproc="2",
        device="cpu" if not torch.cuda.is_available() else "auto",
        epochs=1,
        batch_size=64,
        grad_accum=2,
        amp=amp,
        schedule="cosine",
        warmup_frac=0.1,
        clip_grad_norm=1.0,
        progress=False,
        log_every=25,
        run_dir="runs/char-gpt",
    )
    result = Trainer(
        config,
        model=model,
        train_data=train,
        test_data=test,
        loss_fn=next_char_loss,
        metrics={"loss": per_token_loss, "accuracy": next_char_accuracy},
        optimizer=adamw_with_groups,
    ).fit()
    print(
        f"test loss {result['test_loss']:.3f} nats/char ({result['test_loss'] / math.log(2):.2f} bits), "
        f"unigram baseline {unigram:.3f} nats/char; next-char accuracy {result['test_accuracy']:.3f} "
        f"over {result['test_samples'] * CONTEXT} test characters"
    )
    print("sample:", repr(sample(model, stoi, itos, "The ")))
    return {"test_loss": result["test_loss"], "unigram": unigram, "test_accuracy": result["test_accuracy"]}


if __name__ == "__main__":  # workers are spawned and import this file
    main()
