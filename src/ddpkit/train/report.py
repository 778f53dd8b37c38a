"""What the engine says about its run: the fields of its start record (the ``[start]`` line), the summary at its
end (summary.json), each rank's own figures, the achieved TFLOP/s and MFU of a log interval, and the lines for
a resume at another world size (a Loop's too) and a diverging loss. Each function reads the engine's state
(``train/engine.py``) and changes nothing; every rank calls them alike (``per_rank`` is a collective), and
what only global rank 0 writes is written by the engine's callers (``run/rundir.write_summary``, the logger).
"""

from __future__ import annotations

import math
import os
import time
from typing import TYPE_CHECKING

import torch

from ..ranks import env
from ..run.rundir import unproven
from .ddp import ddp_timers
from .metrics import DIVERGED_RATIO, means, peak_memory_mb
from .syncbn import per_rank_batchnorm
from .task import Classification

if TYPE_CHECKING:
    from .engine import Engine


def summary(e: Engine, result: dict, per_rank: list[dict]) -> dict:
    """summary.json's fields: the run's figures at its end, with the test evaluation ``result`` and the
    per-rank table."""
    cfg, ctx = e.cfg, e.ctx
    return {
        "world_size": ctx.world_size,
        "backend": ctx.backend,
        "device_type": ctx.device.type,
        "dataset": cfg.dataset,
        "model": cfg.model,
        "task": e.task.identity,
        "recipe": cfg.recipe,
        "epochs": cfg.epochs,
        "global_batch_size": e.per_rank_batch * ctx.world_size,
        "grad_accum": e.accum,
        "steps": e.pos.global_step,
        "data_path": e.train_src.path,
        "train_time_s": round(e.timing.train_time_s, 4),
        "compile_time_s": round(e.timing.compile_time_s, 4),
        "samples_per_s": e.pos.global_step * e.per_rank_batch * ctx.world_size / max(1e-9, e.timing.train_time_s),
        **{f"final_{k}": v for k, v in e.final_train.items()},
        **result,
        "peak_memory_mb": peak_memory_mb(ctx),
        "flops_per_step": e.flops_per_step,
        "peak_tflops": e.peak / 1e12 if e.peak else None,
        **{
            f"{k}_per_device" if k == "tflops" else k: v
            for k, v in utilisation(
                e, e.pos.global_step * e.per_rank_batch * ctx.world_size / max(1e-9, e.timing.train_time_s)
            ).items()
        },
        "run_dir": cfg.run_dir,
        "config_hash": cfg.hash(),
        "startup_s": startup_seconds(e.t0, e.first_step_at, env.restart_count(), env.process_started_at(os.getpid())),
        "finished_at": round(time.time(), 3),
        "per_rank": per_rank,
        "ddp_timers": ddp_timers(e.ddp),
        "diverged_at_step": e.watch.diverged_at_step,
        "cuda_graph": e.graph.status if e.graph is not None else str(e.graph_decision),
        **({f"final_{k}": v for k, v in e.last_val[1].items()} if e.last_val is not None else {}),
        "best": {"metric": e.best.metric, "value": e.best.value, "step": e.best.step} if e.best is not None else None,
        "early_stopped_at_step": e.pos.global_step if e.stopped_early else None,
        **e.session.snapshot_figures(),  # what the snapshots held the steps for (rank 0's)
    }


def startup_seconds(t0: float | None, first_step_at: float | None, restarts: int, process_start: float) -> float | None:
    """summary.json's ``startup_s``: from the launch (``t0``) to this attempt's first step; after a restart inside
    the job (the agent's, ``--max-restarts``), from this attempt's own start: its process's, which the agent made
    then, where ``t0`` is the job's launch handed down by ddpkit's launcher (it held the first attempt's training:
    21 s in the porter's seed-004 run, for a 0.4 s start); ``t0`` where it is later (a script under torchrun calls
    fit() again in each attempt, and times it from there, as its first attempt is)."""
    if restarts and process_start == float("inf"):
        return None  # unknown: no figure rather than a wrong one
    start = t0 if not restarts or t0 is None else max(t0, process_start)
    return round(first_step_at - start, 3) if start and first_step_at else None


def start_fields(e: Engine, snap: dict | None) -> dict:
    """The ``start`` record's fields (the ``[start]`` line) beyond the world, backend and device: what the
    run trains on and how, and whether it resumed (``snap``: the snapshot it resumed from, or None)."""
    return dict(
        data_path=e.train_src.path,
        data=e.data_note,
        task=e.task.identity,
        lr_policy=e.lr_policy,
        changes=e.changes,
        steps_per_epoch=e.steps_per_epoch,
        per_rank_batch=e.per_rank_batch,
        grad_accum=e.accum,
        resumed_at_step=e.pos.global_step if snap else None,
        resumed_from_world=snap["world_size"] if snap else None,
        # What the run identity could not read of what was passed in: a resume matched on all but these
        not_read="; ".join(unproven(e.identity or {})) or None,
        cuda_graph=str(e.graph_decision),
        # DDP's search for unused parameters: asked, or found by preflight's trial step (said there)
        find_unused_parameters=bool(e.find_unused) if e.ddp is not None else None,
        flops_per_step=e.flops_per_step,  # one rank's, forward and backward (train/flops.py)
        mfu_peak=e.peak_name if e.flops_per_step else e.flops_note,
        # Each rank's own streams (dropout, a draw in the forward), seeded on the user's behalf (data/seeds.py
        # seed_rank): said, as the README's fidelity rule asks (a plain script that seeded every rank alike draws
        # other dropout masks: the porter's seed-001 port measured its Trainer run 0.07 off the plain one)
        rank_seeds=f"torch {e.cfg.seed} + 1 + rank, numpy and random from ({e.cfg.seed}, rank)",
    )


def per_rank(e: Engine, test_local: torch.Tensor) -> list[dict]:
    """Each rank's own figures (its train samples of the last epoch, its test shard): one all-gather."""
    k = len(e.acc.names)
    train_local = (
        e.train_local
        if e.train_local is not None
        else torch.full((2 * k,), math.nan, dtype=torch.float64, device=e.ctx.device)
    )
    rows = e.ctx.all_gather(torch.cat([train_local, test_local])).tolist()
    test_names = e.task.names
    out = []
    for rank, row in enumerate(rows):
        train, test = row[: 2 * k], row[2 * k :]
        out.append(
            {
                "rank": rank,
                **e.acc.means(train, "train_"),
                **means(test_names, test[:-1], "test_"),
                "test_samples": int(test[-1]),
            }
        )
    return out


def utilisation(e: Engine, samples_per_s: float) -> dict:
    """{tflops: achieved TFLOP/s per device, mfu: its share of the dense peak} at ``samples_per_s`` (all
    ranks'); {} where the step's FLOPs were not counted, and no mfu where the peak is not known."""
    if not e.flops_per_step:
        return {}
    per_device = e.flops_per_step / e.per_rank_batch * samples_per_s / e.ctx.world_size
    out = {"tflops": per_device / 1e12}
    if e.peak:
        out["mfu"] = per_device / e.peak
    return out


def elastic_line(e: Engine, old_world: int) -> str:
    """What a resume at another world size keeps exact, and what it does not (said once)."""
    caveats = ["each rank's random stream (dropout) starts afresh"]
    # a collate_fn's draws are keyed by rank and batch (data/seeds.py); __getitem__'s by sample: the same
    if e.train_src.path == "dataloader" and e.train_src.draws_by_batch:
        caveats.append("random draws in your collate_fn (or __getitems__) follow each rank's new batches")
    if per_rank_batchnorm([e.raw]) and not e.cfg.sync_bn:
        caveats.append(
            "BatchNorm without --sync-bn normalises each rank's share of the batch, now "
            f"{e.per_rank_batch // e.accum} samples"
        )
    if not isinstance(e.task, Classification):
        # DDP averages the ranks' losses: equal to the global batch's loss only for a mean over samples
        caveats.append(
            "your loss gives the same gradient if it is a mean over each rank's samples; a per-token mean "
            "or a sum weighs the ranks differently at another world size"
        )
    return (
        f"ddpkit: resuming step {e.pos.global_step} (epoch {e.pos.epoch}) of a run made at world size "
        f"{old_world} at world size {e.ctx.world_size}: the same global batch of {e.cfg.batch_size} "
        f"and the same samples at every step; otherwise only the order of float reductions differs, except: "
        + "; ".join(caveats)
    )


def divergence_line(e: Engine, loss: float) -> str:
    """The diverging run in one line, with the likely cause."""
    return (
        f"training is diverging: loss {loss:.4g} at step {e.pos.global_step}, over "
        f"{DIVERGED_RATIO:g}x its first logged {e.watch.first_loss:.4g}. The likely cause is the learning "
        f"rate ({e.lr_policy}) for a global batch of {e.cfg.batch_size}: try a lr several times lower"
        f" (--lr, or your optimizer's), or a longer warm-up (--warmup-frac)"
    )


def loop_elastic_line(step: int, old_world: int, new_world: int, per_rank: list[str], plain_bn: bool = False) -> str:
    """A ``Loop``'s resume at another world size: what it keeps exactly, and the values ``per_rank`` (different
    on every rank) it cannot follow, kept as this resume() was given them; ``plain_bn``: a wrapped model's
    BatchNorm normalises each rank's batch, which the new world size changes (the porter's seed-000 port: 4e-3 off
    the uninterrupted run, where SyncBatchNorm is 2e-7 off)."""
    reset = f"; {', '.join(map(repr, per_rank))} (different on every rank) as this resume() was given them"
    bn = (
        "; BatchNorm normalises each rank's share of the batch, which the world size changes: from here the run "
        "differs from the uninterrupted one by more than float noise (Loop(sync_bn=True) normalises over the "
        "global batch)"
    )
    return (
        f"ddpkit: resumed at step {step} from a snapshot made at world size {old_world}, now {new_world}: weights, "
        f"optimizer and named state exactly; each rank's random streams anew from (seed, step, rank), and each "
        f"loader's split is the new world's from the same place in its epoch{reset if per_rank else ''}"
        f"{bn if plain_bn else ''}"
    )


def environ_lines(before: dict, now: dict, step: int) -> list[str]:
    """A ``Loop``'s code reads environment variables that are not compared on a resume (``identity``'s
    ``environ``: {label: value shown}); one line for each whose value differs from the snapshot's run's."""
    return [
        f"ddpkit: {label} is {now[label]} now; this run began with {was}. A Loop does not compare the environment "
        f"on a resume (a loop reads how to run there), so step {step}'s snapshot is loaded as saved: a value it holds "
        f"(an optimizer's lr, say) stays the snapshot's; pass another run_dir to start over with the new one"
        for label, was in sorted(before.items())
        if label in now and now[label] != was
    ]


def global_batch_line(index: int, was: tuple[int, int], now: tuple[int, int]) -> str:
    """A ``Loop.data()`` loader resumed with another global batch than its snapshot's: (world size, each rank's
    batch) then and now. The run trains on as the script now says; the line says what that changes, and the
    batch_size that keeps the run's global batch, where the new world size divides it."""
    (old_world, old_batch), (world, batch) = was, now
    before, after = old_world * old_batch, world * batch
    keep = (
        # (the edit it asks for is one a resume refuses: said, so that the hint does not lead to a refusal, the
        # porter's seed-001 port)
        f"pass batch_size={before} // loop.world_size to loop.data() (each rank's {before // world} here; an edit "
        f"of the loop's code, which a resume refuses unless Loop(check_code=False))"
        if before % world == 0
        else f"a global batch of {before} does not split into {world} equal shares: choose a world size that divides it"
    )
    which = "the loader" if index == 0 else f"loader {index + 1} (in loop.data() order)"
    return (
        f"ddpkit: {which} resumed with a global batch of {after} samples per step ({world} x {batch}), where the "
        f"snapshot's run read {before} ({old_world} x {old_batch}): the steps from here read {after} samples each "
        f"and the epoch has another number of steps, as the script says; to keep the run's global batch, {keep}"
    )


def no_step_line(epoch: int, batches: int) -> str:
    """A ``Loop.epochs()`` epoch that read batches through ``loop.data()`` with no ``loop.step()`` in it."""
    return (
        f"ddpkit: note: epoch {epoch} read {batches} batches through loop.data() and called loop.step() never: "
        f"without it the loop's snapshots, records and stop signals come at epoch ends only (a stop waits for the "
        f"epoch's end) and state.step stays where it was; call loop.step() after each optimizer.step()"
    )


def no_loader_line(epoch: int, world_size: int) -> str:
    """A ``Loop.epochs()`` epoch that stepped at world size > 1 with no ``loop.data()`` loader made (the porter's
    seed 003 forgot it: each rank read the whole dataset, twice the steps, with no word)."""
    return (
        f"ddpkit: note: epoch {epoch} stepped at world size {world_size} with no loader made by loop.data(): a "
        f"DataLoader of your own gives every rank the whole dataset unless its sampler splits it "
        f"(DistributedSampler), and keeps its position out of the snapshots (a resume mid-epoch starts the epoch "
        f"over); a map-style dataset's DataLoader goes through loop.data(loader) (an IterableDataset, or data held "
        f"whole, stays as it is)"
    )


def finished_line(step: int, epoch: int) -> str:
    """A ``Loop`` resumed from the snapshot its run wrote as it finished."""
    return (
        f"ddpkit: this run dir holds a run that finished at step {step} (epoch {epoch}); resumed there, the loop "
        f"trains on only past that point (a longer loop.steps() or loop.epochs()); to train again from the start, "
        f"pass another run_dir to Loop"
    )
