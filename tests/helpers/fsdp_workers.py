"""Loops run on every rank by tests/train/test_fsdp2.py (importable by the launched processes): one training
function, the same code under Loop(strategy="ddp") and Loop(strategy="fsdp2"), in float64 on CPU."""

from __future__ import annotations

import json
import threading
import time
from contextlib import contextmanager
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import TensorDataset

import ddpkit
from ddpkit.models import ConvNet

GLOBAL_BATCH = 12  # whole at world 1, 2 and 3: each rank's batch is 12 / world, in two micro-batches
STEPS = 20  # two epochs of 10 steps


class Block(nn.Module):
    def __init__(self, d: int):
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.attn = nn.MultiheadAttention(d, 4, batch_first=True)
        self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))

    def forward(self, x):
        h = self.ln1(x)
        mask = torch.triu(torch.ones(x.shape[1], x.shape[1], dtype=torch.bool), 1)  # causal
        x = x + self.attn(h, h, h, attn_mask=mask, need_weights=False)[0]
        return x + self.mlp(self.ln2(x))


class SmallGPT(nn.Module):
    """A GPT of two blocks (token and position embeddings, causal attention, an MLP, a final LayerNorm)."""

    def __init__(self, vocab: int = 16, d: int = 32, block: int = 8):
        super().__init__()
        self.emb, self.pos = nn.Embedding(vocab, d), nn.Embedding(block, d)
        self.blocks = nn.ModuleList([Block(d), Block(d)])
        self.ln, self.head = nn.LayerNorm(d), nn.Linear(d, vocab)

    def forward(self, idx):
        x = self.emb(idx) + self.pos(torch.arange(idx.shape[1]))
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln(x))


def data(kind: str, dtype: torch.dtype) -> tuple[TensorDataset, TensorDataset]:
    gen = torch.Generator().manual_seed(1)
    n = GLOBAL_BATCH * STEPS // 2  # one epoch: STEPS / 2 global batches
    if kind == "gpt":
        tokens = torch.randint(16, (n + 7, 9), generator=gen)
        return TensorDataset(tokens[:n, :8], tokens[:n, 1:]), TensorDataset(tokens[n:, :8], tokens[n:, 1:])
    x = torch.randn(n + 7, 1, 12, 12, generator=gen, dtype=torch.float64).to(dtype)
    y = torch.randint(10, (n + 7,), generator=gen)
    return TensorDataset(x[:n], y[:n]), TensorDataset(x[n:], y[n:])


def build(kind: str, dtype: torch.dtype) -> nn.Module:
    torch.manual_seed(0)
    return (SmallGPT() if kind == "gpt" else ConvNet(1, 12, 12, 10)).to(dtype)


def loss_of(kind: str, model: nn.Module, x, y) -> torch.Tensor:
    out = model(x)
    return F.cross_entropy(out.reshape(-1, out.shape[-1]), y.reshape(-1))


def local_bytes(model: nn.Module, opt: torch.optim.Optimizer) -> int:
    """What this rank holds of the parameters, their gradients and the optimizer state (a DTensor: its shard)."""
    local = lambda t: getattr(t, "_local_tensor", t)  # noqa: E731
    size = lambda t: local(t).numel() * local(t).element_size()  # noqa: E731
    total = sum(size(p) + (size(p.grad) if p.grad is not None else 0) for p in model.parameters())
    return total + sum(size(v) for s in opt.state.values() for v in s.values() if torch.is_tensor(v) and v.dim())


def train(
    _ctx,
    run_dir: str,
    kind: str,
    strategy: str,
    stop_at: int | None = None,
    amp: str = "off",
    reverse: bool = False,
    save_every: int = 0,
) -> dict:
    """STEPS AdamW steps with two micro-batches each (the first under no_sync), clipping at norm 0.5, an
    evaluation and best.pt at each epoch's end; ``stop_at``: a stop (snapshot, then Stopped) after that step;
    ``reverse``: each micro-batch's samples in reverse order; ``save_every``: a snapshot every that many
    steps. Returns the whole weights, the evaluations, and
    this rank's bytes (measured before the last zero_grad)."""
    dtype = torch.float64 if amp == "off" else torch.float32  # autocast casts float32 only
    train_set, val_set = data(kind, dtype)
    with ddpkit.Loop(run_dir, log_every=1, strategy=strategy, amp=amp, save_every_steps=save_every) as loop:
        model = loop.wrap(build(kind, dtype), shard=(lambda m: isinstance(m, Block)) if strategy == "fsdp2" else None)
        opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.1)
        loader = loop.data(train_set, batch_size=GLOBAL_BATCH // loop.world_size, drop_last=True)
        loop.resume(model=model, optimizer=opt)
        evals, held = [], 0
        for _ in loop.epochs(2):
            for x, y in loader:
                half = len(x) // 2
                if reverse:  # each micro-batch's samples in reverse: the same sums in another order (a noise run)
                    x, y = (torch.cat([t[:half].flip(0), t[half:].flip(0)]) for t in (x, y))
                with loop.no_sync(model):
                    with loop.autocast():
                        loss = loss_of(kind, model, x[:half], y[:half]) / 2
                    loss.backward()
                with loop.autocast():
                    loss = loss_of(kind, model, x[half:], y[half:]) / 2
                loss.backward()
                loop.clip_grad_norm_(model, 0.5)
                opt.step()
                held = local_bytes(model, opt)
                opt.zero_grad(set_to_none=True)
                loop.log(loss=loss.detach() * 2)
                if stop_at is not None and loop.state.step + 1 == stop_at:
                    loop.session.signal.received = "SIGTERM"  # what the handler records on a real signal
                loop.step()
            result = loop.evaluate(model, val_set, lambda m, b: {"loss": loss_of(kind, m, *b)}, batch_size=2)
            evals.append(result["loss"])
            loop.best("val_loss", result["loss"])
        weights = loop.strategy.model_state(model)  # every rank: gathered to rank 0 under FSDP2
        return {"weights": {k: v.clone() for k, v in weights.items()}, "evals": evals, "bytes": held}


def two_models(_ctx, run_dir: str, strategy: str, reverse: bool = False, stop_at: int | None = None) -> dict:
    """A GAN's shape: two models, each with its own optimizer, trained in turn on each step (an encoder
    regressing a target, and a critic scoring the encoder's detached output), in float64. Returns both
    models' whole weights under one dict; ``stop_at``: a stop after that step."""
    gen = torch.Generator().manual_seed(2)
    x, y = (
        torch.randn(96, 8, generator=gen, dtype=torch.float64),
        torch.randn(96, 4, generator=gen, dtype=torch.float64),
    )
    with ddpkit.Loop(run_dir, log_every=1, strategy=strategy) as loop:
        torch.manual_seed(0)
        enc = loop.wrap(nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 4)).double())
        critic = loop.wrap(nn.Sequential(nn.Linear(4, 16), nn.Tanh(), nn.Linear(16, 1)).double())
        opt_e = torch.optim.Adam(enc.parameters(), lr=1e-2)
        opt_c = torch.optim.SGD(critic.parameters(), lr=1e-2, momentum=0.9)
        loader = loop.data(TensorDataset(x, y), batch_size=12 // loop.world_size, drop_last=True)
        loop.resume(enc=enc, critic=critic, opt_e=opt_e, opt_c=opt_c)
        for _ in loop.epochs(2):
            for xb, yb in loader:
                if reverse:
                    xb, yb = xb.flip(0), yb.flip(0)
                out = enc(xb)
                F.mse_loss(out, yb).backward()
                opt_e.step()
                opt_e.zero_grad()
                critic(out.detach()).pow(2).mean().backward()
                opt_c.step()
                opt_c.zero_grad()
                if stop_at is not None and loop.state.step + 1 == stop_at:
                    loop.session.signal.received = "SIGTERM"
                loop.step()
        states = {"enc": loop.strategy.model_state(enc), "critic": loop.strategy.model_state(critic)}
        return {"weights": {f"{m}.{k}": v.clone() for m, sd in states.items() for k, v in sd.items()}}


class WithUnused(nn.Module):
    """A model with a head its loss never reaches (no gradient, so no optimizer state)."""

    def __init__(self):
        super().__init__()
        self.used, self.unused = nn.Linear(8, 4), nn.Linear(8, 4)

    def forward(self, x):
        return self.used(x)


def unused_and_late(_ctx, run_dir: str, strategy: str, stop_at: int | None = None) -> dict:
    """A parameter that never gets a gradient, and a second model whose optimizer takes its first step at
    step 6: a snapshot before then holds neither's state, and a resume must not make any up (torch's
    state-dict API steps an optimizer with no state at lr 0, which sets Adam's step count to 1)."""
    gen = torch.Generator().manual_seed(3)
    x, y = (
        torch.randn(96, 8, generator=gen, dtype=torch.float64),
        torch.randn(96, 4, generator=gen, dtype=torch.float64),
    )
    with ddpkit.Loop(run_dir, log_every=1, strategy=strategy) as loop:
        torch.manual_seed(0)
        model = loop.wrap(WithUnused().double(), find_unused_parameters=strategy == "ddp")  # DDP must be told
        late = loop.wrap(nn.Linear(4, 4).double())
        opt, opt_late = torch.optim.Adam(model.parameters(), lr=1e-2), torch.optim.Adam(late.parameters(), lr=1e-2)
        loader = loop.data(TensorDataset(x, y), batch_size=12 // loop.world_size, drop_last=True)
        loop.resume(model=model, late=late, opt=opt, opt_late=opt_late)
        for _ in loop.epochs(2):
            for xb, yb in loader:
                out = model(xb)
                F.mse_loss(out, yb).backward()
                opt.step()
                opt.zero_grad()
                if loop.state.step >= 6:
                    F.mse_loss(late(out.detach()), yb).backward()
                    opt_late.step()
                    opt_late.zero_grad()
                if stop_at is not None and loop.state.step + 1 == stop_at:
                    loop.session.signal.received = "SIGTERM"
                loop.step()
        states = {"model": loop.strategy.model_state(model), "late": loop.strategy.model_state(late)}
        return {"weights": {f"{m}.{k}": v.clone() for m, sd in states.items() for k, v in sd.items()}}


def first_weights(_ctx, run_dir: str, strategy: str) -> dict:
    """Each rank seeds apart before building the model (as an unseeded script does): after wrap(), the
    model every rank trains is rank 0's, as DDP's constructor makes it."""
    with ddpkit.Loop(run_dir, strategy=strategy) as loop:
        torch.manual_seed(100 + loop.rank)
        model = loop.wrap(SmallGPT().double())
        return {"weights": {k: v.clone() for k, v in loop.strategy.model_state(model).items()}}


@contextmanager
def before_shard_writes(hook):
    """``hook()`` called before each of this process's DCP file writes (it may wait, record or raise)."""
    from torch.distributed.checkpoint.filesystem import _FileSystemWriter

    original = _FileSystemWriter.write_data

    def patched(self, plan, planner):
        hook()
        return original(self, plan, planner)

    _FileSystemWriter.write_data = patched
    try:
        yield
    finally:
        _FileSystemWriter.write_data = original


def full_disk_on_rank_1(ctx, after_s: float = 0.0):
    """A hook for :func:`before_shard_writes`: rank 1's writes fail (a full disk, on its node alone)."""

    def hook():
        if ctx.rank == 1:
            time.sleep(after_s)
            raise OSError(28, "No space left on device")

    return hook


def slow_shard_writes(ctx, run_dir: str, stop_at: int, delay_s: float) -> dict:
    """:func:`train` of the GPT under FSDP2 with a snapshot every 2 steps, each rank's shard writes slowed by
    ``delay_s`` before they start (DCP's file writer), so that the steps after a snapshot change the weights in
    place while it is written; the name of the thread each write ran on is kept in the run dir."""
    names = []

    def slow():
        names.append(threading.current_thread().name)
        time.sleep(delay_s)

    try:
        with before_shard_writes(slow):
            return train(ctx, run_dir, "gpt", "fsdp2", stop_at=stop_at, save_every=2)
    finally:
        Path(run_dir, f"writer-threads-{ctx.rank}.json").write_text(json.dumps(names))


def failing_shard_write(ctx, run_dir: str) -> dict:
    """:func:`train` of the GPT under FSDP2 with a snapshot every 2 steps, rank 1's shard writes failing after a
    second, so that the next snapshot is due before the failure is known."""
    with before_shard_writes(full_disk_on_rank_1(ctx, after_s=1.0)):
        return train(ctx, run_dir, "gpt", "fsdp2", save_every=2)


def counting_crcs(ctx, run_dir: str, *args) -> dict:
    """``train(ctx, run_dir, *args)``, the shard files this rank reads for their CRC32 (folder/name) kept in the
    run dir, for each rank."""
    from ddpkit.run import shards

    read, original = [], shards.file_crc

    def counting(path):
        read.append(f"{path.parent.name}/{path.name}")
        return original(path)

    shards.file_crc = counting
    try:
        return train(ctx, run_dir, *args)
    finally:
        shards.file_crc = original
        Path(run_dir, f"crcs-read-{ctx.rank}.json").write_text(json.dumps(read))


def failing_shards_in_the_step(ctx, folder: str) -> None:
    """A sharded state written in the step (``run/shards.py``'s ``save_shards``: DCP's own save) while rank 1's
    file writes fail."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from ddpkit.run import shards

    model = nn.Linear(8, 8).double()
    fully_shard(model, mesh=init_device_mesh("cpu", (ctx.world_size,)))
    with before_shard_writes(full_disk_on_rank_1(ctx)):
        shards.save_shards({"s0": get_model_state_dict(model)}, Path(folder), ctx)
