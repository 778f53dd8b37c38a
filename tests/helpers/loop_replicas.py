"""A ``ddpkit.Loop`` script written for ``ddpkit run --replicas``: each step's batches through ``loop.shares``
(tests/system/test_loop_replicas.py). In float64, a small MLP with momentum, on 512 samples that carry their own
index; 16 samples a rank (a group) a step.

    python loop_replicas.py RUN_DIR STEPS [KILL_AT [PAUSE_S]]

KILL_AT: replica group 1's first attempt SIGKILLs itself in the forward of that step's first share (mid-step: the
other group is then in that step's all-reduce or about to be). Each step's sample indices, as this process read them
through ``loop.shares`` (an attempt computed again reads the same again), go to RUN_DIR's samples.jsonl, a line a
step; the final weights to final.pt. PAUSE_S: seconds each share's forward waits (a run long enough for the lost
group to come back while the other trains on). (RUN_DIR: the group's own run dir, ``loop.config.run_dir``.)
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
kill_at = int(sys.argv[3]) if len(sys.argv) > 3 else -1
pause_s = float(sys.argv[4]) if len(sys.argv) > 4 else 0.0
first_attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0"
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
        for step in loop.steps(steps):
            used = set()
            opt.zero_grad()
            for xb, yb, ib in loop.shares(loader):
                if step == kill_at and loop.rank == 1 and first_attempt:
                    os.kill(os.getpid(), signal.SIGKILL)
                time.sleep(pause_s)
                loss = nn.functional.cross_entropy(model(xb), yb)
                loss.backward()
                loop.log(loss=loss)
                used.update(ib.tolist())
            opt.step()
            log.write(json.dumps({"step": step, "samples": sorted(used)}) + "\n")
            log.flush()
    torch.save(model.module.state_dict(), os.path.join(loop.config.run_dir, "final.pt"))
