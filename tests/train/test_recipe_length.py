"""The MNIST recipe at any length: its peak lr scaled to the run's optimizer steps, and only where ddpkit chose it.

Issue 41, case 9: ``ddpkit train --dataset mnist --nproc 1 --limit-train 2000 --epochs 1`` (15 steps) diverged at
the recipe's peak lr 0.1 and ended at 11.7% test accuracy, where plain Adam at lr 1e-3 reaches 80-85%.
"""

from __future__ import annotations

import math

import pytest
import torch

from ddpkit import TrainConfig, Trainer, recipes
from ddpkit.train.optim import build_optimizer, build_schedule, lr_depends_on_total, lr_policy, peak_scale

CPU = torch.device("cpu")


def schedule(cfg: TrainConfig, steps: int, model: torch.nn.Module | None = None):
    opt = build_optimizer(model or torch.nn.Linear(2, 2), cfg, CPU)
    return opt, build_schedule(opt, cfg, steps)


@pytest.mark.parametrize(
    "steps,peak,warmup", [(15, 0.1 * math.sqrt(15 / 900), 2), (45, 0.1 * math.sqrt(45 / 900), 7), (1000, 0.1, 150)]
)
def test_the_recipes_peak_is_scaled_below_900_steps_and_its_warm_up_is_a_fraction_of_them(steps, peak, warmup):
    cfg = TrainConfig(dataset="mnist", recipe="mnist").resolved()
    assert (cfg.lr, cfg.full_lr_steps, cfg.warmup_frac) == (0.1, 900, 0.15)
    opt, sched = schedule(cfg, steps)
    assert sched.base_lrs == [pytest.approx(peak, rel=1e-12)]
    assert sched.lr_lambdas[0].warmup == warmup
    lrs = list(sched.table[0])
    assert max(lrs) == lrs[warmup] == pytest.approx(peak, rel=1e-12)  # the peak, at the warm-up's end
    assert lrs[0] == pytest.approx(peak / 25) and lrs[steps] == 0.0  # onecycle: from peak/25, down to 0


def test_the_start_line_says_the_scaled_peak_and_the_lr_it_comes_from():
    cfg = TrainConfig(dataset="mnist", recipe="mnist").resolved()
    tail = "onecycle: 0.15 of the steps warm-up then linear to 0"
    opt, sched = schedule(cfg, 15)
    assert lr_policy(cfg, opt, False, sched, False) == (
        f"sgd at lr {0.1 * math.sqrt(15 / 900):g} (momentum 0.9 nesterov, weight decay 0.0005) as the peak "
        f"(scaled for a 15-step run; 0.1 from 900 steps), {tail}"
    )
    opt, sched = schedule(cfg, 1000)
    assert lr_policy(cfg, opt, False, sched, False) == (
        f"sgd at lr 0.1 (momentum 0.9 nesterov, weight decay 0.0005) as the peak, {tail}"
    )


def test_the_bf16_recipe_scales_as_the_float32_one():
    """``--recipe auto`` picks mnist-cpu-bf16 on CPUs with native bf16: the same rule."""
    bf16 = recipes.apply(TrainConfig(dataset="mnist", device="cpu"), flags=frozenset({"avx512_bf16"}))
    assert (bf16.recipe, bf16.amp, bf16.lr, bf16.full_lr_steps) == ("mnist-cpu-bf16", "bf16", 0.1, 900)


@pytest.mark.parametrize(
    "given",
    [
        dict(lr=0.1),
        dict(lr=0.05),
        dict(schedule="constant"),
        dict(recipe="none"),
        dict(recipe="auto", dataset="cifar10"),
    ],
)
def test_an_lr_or_schedule_you_give_runs_as_given_at_any_length(given):
    """Fidelity: --lr 0.1 is 0.1 at 15 steps, and --schedule constant keeps the recipe's lr as it is. The
    recipes other than MNIST's have no such rule (unmeasured at short lengths)."""
    cfg = TrainConfig(**{"dataset": "mnist", "recipe": "mnist", **given}).resolved()
    assert cfg.full_lr_steps == 0
    opt, sched = schedule(cfg, 15)
    assert sched.base_lrs == [cfg.lr]
    assert "scaled" not in lr_policy(cfg, opt, False, sched, False)


def test_your_own_optimizer_is_never_scaled():
    cfg = TrainConfig(dataset="mnist", recipe="mnist", optimizer="custom:SGD#1a2b3c4d", schedule="onecycle")
    cfg = cfg.resolved()
    assert cfg.full_lr_steps == 0
    forced = TrainConfig(**{**cfg.to_dict(), "full_lr_steps": 900})  # even a config file's rule: not on yours
    assert peak_scale(forced, 15) == 1.0


def test_a_longer_horizon_is_refused_as_for_any_schedule_over_the_total_and_a_resume_keeps_its_curve():
    """The scaled peak depends on the total steps; it comes only with onecycle and cosine, whose curves do too,
    so a longer horizon is already refused for it (preflight.settle_run_dir). With constant, only a config
    file can set the rule, and then it is refused the same way. A snapshot holds the scaled peak as the
    schedule's base_lrs, so a resume goes on along the curve the run started on."""
    cfg = TrainConfig(dataset="mnist", recipe="mnist").resolved()
    assert lr_depends_on_total(cfg) == "the onecycle lr schedule spans the total steps"
    constant = TrainConfig(dataset="mnist", recipe="mnist", schedule="constant", full_lr_steps=900).resolved()
    assert lr_depends_on_total(constant) == "the lr is scaled for runs under 900 steps"
    model = torch.nn.Linear(2, 2)
    opt, sched = schedule(cfg, 15, model)
    for _ in range(5):
        opt.step()
        sched.step()
    saved_opt, saved_sched = opt.state_dict(), sched.state_dict()
    opt2, sched2 = schedule(cfg, 1000, torch.nn.Linear(2, 2))  # built for another length: the snapshot's wins
    opt2.load_state_dict(saved_opt)
    sched2.load_state_dict(saved_sched)
    for _ in range(5):
        for o, s in ((opt, sched), (opt2, sched2)):
            o.step()
            s.step()
        assert sched2.get_last_lr() == sched.get_last_lr()


def test_a_run_dir_written_before_the_rule_is_matched_on_the_rest_and_a_new_one_on_it():
    """A config.toml from before the rule reads full_lr_steps as unset: such a run resumes (its snapshot holds
    its own lr curve; tests/system/test_old_run_dir.py finishes one bitwise). A recorded value is compared."""
    cfg = TrainConfig(dataset="mnist", recipe="mnist").resolved()
    saved = cfg.to_dict()
    assert cfg.differing_keys({**saved, "full_lr_steps": None}) == []
    assert cfg.differing_keys({k: v for k, v in saved.items() if k != "full_lr_steps"}) == []
    assert cfg.differing_keys({**saved, "full_lr_steps": 0}) == ["full_lr_steps"]
    given = TrainConfig(dataset="mnist", recipe="mnist", lr=0.1).resolved()
    assert given.hash() != cfg.hash()  # --lr 0.1 is another run than the recipe's 0.1: short, they differ


@pytest.mark.slow
def test_fifteen_steps_on_2000_images_learn_mnist(tmp_path):
    """The issue's run, in-process (``--recipe auto``: the float32 recipe on the AVX2-only CPU conftest shows):
    11.7% before. Plain Adam at lr 1e-3 reaches 79.9-85.3% here and the recipe now 84.4-87.2% (seeds 0-4, sd
    1.2; BENCHMARKS.md, "Short runs"); this is seed 0, 87.2% on AMD. 80%, plain Adam's worst seed, leaves 7
    points for another CPU's last bits."""
    cfg = TrainConfig(
        dataset="mnist",
        limit_train=2000,
        epochs=1,
        nproc="1",
        device="cpu",
        progress=False,
        plots=False,
        quiet=True,
        run_dir=str(tmp_path / "r"),
    )
    result = Trainer(cfg).fit()
    assert result["steps"] == 15
    assert result["test_accuracy"] >= 0.80
    assert result["final_train_loss"] < 2.3  # below chance's log(10): no early divergence
