"""Your training, exactly as you wrote it: what ddpkit does and never does to code you pass in."""

from __future__ import annotations

import dataclasses
import json

import plain_ddp
import pytest
import torch
from clirun import free_port

from ddpkit import TrainConfig, Trainer


@pytest.mark.slow
@pytest.mark.multiprocess
def test_a_plain_ddp_loop_ported_with_default_settings_gives_its_losses_step_for_step(tmp_path):
    """Regression: the user's AdamW at a constant 1e-3 was driven by the default onecycle schedule
    (a minGPT port reached test loss 2.16 where its own loop reached 0.048). The same model, data,
    seeds, batch and clipping through ddpkit with nothing else set must give the plain loop's losses."""
    world = 2
    plain = plain_ddp.plain_losses(world, free_port(), str(tmp_path / "plain.pt"))
    result = Trainer(
        TrainConfig(
            nproc=str(world),
            device="cpu",
            batch_size=plain_ddp.BATCH,
            epochs=plain_ddp.EPOCHS,
            clip_grad_norm=plain_ddp.CLIP,
            log_every=1,
            progress=False,
            run_dir=str(tmp_path / "run"),
        ),
        model=plain_ddp.model(),
        train_data=plain_ddp.data(),
        test_data=plain_ddp.data(),
        optimizer=plain_ddp.optimizer,
    ).fit()
    records = [json.loads(line) for line in (result.run_dir / "metrics.jsonl").read_text().splitlines()]
    start = next(r for r in records if r["event"] == "start")
    assert start["lr_policy"] == "your AdamW at lr 0.001, constant"
    assert start["changes"] == "grad norm clipped to 1"  # what was asked for, and nothing else
    # Each rank's dropout stream is seeded on your behalf: said (the porter's seed-001 port found it said nowhere
    # on the [start] line, where a plain script seeding every rank alike drew other masks)
    assert start["rank_seeds"] == "torch 0 + 1 + rank, numpy and random from (0, rank)"
    steps = [r for r in records if r["event"] == "step"]
    assert [r["lr"] for r in steps] == [plain_ddp.LR] * len(plain)
    ours = [r["loss"] for r in steps]
    assert len(ours) == len(plain) == plain_ddp.EPOCHS * (200 // plain_ddp.BATCH)
    # float32 reduction-order noise in a loss of ~1 is ~1e-7; a schedule or a changed step is ~1e-2
    assert max(abs(a - b) for a, b in zip(ours, plain)) < 1e-5, list(zip(ours, plain))


def test_a_model_you_pass_keeps_its_precision_and_memory_format_unless_you_ask():
    """Regression: on a CPU with bf16 instructions, a user's model on MNIST got the recipe's bf16
    autocast, and a user's conv model got channels_last, neither asked for nor stated."""
    from ddpkit import recipes

    bf16_cpu = frozenset({"avx512_bf16"})
    builtin = recipes.apply(TrainConfig(dataset="mnist", device="cpu"), bf16_cpu)
    assert builtin.amp == "bf16" and builtin.channels_last  # ddpkit's own ConvNet: the measured recipe
    yours = recipes.apply(TrainConfig(dataset="mnist", device="cpu", model="custom:Net#1a2b3c4d"), bf16_cpu)
    assert yours.amp == "none" and yours.channels_last is False
    asked = recipes.apply(
        TrainConfig(dataset="mnist", device="cpu", model="custom:Net#1a2b3c4d", amp="bf16", channels_last=True),
        bf16_cpu,
    )
    assert asked.amp == "bf16" and asked.channels_last


def test_your_optimizer_runs_at_its_own_lr_unless_a_schedule_is_asked_for():
    own = dict(optimizer="custom:AdamW#1a2b3c4d", dataset="custom:TensorDataset#1a2b3c4d")
    assert TrainConfig(**own).resolved().schedule == "constant"
    assert TrainConfig(**own).resolved().warmup_frac is None  # nothing claims a warm-up that does not run
    asked = TrainConfig(**own, schedule="cosine", warmup_frac=0.1).resolved()
    assert (asked.schedule, asked.warmup_frac) == ("cosine", 0.1)
    assert TrainConfig(dataset="synthetic").resolved().schedule == "onecycle"  # ddpkit's own optimizer: the recipe's


def test_the_start_line_states_the_lr_policy_and_every_change_in_words():
    from ddpkit.train.optim import changes, lr_policy

    model = torch.nn.Linear(2, 1)
    adamw = torch.optim.AdamW(model.parameters(), lr=3e-4)
    cfg = TrainConfig(optimizer="custom:AdamW#1a2b3c4d", dataset="custom:T#1a2b3c4d").resolved()
    assert lr_policy(cfg, adamw, True, None, False) == "your AdamW at lr 0.0003, constant"
    sched = torch.optim.lr_scheduler.LambdaLR(adamw, lambda step: 0.5)
    assert lr_policy(cfg, adamw, True, sched, True) == "your AdamW at lr 0.0003, your LambdaLR each step"
    built = TrainConfig(dataset="mnist", recipe="mnist").resolved()
    sgd = torch.optim.SGD(model.parameters(), lr=built.lr)
    assert lr_policy(built, sgd, False, None, False) == (
        "sgd at lr 0.1 (momentum 0.9 nesterov, weight decay 0.0005) as the peak, onecycle: "
        "0.15 of the steps warm-up then linear to 0"
    )
    assert changes(cfg, applies_conv=False) == "none"
    many = TrainConfig(dataset="cifar10", sync_bn=True, clip_grad_norm=1.0, ema=0.99).resolved()
    assert changes(many, applies_conv=True) == (
        "SyncBatchNorm, channels_last, grad norm clipped to 1, weight EMA 0.99 (eval uses it), "
        "label smoothing 0.2, flip TTA at eval"
    )


# ---------------------------------------------------------------- divergence is not success
def test_the_divergence_watch_flags_a_loss_far_above_its_start_once():
    from ddpkit.train.metrics import DivergenceWatch

    watch = DivergenceWatch()
    assert [watch.check(x, s) for s, x in enumerate([3.07, 2.5, 9.0, 56.8, 70.0], 1)] == [
        False,
        False,
        False,
        True,  # 56.8 > 10 x 3.07: said once
        False,
    ]
    assert watch.diverged_at_step == 4
    near_zero = DivergenceWatch()
    assert not any(near_zero.check(x, s) for s, x in enumerate([1e-4, 5e-3, 0.5], 1))  # tenfold, but within 1
    assert not DivergenceWatch(first_loss=-2.0).check(30.0, 5)  # a loss below 0 (a log-likelihood) has no ratio
    assert not DivergenceWatch(first_loss=1.0).check(float("nan"), 5)  # non-finite: --on-nan's business


class Rising:
    """A loss 500 above the model's error from the second step on (the first call is the check before
    launch): a run that diverges, as far as its loss tells, without becoming non-finite; the gradients
    are the plain MSE's."""

    def __init__(self):
        self.calls = 0

    def __call__(self, model, batch):
        self.calls += 1
        out = model(batch[0])
        return torch.nn.functional.mse_loss(out, batch[1]) + (0.0 if self.calls <= 2 else 500.0), out


def test_a_diverging_run_says_so_in_one_line_and_in_its_summary(tmp_path, capsys):
    from user_code import RegressionMLP, regression_data

    result = Trainer(
        TrainConfig(nproc="1", device="cpu", batch_size=16, epochs=1, log_every=1, run_dir=str(tmp_path / "r")),
        model=RegressionMLP(),
        train_data=regression_data(128, 0),
        test_data=regression_data(16, 1),
        loss_fn=Rising(),
    ).fit()
    out = capsys.readouterr().out
    said = [line for line in out.splitlines() if "training is diverging" in line]
    assert len(said) == 1 and "The likely cause is the learning rate (sgd at lr 0.05" in said[0]
    assert "for a global batch of 16" in said[0]
    assert result["diverged_at_step"] == 2 and "this run diverged at step 2" in out


@pytest.mark.slow
@pytest.mark.multiprocess
def test_the_cnn_converges_on_an_image_folder_with_the_recipe_defaults(tmp_path, capsys):
    """Regression: `--model cnn` on an ImageFolder took the resnet recipe's lr 0.1 with a 100M-weight
    classifier at 224 px, went from loss 3.07 to 56.8 and finished at chance, exit 0, no warning."""
    import numpy as np
    from PIL import Image

    rng = np.random.default_rng(0)
    colours = [(200, 40, 40), (40, 200, 40), (40, 40, 200), (200, 200, 40)]
    for split, n in (("train", 48), ("val", 12)):
        for c, colour in enumerate(colours):
            folder = tmp_path / "images" / split / f"c{c}"
            folder.mkdir(parents=True)
            for i in range(n):
                pixels = np.clip(rng.normal(colour, 60, (48, 48, 3)), 0, 255).astype(np.uint8)
                Image.fromarray(pixels).save(folder / f"{i}.png")
    cfg = TrainConfig(
        dataset=f"imagefolder:{tmp_path / 'images'}",
        model="cnn",
        image_size=64,
        epochs=4,
        batch_size=64,
        device="cpu",
        nproc="1",
        log_every=1,
        run_dir=str(tmp_path / "r"),
    )
    assert cfg.resolved().lr == 0.02  # the resnet18 recipe's, less its lr
    result = Trainer(cfg).fit()
    steps = [json.loads(line) for line in (result.run_dir / "metrics.jsonl").read_text().splitlines()]
    losses = [r["loss"] for r in steps if r["event"] == "step"]
    assert result["diverged_at_step"] is None and "diverging" not in capsys.readouterr().out
    assert max(losses) < 2 * losses[0] and losses[-1] < 0.2 * losses[0]
    assert result["test_accuracy"] > 0.9


def test_a_model_specific_lr_never_lands_on_your_own_optimizer():
    """Review: BY_MODEL put lr 0.02 back into a config whose optimizer is yours, recording an lr nobody used."""
    from ddpkit import recipes

    yours = recipes.apply(TrainConfig(dataset="synthetic", model="cnn", optimizer="custom:AdamW#1a2b3c4d"))
    assert yours.lr is None and yours.schedule == "constant"
    assert recipes.apply(TrainConfig(dataset="synthetic", model="cnn")).lr == 0.02


def times50(items):
    """A collate_fn that changes the data: the inputs multiplied by 50."""
    x, y = torch.utils.data.default_collate(items)
    return x * 50, y


@pytest.mark.parametrize("given", ["collate_fn=", "a DataLoader's"])
def test_your_collate_fn_makes_every_batch_of_a_tensor_dataset(tmp_path, given):
    """Regression: a TensorDataset with a collate_fn (passed beside it, or in a DataLoader over it) was
    indexed in memory and the collate never ran: the run trained as if none were given. Trained in float64,
    a run with the collate must equal, bitwise, one on inputs multiplied by 50 ahead, and differ from one
    on the inputs as they are."""
    from torch.utils.data import DataLoader, TensorDataset
    from user_code import RegressionMLP, mse, regression_data

    x, y = regression_data(64, 0, dtype=torch.float64).tensors

    def trained(name: str, data, **kw) -> tuple[dict, dict]:
        torch.manual_seed(0)
        model = RegressionMLP(dtype=torch.float64)
        cfg = TrainConfig(nproc="1", device="cpu", batch_size=16, epochs=2, dtype="float64", num_workers=0)
        result = Trainer(
            dataclasses.replace(cfg, progress=False, run_dir=str(tmp_path / name)),
            model=model,
            train_data=data,
            test_data=regression_data(16, 1, dtype=torch.float64),
            loss_fn=mse,
            **kw,
        ).fit()
        records = [json.loads(line) for line in (result.run_dir / "metrics.jsonl").read_text().splitlines()]
        return model.state_dict(), next(r for r in records if r["event"] == "start")

    plain, plain_start = trained("plain", TensorDataset(x, y))
    scaled, _ = trained("scaled", TensorDataset(x * 50, y))
    if given == "collate_fn=":
        ours, start = trained("collate", TensorDataset(x, y), collate_fn=times50)
    else:
        ours, start = trained("collate", DataLoader(TensorDataset(x, y), batch_size=16, collate_fn=times50))
    assert not all(torch.equal(plain[k], scaled[k]) for k in plain)  # the collate changes what is learnt
    assert all(torch.equal(ours[k], scaled[k]) for k in plain)  # and it made every training batch
    assert plain_start["data_path"] == "in-memory" and "indexed in place" in plain_start["data"]
    assert start["data_path"] == "dataloader" and "train streamed (a collate_fn is given" in start["data"]


def test_data_path_device_with_a_collate_fn_is_refused_before_launch(tmp_path):
    """Regression: --data-path device took a TensorDataset given with a collate_fn as held in memory and
    indexed it, the collate never called; batches that only a DataLoader makes cannot be held in memory."""
    from torch.utils.data import TensorDataset
    from user_code import RegressionMLP, mse, regression_data

    from ddpkit.errors import ConfigError

    x, y = regression_data(64, 0).tensors
    cfg = TrainConfig(nproc="1", device="cpu", batch_size=16, data_path="device", run_dir=str(tmp_path / "r"))
    data = TensorDataset(x, y)
    trainer = Trainer(cfg, model=RegressionMLP(), train_data=data, test_data=data, loss_fn=mse, collate_fn=times50)
    with pytest.raises(ConfigError, match=r"--data-path device needs a dataset held in memory.*a collate_fn is given"):
        trainer.fit()
    assert not (tmp_path / "r").exists()  # nothing written


@pytest.mark.multiprocess
def test_a_dataloaders_worker_init_fn_runs_in_every_loader_worker(tmp_path, monkeypatch, capsys):
    """Review finding: a DataLoader passed as train_data lost its worker_init_fn without a word (one that
    opens a per-worker file or shard then never ran). It runs in each of ddpkit's loader workers, train and
    eval, and the one-line message says it is used."""
    from torch.utils.data import DataLoader
    from user_code import RegressionMLP, mark_worker, mse, regression_data

    marks = tmp_path / "marks"
    marks.mkdir()
    monkeypatch.setenv("USER_CODE_MARKS", str(marks))
    loader = DataLoader(regression_data(64, 0), batch_size=16, num_workers=2, worker_init_fn=mark_worker)
    run_dir = str(tmp_path / "r")
    cfg = TrainConfig(nproc="1", device="cpu", epochs=1, progress=False, data_path="loader", run_dir=run_dir)
    Trainer(cfg, model=RegressionMLP(), train_data=loader, test_data=regression_data(16, 1), loss_fn=mse).fit()
    assert "worker_init_fn" in capsys.readouterr().out.split("is a DataLoader: ddpkit uses")[1].split(";")[0]
    started = sorted(p.name.split("-pid-")[0] for p in marks.iterdir())
    assert started.count("worker-0") >= 2 and started.count("worker-1") >= 2, started  # the train and eval loaders
