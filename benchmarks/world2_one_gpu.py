"""World size 2 on one GPU: the multi-rank CUDA paths a single-GPU machine can still run.

    python benchmarks/world2_one_gpu.py --out w2/                 # one GPU: two ranks on cuda:0, over gloo
    python benchmarks/world2_one_gpu.py --device cpu --out w2/    # the same procedures on the CPU (gloo)

NCCL refuses two ranks on one GPU, so both ranks share ``cuda:0`` over gloo, which moves CUDA
tensors through the host (``DDPKIT_SHARE_GPU=1``, ranks/context.py). Slow, and not a speed
figure: what it shows is that the code paths that only run at world >= 2 on CUDA work.

| check | what passes |
|---|---|
| --sync-bn, world 2 vs BN at world 1 | torch's SyncBatchNorm runs synchronised; step 1's loss within 1e-5 (relative) |
| --data-path host vs device, world 2 | the host-staged path trains the same bits (--deterministic) |
| SIGKILL one rank, restart, resume | model.pt bitwise equal to the uninterrupted world-2 run (--deterministic) |
| --cuda-graph on at world 2 | refused before launch in one line (DDP's capture is not built yet) |

Writes ``world2.json`` and ``world2.md`` to ``--out`` and prints the table. On the CPU the last
check is skipped (the capture is CUDA's; tests/train/test_graph.py emulates it).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE.parent / "src"), str(HERE)]

from faults import src_env, train_killing_one_worker  # noqa: E402

# MNIST, 2,560 samples and a global batch of 128: 20 steps an epoch, enough for a capture after 11.
COMMON = [
    "--dataset", "mnist", "--recipe", "mnist", "--limit-train", "2560", "--limit-test", "500", "--batch-size", "128",
    "--epochs", "2", "--log-every", "5", "--no-progress", "--no-plots",
]  # fmt: skip


class Runner:
    def __init__(self, device: str, work: Path):
        self.device, self.work, self.n = device, work, 0

    def run_dir(self) -> Path:
        self.n += 1
        return self.work / f"run{self.n}"

    def args(self, nproc: int, *extra: str) -> list[str]:
        return [*COMMON, "--device", self.device, "--nproc", str(nproc), *extra]

    def train(self, nproc: int, *extra: str, env: dict | None = None) -> Path:
        run_dir = self.run_dir()
        done = subprocess.run(
            [sys.executable, "-m", "ddpkit", "train", *self.args(nproc, *extra), "--run-dir", str(run_dir)],
            env={**src_env(), **(env or {})},
            capture_output=True,
            text=True,
            timeout=900,
        )
        if done.returncode != 0:
            tail = (done.stderr or done.stdout).strip().splitlines()[-3:]
            raise RuntimeError(f"ddpkit train {' '.join(extra)} at world {nproc} failed: {tail}")
        (run_dir / "stdout.txt").write_text(done.stdout)
        return run_dir


def records(run_dir: Path, event: str) -> list[dict]:
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [r for r in map(json.loads, lines) if r["event"] == event]


def summary(run_dir: Path) -> dict:
    return json.loads((run_dir / "summary.json").read_text())


def differing(a: Path, b: Path) -> list[str]:
    x = torch.load(a / "model.pt", map_location="cpu", weights_only=True)
    y = torch.load(b / "model.pt", map_location="cpu", weights_only=True)
    return [k for k in x if not torch.equal(x[k], y[k])]


def syncbn(r: Runner) -> dict:
    """SyncBN over two half-batches normalises over the global batch, as BN does at world 1."""
    # The first step's loss, from the same weights: only the order of float32 sums differs. On the CPU
    # (2026-11-23) it differed by 1.8e-6 (relative) with --sync-bn, and by 2.9e-4 without it (BN over each
    # rank's half of the batch): 1e-5 tells the two apart.
    first = ("--deterministic", "--log-every", "1", "--max-steps", "2")
    two = r.train(2, "--sync-bn", *first)
    one = r.train(1, *first)
    a, b = records(two, "step")[0]["loss"], records(one, "step")[0]["loss"]
    rel = abs(a - b) / abs(b)
    return {"passed": rel <= 1e-5, "world2_first_loss": a, "world1_first_loss": b, "relative_difference": rel}


def host_path(r: Runner) -> dict:
    host = r.train(2, "--data-path", "host", "--deterministic")
    device = r.train(2, "--data-path", "device", "--deterministic")
    diff = differing(host, device)
    return {
        "passed": not diff and summary(host)["data_path"] == "host-staged",
        "differing_tensors": diff,
        "paths": [summary(host)["data_path"], summary(device)["data_path"]],
    }


def resume(r: Runner) -> dict:
    args = r.args(2, "--deterministic", "--save-every-steps", "10", "--max-restarts", "1")
    ref = r.train(2, "--deterministic", "--save-every-steps", "10")
    killed = r.run_dir()
    code, _ = train_killing_one_worker(args, killed, 15)
    starts = records(killed, "start")
    diff = differing(ref, killed) if code == 0 else ["(the killed run failed)"]
    return {
        "passed": code == 0 and not diff,
        "exit_code": code,
        "resumed_at_step": [s.get("resumed_at_step") for s in starts],
        "differing_tensors": diff,
    }


def graph_refused(r: Runner) -> dict:
    """DDP's capture is not built: --cuda-graph on at world 2 on CUDA is refused before launch, in one line."""
    if r.device != "cuda":
        return {"passed": None, "skipped": "the capture is CUDA's (tests/train/test_graph.py emulates it)"}
    run_dir = r.run_dir()
    done = subprocess.run(
        [sys.executable, "-m", "ddpkit", "train", *r.args(2, "--cuda-graph", "on"), "--run-dir", str(run_dir)],
        env=src_env(),
        capture_output=True,
        text=True,
        timeout=600,
    )
    said = [line for line in done.stderr.splitlines() if "--cuda-graph on cannot capture" in line]
    return {
        "passed": done.returncode == 2 and len(said) == 1 and "world size > 1" in said[0] and not run_dir.exists(),
        "exit_code": done.returncode,
        "said": said,
    }


CHECKS = {"syncbn": syncbn, "host_path": host_path, "resume": resume, "graph_refused": graph_refused}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--only", default=",".join(CHECKS), help=f"comma-separated subset of {', '.join(CHECKS)}")
    args = p.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        print("no CUDA GPU visible: run on a GPU machine, or pass --device cpu", file=sys.stderr)
        return 2
    os.environ["DDPKIT_SHARE_GPU"] = "1"  # two ranks on cuda:0 over gloo (no effect on the CPU)
    args.out.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="ddpkit-world2-"))
    results = {}
    try:
        for name in args.only.split(","):
            t = time.monotonic()
            try:
                results[name] = CHECKS[name](Runner(args.device, work / name))
            except Exception as exc:  # one broken check must not hide the others
                traceback.print_exc()
                results[name] = {"passed": False, "error": f"{type(exc).__name__}: {exc}"[:400]}
            results[name]["seconds"] = round(time.monotonic() - t, 1)
            print(f"{name}: {results[name]}", flush=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    info = {
        "device": torch.cuda.get_device_name(0) if args.device == "cuda" else "cpu",
        "torch": torch.__version__,
        "date": time.strftime("%Y-%m-%d"),
    }
    verdict = {True: "passed", False: "FAILED", None: "skipped"}
    table = [
        f"World 2 on one {info['device']}, torch {info['torch']}, {info['date']}",
        "",
        "| check | result |",
        "|---|---|",
    ]
    table += [f"| {k} | {verdict[v['passed']]} |" for k, v in results.items()]
    (args.out / "world2.md").write_text("\n".join(table) + "\n")
    (args.out / "world2.json").write_text(json.dumps({"environment": info, "checks": results}, indent=2) + "\n")
    print("\n".join(table))
    return 1 if any(v["passed"] is False for v in results.values()) else 0


if __name__ == "__main__":
    sys.exit(main())
