"""One rank's training run: the loop, and the only training loop in ddpkit.

    with distributed(cfg.device, cfg.timeout_s) as ctx:
        summary = Engine(cfg, ctx, model, splits).fit()

The step (:meth:`Engine._step`) is free of host syncs: no ``.item()``, no print, no
host copy. Loss and accuracy accumulate on the device and are all-reduced every
``--log-every`` steps. The checkpointer, the logger and the run-dir writers are called
on every rank and decide themselves that only global rank 0 writes.
"""

from __future__ import annotations

import math
import time
from pathlib import Path

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from .checkpoint import Checkpointer, set_rng_state
from .data import DataSplits, ImageData
from .data.loader import Preprocess, make_train_source
from .dist import DistContext
from .errors import NonFiniteLoss, Stopped
from .evaluate import evaluate
from .metrics import Accumulator, MetricLogger, peak_memory_mb
from .models import uses_conv
from .optim import EMA, autocast, build_optimizer, build_scaler, build_schedule
from .rundir import write_config, write_model, write_summary
from .signals import StopSignal
from .syncbn import convert_sync_batchnorm


class Engine:
    def __init__(self, cfg, ctx: DistContext, model: nn.Module, splits: DataSplits, static_graph: bool = False):
        self.cfg, self.ctx, self.meta = cfg, ctx, splits.meta
        self.per_rank_batch = cfg.batch_size // ctx.world_size
        self.train_src = make_train_source(splits.train, splits.meta, cfg, ctx, self.per_rank_batch)
        self.test_data = splits.test
        if getattr(self.train_src, "on_device", False) and isinstance(self.test_data, ImageData):
            self.test_data = ImageData(self.test_data.images.to(ctx.device), self.test_data.labels.to(ctx.device))
        self.raw, self.model = self._setup_model(model, static_graph)
        self.opt = build_optimizer(self.raw, cfg, ctx.device)
        self.total_steps = cfg.epochs * self.train_src.steps_per_epoch
        self.sched = build_schedule(self.opt, cfg, self.total_steps)
        self.scaler = build_scaler(cfg, ctx.device)
        self.ema = EMA(self.raw, cfg.ema) if cfg.ema else None
        self.criterion = nn.CrossEntropyLoss(label_smoothing=cfg.label_smoothing)
        self.autocast = autocast(cfg, ctx.device)
        self.acc = Accumulator(ctx.device)
        self.ckpt = Checkpointer(cfg.run_dir, ctx, cfg, keep=cfg.keep_snapshots)
        self.log = MetricLogger(ctx, cfg.run_dir, self.total_steps, cfg.progress)
        # position and totals: part of every snapshot
        self.epoch = self.step_in_epoch = self.global_step = 0
        self.train_time_s = self.compile_time_s = 0.0
        self.epoch_elapsed_s = 0.0  # time already spent in the current epoch before a resume
        self._epoch_t0 = 0.0
        self.final_train_loss: float | None = None
        self._stop = StopSignal()
        self._nan_warned = False

    # ------------------------------------------------------------------ setup
    def _setup_model(self, model: nn.Module, static_graph: bool) -> tuple[nn.Module, nn.Module]:
        cfg, ctx = self.cfg, self.ctx
        raw = model.to(ctx.device)
        if cfg.sync_bn:
            raw = convert_sync_batchnorm(raw, ctx.device)  # before the DDP wrap, so DDP sees the final modules
        if cfg.channels_last and uses_conv(raw):
            raw = raw.to(memory_format=torch.channels_last)
        wrapped = raw
        if cfg.ddp:
            wrapped = DDP(raw, device_ids=[ctx.device] if ctx.device.type == "cuda" else None,
                          gradient_as_bucket_view=True,  # grads are views into the all-reduce buckets: no copy
                          static_graph=static_graph)
        if cfg.compile:
            wrapped = torch.compile(wrapped, mode=cfg.compile_mode)
        torch.manual_seed(cfg.seed + 1 + ctx.rank)  # same init everywhere, different dropout per rank
        return raw, wrapped

    # ------------------------------------------------------------------ state
    def state_dict(self) -> dict:
        return {"model": self.raw.state_dict(), "optimizer": self.opt.state_dict(),
                "scheduler": self.sched.state_dict(), "scaler": self.scaler.state_dict(),
                "ema": self.ema.state_dict() if self.ema else None,
                "position": {"epoch": self.epoch, "step_in_epoch": self.step_in_epoch, "global_step": self.global_step},
                "timing": {"train_time_s": self.train_time_s, "compile_time_s": self.compile_time_s,
                           "final_train_loss": self.final_train_loss,
                           "epoch_elapsed_s": time.perf_counter() - self._epoch_t0 if self.step_in_epoch else 0.0},
                # Plain floats: this travels through all_gather_object, which would rebuild a
                # device tensor on the sender's GPU in every receiver (float64 -> float is exact).
                "rank_state": {"acc": self.acc.sums.tolist()}}

    def load_state_dict(self, snap: dict) -> None:
        state = snap["trainer"]
        self.raw.load_state_dict(state["model"])
        self.opt.load_state_dict(state["optimizer"])
        self.sched.load_state_dict(state["scheduler"])
        self.scaler.load_state_dict(state["scaler"])
        if self.ema:
            self.ema.load_state_dict(state["ema"])
        pos = state["position"]
        self.epoch, self.step_in_epoch, self.global_step = pos["epoch"], pos["step_in_epoch"], pos["global_step"]
        self.train_time_s = state["timing"]["train_time_s"]
        self.compile_time_s = state["timing"]["compile_time_s"]
        self.final_train_loss = state["timing"]["final_train_loss"]
        self.epoch_elapsed_s = state["timing"].get("epoch_elapsed_s", 0.0)
        mine = snap["ranks"][self.ctx.rank]
        self.acc.sums.copy_(torch.as_tensor(mine["rank_state"]["acc"], dtype=torch.float64))
        set_rng_state(mine["rng"], self.ctx.device)

    # ------------------------------------------------------------------ loop
    def fit(self) -> dict:
        snap = self.ckpt.load_latest(warn=self.log.print)
        if snap is not None:
            self.load_state_dict(snap)
            self.log.rewind(self.global_step, self.epoch)  # the steps after the snapshot run again
        write_config(self.cfg, self.ctx)
        self.log.log("start", world_size=self.ctx.world_size, backend=self.ctx.backend,
                     device=str(self.ctx.device), data_path=self.train_src.path,
                     steps_per_epoch=self.train_src.steps_per_epoch, per_rank_batch=self.per_rank_batch,
                     resumed_at_step=self.global_step if snap else None)
        try:
            with self._stop:
                while self.epoch < self.cfg.epochs:
                    self._run_epoch()
        finally:
            self.log.close()
        return self._finish()

    def _run_epoch(self) -> None:
        cfg, ctx = self.cfg, self.ctx
        self.model.train()
        steps = self.train_src.steps_per_epoch
        # After a mid-epoch resume the restored accumulator already holds the epoch's earlier
        # samples; the first interval must count only new ones. (Same condition on every rank.)
        sums = self.acc.global_sums(ctx) if self.step_in_epoch else (0.0, 0.0)
        self._epoch_t0 = time.perf_counter() - self.epoch_elapsed_s
        self._interval_start(time.perf_counter(), sums)
        for x, y in self.train_src.batches(self.epoch, self.step_in_epoch):
            if cfg.compile and self.global_step == 0:
                self._compile_step(x, y)
                self._epoch_t0 += self.compile_time_s
                self._interval_start(time.perf_counter(), sums)
            else:
                self._step(x, y)
            self.step_in_epoch += 1
            self.global_step += 1
            last = self.step_in_epoch == steps
            if self.step_in_epoch % cfg.log_every == 0 or last:
                self._log_interval()
            if not last and cfg.save_every_steps and self.global_step % cfg.save_every_steps == 0:
                self._snapshot()  # the epoch's last step is saved by _end_epoch, after eval
        # The epoch's last step always logs, and that all-reduce synced the device: reuse its sums.
        loss_sum, correct = self._sums_last
        epoch_time = time.perf_counter() - self._epoch_t0
        self.epoch_elapsed_s = 0.0
        self.train_time_s += epoch_time
        seen = steps * self.per_rank_batch * ctx.world_size
        self._end_epoch(loss_sum / seen, correct / seen, epoch_time, seen)

    def _step(self, x: torch.Tensor, y: torch.Tensor) -> None:
        """One optimisation step. Hot path: no host sync of any kind."""
        with self.autocast:
            logits = self.model(x)
            loss = self.criterion(logits, y)
        self.opt.zero_grad(set_to_none=True)
        self.scaler.scale(loss).backward()
        self.scaler.step(self.opt)
        self.scaler.update()
        self.sched.step()
        if self.ema is not None:
            self.ema.update(self.raw)
        self.acc.add(loss, logits, y)

    def _compile_step(self, x, y) -> None:
        """The first step of a compiled run, timed apart: it includes compilation."""
        t = time.perf_counter()
        self._step(x, y)
        self.acc.global_sums(self.ctx)  # sync
        self.compile_time_s = time.perf_counter() - t

    def _interval_start(self, now: float, sums: tuple[float, float]) -> None:
        self._t_last, self._step_last, self._sums_last = now, self.step_in_epoch, sums

    def _sync(self, check_weights: bool = False) -> tuple[float, float, bool, bool]:
        """One all-reduce and host copy, at log intervals and snapshots only: this epoch's
        (loss sum, correct), whether any rank was sent SIGTERM, and (if asked) whether any
        rank holds a non-finite weight. A NaN loss on one rank makes the summed loss NaN."""
        flags = torch.zeros(2, dtype=torch.float64, device=self.ctx.device)
        flags[0] = float(self._stop.received is not None)
        if check_weights:
            flags[1] = torch.stack([~p.detach().isfinite().all() for p in self.raw.parameters()]).any()
        loss_sum, correct, stop, bad = self.ctx.all_reduce(torch.cat([self.acc.sums, flags])).tolist()
        return loss_sum, correct, stop > 0, bad > 0

    def _check_finite(self, loss_sum: float, bad_weights: bool = False) -> None:
        """``--on-nan``: stop (same decision on every rank: the inputs are all-reduced), or warn once."""
        if math.isfinite(loss_sum) and not bad_weights:
            return
        what = "the weights" if bad_weights else "the training loss"
        msg = f"{what} became NaN or Inf by step {self.global_step} (epoch {self.epoch})"
        if self.cfg.on_nan == "warn":
            if not self._nan_warned:
                self.log.print(f"ddpkit: warning: {msg}; training on (--on-nan warn)")
                self._nan_warned = True
            return
        last = self.ckpt.snapshots()
        self.log.log("stopped", reason="non-finite", step=self.global_step)
        raise NonFiniteLoss(f"{msg}. Stopped without saving it: the last good snapshot is "
                            f"{last[0] if last else '(none yet)'}, and model.pt was not written. Lower --lr, check "
                            f"the data, or prefer --amp bf16 to fp16; --on-nan warn trains on regardless.")

    def _snapshot(self) -> Path:
        """Save on every rank's call (rank 0 writes), after checking there is nothing non-finite to keep."""
        loss_sum, _, _, bad = self._sync(check_weights=True)
        self._check_finite(loss_sum, bad)
        return self.ckpt.save(self.state_dict(), self.global_step)

    def _log_interval(self) -> None:
        cfg, ctx = self.cfg, self.ctx
        loss_sum, correct, stop, _ = self._sync()
        now = time.perf_counter()
        base_loss, _ = self._sums_last
        n = (self.step_in_epoch - self._step_last) * self.per_rank_batch * ctx.world_size
        self.log.log("step", epoch=self.epoch, step=self.global_step, loss=(loss_sum - base_loss) / max(1, n),
                     lr=self.sched.get_last_lr()[0], samples_per_s=n / max(1e-9, now - self._t_last))
        self.log.progress(self.global_step, f"epoch {self.epoch} loss {(loss_sum - base_loss) / max(1, n):.4f}")
        self._t_last, self._step_last, self._sums_last = now, self.step_in_epoch, (loss_sum, correct)
        self._check_finite(loss_sum)
        if stop:
            path = self._snapshot()
            self.log.log("stopped", reason="signal", step=self.global_step)
            raise Stopped(f"stopped on SIGTERM at step {self.global_step} (epoch {self.epoch}); saved {path}; "
                          f"run the same command again to resume from it")

    def _end_epoch(self, train_loss: float, train_acc: float, epoch_time: float, seen: int) -> None:
        result = self._evaluate()
        self.log.log("epoch", epoch=self.epoch, train_loss=train_loss, train_accuracy=train_acc, **result,
                     epoch_time_s=epoch_time, samples_per_s=seen / max(1e-9, epoch_time),
                     peak_memory_mb=peak_memory_mb(self.ctx))
        self.final_train_loss = train_loss
        self.epoch += 1
        self.step_in_epoch = 0
        self.acc.reset()
        self._snapshot()

    def _evaluate(self) -> dict:
        pre = Preprocess(self.meta, self.ctx.device, bool(self.cfg.channels_last))
        model = self.ema.module if self.ema is not None else self.raw
        # DDP broadcasts rank 0's buffers (BN running stats) at the start of each forward, so after
        # the last step every other rank still holds its own. Evaluate what model.pt will hold.
        for buf in model.buffers():
            self.ctx.broadcast(buf)
        return evaluate(model, self.test_data, pre, self.cfg, self.ctx, max(256, self.per_rank_batch))

    def _finish(self) -> dict:
        cfg, ctx = self.cfg, self.ctx
        result = self._evaluate()
        model = self.ema.module if self.ema is not None else self.raw
        write_model(cfg.run_dir, model, ctx)
        summary = {"world_size": ctx.world_size, "backend": ctx.backend, "device_type": ctx.device.type,
                   "dataset": cfg.dataset, "model": cfg.model, "recipe": cfg.recipe, "epochs": cfg.epochs,
                   "global_batch_size": self.per_rank_batch * ctx.world_size, "steps": self.global_step,
                   "data_path": self.train_src.path, "train_time_s": round(self.train_time_s, 4),
                   "compile_time_s": round(self.compile_time_s, 4),
                   "samples_per_s": self.global_step * self.per_rank_batch * ctx.world_size / max(1e-9, self.train_time_s),
                   "final_train_loss": self.final_train_loss, **result,
                   "peak_memory_mb": peak_memory_mb(ctx), "run_dir": cfg.run_dir, "config_hash": cfg.hash()}
        write_summary(cfg.run_dir, summary, ctx)
        self.log.log("summary", **{k: summary[k] for k in ("test_accuracy", "test_samples", "train_time_s",
                                                          "samples_per_s", "run_dir")})
        return summary
