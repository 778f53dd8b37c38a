"""What a test pays to launch a run: from a fresh interpreter, or from a process that has launched before.

    python benchmarks/launch_cost.py              # 3 alternated pairs, medians
    python benchmarks/launch_cost.py --repeats 5

The run is tests/system/test_fault_tolerance.py's (tests/helpers/custom_train.py: the MNIST ConvNet at world 2,
2,000 images, 2 epochs of 20 steps, a 0.03 s sleep per step). "fresh" starts ``python custom_train.py SPEC``:
an interpreter, ``import torch``, the launcher, a new forkserver (torch and dynamo imported again), the workers.
"warm" calls ``custom_train.trainer(spec).fit()`` in this process, as a test does from its pytest worker: its
forkserver, started by the first launch, forks the workers (the first warm launch, which starts it, is left out).
Both give the same model.pt, bit for bit (checked here). The two alternate, so a slow spell hits both alike.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests" / "helpers"))

import custom_train  # noqa: E402 - tests/helpers, put on the path above
from clirun import cli_env  # noqa: E402

CONFIG = custom_train.BASE  # test_fault_tolerance.py's run


def spec(run_dir: Path) -> dict:
    return {"fault": "slow", "seconds": 0.03, "config": {**CONFIG, "run_dir": str(run_dir)}}


def fresh(run_dir: Path) -> float:
    t = time.perf_counter()
    done = subprocess.run(
        [sys.executable, str(ROOT / "tests" / "helpers" / "custom_train.py"), json.dumps(spec(run_dir))],
        env=cli_env(),
        capture_output=True,
        text=True,
    )
    if done.returncode != 0:
        raise SystemExit(done.stderr[-2000:])
    return time.perf_counter() - t


def warm(run_dir: Path) -> float:
    t = time.perf_counter()
    custom_train.trainer(spec(run_dir)).fit()
    return time.perf_counter() - t


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--repeats", type=int, default=3)
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        warm(root / "first")  # starts this process's forkserver: not timed
        times: dict[str, list[float]] = {"fresh": [], "warm": []}
        for i in range(args.repeats):
            times["fresh"].append(fresh(root / f"fresh{i}"))
            times["warm"].append(warm(root / f"warm{i}"))
        a, b = (torch.load(root / f"{k}0" / "model.pt", weights_only=True) for k in ("fresh", "warm"))
        same = all(torch.equal(a[k], b[k]) for k in a)
    med = {k: statistics.median(v) for k, v in times.items()}
    print("| launch | median s | runs s |\n|---|---|---|")
    for k, v in times.items():
        print(f"| {k} | {med[k]:.2f} | {', '.join(f'{x:.2f}' for x in v)} |")
    print(f"fresh / warm: {med['fresh'] / med['warm']:.2f}x; model.pt bitwise equal: {same}")


if __name__ == "__main__":
    main()
