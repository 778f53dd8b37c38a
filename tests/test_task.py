"""The step contract: the default task's numbers, its refusals, and user losses and metrics."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import ddpkit.dist
from ddpkit import TrainConfig, Trainer
from ddpkit.errors import TaskError
from ddpkit.metrics import Accumulator
from ddpkit.task import Classification, ModelLoss, UserLoss, resolve_task

GOLDEN = Path(__file__).parent / "golden" / "default_task.json"


def test_the_default_task_reproduces_the_pre_refactor_engine_bitwise(tmp_path, monkeypatch):
    """Same seed, same model.pt bytes and summary figures as the engine before the step contract
    (tests/golden/default_task.json, written by that engine on this machine type and torch)."""
    golden = json.loads(GOLDEN.read_text())
    here = (str(torch.__version__), torch.backends.cpu.get_cpu_capability())
    if here != (golden["torch"], golden["cpu_capability"]):
        # oneDNN picks other kernels on another ISA, and another torch may change them: bitwise
        # equality holds only where the golden was made (CI's machine type).
        pytest.skip(f"golden made with torch {golden['torch']} on {golden['cpu_capability']}; here {here}")
    monkeypatch.setattr(ddpkit.dist, "cpu_cores", lambda: 2)  # oneDNN's reductions depend on the thread count
    for name, run in golden["runs"].items():
        run_dir = tmp_path / name
        cfg = dict(dataset="mnist", limit_train=800, limit_test=500, batch_size=100, lr=0.05, epochs=1, nproc="1",
                   device="cpu", progress=False, log_every=3, run_dir=str(run_dir))
        summary = Trainer(TrainConfig(**{**cfg, **run["config"]})).fit().summary
        state = torch.load(run_dir / "model.pt", weights_only=True)
        digests = {k: hashlib.sha256(v.contiguous().numpy().tobytes()).hexdigest()[:16] for k, v in sorted(state.items())}
        assert digests == run["tensors"], name
        assert {k: summary[k] for k in run["summary"]} == run["summary"], name


def logits_and_labels(b=4, c=3):
    return torch.randn(b, c), torch.randint(0, c, (b,))


@pytest.mark.parametrize("logits,targets,message", [
    (torch.randn(4, 1), torch.randn(4, 1), "targets are float32 \\[4, 1\\].*integer class labels.*loss_fn"),
    (torch.randn(4, 3), torch.randn(4), "targets are float32 \\[4\\]"),
    (torch.randn(4, 7, 11), torch.randint(0, 11, (4, 7)), "output has shape \\[4, 7, 11\\].*\\[batch, classes\\]"),
    (torch.randn(4, 5), torch.randint(0, 3, (4,)), "outputs 5 classes but the dataset has 3"),
])
def test_classification_refuses_what_it_cannot_do_in_one_line(logits, targets, message):
    task = Classification(classes=3)
    with pytest.raises(TaskError, match=message):
        task.loss(lambda x: logits, (torch.zeros(4, 2), targets))


def test_classification_sums_and_counts():
    logits, y = torch.tensor([[2.0, 0.0], [0.0, 2.0], [2.0, 0.0]]), torch.tensor([0, 1, 1])
    task = Classification()
    loss, out = task.loss(lambda x: logits, (torch.zeros(3), y))
    (loss_sum, n1), (correct, n2) = task.measure(loss, out, (torch.zeros(3), y))
    assert n1 == n2 == 3 and correct.item() == 2
    assert loss_sum.item() == pytest.approx(F.cross_entropy(logits, y).item() * 3)


def test_a_metric_must_return_a_sum_and_a_count():
    task = UserLoss(lambda m, b: (m(b).sum(), m(b)), {"acc": lambda out, b: out.mean()})
    with pytest.raises(TaskError, match="metric 'acc' returned Tensor; a metric returns \\(sum, count\\)"):
        task.evaluate(lambda b: b, torch.ones(3))
    with pytest.raises(TaskError, match="metric name 'test samples'"):
        UserLoss(lambda m, b: m(b), {"test samples": lambda o, b: (0, 1)})


def test_user_loss_may_return_outputs_for_the_metrics_and_may_define_its_own_loss_metric():
    def loss_fn(model, batch):
        out = model(batch)
        return out.mean(), out

    task = UserLoss(loss_fn, {"loss": lambda out, b: (out.sum(), out.numel()), "peak": lambda out, b: (out.max(), 1)})
    assert task.names == ("loss", "peak") and task.identity.startswith("custom:test_user_loss")
    assert UserLoss(loss_fn, {"peak": lambda out, b: (out.min(), 1)}).identity != \
        UserLoss(loss_fn, {"peak": lambda out, b: (out.max(), 1)}).identity  # an edited metric is a new run
    values = task.evaluate(lambda b: b * 2, torch.arange(6.0).view(3, 2))
    assert [(float(s), float(c)) for s, c in values] == [(30.0, 6.0), (10.0, 1.0)]  # the per-element loss wins
    with pytest.raises(TaskError, match="loss_fn returned a tensor of shape \\[3, 2\\]"):
        UserLoss(lambda m, b: m(b)).loss(lambda b: b, torch.ones(3, 2))


def test_a_dict_batch_goes_to_a_model_that_returns_its_own_loss():
    class HFStyle(nn.Module):
        def forward(self, input_ids, labels):
            return {"loss": (input_ids.float() - labels).pow(2).mean(), "logits": input_ids.float()}

    task = resolve_task(TrainConfig(), sample={"input_ids": torch.ones(3), "labels": torch.zeros(3)})
    assert isinstance(task, ModelLoss) and task.identity == "model-loss"
    loss, out = task.loss(HFStyle(), {"input_ids": torch.ones(3), "labels": torch.zeros(3)})
    assert loss.item() == 1.0
    with pytest.raises(TaskError, match="has no .loss or 'loss' entry"):
        task.loss(lambda **kw: kw["input_ids"], {"input_ids": torch.ones(3)})


def test_the_accumulator_keeps_device_sums_and_host_counts_and_reduces_them_together():
    acc = Accumulator(("loss", "tokens"), torch.device("cpu"))
    acc.add([(torch.tensor(2.0), 4), (torch.tensor(3.0), torch.tensor(5))])
    acc.add([(1.0, 2), (torch.tensor(1.0), torch.tensor(1))])
    totals = acc.local().tolist()
    assert totals == [3.0, 4.0, 6.0, 6.0]
    assert acc.means(totals, "test_") == {"test_loss": 0.5, "test_tokens": 4 / 6}
    acc.load(acc.state())
    assert acc.local().tolist() == totals
