"""An IterableDataset as train_data (issue 35): each rank reads its shard, every sample once an epoch, and a
run SIGKILLed mid-epoch resumes at the same position, ending bitwise as an uninterrupted run."""

from __future__ import annotations

import json
import os
import signal
import time
from collections import Counter
from pathlib import Path

import pytest
import stream_train
import torch
from clirun import ROOT, read_jsonl, run_python, start_python
from torch.utils.data import TensorDataset
from user_code import Rows, row_reads

from ddpkit import TrainConfig, Trainer
from ddpkit.data import stream_shard
from ddpkit.errors import DataError

pytestmark = pytest.mark.multiprocess
SCRIPT = str(ROOT / "tests" / "helpers" / "stream_train.py")
# 96 rows, global batch 16: 6 steps an epoch at world 2 (each rank 48 rows, 6 batches of 8)
CONFIG = dict(nproc="2", device="cpu", batch_size=16, epochs=2, lr=0.05, progress=False, log_every=1, plots=False)


def spec(tmp_path: Path, name: str, workers: int, seek: bool, sleep_s: float = 0.0, **config) -> dict:
    return {
        "run_dir": str(tmp_path / name),
        "log_dir": str(tmp_path / f"{name}-log"),
        "rows": {"n": 96, "seek": seek, "sleep_s": sleep_s},
        "config": {**CONFIG, "num_workers": workers, **config},
    }


def run(s: dict, script: bool = False) -> int:
    """The run of ``s``, launched from this process, or (``script``) by the script in its own: the launcher's
    pid (its reads are preflight's sample, not training's). A rerun of a run the script made is the script's
    too: its loss is ``__main__.mse`` there, which the run identity tells from ``stream_train.mse``."""
    Path(s["log_dir"]).mkdir(parents=True, exist_ok=True)
    if not script:
        stream_train.trainer(s).fit()
        return os.getpid()
    done = run_python(SCRIPT, json.dumps(s))
    assert done.returncode == 0, done.stderr[-3000:]
    return int(done.stdout.split()[1])


def weights(s: dict) -> dict:
    return torch.load(Path(s["run_dir"]) / "model.pt", weights_only=True)


@pytest.mark.slow
@pytest.mark.parametrize("workers", [0, 2])
def test_each_sample_is_read_once_an_epoch_across_ranks_and_workers(tmp_path, workers):
    s = spec(tmp_path, "r", workers, seek=False)
    launcher = run(s)
    reads = Counter(row_reads(s["log_dir"], skip_pid=launcher))
    assert reads == Counter({(epoch, row): 1 for epoch in (0, 1) for row in range(96)})
    summary = json.loads((Path(s["run_dir"]) / "summary.json").read_text())
    assert summary["steps"] == 12 and summary["data_path"] == "stream"


@pytest.mark.slow
def test_a_stream_read_whole_by_every_shard_is_still_split_exactly(tmp_path):
    """A dataset that does not ask for its shard: every rank reads it all, and keeps every 2nd row, its own."""
    s = spec(tmp_path, "r", 0, seek=True)  # (seek: its noise keyed by row, whoever reads it)
    s["rows"]["shard"] = False
    launcher = run(s)
    sharded = spec(tmp_path, "s", 0, seek=True)
    run(sharded)
    reads = Counter(row_reads(s["log_dir"], skip_pid=launcher))
    # rank 0's share ends at row 94: it stops reading there; every other row is read by both ranks
    assert reads == Counter({(epoch, row): 1 if row == 95 else 2 for epoch in (0, 1) for row in range(96)})
    w, v = weights(s), weights(sharded)
    assert all(torch.equal(w[k], v[k]) for k in w)  # the same batches as a dataset reading its own shard


@pytest.mark.slow
@pytest.mark.parametrize("workers,seek", [(0, False), (2, True)])
def test_a_sigkilled_stream_resumes_at_its_position_and_ends_bitwise(tmp_path, workers, seek):
    """SIGKILL after the step-3 snapshot of epoch 1 (step 9): the rerun resumes there. A dataset that seeks
    (stream_start) reads only the rows after it; one that does not has its rows before it read again and
    dropped, their random draws replayed. Either way the weights are an uninterrupted run's, bit for bit."""
    whole = spec(tmp_path, "whole", workers, seek)
    run(whole)
    cut = spec(tmp_path, "cut", workers, seek, sleep_s=0.01, save_every_steps=3)
    Path(cut["log_dir"]).mkdir(parents=True)
    proc = start_python(SCRIPT, json.dumps(cut))
    metrics, deadline = Path(cut["run_dir"]) / "metrics.jsonl", time.monotonic() + 120
    # The step-9 snapshot is written in the background while steps 10 on run: killed once it is whole
    ninth = Path(cut["run_dir"]) / "checkpoints" / "snapshot-000000009.pt"
    try:
        while time.monotonic() < deadline:
            if ninth.exists():
                os.killpg(proc.pid, signal.SIGKILL)
                break
            assert proc.poll() is None, proc.communicate()
            time.sleep(0.01)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
    for f in Path(cut["log_dir"]).glob("*.txt"):
        f.unlink()  # count the rerun's reads alone
    launcher = run(cut, script=True)
    starts = [r for r in read_jsonl(metrics) if r["event"] == "start"]
    assert starts[-1]["resumed_at_step"] == 9
    reads = row_reads(cut["log_dir"], skip_pid=launcher)
    epoch1 = Counter(row for epoch, row in reads if epoch == 1)
    # the epoch's last 3 of 6 steps: 48 rows, each once; with the replay, its first 48 rows read again too
    assert sum(epoch1.values()) == (48 if seek else 96) and set(epoch1.values()) == {1}
    assert not [r for r in reads if r[0] == 0]  # epoch 0 was done: not read again
    w, v = weights(whole), weights(cut)
    assert all(torch.equal(w[k], v[k]) for k in w)


def test_the_contract_and_its_refusals(tmp_path):
    assert stream_shard() == (0, 1)  # outside ddpkit's reading: the whole stream

    class NoLen(torch.utils.data.IterableDataset):
        def __iter__(self):
            yield torch.zeros(2), torch.zeros(1)

    test = TensorDataset(torch.zeros(4, 2), torch.zeros(4, 1))
    cfg = TrainConfig(**{**CONFIG, "nproc": "1"}, run_dir=str(tmp_path / "r"))
    with pytest.raises(DataError, match="an IterableDataset without __len__: give it one"):
        Trainer(cfg, model=torch.nn.Linear(2, 1), train_data=NoLen(), test_data=test, loss_fn=lambda m, b: 0)
    rows = Rows(96, str(tmp_path))
    with pytest.raises(DataError, match="test_data is an IterableDataset.*evaluation needs each sample once"):
        Trainer(cfg, model=torch.nn.Linear(4, 1), train_data=rows, test_data=rows)


def test_a_stream_resumed_with_other_loader_workers_is_refused(tmp_path):
    """Review finding: the shards follow the loader workers, and num_workers is no part of the run identity:
    a resume with another count read other shards silently. The snapshot keeps the count; another is one line."""
    cfg = dict(CONFIG, nproc="1", schedule="constant", run_dir=str(tmp_path / "r"))
    test = TensorDataset(torch.zeros(4, 4), torch.zeros(4, 1))

    def fit(workers: int, epochs: int):
        torch.manual_seed(0)
        rows = Rows(96, str(tmp_path))
        return Trainer(
            TrainConfig(**{**cfg, "epochs": epochs, "num_workers": workers}),
            model=torch.nn.Linear(4, 1),
            train_data=rows,
            test_data=test,
            loss_fn=lambda m, b: torch.nn.functional.mse_loss(m(b[0]), b[1]),
        ).fit()

    fit(0, 1)
    with pytest.raises(
        DataError, match="read its IterableDataset with --num-workers 0, .* resume it with --num-workers 0"
    ):
        fit(2, 2)  # trained on to 2 epochs (a constant lr), from the snapshot made with no workers


def test_preflights_sample_of_a_one_sample_training_set_is_a_batch_of_one(tmp_path):
    """Review finding (a read of the diff): the first-samples helper returned a bare sample when asked for
    one, so preflight's batch of a one-sample map-style training set was collated from the sample's fields."""
    from ddpkit.data import DataSplits
    from ddpkit.preflight import sample_batch

    one = TensorDataset(torch.ones(1, 3), torch.zeros(1, 1))
    x, y = sample_batch(DataSplits(one, one, None))
    assert x.shape == (1, 3) and y.shape == (1, 1)
    rows = Rows(96, str(tmp_path))
    assert len(sample_batch(DataSplits(rows, one, None), 2)[0]) == 2  # a stream's first items, as a batch


def test_a_streams_identity_reads_everything_it_holds(tmp_path):
    """Found by a newcomer's port: every IterableDataset subclass was "not read" (ABCMeta's `_abc_impl` cache
    on the class), so --reuse-finished could never return a stream's run."""
    from ddpkit.identity import data_fingerprint

    fp = data_fingerprint(Rows(96, str(tmp_path)), TensorDataset(torch.zeros(4, 4), torch.zeros(4, 1)))
    assert not [u for u in fp.unproven if "_abc" in u], fp.unproven  # (its log folder is read by name only)
