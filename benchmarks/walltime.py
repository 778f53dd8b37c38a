"""Wall time as the user feels it: whole commands, timed from outside, on this machine.

    python benchmarks/walltime.py                       # the four workloads of issue 10
    python benchmarks/walltime.py --baseline 04f59eb    # and the same on another revision, side by side
    python benchmarks/walltime.py --tiny                # seconds: CI runs this so it cannot rot

| workload (2 processes) | measured | target |
|---|---|---|
| MNIST ConvNet, 1 epoch, default recipe | wall - train_time_s | <= 3 s |
| a 1-step run | wall | <= 4 s |
| seed 004's toy problem (5 samples, 2-30-20-2 MLP, 3 epochs) through the Python API | wall | <= 6 s |
| 1,500 generated 32x32 PNGs as an ImageFolder, resnet9, 4 epochs | wall / train_time_s | <= 1.3 |
| the same folder's data load, second run | seconds | <= 1 |

Each workload runs as a subprocess with a fresh run dir; wall time is from the spawn to the
exit. ``--baseline REV`` checks REV out into a temporary worktree and runs every workload
on it too, in the same invocation and interleaved, so both sides see the same machine
state. ``--repeats N`` takes medians. Prints a table; ``--json`` writes the figures.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# Seed 004's own data and model, shared by both toy programs below
TOY_MODEL = """
class ToyDataset(Dataset):                      # seed 004's own data and model
    def __init__(self, X, y):
        self.features, self.labels = X, y
    def __getitem__(self, i):
        return self.features[i], self.labels[i]
    def __len__(self):
        return self.labels.shape[0]

class NeuralNetwork(torch.nn.Module):
    def __init__(self, num_inputs, num_outputs):
        super().__init__()
        self.layers = torch.nn.Sequential(torch.nn.Linear(num_inputs, 30), torch.nn.ReLU(),
                                          torch.nn.Linear(30, 20), torch.nn.ReLU(), torch.nn.Linear(20, num_outputs))
    def forward(self, x):
        return self.layers(x)
"""

TOY = """
import sys, torch
from torch.utils.data import Dataset
from ddpkit import TrainConfig, Trainer

# TOY_MODEL
if __name__ == "__main__":
    X_train = torch.tensor([[-1.2, 3.1], [-0.9, 2.9], [-0.5, 2.6], [2.3, -1.1], [2.7, -1.5]])
    y_train = torch.tensor([0, 0, 0, 1, 1])
    X_test, y_test = torch.tensor([[-0.8, 2.8], [2.6, -1.6]]), torch.tensor([0, 1])
    torch.manual_seed(123)
    cfg = TrainConfig(nproc="2", device="cpu", epochs=3, batch_size=4, optimizer="sgd", lr=0.5, momentum=0.0,
                      nesterov=False, weight_decay=0.0, schedule="constant", progress=False, run_dir=sys.argv[1])
    Trainer(cfg, model=NeuralNetwork(2, 2), train_data=ToyDataset(X_train, y_train),
            test_data=ToyDataset(X_test, y_test)).fit()
"""

# The same toy as seed 004's own program (appendix A, listing A.13): mp.spawn, DistributedSampler, DDP, on
# CPU over gloo instead of nccl and cuda:rank, its "insert ..." placeholders filled as the appendix's earlier
# listings do (cross_entropy, SGD steps, compute_accuracy), 3 epochs, then each rank's accuracy. What ddpkit's startup is held against: issue 42 asks the toy through Trainer to stay within
# 1 s of this program's wall time.
TOY_PLAIN = """
import os, socket, sys, torch
import torch.multiprocessing as mp
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.distributed import init_process_group, destroy_process_group

# TOY_MODEL
def prepare_dataset():
    X_train = torch.tensor([[-1.2, 3.1], [-0.9, 2.9], [-0.5, 2.6], [2.3, -1.1], [2.7, -1.5]])
    y_train = torch.tensor([0, 0, 0, 1, 1])
    X_test, y_test = torch.tensor([[-0.8, 2.8], [2.6, -1.6]]), torch.tensor([0, 1])
    train_ds, test_ds = ToyDataset(X_train, y_train), ToyDataset(X_test, y_test)
    train_loader = DataLoader(dataset=train_ds, batch_size=2, shuffle=False, drop_last=True,
                              sampler=DistributedSampler(train_ds))
    test_loader = DataLoader(dataset=test_ds, batch_size=2, shuffle=False)
    return train_loader, test_loader

def compute_accuracy(model, dataloader):
    model = model.eval()
    correct, total = 0.0, 0
    for features, labels in dataloader:
        with torch.no_grad():
            logits = model(features)
        correct += torch.sum(labels == torch.argmax(logits, dim=1))
        total += len(labels)
    return (correct / total).item()

def main(rank, world_size, num_epochs, port):
    os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = "localhost", str(port)
    init_process_group(backend="gloo", rank=rank, world_size=world_size)
    train_loader, test_loader = prepare_dataset()
    model = NeuralNetwork(num_inputs=2, num_outputs=2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    model = DDP(model)
    for epoch in range(num_epochs):
        train_loader.sampler.set_epoch(epoch)
        model.train()
        for features, labels in train_loader:
            logits = model(features)
            loss = torch.nn.functional.cross_entropy(logits, labels)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            print(f"[GPU{rank}] Epoch: {epoch+1:03d}/{num_epochs:03d} | Batchsize {labels.shape[0]:03d}"
                  f" | Train/Val Loss: {loss:.2f}")
    model.eval()
    print(f"[GPU{rank}] Training accuracy", compute_accuracy(model, train_loader))
    print(f"[GPU{rank}] Test accuracy", compute_accuracy(model, test_loader))
    destroy_process_group()

if __name__ == "__main__":
    torch.manual_seed(123)
    with socket.socket() as s:
        s.bind(("localhost", 0))
        port = s.getsockname()[1]
    mp.spawn(main, args=(2, 3, port), nprocs=2)
"""
TOY, TOY_PLAIN = (program.replace("# TOY_MODEL\n", TOY_MODEL) for program in (TOY, TOY_PLAIN))


def make_image_folder(root: Path, n_train: int, n_test: int) -> Path:
    import numpy as np
    from PIL import Image

    rng = np.random.default_rng(0)
    for split, n in (("train", n_train), ("val", n_test)):
        for c in range(10):
            (root / split / f"class{c}").mkdir(parents=True, exist_ok=True)
            for i in range(n // 10):
                Image.fromarray(rng.integers(0, 256, (32, 32, 3), dtype=np.uint8)).save(
                    root / split / f"class{c}" / f"{i:04d}.png"
                )
    return root


def timed(cmd: list[str], src: Path, run_dir: Path, summary: bool = True) -> dict:
    """Run ``cmd`` with ddpkit from ``src``; wall time from spawn to exit, and the run's summary."""
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "LOCAL_RANK", "WORLD_SIZE")}
    # ddpkit from `src` first; what PYTHONPATH held stays behind it (`pip --target` dependencies)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(src), env.get("PYTHONPATH")]))
    t = time.perf_counter()
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
    wall = time.perf_counter() - t
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd[:6])}... failed:\n{proc.stderr[-2000:]}")
    if not summary:  # the plain program writes none
        return {"wall_s": wall, "train_time_s": None, "startup_s": None, "teardown_s": None}
    summary = json.loads((run_dir / "summary.json").read_text())
    return {
        "wall_s": wall,
        "train_time_s": summary["train_time_s"],
        "startup_s": summary.get("startup_s"),
        "teardown_s": summary.get("teardown_s"),
    }


def data_load_s(src: Path, folder: Path, size: int) -> float:
    """Seconds to have the ImageFolder in memory, in a fresh process (the second run: its cache exists)."""
    code = (
        "import sys, time, types; sys.path.insert(0, sys.argv[1]); t = time.perf_counter()\n"
        "from ddpkit.data.folder import load_imagefolder\n"
        "from ddpkit.data.materialize import materialize\n"
        "cfg = types.SimpleNamespace(data_path='auto', dataset='imagefolder:' + sys.argv[2], image_size=int(sys.argv[3]))\n"
        "t = time.perf_counter(); s = materialize(load_imagefolder(sys.argv[2], int(sys.argv[3])), cfg)\n"
        "print(time.perf_counter() - t); print(s.note, file=sys.stderr)"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code, str(src), str(folder), str(size)], capture_output=True, text=True
    )
    if proc.returncode != 0:
        raise RuntimeError(proc.stderr[-2000:])
    return float(proc.stdout.strip().splitlines()[-1])


def workloads(args, work: Path, folder: Path) -> dict:
    py = sys.executable
    mnist = ["--dataset", "mnist", "--nproc", "2", "--device", "cpu", "--no-progress"]
    toy = work / "toy.py"
    toy.write_text(TOY)
    plain = work / "toy_plain.py"
    plain.write_text(TOY_PLAIN)
    epochs = "1" if args.tiny else "4"
    return {
        "mnist_epoch": lambda d: (
            [py, "-m", "ddpkit", "train", *mnist, "--epochs", "1", "--run-dir", str(d)]
            + (["--limit-train", "500", "--limit-test", "200"] if args.tiny else [])
        ),
        "one_step": lambda d: [
            py,
            "-m",
            "ddpkit",
            "train",
            *mnist,
            "--epochs",
            "1",
            "--limit-train",
            "200",
            "--batch-size",
            "100",
            "--limit-test",
            "100",
            "--run-dir",
            str(d),
        ],
        "toy_api": lambda d: [py, str(toy), str(d)],
        "toy_plain": lambda d: [py, str(plain)],  # the same toy, the seed's own mp.spawn program
        "imagefolder": lambda d: (
            [
                py,
                "-m",
                "ddpkit",
                "train",
                "--dataset",
                f"imagefolder:{folder}",
                "--image-size",
                "32",
                "--model",
                "mlp" if args.tiny else "resnet9",
                "--nproc",
                "2",
                "--device",
                "cpu",
                "--epochs",
                epochs,
                "--no-progress",
                "--run-dir",
                str(d),
            ]
            + (["--batch-size", "20"] if args.tiny else [])
        ),
    }


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--baseline", help="a git revision to run the same workloads on, side by side")
    p.add_argument("--repeats", type=int, default=1, help="rounds; figures are medians")
    p.add_argument("--tiny", action="store_true", help="small data, one round: exercises the harness (CI)")
    p.add_argument("--json", type=Path, help="write the figures here")
    p.add_argument("--only", help="comma-separated workloads to run (say toy_api,toy_plain); the rest are n/a")
    args = p.parse_args(argv)
    work = Path(tempfile.mkdtemp(prefix="ddpkit-walltime-"))
    sides = {"ddpkit": ROOT / "src"}
    try:
        if args.baseline:
            tree = work / "baseline"
            subprocess.run(
                ["git", "-C", str(ROOT), "worktree", "add", "--detach", str(tree), args.baseline],
                check=True,
                capture_output=True,
            )
            sides = {"baseline": tree / "src", **sides}
        n_train, n_test = (100, 50) if args.tiny else (1500, 500)
        rounds: dict = {
            side: {name: [] for name in ("mnist_epoch", "one_step", "toy_api", "toy_plain", "imagefolder")}
            for side in sides
        }
        loads: dict = {side: [] for side in sides}
        for r in range(args.repeats):
            for side, src in sides.items():  # interleaved: a slow spell hits both sides alike
                folder = make_image_folder(work / f"images-{side}-{r}", n_train, n_test)  # fresh: no cache yet
                for name, cmd in workloads(args, work, folder).items():
                    if args.only and name not in args.only.split(","):
                        continue
                    if args.tiny and name == "mnist_epoch" and (not args.only or "one_step" in args.only):
                        continue  # tiny: the 1-step run, an MNIST epoch too, stands for it (below): one launch less
                    run_dir = work / f"{side}-{name}-{r}"
                    rounds[side][name].append(timed(cmd(run_dir), src, run_dir, summary=name != "toy_plain"))
                if args.tiny and rounds[side]["one_step"] and not rounds[side]["mnist_epoch"]:
                    rounds[side]["mnist_epoch"] = rounds[side]["one_step"]
                loads[side].append(data_load_s(src, folder, 32) if (folder / ".ddpkit-cache").exists() else None)
        figures = {"config": {**vars(args), "json": None}, "sides": {}}
        for side in sides:
            nothing = {"wall_s": math.nan, "train_time_s": math.nan, "startup_s": None, "teardown_s": None}
            med = {
                name: {k: statistics.median(x[k] for x in runs) if runs[0][k] is not None else None for k in runs[0]}
                if runs
                else nothing  # not run (--only)
                for name, runs in rounds[side].items()
            }
            load = [v for v in loads[side] if v is not None]
            figures["sides"][side] = {
                "mnist_epoch_overhead_s": med["mnist_epoch"]["wall_s"] - med["mnist_epoch"]["train_time_s"],
                "one_step_wall_s": med["one_step"]["wall_s"],
                "toy_api_wall_s": med["toy_api"]["wall_s"],
                "toy_plain_wall_s": med["toy_plain"]["wall_s"],
                "toy_api_over_plain_s": med["toy_api"]["wall_s"] - med["toy_plain"]["wall_s"],
                "imagefolder_wall_over_train": med["imagefolder"]["wall_s"] / med["imagefolder"]["train_time_s"],
                "imagefolder_second_load_s": statistics.median(load) if load else None,
                "runs": med,
                "rounds": rounds[side],
            }
        print(table(figures, args))
        if args.json:
            args.json.write_text(json.dumps(figures, indent=2, default=str) + "\n")
    finally:
        if args.baseline:
            subprocess.run(
                ["git", "-C", str(ROOT), "worktree", "remove", "--force", str(work / "baseline")], capture_output=True
            )
        shutil.rmtree(work, ignore_errors=True)
    return 0


def table(figures: dict, args) -> str:
    sides = figures["sides"]
    rows = [
        ("MNIST 1 epoch: wall - train_time_s", "mnist_epoch_overhead_s", "<= 3 s", "{:.2f} s"),
        ("1-step run: wall", "one_step_wall_s", "<= 4 s", "{:.2f} s"),
        ("seed 004 toy, Python API: wall", "toy_api_wall_s", "<= 6 s", "{:.2f} s"),
        ("seed 004 toy, its own mp.spawn program: wall", "toy_plain_wall_s", "", "{:.2f} s"),
        ("seed 004 toy: Python API - mp.spawn program", "toy_api_over_plain_s", "<= 1 s", "{:.2f} s"),
        ("ImageFolder 1,500 PNGs, resnet9, 4 epochs: wall / train", "imagefolder_wall_over_train", "<= 1.3", "{:.2f}"),
        ("ImageFolder, second run: data load", "imagefolder_second_load_s", "<= 1 s", "{:.2f} s"),
    ]
    head = "| workload, 2 processes | " + " | ".join(sides) + " | target |"
    lines = [
        f"{'tiny mode: ' if args.tiny else ''}median of {args.repeats} round(s)",
        "",
        head,
        "|---" * (len(sides) + 2) + "|",
    ]
    for label, key, target, fmt in rows:
        cells = [fmt.format(sides[s][key]) if sides[s][key] is not None else "n/a" for s in sides]
        lines.append(f"| {label} | " + " | ".join(cells) + f" | {target} |")
    startup = " | ".join(
        f"{s}: startup {sides[s]['runs']['one_step']['startup_s']}, teardown "
        f"{sides[s]['runs']['one_step']['teardown_s']}"
        for s in sides
    )
    return "\n".join(lines) + f"\n\n1-step run, from summary.json: {startup}\n"


if __name__ == "__main__":
    sys.exit(main())
