"""What ``ddpkit check``'s randomness rule rests on: on models without randomness (or with only the
dropout check switches off), how far the seeds run (the reference again, its generators seeded
apart) and the noise run (rounding only) move each tensor, in float32 and float64.

    python benchmarks/check_noise.py              # the table, on this machine (CPU)
    python benchmarks/check_noise.py --json out.json

The seeds run must be 0 (bitwise the reference) on every such model, for ``FLOOR[dtype]`` to be
a safe randomness threshold; the noise run shows the rounding a tolerance must allow for.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "helpers"))

from random_models import AttentionDropout, DropoutMLP  # noqa: E402
from user_code import (  # noqa: E402
    BatchNormMLP,
    RegressionMLP,
    TinyTransformer,
    mse,
    regression_data,
    token_classes,
    uneven_data,
)

from ddpkit import TrainConfig  # noqa: E402
from ddpkit.tools.check import check  # noqa: E402

SMALL = dict(device="cpu", limit_train=256, limit_test=64, batch_size=32, num_workers=0)


def table() -> list[tuple]:
    """(name, model factory, train data, loss, config)"""
    return [
        ("RegressionMLP", RegressionMLP, regression_data(256, 0), mse, TrainConfig(**SMALL)),
        ("DropoutMLP (dropout off)", DropoutMLP, regression_data(256, 0), mse, TrainConfig(**SMALL)),
        ("BatchNormMLP + SyncBN", BatchNormMLP, uneven_data(256), mse, TrainConfig(**SMALL)),
        ("AttentionDropout (dropout off)", AttentionDropout, regression_data(256, 0), mse, TrainConfig(**SMALL)),
        ("TinyTransformer", TinyTransformer, token_classes(256, 0), None, TrainConfig(**SMALL)),
        (
            "convnet + SyncBN, mnist",
            None,
            None,
            None,
            TrainConfig(model="convnet", dataset="mnist", recipe="mnist", **dict(SMALL, batch_size=64)),
        ),
        (
            "resnet9 + SyncBN, synthetic",
            None,
            None,
            None,
            TrainConfig(model="resnet9", dataset="synthetic", synthetic_shape="3,16,16", synthetic_size=256, **SMALL),
        ),
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--json", default="")
    args = parser.parse_args()
    rows = []
    for name, factory, data, loss, cfg in table():
        for dtype in ("float64", "float32"):
            torch.manual_seed(0)
            model = factory() if factory else None
            rep = check(model, data, config=cfg, nproc=2, steps=args.steps, loss_fn=loss, dtype=dtype)
            worst_noise = max(rep.tensors, key=lambda t: t.noise)
            row = {
                "model": name,
                "dtype": dtype,
                "verdict": rep.verdict,
                "seeds_max_rel_diff": rep.seeds_diff,
                "noise_max": worst_noise.noise,
                "noise_max_tensor": worst_noise.name,
                "test_max_rel_diff": max(t.diff for t in rep.tensors),
            }
            rows.append(row)
            print(json.dumps(row), flush=True)
    print()
    print("| model | dtype | verdict | seeds run, max diff | noise run, max (tensor) | 2 processes, max diff |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {r['model']} | {r['dtype']} | {r['verdict']} | {r['seeds_max_rel_diff']:.2g} | "
            f"{r['noise_max']:.2g} ({r['noise_max_tensor']}) | {r['test_max_rel_diff']:.2g} |"
        )
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=2) + "\n")


if __name__ == "__main__":
    main()
