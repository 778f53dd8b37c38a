"""The Python API with the user's own model, data, loss and metrics, at world sizes 1, 2 and 3."""

from __future__ import annotations

import json
import re
import shutil
import time

import pytest
import torch
from clirun import run_cli, run_python
from torch.utils.data import TensorDataset
from user_code import (
    CharModel,
    DictData,
    OwnLossModel,
    RegressionMLP,
    Sequences,
    dict_mae,
    first_token_share,
    mae,
    mse,
    per_token_loss,
    regression_data,
    token_loss,
)

from ddpkit import TrainConfig, Trainer
from ddpkit.errors import ConfigError, DataError, RunDirError, TaskError
from ddpkit.models import ConvNet

SMALL = dict(batch_size=32, epochs=2, lr=0.05, progress=False, device="cpu", num_workers=0, log_every=5)


@pytest.mark.slow
@pytest.mark.multiprocess
def test_each_rank_trains_its_own_copy_of_a_passed_model(tmp_path):
    """Regression: spawned workers got the model's tensors in shared memory, so both ranks
    stepped the same storage (BN counted ~1.5 forwards per step, and runs were not repeatable)."""
    torch.manual_seed(0)
    cfg = TrainConfig(
        dataset="mnist",
        limit_train=800,
        limit_test=200,
        batch_size=100,
        lr=0.05,
        epochs=1,
        progress=False,
        device="cpu",
        nproc="2",
        run_dir=str(tmp_path / "run"),
    )
    model = ConvNet()
    result = Trainer(cfg, model=model).fit()
    state = torch.load(tmp_path / "run" / "model.pt", weights_only=True)
    assert result["steps"] == 8 and result["world_size"] == 2
    assert state["layer1.1.num_batches_tracked"].item() == 8
    assert state["layer2.1.num_batches_tracked"].item() == 8
    # Regression: fit() left the caller's object untrained; it now holds model.pt.
    assert all(torch.equal(v, state[k]) for k, v in model.state_dict().items())


@pytest.mark.parametrize("flat", [False, True])
def test_float_targets_under_the_default_task_are_one_line_before_launch(tmp_path, flat):
    """Regression: [N, 1] float targets trained nothing and reported loss=0 with exit 0; [N]
    raised a raw dtype error on every rank. Now: one line, before any worker starts."""
    trainer = Trainer(
        TrainConfig(nproc="2", run_dir=str(tmp_path / "r"), **SMALL),
        model=RegressionMLP(),
        train_data=regression_data(64, 0, flat_targets=flat),
        test_data=regression_data(32, 1),
    )
    with pytest.raises(TaskError, match="targets are float32.*integer class labels.*pass loss_fn"):
        trainer.fit()
    assert not (tmp_path / "r").exists()


def test_sequence_logits_under_the_default_task_are_one_line_before_launch(tmp_path):
    trainer = Trainer(
        TrainConfig(nproc="2", run_dir=str(tmp_path / "r"), **SMALL),
        model=CharModel(),
        train_data=TensorDatasetOfTokens(),
        test_data=TensorDatasetOfTokens(),
    )
    with pytest.raises(TaskError, match=r"output has shape \[2, 8, 11\]; the default classification task needs"):
        trainer.fit()


@pytest.mark.multiprocess  # (fit() starts the forkserver early, before its checks)
def test_newcomer_mistakes_with_a_toy_model_are_one_line_naming_the_mistake(tmp_path):
    """Regressions (the porter's seed-004 port, appendix A's toy): the model's class passed for a model was a
    TypeError from deep in the identity's read; int32 labels were said as the model failing on a batch; no
    test_data was "the test set ... is empty". Each is now one line naming what to change, before launch."""
    x = torch.randn(64, 2)
    labels = torch.tensor([0, 1] * 32)
    cfg = TrainConfig(nproc="2", run_dir=str(tmp_path / "r"), **SMALL)
    toy = torch.nn.Sequential(torch.nn.Linear(2, 2))
    with pytest.raises(ConfigError, match=r"model= is the class Sequential, not a model: pass an instance"):
        Trainer(cfg, model=torch.nn.Sequential, train_data=TensorDataset(x, labels), test_data=TensorDataset(x, labels))
    narrow = TensorDataset(x, labels.int())
    with pytest.raises(DataError, match=r"labels of custom:\S+ are torch.int32: .* return them as torch.long"):
        Trainer(cfg, model=toy, train_data=narrow, test_data=narrow).fit()
    wrong = torch.nn.Sequential(torch.nn.Linear(3, 2))  # the model's own error, int32 labels or not: the model's
    with pytest.raises(ConfigError, match=r"fails on a batch of custom:\S+ \(input \[2, 2\]\): RuntimeError: mat1"):
        Trainer(cfg, model=wrong, train_data=narrow, test_data=narrow).fit()
    with pytest.raises(ConfigError, match=r"has no test split: pass test_data= to Trainer"):
        Trainer(cfg, model=toy, train_data=TensorDataset(x, labels)).fit()
    assert not (tmp_path / "r").exists()


@pytest.mark.multiprocess
def test_a_config_error_in_trainers_constructor_ends_a_script_in_one_line(tmp_path):
    """Regression (the porter's seed-004 port): a ConfigError raised while Trainer(...) was built ended an uncaught
    script in a traceback and exit 1, where the same class raised in fit() is one line and exit 2."""
    script = tmp_path / "mistake.py"
    script.write_text(
        "import torch\nfrom ddpkit import TrainConfig, Trainer\n"
        "opt = lambda m: torch.optim.SGD(m.parameters(), lr=0.5)\n"
        "Trainer(TrainConfig(lr=0.1), model=torch.nn.Linear(2, 2), optimizer=opt)\n"
    )
    proc = run_python(script, cwd=tmp_path)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
    assert proc.stderr.count("you pass your own optimizer, so the config's lr would be ignored") == 1, proc.stderr


def TensorDatasetOfTokens():
    seqs = Sequences(64, 0)
    return torch.utils.data.TensorDataset(seqs.tokens[:, :-1], seqs.tokens[:, 1:])


@pytest.mark.slow
@pytest.mark.multiprocess
def test_a_regression_mlp_trains_on_two_processes_with_its_own_loss_and_metric(tmp_path):
    torch.manual_seed(0)
    model = RegressionMLP()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    result = Trainer(
        TrainConfig(nproc="2", run_dir=str(tmp_path / "r"), **SMALL),
        model=model,
        train_data=regression_data(256, 0),
        test_data=regression_data(100, 1),
        loss_fn=mse,
        metrics={"mae": mae},
    ).fit()
    s = result.summary
    assert re.fullmatch(r"custom:mse#\w{8}\+mae#\w{8}", s["task"]) and s["world_size"] == 2 and s["test_samples"] == 100
    assert s["test_loss"] < 1.0 and 0 < s["test_mae"] < 1.0  # y has variance ~14: it learned
    assert not any(torch.equal(before[k], v) for k, v in model.state_dict().items() if v.is_floating_point())
    state = torch.load(result.run_dir / "model.pt", weights_only=True)
    assert all(torch.equal(v, state[k]) for k, v in model.state_dict().items())
    # each rank's own figures: its train samples of the last epoch, and its half of the test set
    assert [r["rank"] for r in result.per_rank] == [0, 1]
    assert sum(r["test_samples"] for r in result.per_rank) == 100
    assert all(r["test_mae"] > 0 and r["train_loss"] > 0 for r in result.per_rank)
    records = [json.loads(line) for line in (result.run_dir / "metrics.jsonl").read_text().splitlines()]
    epoch = [r for r in records if r["event"] == "epoch"][-1]
    assert {"train_loss", "train_mae", "test_loss", "test_mae"} <= set(epoch)


@pytest.mark.slow
@pytest.mark.multiprocess
def test_metrics_reduce_exactly_at_world_1_2_and_3(tmp_path):
    """Per-token loss reduces as (sum of token losses)/(token count) over all ranks, not as a mean of
    rank means: sequences have skewed lengths, so ranks hold very different token counts. In float64
    the reduction order moves the result by ~1e-16, while a mean of rank means would be off by
    ~1e-3 here. And a count metric sums to the dataset size: 101 samples split 34/34/33."""
    torch.manual_seed(0)
    model, test = CharModel(torch.float64), Sequences(101, 1, skewed=True)
    tokens, targets, mask = (torch.stack(t) for t in zip(*(test[i] for i in range(len(test)))))
    with torch.no_grad():
        losses = torch.nn.functional.cross_entropy(model(tokens).reshape(-1, 11), targets.reshape(-1), reduction="none")
    per_token = (losses * mask.reshape(-1)).view(101, -1).sum(1)
    expected = per_token.sum().item() / mask.sum().item()
    for world in (2, 3):  # what averaging each rank's own mean would give: clearly not expected
        rank_means = [per_token[r::world].sum() / mask[r::world].sum() for r in range(world)]
        assert abs(sum(rank_means).item() / world - expected) > 1e-4
    results = {}
    for nproc in ("1", "2", "3"):
        trainer = Trainer(
            TrainConfig(nproc=nproc, run_dir=str(tmp_path / nproc), **SMALL),
            model=model,
            train_data=Sequences(64, 0),
            test_data=test,
            loss_fn=token_loss,
            metrics={"loss": per_token_loss, "share": first_token_share},
        )
        results[nproc] = trainer.evaluate()
    for nproc, r in results.items():
        assert r["world_size"] == int(nproc) and r["test_samples"] == 101
        assert abs(r["test_loss"] - expected) < 1e-12 * expected, nproc
        assert r["test_share"] == 1.0  # every sequence has at least one valid token: 101 of 101


@pytest.mark.slow
@pytest.mark.multiprocess
def test_grad_accumulation_and_two_ranks_match_one_rank_one_batch_in_float64(tmp_path):
    """Without BatchNorm, world 2 with 2 micro-batches of B/4 per rank is one step of B on the
    same samples as world 1 (DistributedSampler gives the ranks alternate indices). In float64
    only the summation order differs, so weights agree to ~1e-16."""
    common = dict(SMALL, batch_size=16, epochs=1, momentum=0.9)
    train, test = regression_data(128, 0, torch.float64), regression_data(20, 1, torch.float64)
    states = {}
    for name, extra in {
        "w1": dict(nproc="1"),
        "w1-accum4": dict(nproc="1", grad_accum=4),
        "w2-accum2": dict(nproc="2", grad_accum=2),
    }.items():
        torch.manual_seed(0)
        model = RegressionMLP(dtype=torch.float64)
        Trainer(
            TrainConfig(run_dir=str(tmp_path / name), **common, **extra),
            model=model,
            train_data=train,
            test_data=test,
            loss_fn=mse,
        ).fit()
        states[name] = model.state_dict()
    for other in ("w1-accum4", "w2-accum2"):
        worst = max((states[other][k] - v).abs().max().item() for k, v in states["w1"].items())
        assert worst < 1e-12, (other, worst)
    assert (
        max(
            (states["w1"][k] - v).abs().max().item() for k, v in RegressionMLP(dtype=torch.float64).state_dict().items()
        )
        > 1e-3
    )  # and it did train


@pytest.mark.slow
@pytest.mark.multiprocess
def test_dict_batches_train_through_the_models_own_loss_on_two_processes(tmp_path):
    """Regression: dict batches (as Hugging Face datasets give) failed with "'str' object has no attribute 'to'"."""
    torch.manual_seed(0)
    result = Trainer(
        TrainConfig(nproc="2", run_dir=str(tmp_path / "r"), **SMALL),
        model=OwnLossModel(),
        train_data=DictData(256, 0),
        test_data=DictData(64, 1),
        metrics={"mae": dict_mae},
    ).fit()
    assert re.fullmatch(r"model-loss\+mae#\w{8}", result["task"]) and result["test_samples"] == 64
    assert result["test_loss"] < 1.0 and result["test_mae"] < 1.0


def test_optimizer_scheduler_and_clipping_come_from_the_user(tmp_path):
    torch.manual_seed(0)
    model = RegressionMLP()
    adam = torch.optim.AdamW(
        [{"params": model.net[0].parameters(), "lr": 0.01}, {"params": model.net[2].parameters(), "lr": 0.003}]
    )  # parameter groups
    seen = {}

    def schedule(opt, total_steps):
        seen["total_steps"] = total_steps
        return torch.optim.lr_scheduler.LinearLR(opt, 1.0, 0.1, total_iters=total_steps)

    data = dict(train_data=regression_data(128, 0), test_data=regression_data(32, 1), loss_fn=mse)
    with pytest.raises(ConfigError, match="you pass your own optimizer, so the config's lr would be ignored"):
        Trainer(TrainConfig(**SMALL), model=model, optimizer=adam, **data)
    mine = {k: v for k, v in SMALL.items() if k != "lr"}
    result = Trainer(
        TrainConfig(nproc="1", run_dir=str(tmp_path / "r"), clip_grad_norm=0.5, **mine),
        model=model,
        optimizer=adam,
        scheduler=schedule,
        **data,
    ).fit()
    assert seen["total_steps"] == result["steps"] == 8
    snap = torch.load(sorted((result.run_dir / "checkpoints").glob("*.pt"))[-1], weights_only=True)
    groups = snap["trainer"]["optimizer"]["param_groups"]
    assert [g["initial_lr"] for g in groups] == [0.01, 0.003] and "exp_avg" in snap["trainer"]["optimizer"]["state"][0]
    cfg_text = (result.run_dir / "config.toml").read_text()
    assert 'optimizer = "custom:AdamW#' in cfg_text and "lr =" not in cfg_text  # nothing claims an unused lr
    steps = [json.loads(line) for line in (result.run_dir / "metrics.jsonl").read_text().splitlines()]
    assert all(r["grad_norm"] > 0 for r in steps if r["event"] == "step")


def test_an_edited_model_is_a_new_run_never_a_stale_result(tmp_path):
    """Regression: a custom model's identity was its class name, so an edited model got the old summary."""
    data = dict(train_data=regression_data(64, 0), test_data=regression_data(32, 1), loss_fn=mse)
    cfg = TrainConfig(nproc="1", **SMALL)
    a = Trainer(cfg, model=RegressionMLP(hidden=16), **data).config.resolved()
    b = Trainer(cfg, model=RegressionMLP(hidden=32), **data).config.resolved()
    assert a.model != b.model and a.run_dir != b.run_dir
    assert Trainer(cfg, model=RegressionMLP(hidden=16), **data).config.resolved().run_dir == a.run_dir  # stable
    c = Trainer(
        cfg,
        model=RegressionMLP(hidden=16),
        train_data=regression_data(65, 0),
        test_data=regression_data(32, 1),
        loss_fn=mse,
    ).config.resolved()
    assert c.dataset != a.dataset  # a dataset of another size is another run too
    run = str(tmp_path / "r")
    Trainer(TrainConfig(nproc="1", run_dir=run, **SMALL), model=RegressionMLP(hidden=16), **data).fit()
    said = "different config \\(model RegressionMLP: net.0.out_features 16 -> 32, .*structure 97 parameters .* -> 193"
    with pytest.raises(RunDirError, match=said):
        Trainer(TrainConfig(nproc="1", run_dir=run, **SMALL), model=RegressionMLP(hidden=32), **data).fit()


def test_init_from_and_resume_never(tmp_path):
    data = dict(train_data=regression_data(64, 0), test_data=regression_data(32, 1), loss_fn=mse)
    first = Trainer(TrainConfig(nproc="1", run_dir=str(tmp_path / "a"), **SMALL), model=RegressionMLP(), **data).fit()
    with pytest.raises(RunDirError, match="--resume never: .* already holds a run"):
        Trainer(
            TrainConfig(nproc="1", run_dir=str(tmp_path / "a"), resume="never", **SMALL), model=RegressionMLP(), **data
        ).fit()
    tuned = Trainer(
        TrainConfig(
            nproc="1", run_dir=str(tmp_path / "b"), init_from=str(first.run_dir / "model.pt"), **dict(SMALL, epochs=1)
        ),
        model=RegressionMLP(),
        **data,
    ).fit()
    assert tuned["test_loss"] < first["test_loss"]  # started from the trained weights
    with pytest.raises(ConfigError, match="--init-from .* does not fit the model: .*other shapes"):
        Trainer(
            TrainConfig(nproc="1", run_dir=str(tmp_path / "c"), init_from=str(first.run_dir / "model.pt"), **SMALL),
            model=RegressionMLP(hidden=8),
            **data,
        ).fit()


def test_each_run_of_one_process_is_timed_from_its_own_start(tmp_path, monkeypatch):
    """check and bench start several runs from one CLI call: each reported the time since the CLI
    started as its own start-up (8.7 s, 50.9 s, 89.5 s for runs that each started in seconds)."""
    from ddpkit.ranks import env

    monkeypatch.setenv(env.T0, repr(time.time() - 100.0))  # the CLI started 100 s ago
    data = dict(train_data=regression_data(64, 0), test_data=regression_data(32, 1), loss_fn=mse)
    runs = [
        Trainer(TrainConfig(nproc="1", run_dir=str(tmp_path / name), **SMALL), model=RegressionMLP(), **data).fit()
        for name in ("first", "second")
    ]
    assert runs[0]["startup_s"] >= 100  # the first run is the one the CLI started
    assert runs[1]["startup_s"] < 30


@pytest.mark.slow
@pytest.mark.multiprocess
def test_ddpkit_eval_on_a_python_run_says_how_to_evaluate_it(tmp_path):
    """Regression: `ddpkit eval` on a custom run died with KeyError: 'custom:ImageData'."""
    run = tmp_path / "r"
    Trainer(
        TrainConfig(nproc="1", run_dir=str(run), **SMALL),
        model=RegressionMLP(),
        train_data=regression_data(64, 0),
        test_data=regression_data(32, 1),
        loss_fn=mse,
    ).fit()
    proc = run_cli("eval", str(run))
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    errors = [line for line in proc.stderr.splitlines() if line.startswith("ddpkit: error:")]
    assert len(errors) == 1 and "was trained from Python" in errors[0] and ".evaluate()" in errors[0]


INLINE = """
import torch, torch.nn.functional as F
from torch import nn
from torch.utils.data import TensorDataset
from ddpkit import TrainConfig, Trainer, launch

class MLP(nn.Module):          # defined in __main__ of `python -c`: spawn cannot import it
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 1)
    def forward(self, x):
        return self.fc(x)

torch.manual_seed(0)
x = torch.randn(64, 4); y = x.sum(1, keepdim=True)
data = TensorDataset(x, y)
result = Trainer(TrainConfig(nproc="2", device="cpu", batch_size=16, epochs=2, lr=0.05, progress=False,
                             num_workers=0, run_dir={run!r}),
                 model=MLP(), train_data=data, test_data=data,
                 loss_fn=lambda model, b: F.mse_loss(model(b[0]), b[1])).fit()
print("WORLD", result["world_size"], "LOSS", result["test_loss"])
print("LAUNCH", launch(lambda ctx, k: (ctx.rank, ctx.world_size, k), 7, nproc=2))
"""


@pytest.mark.slow
@pytest.mark.multiprocess
def test_a_model_and_loss_defined_in_python_c_run_on_two_processes(tmp_path):
    """Regression: "Can't get attribute 'MLP' on <module '__main__'>". Workers are forked on CPU
    when spawn cannot import the code, as Lightning's ddp_notebook and Accelerate do."""
    proc = run_python("-c", INLINE.format(run=str(tmp_path / "r")))
    assert proc.returncode == 0, proc.stderr[-3000:]
    world, loss = proc.stdout.split("WORLD ")[1].split()[0], float(proc.stdout.split("LOSS ")[1].split()[0])
    assert world == "2" and loss < 1.0
    assert "LAUNCH (0, 2, 7)" in proc.stdout


def test_a_model_on_a_gpu_is_moved_to_the_cpu_before_workers_are_spawned():
    """Spawned workers would rebuild CUDA tensors on the parent's GPU 0 via CUDA IPC."""
    from ddpkit.preflight import move_to_cpu

    class OnGPU(torch.nn.Module):  # reports a CUDA parameter; records where it is moved
        def __init__(self):
            super().__init__()
            self.moves = []

        def parameters(self, recurse=True):
            yield type("P", (), {"device": torch.device("cuda", 3)})()

        def to(self, *args, **kwargs):
            self.moves.append(args)
            return self

    model = OnGPU()
    assert move_to_cpu(model) == torch.device("cuda", 3) and model.moves == [("cpu",)]
    assert move_to_cpu(ConvNet()) is None


# ---------------------------------------------------------------- found by trying the API as a newcomer
class ReluMLP(torch.nn.Module):
    def __init__(self, act=torch.nn.ReLU):
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(4, 8), act(), torch.nn.Linear(8, 1))

    def forward(self, x):
        return self.net(x)


def test_edits_that_keep_every_shape_are_new_runs_too():
    """Regression: ReLU -> Tanh, an edited loss body, or relabelled data returned the old result."""
    cfg = TrainConfig(nproc="1", **SMALL)
    data = dict(train_data=regression_data(64, 0), test_data=regression_data(32, 1))

    def run_dir(model=None, loss=mse, **d):
        return Trainer(cfg, model=model or ReluMLP(), loss_fn=loss, **{**data, **d}).config.resolved().run_dir

    base = run_dir()
    assert run_dir() == base  # and nothing else moves it
    assert run_dir(ReluMLP(torch.nn.Tanh)) != base

    def mse_times_100(model, batch):
        x, y = batch
        out = model(x)
        return 100 * torch.nn.functional.mse_loss(out, y), out

    mse_times_100.__qualname__ = "mse"  # the same name, another body
    assert run_dir(loss=mse_times_100) != base
    relabelled = regression_data(64, 0)
    relabelled.tensors = (relabelled.tensors[0], relabelled.tensors[1] + 1)
    assert run_dir(train_data=relabelled) != base


def test_a_restarted_torchrun_job_returns_only_the_run_it_finished_itself(tmp_path, monkeypatch, capsys):
    """Review finding: a torchrun restart returned any finished run in the run dir, also an older job's that
    this job (training in runs/NAME-2) never wrote. It returns one written after its agent started only."""
    from ddpkit import preflight as preflight_module

    args = dict(model=RegressionMLP(), train_data=regression_data(64, 0), test_data=regression_data(32, 1), loss_fn=mse)
    cfg = TrainConfig(nproc=1, run_dir=str(tmp_path / "r"), **SMALL)
    first = Trainer(cfg, **args).fit()
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")
    monkeypatch.setattr(preflight_module, "agent_started_at", lambda: first.summary["finished_at"] - 5)
    capsys.readouterr()
    assert Trainer(cfg, **args).fit().summary == first.summary  # this job's own: returned
    assert "torchrun restarted the job after it" in capsys.readouterr().out
    monkeypatch.setattr(preflight_module, "agent_started_at", lambda: first.summary["finished_at"] + 5)
    with pytest.raises(RunDirError, match="holds a finished run, left as it is"):  # an older job's: not returned
        Trainer(cfg, **args).fit()


def test_a_finished_run_says_how_to_train_again(tmp_path, capsys):
    args = dict(model=RegressionMLP(), train_data=regression_data(64, 0), test_data=regression_data(32, 1), loss_fn=mse)
    cfg = TrainConfig(nproc=1, run_dir=str(tmp_path / "r"), **SMALL)  # nproc as a plain int
    Trainer(cfg, **args).fit()
    capsys.readouterr()
    with pytest.raises(RunDirError) as refused:  # a run dir you named: left as it is
        Trainer(cfg, **args).fit()
    said = str(refused.value)
    assert "holds a finished run, left as it is" in said and "pass a new run_dir (--run-dir) or delete it" in said
    assert "pass --reuse-finished" in said and "--resume never" not in said


@pytest.mark.parametrize(
    "model,data,metrics,message",
    [
        (
            RegressionMLP(),
            "reg",
            {"mae": lambda out, b: ((out - b[1]).abs(), len(b[1]))},
            "metric 'mae' returned a sum of shape \\[2, 1\\].*add .sum\\(\\)",
        ),
        (RegressionMLP(), "cls2", {}, "outputs 1 value per sample; classification needs one logit per class"),
        (torch.nn.Linear(4, 2), "cls3", {}, "outputs 2 classes but the labels go up to 2"),
    ],
)
def test_mistakes_in_the_workload_are_one_line_before_launch(tmp_path, model, data, metrics, message):
    x = torch.randn(64, 4)
    labels = {"cls2": torch.arange(64) % 2, "cls3": torch.arange(64) % 3}.get(data)
    train = regression_data(64, 0) if data == "reg" else torch.utils.data.TensorDataset(x, labels)
    loss = mse if data == "reg" else None
    with pytest.raises(TaskError, match=message):
        Trainer(
            TrainConfig(nproc="2", run_dir=str(tmp_path / "r"), **SMALL),
            model=model,
            train_data=train,
            test_data=train,
            loss_fn=loss,
            metrics=metrics,
        ).fit()


def test_a_metric_reading_outputs_that_loss_fn_did_not_return_says_so(tmp_path):
    def bare(model, batch):
        return torch.nn.functional.mse_loss(model(batch[0]), batch[1])

    with pytest.raises(TaskError, match="metric 'mae' raised TypeError.*outputs=None: loss_fn returned only the loss"):
        Trainer(
            TrainConfig(nproc="1", run_dir=str(tmp_path / "r"), **SMALL),
            model=RegressionMLP(),
            train_data=regression_data(64, 0),
            test_data=regression_data(32, 1),
            loss_fn=bare,
            metrics={"mae": mae},
        ).fit()


def test_an_attempt_that_saved_nothing_does_not_lock_its_run_dir(tmp_path, capsys):
    """Regression: after a crash at step 0 and a fix, the rerun was refused as 'a different config'."""
    run = tmp_path / "r"
    data = dict(train_data=regression_data(64, 0), test_data=regression_data(32, 1), loss_fn=mse)
    Trainer(TrainConfig(nproc="1", run_dir=str(run), **SMALL), model=RegressionMLP(), **data).fit()
    shutil.rmtree(run / "checkpoints")
    (run / "model.pt").unlink()
    (run / "summary.json").unlink()  # what a crash before the first snapshot leaves: config.toml, metrics.jsonl
    result = Trainer(TrainConfig(nproc="1", run_dir=str(run), **SMALL), model=RegressionMLP(hidden=8), **data).fit()
    assert result["steps"] == 4 and "starting over in it" in capsys.readouterr().out


FORGOT_GUARD = """
import torch
from torch.utils.data import TensorDataset
from ddpkit import TrainConfig, Trainer
x = torch.randn(32, 4); y = torch.arange(32) % 2
data = TensorDataset(x, y)
# 1 process with restarts: 2 threads per rank on 2 cores, so workers come from the forkserver, which imports this
Trainer(TrainConfig(nproc="1", max_restarts=1, device="cpu", batch_size=8, epochs=1, progress=False, num_workers=0,
                    run_dir={run!r}), model=torch.nn.Linear(4, 2), train_data=data, test_data=data).fit()  # no guard
"""


@pytest.mark.slow
@pytest.mark.multiprocess
def test_a_script_without_the_main_guard_gets_one_line_not_a_bootstrap_traceback(tmp_path):
    script = tmp_path / "train.py"
    script.write_text(FORGOT_GUARD.format(run=str(tmp_path / "r")))
    proc = run_python(script)
    assert proc.returncode != 0
    # fit() raises in the calling script, as an API call does, before any worker starts: neither
    # multiprocessing's bootstrap traceback nor a line from every rank; uncaught, it is said as every ddpkit
    # error a script leaves uncaught is (issue 41, case 6): one line and its exit status, no traceback
    assert "bootstrapping phase" not in proc.stderr and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    said = [line for line in proc.stderr.splitlines() if line.startswith("ddpkit: error:")]
    assert len(said) == 1 and proc.returncode == 2, proc.stderr[-3000:]
    assert said[0].startswith(f"ddpkit: error: {script}:9 starts the workers when the script is imported")
    assert not (tmp_path / "r").exists()


@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.parametrize(
    "call", ["sys.exit(run_reporting_errors(lambda: launch(buggy, nproc=2)))", "launch(buggy, nproc=2)"]
)
def test_a_bug_in_a_worker_is_named_with_its_rank_and_exception(tmp_path, call):
    """Regression: the last line said only 'worker(s) failed: rank 0 exit code 4' (the survivor's). And a script
    calling launch() as the porter's seed 003 did, with nothing around it: the launcher's own traceback followed
    the worker's."""
    code = (
        "import sys; from ddpkit import launch; from ddpkit.cli import run_reporting_errors\n"
        "def buggy(ctx):\n"
        "    import torch\n"
        "    if ctx.rank == 1: raise ValueError('my bug on rank 1')\n"
        "    ctx.all_reduce(torch.ones(1))\n"
        f"if __name__ == '__main__': {call}\n"
    )
    script = tmp_path / "loop.py"
    script.write_text(code)
    proc = run_python(script)
    assert proc.returncode == 1
    assert "ValueError: my bug on rank 1" in proc.stderr  # the traceback, kept: it is a bug
    assert proc.stderr.count("Traceback (most recent call last)") == 1, proc.stderr  # the worker's alone
    errors = [line for line in proc.stderr.splitlines() if line.startswith("ddpkit: error:")]
    assert errors == ["ddpkit: error: rank 1 raised ValueError: my bug on rank 1 (its traceback is above)"], (
        proc.stderr[-2000:]
    )


def test_max_steps_stops_mid_epoch_and_float64_reaches_the_model_and_its_batches(tmp_path, capsys):
    torch.manual_seed(0)
    model = RegressionMLP()  # float32: --dtype float64 converts it, and the float32 data too
    result = Trainer(
        TrainConfig(
            nproc="1", max_steps=3, dtype="float64", quiet=True, run_dir=str(tmp_path / "r"), **dict(SMALL, epochs=5)
        ),
        model=model,
        train_data=regression_data(256, 0),
        test_data=regression_data(64, 1),
        loss_fn=mse,
    ).fit()
    assert result["steps"] == 3 and result["epochs"] == 5  # 8 steps per epoch: stopped 3 steps in
    state = torch.load(result.run_dir / "model.pt", weights_only=True)
    assert all(v.dtype == torch.float64 for v in state.values())
    records = [json.loads(line) for line in (result.run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records if r["event"] == "step"] == [3]  # the last step always logs
    assert len([r for r in records if r["event"] == "epoch"]) == 1
    assert "[epoch]" not in capsys.readouterr().out  # quiet


def test_a_dataloader_is_taken_as_users_hold_their_data(tmp_path, capsys):
    """Regression: a DataLoader as train_data died with "'DataLoader' object is not subscriptable"."""
    from torch.utils.data import DataLoader

    seen = []

    def collate(items):
        seen.append(len(items))
        return torch.stack([x for x, _ in items]), torch.stack([y for _, y in items])

    loader = DataLoader(regression_data(64, 0), batch_size=16, shuffle=True, collate_fn=collate)
    cfg = TrainConfig(nproc="1", device="cpu", epochs=1, progress=False, num_workers=0, run_dir=str(tmp_path / "r"))
    result = Trainer(cfg, model=RegressionMLP(), train_data=loader, test_data=regression_data(16, 1), loss_fn=mse).fit()
    said = [line for line in capsys.readouterr().out.splitlines() if "is a DataLoader" in line]
    assert len(said) == 1
    assert "its dataset, collate_fn, batch_size 16 as the global batch" in said[0] and "RandomSampler" in said[0]
    assert result["steps"] == 4 and result["global_batch_size"] == 16 and seen  # its collate_fn made the batches


def test_a_dataloaders_batch_sampler_gives_its_batch_size(tmp_path, capsys):
    """Regression: a DataLoader built with batch_sampler=BatchSampler(...) has batch_size None, so its batch
    was lost and the run was refused for a "--batch-size 256" nobody gave (the recipe's, over 44 samples)."""
    from torch.utils.data import BatchSampler, DataLoader, RandomSampler

    data = regression_data(44, 0)
    loader = DataLoader(data, batch_sampler=BatchSampler(RandomSampler(data), batch_size=8, drop_last=False))
    cfg = TrainConfig(nproc="1", device="cpu", epochs=1, progress=False, num_workers=0, run_dir=str(tmp_path / "r"))
    result = Trainer(cfg, model=RegressionMLP(), train_data=loader, test_data=regression_data(16, 1), loss_fn=mse).fit()
    said = [line for line in capsys.readouterr().out.splitlines() if "is a DataLoader" in line]
    assert len(said) == 1
    assert "its batch_sampler's batch_size 8 as the global batch" in said[0]
    assert "RandomSampler" in said[0]  # the sampler inside the BatchSampler, not the loader's unused default
    assert "the last partial batch of each epoch (4 samples) is dropped" in said[0]  # its drop_last=False, said
    assert result["global_batch_size"] == 8 and result["steps"] == 44 // 8


class Buckets(torch.utils.data.Sampler):
    """A batch sampler of the user's own: batches it chooses (here, by parity), which ddpkit cannot follow."""

    def __init__(self, n: int):
        self.n = n

    def __iter__(self):
        yield from ([i for i in range(self.n) if i % 2 == p] for p in (0, 1))

    def __len__(self):
        return 2


@pytest.mark.parametrize("which", ["train_data", "test_data"])
@pytest.mark.parametrize(
    "loader, message",
    [
        (
            lambda: torch.utils.data.DataLoader(regression_data(32, 0), batch_size=None),
            r"is a DataLoader with batch_size=None \(automatic batching off: each item of its dataset is taken "
            r"as a whole batch\); ddpkit batches single samples by index: pass DataLoader\(dataset, batch_size=N",
        ),
        (
            lambda: torch.utils.data.DataLoader(regression_data(32, 0), batch_sampler=Buckets(32)),
            r"is a DataLoader with its own batch_sampler \(Buckets\), which ddpkit cannot follow",
        ),
    ],
    ids=["batch_size None", "own batch_sampler"],
)
def test_a_dataloader_whose_batches_ddpkit_cannot_make_is_one_line(which, loader, message):
    """Regression: batch_size=None took default_convert as the collate_fn (batches of 256 unstacked
    samples), and a batch sampler of the user's own was dropped without a word."""
    from ddpkit.errors import DataError

    data = {"train_data": regression_data(32, 0), "test_data": regression_data(16, 1), which: loader()}
    with pytest.raises(DataError, match=f"^{which} {message}"):
        Trainer(TrainConfig(nproc="1", device="cpu"), model=RegressionMLP(), loss_fn=mse, **data)


@pytest.mark.parametrize("kind", ["iterable", "no length"])
def test_data_ddpkit_cannot_shard_by_index_is_one_line(kind):
    """Regression: an IterableDataset gave "object of type ... has no len()" from deep inside."""
    from ddpkit.errors import DataError

    class Stream(torch.utils.data.IterableDataset):
        def __iter__(self):
            yield from regression_data(8, 0)

    class NoLength:
        def __getitem__(self, i):
            return regression_data(8, 0)[i]

    data = Stream() if kind == "iterable" else NoLength()
    said = (
        "train_data is an IterableDataset without __len__: give it one"  # a stream trains, given its length
        if kind == "iterable"
        else "train_data is a NoLength, which ddpkit cannot split"
    )
    with pytest.raises(DataError, match=said):
        Trainer(TrainConfig(nproc="1"), model=RegressionMLP(), train_data=data, loss_fn=mse)


def test_fit_decides_once_and_leaves_the_config_as_asked(tmp_path, monkeypatch):
    """Issue 34's seam: the config was resolved twice per fit and the launch spec built three times (each may
    read SLURM's variables into os.environ and print), and preflight wrote its unused-parameter decision
    into the config. Now one Plan is made once: one recipe fill, one LaunchSpec, and the decision beside the
    config (the start record says it), config.toml keeping what was asked."""
    from torch.utils.data import TensorDataset
    from user_code import UnusedBranch

    from ddpkit import recipes
    from ddpkit.ranks import launcher

    calls = {"fill": 0, "spec": 0}
    fill, spec = recipes.apply, launcher.LaunchSpec.from_config.__func__

    def counted_fill(cfg):
        calls["fill"] += 1
        return fill(cfg)

    def counted_spec(cls, cfg, resumable=True):
        calls["spec"] += 1
        return spec(cls, cfg, resumable)

    monkeypatch.setattr(recipes, "apply", counted_fill)
    monkeypatch.setattr(launcher.LaunchSpec, "from_config", classmethod(counted_spec))
    cfg = TrainConfig(nproc=1, ddp=True, run_dir=str(tmp_path / "r"), **{**SMALL, "batch_size": 16, "epochs": 1})
    gen = torch.Generator().manual_seed(0)
    data = TensorDataset(torch.randn(80, 2, generator=gen), torch.randint(0, 3, (80,), generator=gen))
    result = Trainer(cfg, model=UnusedBranch(), train_data=data, test_data=data).fit()
    assert calls == {"fill": 1, "spec": 1}
    start = json.loads((result.run_dir / "metrics.jsonl").read_text().splitlines()[0])
    assert start["find_unused_parameters"] is True  # found by the trial step, and DDP searched (it trained)
    assert "find_unused_parameters" not in (result.run_dir / "config.toml").read_text()
