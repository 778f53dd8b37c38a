"""Healthy runs with a pause longer than the hang watch's threshold, for tests/ranks/test_hangwatch.py: run
as ``python busy_workers.py CASE RUN_DIR``, it trains 2 gloo ranks at ``--timeout-s 10`` (the watch looks
at 5 s, and looks again 1.25 s later before it reports). The pause is a sleep, patched into each worker
when it imports this file:

- ``step``: every rank sleeps in its loss at the same step (a step slower than the threshold everywhere);
- ``save``: rank 0's first snapshot write sleeps (a slow disk) while rank 1 waits for it in a collective;
- ``end``: rank 0's end of the run after the last collective (its loggers' close: a slow TensorBoard or
  W&B flush; its plots where no launcher draws them) takes longer than the whole timeout.
"""

from __future__ import annotations

import os
import sys
import time

if __name__ == "__main__":
    os.environ["BUSY_CASE"] = sys.argv[1]  # inherited by the workers, which import this file as __mp_main__
CASE = os.environ.get("BUSY_CASE", "")

TIMEOUT_S = 10.0
# Over the threshold (5 s) and the second look (6.25 s), and 3.5 s under the timeout that the other rank's
# wait for it runs into: a margin for a loaded 2-core CI machine
PAUSE_S = 6.5
END_PAUSE_S = 12.0  # over the whole timeout: after the last collective nobody may wait for it

CALLS = [0]


def loss(model, batch):
    """mse; with CASE ``step``, every worker sleeps in its 3rd call (step 3 of 4)."""
    import torch.nn.functional as F

    x, y = batch
    CALLS[0] += x.device.type != "meta"  # not the engine's FLOP count (train/flops.py), on meta copies
    if CASE == "step" and CALLS[0] == 3 and os.environ.get("RANK") is not None:
        time.sleep(PAUSE_S)
    return F.mse_loss(model(x), y)


def _slowed(module, name: str, pause_s: float) -> None:
    """``module.name``, sleeping ``pause_s`` before its first call."""
    real, first = getattr(module, name), [True]

    def slow(*args, **kwargs):
        if first[0]:
            first[0] = False
            time.sleep(pause_s)
        return real(*args, **kwargs)

    setattr(module, name, slow)


if CASE == "save":
    from ddpkit.run import checkpoint

    _slowed(checkpoint, "atomic_write", PAUSE_S)  # only rank 0 writes snapshots
elif CASE == "end":
    from ddpkit.run.recorder import MetricLogger

    _close = MetricLogger.close

    def _slow_close(self, ok: bool = True) -> None:  # rank 0's, after the run's last collective
        if os.environ.get("RANK") == "0" and not getattr(self, "_paused", False):
            self._paused = True
            time.sleep(END_PAUSE_S)
        _close(self, ok)

    MetricLogger.close = _slow_close


def train(run_dir: str):
    from user_code import RegressionMLP, regression_data

    from ddpkit import TrainConfig, Trainer

    cfg = TrainConfig(
        nproc="2",
        device="cpu",
        batch_size=16,
        epochs=1,
        timeout_s=TIMEOUT_S,
        run_dir=run_dir,
        num_workers=0,
        progress=False,
        save_every_steps=2,  # a snapshot between steps 2 and 3, and one at the end
        plots=CASE == "end",
    )
    Trainer(
        cfg, model=RegressionMLP(), train_data=regression_data(64, 0), test_data=regression_data(32, 1), loss_fn=loss
    ).fit()


if __name__ == "__main__":
    train(sys.argv[2])
