"""A ``ddpkit.Loop`` script written for ``ddpkit run --replicas``: each step's batches through ``loop.shares``
(tests/system/test_loop_replicas.py). In float64, a small MLP with momentum, on 512 samples that carry their own
index; 16 samples a rank (a group) a step.

    python loop_replicas.py RUN_DIR STEPS [KILL_AT[,KILL_AFTER...] [PAUSE_S]]

KILL_AT: replica group 1's first attempt SIGKILLs itself in the forward of that step's first share (mid-step: the
other group is then in that step's all-reduce or about to be); KILL_AFTER: its next attempt does so that many steps
after the step it healed at. Each step's sample indices, as this process read them through ``loop.shares`` (an
attempt computed again reads the same again), go to the group's samples.jsonl, a line a step; the final weights to
final.pt. PAUSE_S: seconds each share's forward waits until group 1 has healed once per kill, ten times as long in
the last 8 steps (so that group 0 cannot end the run before group 1 is back, however loaded the machine). (The
group's own run dir: ``loop.config.run_dir``.)
"""

import json
import os
import signal
import sys
import time

import torch
from torch import nn
from torch.utils.data import TensorDataset

import ddpkit

torch.set_default_dtype(torch.float64)
run_dir, steps = sys.argv[1], int(sys.argv[2])
kills = [int(k) for k in sys.argv[3].split(",")] if len(sys.argv) > 3 else []
pause_s = float(sys.argv[4]) if len(sys.argv) > 4 else 0.0
attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))


def heals() -> int:
    """Group 1's heals so far, by its records."""
    try:
        with open(f"{run_dir}-group-1/metrics.jsonl") as f:
            return sum('"change": "healed"' in line for line in f)
    except FileNotFoundError:
        return 0


g = torch.Generator().manual_seed(0)
x = torch.randn(512, 8, generator=g)
data = TensorDataset(x, (x.sum(1) > 0).long(), torch.arange(512))

with ddpkit.Loop(run_dir, device="cpu", log_every=8, save_every_steps=16) as loop:
    torch.manual_seed(0)
    model = loop.wrap(nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 2)))
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    loader = loop.data(data, batch_size=16)
    loop.resume(model=model, optimizer=opt)
    with open(os.path.join(loop.config.run_dir, "samples.jsonl"), "a") as log:
        first = None
        for step in loop.steps(steps):
            first = step if first is None else first  # the attempt's first: its heal's, after a restart
            used = set()
            opt.zero_grad()
            for xb, yb, ib in loop.shares(loader):
                if loop.rank == 1 and attempt < len(kills) and step - (first if attempt else 0) == kills[attempt]:
                    os.kill(os.getpid(), signal.SIGKILL)
                if heals() < len(kills):  # the last 8 steps 10x slower: a restart on a loaded machine took 20 s
                    time.sleep(pause_s * (10 if step >= steps - 8 else 1))
                loss = nn.functional.cross_entropy(model(xb), yb)
                loss.backward()
                loop.log(loss=loss)
                used.update(ib.tolist())
            opt.step()
            log.write(json.dumps({"step": step, "samples": sorted(used)}) + "\n")
            log.flush()
    torch.save(model.module.state_dict(), os.path.join(loop.config.run_dir, "final.pt"))
