"""A user's own models, datasets, losses and metrics, importable by spawned workers (tests only)."""

from __future__ import annotations

import json
import os
import random
import signal
import time

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import Dataset, TensorDataset


# ---------------------------------------------------------------- regression
class RegressionMLP(nn.Module):
    def __init__(self, features: int = 4, hidden: int = 16, dtype=torch.float32):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(features, hidden, dtype=dtype), nn.Tanh(), nn.Linear(hidden, 1, dtype=dtype))

    def forward(self, x):
        return self.net(x)


def regression_data(n: int, seed: int, dtype=torch.float32, flat_targets: bool = False) -> TensorDataset:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 4, generator=gen, dtype=dtype)
    y = (x @ torch.tensor([[1.0], [-2.0], [0.5], [3.0]], dtype=dtype)) + 0.1 * torch.randn(
        n, 1, generator=gen, dtype=dtype
    )
    return TensorDataset(x, y[:, 0] if flat_targets else y)


class PlainData(Dataset):
    """A map-style dataset (not a TensorDataset) whose samples are the same on every read."""

    def __init__(self, n: int, seed: int):
        self.x, self.y = regression_data(n, seed).tensors

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        return self.x[i], self.y[i]


class NoisyData(Dataset):
    """Samples drawn afresh on every read, as a random augmentation gives."""

    def __init__(self, n: int):
        self.n = n

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        return torch.randn(4), torch.randn(1)


def mse(model, batch):
    x, y = batch
    out = model(x)
    return F.mse_loss(out, y), out


def mae(out, batch):
    return (out - batch[1]).abs().sum(), batch[1].numel()


# ---------------------------------------------------------------- a tiny character model
VOCAB, LENGTH = 11, 8


class CharModel(nn.Module):
    """Embedding + linear: logits [B, T, V] for next-token prediction."""

    def __init__(self, dtype=torch.float32):
        super().__init__()
        self.emb = nn.Embedding(VOCAB, 16, dtype=dtype)
        self.out = nn.Linear(16, VOCAB, dtype=dtype)

    def forward(self, tokens):
        return self.out(self.emb(tokens))


class Sequences(Dataset):
    """Token sequences with a mask of varying valid length, so ranks see different token counts."""

    def __init__(self, n: int, seed: int, skewed: bool = False):
        gen = torch.Generator().manual_seed(seed)
        self.tokens = torch.randint(0, VOCAB, (n, LENGTH + 1), generator=gen)
        self.lengths = torch.randint(1, LENGTH + 1, (n,), generator=gen)
        if skewed:  # every 6th sequence is whole, the rest hold one token: rank 0 gets far more tokens
            self.lengths = torch.where(torch.arange(n) % 6 == 0, LENGTH, 1)

    def __len__(self):
        return len(self.tokens)

    def __getitem__(self, i):
        mask = torch.arange(LENGTH) < self.lengths[i]
        return self.tokens[i, :-1], self.tokens[i, 1:], mask


def token_loss(model, batch):
    tokens, targets, mask = batch
    logits = model(tokens)
    losses = F.cross_entropy(logits.reshape(-1, VOCAB), targets.reshape(-1), reduction="none")
    return (losses * mask.reshape(-1)).sum() / mask.sum(), losses


def per_token_loss(losses, batch):
    mask = batch[2].reshape(-1)
    return (losses * mask).sum(), mask.sum()


def first_token_share(outputs, batch):
    """A per-sample metric: the share of sequences whose first token counts (all of them)."""
    return batch[2][:, 0].sum(), len(batch[2])


# ---------------------------------------------------------------- dict batches, model's own loss
class DictData(Dataset):
    def __init__(self, n: int, seed: int):
        self.inner = regression_data(n, seed)

    def __len__(self):
        return len(self.inner)

    def __getitem__(self, i):
        x, y = self.inner[i]
        return {"features": x, "labels": y}


class OwnLossModel(nn.Module):
    """Returns {"loss": ..., "prediction": ...} when given labels, as Hugging Face models do."""

    def __init__(self):
        super().__init__()
        self.mlp = RegressionMLP()

    def forward(self, features, labels=None):
        prediction = self.mlp(features)
        return {"loss": F.mse_loss(prediction, labels), "prediction": prediction}


def dict_mae(out, batch):
    return (out["prediction"] - batch["labels"]).abs().sum(), batch["labels"].numel()


# ---------------------------------------------------------------- ddpkit.launch
def all_reduce_rank(ctx, scale: int) -> dict:
    """A user's own loop, as seed 004 writes one: every rank contributes, rank 0 returns."""
    t = torch.tensor([float(ctx.rank + 1)])
    ctx.all_reduce(t)
    return {"sum": t.item() * scale, "world": ctx.world_size, "device": str(ctx.device)}


# ---------------------------------------------------------------- a ConvNet with one more buffer
class TaggedConvNet(nn.Module):
    """The seed ConvNet plus a buffer that is not BatchNorm's: DDP must keep broadcasting buffers."""

    def __init__(self):
        super().__init__()
        from ddpkit.models import ConvNet

        self.net = ConvNet()
        self.register_buffer("tag", torch.zeros(1))

    def forward(self, x):
        return self.net(x)


# ---------------------------------------------------------------- models ddpkit check must reject
class RankNoiseMLP(RegressionMLP):
    """Adds noise that depends on the rank: N processes cannot compute what 1 does."""

    def forward(self, x):
        import torch.distributed as dist

        rank = dist.get_rank() if dist.is_initialized() else 0
        return super().forward(x) + 1e-3 * rank


class BatchNormMLP(nn.Module):
    """BatchNorm on features whose scale differs per rank's share of the data."""

    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(4, 16), nn.BatchNorm1d(16), nn.Tanh(), nn.Linear(16, 1))

    def forward(self, x):
        return self.net(x)


def uneven_data(n: int) -> TensorDataset:
    """Sample i has scale 1 + 3 * (i % 2): with 2 ranks taking alternate indices of a shuffled order,
    each rank's batch statistics differ from the global batch's."""
    x, y = regression_data(n, 0).tensors
    scale = 1 + 3 * (torch.arange(n) % 2).float()[:, None]
    return TensorDataset(x * scale, y)


class ManyTensors(nn.Module):
    """500 Linear(2, 2) layers in a chain: 1,000 parameter tensors (test_real_models.py)."""

    def __init__(self, n: int = 500):
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(2, 2) for _ in range(n))
        self.head = nn.Linear(2, 3)

    def forward(self, x):
        for layer in self.layers:
            x = x + 0.01 * layer(x)
        return self.head(x)


class ListData(Dataset):
    """Samples held as a list of separate tensors (300 of them), not one stacked tensor."""

    def __init__(self, n: int = 300):
        gen = torch.Generator().manual_seed(5)
        self.items = [torch.randn(2, generator=gen) for _ in range(n)]

    def __len__(self):
        return len(self.items)

    def __getitem__(self, i):
        return self.items[i], int(self.items[i].sum() > 0)


class UnusedBranch(nn.Module):
    """A model with a head its forward never calls (an auxiliary head left from another task)."""

    def __init__(self):
        super().__init__()
        self.body = nn.Linear(2, 8)
        self.head = nn.Linear(8, 3)
        self.aux_head = nn.Linear(8, 5)  # never used

    def forward(self, x):
        return self.head(torch.relu(self.body(x)))


class DataDependentBranch(nn.Module):
    """A model whose second head joins the loss only for batches holding a flagged sample (feature 2 > 0):
    which parameters get a gradient depends on the batch."""

    def __init__(self):
        super().__init__()
        self.body = nn.Linear(3, 8)
        self.head = nn.Linear(8, 2)
        self.flagged_head = nn.Linear(8, 2)

    def forward(self, x):
        h = torch.relu(self.body(x))
        out = self.head(h)
        if bool((x[:, 2] > 0).any()):  # a host sync per step: fine for a test model
            out = out + self.flagged_head(h)
        return out


def flagged_first(n: int) -> TensorDataset:
    """``n`` samples of 3 features, only the first two flagged (feature 2 = 1): preflight's trial batch (the
    first two samples) uses every parameter, most training batches do not."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(n, 3, generator=gen)
    x[:, 2] = (torch.arange(n) < 2).float()
    return TensorDataset(x, (x[:, 0] > 0).long())


def tensor_count(ctx, tensors) -> int:
    """launch() with a list of tensors as its argument: how many arrived (test_real_models.py)."""
    return len(tensors)


# ---------------------------------------------------------------- real-model shapes (test_real_models.py)
class TinyTransformer(nn.Module):
    """Token classification with nn.TransformerEncoderLayer (nn.MultiheadAttention inside), mean-pooled."""

    def __init__(self, vocab: int = VOCAB, width: int = 16, classes: int = 3):
        super().__init__()
        self.emb = nn.Embedding(vocab, width)
        self.encoder = nn.TransformerEncoderLayer(width, nhead=2, dim_feedforward=32, dropout=0.0, batch_first=True)
        self.head = nn.Linear(width, classes)

    def forward(self, tokens):
        return self.head(self.encoder(self.emb(tokens)).mean(1))


def token_classes(n: int, seed: int) -> TensorDataset:
    """Fixed-length token sequences; the class is the first token mod 3."""
    gen = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, VOCAB, (n, LENGTH), generator=gen)
    return TensorDataset(tokens, tokens[:, 0] % 3)


class VarLength(Dataset):
    """Token sequences of 2 to 10 tokens, each with a class (its first token mod 3): padded by pad_collate."""

    def __init__(self, n: int, seed: int):
        gen = torch.Generator().manual_seed(seed)
        lengths = torch.randint(2, 11, (n,), generator=gen)
        self.items = [torch.randint(1, VOCAB, (int(k),), generator=gen) for k in lengths]

    def __len__(self):
        return len(self.items)

    def __getitem__(self, i):
        return self.items[i], int(self.items[i][0]) % 3


def pad_collate(samples):
    """(tokens [B, longest], mask [B, longest], labels [B]): 0 pads."""
    longest = max(len(t) for t, _ in samples)
    tokens = torch.zeros(len(samples), longest, dtype=torch.long)
    for row, (t, _) in enumerate(samples):
        tokens[row, : len(t)] = t
    return tokens, tokens != 0, torch.tensor([label for _, label in samples])


class MaskedMean(nn.Module):
    """Embedding averaged over the unpadded tokens, then a linear head."""

    def __init__(self, width: int = 16, classes: int = 3):
        super().__init__()
        self.emb = nn.Embedding(VOCAB, width)
        self.head = nn.Linear(width, classes)

    def forward(self, tokens, mask):
        m = mask.unsqueeze(-1).to(self.emb.weight.dtype)
        return self.head((self.emb(tokens) * m).sum(1) / m.sum(1))


def padded_loss(model, batch):
    tokens, mask, labels = batch
    logits = model(tokens, mask)
    return F.cross_entropy(logits, labels), logits


def padded_accuracy(logits, batch):
    return (logits.argmax(1) == batch[2]).sum(), len(batch[2])


# ---------------------------------------------------------------- random draws in __getitem__, a collate and a forward
class Draws(Dataset):
    """Sample i is [i, a torch draw, a numpy draw, a Python draw]: what each global generator gave its read."""

    def __init__(self, n: int):
        self.n = n

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        return torch.tensor([float(i), torch.rand(()).item(), np.random.rand(), random.random()], dtype=torch.float64)


def drawing_collate(samples):
    """The batch, and a draw of each generator made by the collate itself (as MixUp in a collate_fn draws)."""
    return torch.stack(samples), torch.tensor([torch.rand(()).item(), np.random.rand(), random.random()])


class Augmenting(Dataset):
    """Two-class samples read through a random window and noise from torch, numpy and Python's random."""

    def __init__(self, n: int, seed: int):
        gen = torch.Generator().manual_seed(seed)
        self.x = torch.randn(n, 8, generator=gen)
        self.y = (self.x[:, 2:6].sum(1) > 0).long()

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        start = random.randrange(5)  # a window of 4 of the 8 features
        noise = 0.1 * torch.randn(4) + 0.1 * torch.from_numpy(np.random.standard_normal(4)).float()
        return self.x[i, start : start + 4] + noise, self.y[i]


def augmenting_data(n: int = 96, seed: int = 0):
    return Augmenting(n, seed), Augmenting(n // 2, seed + 1)


class WindowClassifier(nn.Module):
    """A classifier of :class:`Augmenting`'s 4-feature windows with no draw of its own and nothing coupling a
    batch's samples (no BatchNorm, no dropout): what it computes does not depend on the world size."""

    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(4, 16), nn.Tanh(), nn.Linear(16, 2))

    def forward(self, x):
        return self.net(x)


def noisy_collate(samples):
    """(x, y) collated, with noise from torch's global generator added to x: a collate_fn that draws."""
    x, y = torch.utils.data.default_collate(samples)
    return x + 0.1 * torch.randn(x.shape, dtype=x.dtype), y


class DrawingMLP(nn.Module):
    """Dropout, and a numpy and a Python draw in the training forward: the rank's own streams.

    ``DDPKIT_TEST_FAULT="term@K"`` or ``"kill@K"`` in the environment: at its K-th training forward rank 1
    sends SIGTERM to its whole process group, as SLURM signals every process of a job step (start the job
    in a session of its own), or SIGKILL to itself (in the job's first attempt only, so a restart trains on).
    """

    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(4, 16), nn.ReLU(), nn.Dropout(0.2), nn.Linear(16, 2))
        self.calls = 0

    def forward(self, x):
        if self.training:
            x = x * (1 + 0.01 * random.random()) + 0.01 * torch.from_numpy(np.random.standard_normal(x.shape)).to(x)
            self.calls += 1
            self._fault()
        return self.net(x)

    def _fault(self):
        kind, _, at = os.environ.get("DDPKIT_TEST_FAULT", "").partition("@")
        if not kind or os.environ.get("RANK") != "1" or self.calls != int(at):
            return
        if kind == "term":
            os.killpg(os.getpgrp(), signal.SIGTERM)
        elif kind == "kill" and os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0":
            os.kill(os.getpid(), signal.SIGKILL)


# ---------------------------------------------------------------- dataset functions by import path (bad input)
def returns_int():
    """``--dataset user_code:returns_int``: not datasets."""
    return 3


def unparsable_settings():
    """``--dataset user_code:unparsable_settings``: raises inside the standard library (json), called from here."""
    import json

    return json.loads("{not json")  # the line an error names: this one, not json's own


def picture_data(n: int = 12, size: int = 8):
    """``--dataset user_code:picture_data --dataset-args '{"n": ...}'``: ``n`` uint8 RGB images each split."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randint(0, 256, (n, 3, size, size), dtype=torch.uint8, generator=gen)
    data = TensorDataset(x, torch.arange(n) % 3)
    return data, data


def mark_worker(worker_id: int) -> None:
    """A DataLoader worker_init_fn: leaves a file per worker in $USER_CODE_MARKS (a per-worker resource a
    real one would open: a file handle, a shard)."""
    import os
    from pathlib import Path

    Path(os.environ["USER_CODE_MARKS"], f"worker-{worker_id}-pid-{os.getpid()}").touch()


# ---------------------------------------------------------------- a stream (test_stream.py)
class Rows(torch.utils.data.IterableDataset):
    """``n`` rows (x, y) as a stream, logging each row it reads to ``log_dir/<pid>.txt`` as "epoch row".
    ``shard``: it reads its own shard (ddpkit.data.stream_shard); ``seek``: and starts after the rows trained
    on (stream_start), its noise keyed by (epoch, row); otherwise its noise comes from torch's global stream.
    ``sleep_s`` per row gives a test time to act."""

    def __init__(self, n: int, log_dir: str, shard: bool = True, seek: bool = False, sleep_s: float = 0.0):
        self.n, self.log_dir, self.shard, self.seek, self.sleep_s, self.epoch = n, log_dir, shard, seek, sleep_s, 0
        gen = torch.Generator().manual_seed(0)
        self.x = torch.randn(n, 4, generator=gen)
        self.y = self.x @ torch.tensor([[1.0], [-2.0], [0.5], [3.0]])

    def __len__(self):
        return self.n

    def set_epoch(self, epoch: int):
        self.epoch = epoch

    def __iter__(self):
        import os
        import time
        from pathlib import Path

        import ddpkit

        index, count = ddpkit.data.stream_shard() if self.shard else (0, 1)
        start = ddpkit.data.stream_start() if self.seek else 0
        with open(Path(self.log_dir) / f"{os.getpid()}.txt", "a") as log:
            for i in list(range(index, self.n, count))[start:]:
                log.write(f"{self.epoch} {i}\n")
                log.flush()
                time.sleep(self.sleep_s)
                if self.seek:
                    noise = torch.randn(1, generator=torch.Generator().manual_seed(self.epoch * self.n + i))
                else:
                    noise = torch.randn(1)
                yield self.x[i], self.y[i] + 0.01 * noise


def row_reads(log_dir, skip_pid: int | None = None) -> list[tuple[int, int]]:
    """(epoch, row) of every read logged by :class:`Rows`, but the process ``skip_pid``'s (the launcher's preflight)."""
    from pathlib import Path

    out = []
    for f in Path(log_dir).glob("*.txt"):
        if skip_pid is not None and f.stem == str(skip_pid):
            continue
        out += [tuple(map(int, line.split())) for line in f.read_text().splitlines()]
    return out


class ReplicaNet(nn.Module):
    """A small net with BatchNorm (buffers a replica group must keep as DDP keeps rank 0's), for 1x8x8 images of 4
    classes. ``DDPKIT_TEST_FAULT="kill@K:G"``: the K-th training forward of replica group G SIGKILLs its process
    (K = 0: the worker's copy of the model, made before the groups meet);
    ``"term@K:G"``: it sends SIGTERM to its whole process group (start the job in a session of its own). Faults
    joined by "," are of the group's attempts in turn (its agent's restarts): "kill@12:1,kill@30:1" kills group 1
    in its first attempt and again in its second. ``"hang@K:G"``: the K-th training forward sleeps for an hour (stuck
    in its own code, its heartbeats going on); ``"evalhang@K:G"``: the K-th evaluation forward does (stuck outside
    its step).

    ``DDPKIT_TEST_HEAL_LATER=RUN_DIR`` (with a kill of group 1 in its first epoch) makes group 1's heal land in a
    later epoch than the one its own snapshot is in, whatever the machine's load: group 1's restart, as it loads
    that snapshot (before it meets the others), waits until group 0 has ended its first epoch; group 0, from then
    on, waits at a training forward until group 1 has started again, and then takes 0.1 s a forward until group 1
    has healed, so that it cannot end the run first.

    ``DDPKIT_TEST_SLOW_UNTIL_HEALED="RUN_DIR:GROUPS:COUNT"``: every training forward of every group takes 0.2 s more
    until the run's GROUPS groups have healed COUNT times between them, so that the groups still up cannot end the
    run before the ones killed are back (a group that comes back to no one trains on alone, and serves no test)."""

    def __init__(self, dropout: float = 0.0):
        super().__init__()
        self.net = nn.Sequential(
            nn.Flatten(), nn.Linear(64, 32), nn.BatchNorm1d(32), nn.ReLU(), nn.Dropout(dropout), nn.Linear(32, 4)
        )
        self.calls = self.evals = 0
        self.later = os.environ.get("DDPKIT_TEST_HEAL_LATER", "")

    def load_state_dict(self, state, *args, **kwargs):
        if (
            self.later
            and os.environ.get("DDPKIT_REPLICA") == "1"
            and os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") != "0"
        ):
            _wait_for(self.later, 0, lambda r: r["event"] == "epoch")
        return super().load_state_dict(state, *args, **kwargs)

    def _heal_later(self) -> None:
        if os.environ.get("DDPKIT_REPLICA") != "0" or not _records(self.later, 0, lambda r: r["event"] == "epoch"):
            return
        if not _records(self.later, 1, lambda r: r.get("change") == "healed"):
            _wait_for(self.later, 1, lambda r: r["event"] == "start", count=2)
            time.sleep(0.1)

    def __setstate__(self, state):
        super().__setstate__(state)
        if "TORCHELASTIC_RESTART_COUNT" in os.environ:  # a worker's own copy, made before it meets the other groups
            self.evals = 0  # the worker's own evaluations (its launcher's checks evaluated the copy it was sent)
            self._fault()

    def forward(self, x):
        if self.training:
            self.calls += 1
            self._fault()
            if self.later:
                self._heal_later()
            slow = os.environ.get("DDPKIT_TEST_SLOW_UNTIL_HEALED")
            if slow:
                run_dir, groups, count = slow.rsplit(":", 2)
                healed = (_records(run_dir, g, lambda r: r.get("change") == "healed") for g in range(int(groups)))
                if sum(map(len, healed)) < int(count):
                    time.sleep(0.2)
        elif "TORCHELASTIC_RESTART_COUNT" in os.environ:  # in a worker, not its launcher's checks
            self.evals += 1
            self._fault(evaluating=True)
        return self.net(x)

    def _fault(self, evaluating: bool = False) -> None:
        faults = [f for f in os.environ.get("DDPKIT_TEST_FAULT", "").split(",") if f]
        attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
        if attempt < len(faults):
            kind, _, at = faults[attempt].partition("@")
            at, _, group = at.partition(":")
            if os.environ.get("DDPKIT_REPLICA") != group or (kind == "evalhang") != evaluating:
                return
            if (self.evals if evaluating else self.calls) == int(at):
                if kind == "kill":
                    os.kill(os.getpid(), signal.SIGKILL)
                elif kind == "term":  # the whole job, as SLURM signals every process of a step
                    os.killpg(os.getpgrp(), signal.SIGTERM)
                elif kind in ("hang", "evalhang"):  # stuck (a deadlocked reader, say), its heartbeats going on
                    time.sleep(3600)


def _records(run_dir: str, group: int, keep) -> list[dict]:
    """Replica group ``group``'s records of run ``run_dir`` (ranks/replicas.py's group_dir) that ``keep`` keeps."""
    path = f"{run_dir}-group-{group}" if group else run_dir
    try:
        with open(os.path.join(path, "metrics.jsonl")) as f:
            return [r for r in map(json.loads, f) if keep(r)]
    except (FileNotFoundError, json.JSONDecodeError):  # not yet written, or a line being written
        return []


def _wait_for(run_dir: str, group: int, keep, count: int = 1, limit_s: float = 120.0) -> None:
    deadline = time.monotonic() + limit_s
    while len(_records(run_dir, group, keep)) < count:
        if time.monotonic() > deadline:
            raise RuntimeError(f"replica group {group} of {run_dir} wrote no such record in {limit_s} s")
        time.sleep(0.02)


def replica_net() -> ReplicaNet:
    return ReplicaNet()


def replica_net_dropout() -> ReplicaNet:
    return ReplicaNet(dropout=0.25)
