"""``ddpkit bench``: throughput and scaling across world sizes, measured beside a cost model.

    report = bench(TrainConfig(model="resnet9", dataset="synthetic"), nprocs=[1, 2], steps=200, out="bench")
    # bench/bench.json, bench/bench.md, bench/scaling.png

Every figure comes from the training engine itself (``Trainer.fit`` with ``max_steps``):
the step records it logs every ``window`` steps give samples/s per window; the first
windows (the warm-up: allocator, kernel selection, caches) are dropped, and the report
gives the median of the rest and their spread. At each world size N > 1 the same steps
run again with gradient sync off (``grad_sync=False``: DDP's ``no_sync``), so
``comm = step - step without sync`` is the communication the step actually waits for.
Where the installed torch exposes DDP's own timers (a private API), they are added,
marked as such. An all-reduce probe at N ranks measures the backend's latency and bus
bandwidth; :mod:`ddpkit.tools.costmodel` then predicts each world size from the world-1 step,
for this machine and for GPUs it does not have.

Weak scaling (default) keeps the per-rank batch (``--batch-size`` is per rank), strong
scaling (``--strong``) the global batch.

The conditions are measured and reported, since a speedup is only as good as its world-1 run:
the CPU that other processes take before and during every run (:mod:`ddpkit.tools.hostload`),
and the threads each world size ran with. A row is marked invalid, never printed as a valid
figure, when other processes took more than ``LOAD_LIMIT`` cores during it, when its efficiency
exceeds 100% (N ranks cannot do more than N times one rank's work: the world-1 run was slowed),
or when the world-1 run it is relative to is itself invalid; ``ddpkit bench`` then exits 1.
"""

from __future__ import annotations

import dataclasses
import json
import math
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import torch

from ..config import TrainConfig
from ..data import load_dataset
from ..device import resolve_device_type
from ..errors import ConfigError
from ..files import atomic_write
from ..models import model_for
from ..ranks.context import cpu_cores, cpu_threads, distributed
from ..ranks.launcher import LaunchSpec, run_workers
from ..run.paths import RunFiles
from ..run.plots import scaling_plot
from ..run.records import read_records
from ..trainer import Trainer
from . import hostload
from .costmodel import LINKS, Link, ddp_buckets, predict_step

WARMUP_FRAC = 0.2  # of the windows, dropped from the front (at least one)
PROBE_BYTES = (1 << 20, 8 << 20, 25 << 20)  # DDP's first bucket, a middle one, a full 25 MiB bucket
# Cores' worth of CPU other processes may take during a run before its figures are invalid: an idle
# 2-core CI machine shows 0.00-0.05 (hostload.sample over 0.5 s), one busy loop 1.0.
LOAD_LIMIT = 0.25


def windows(metrics_jsonl: Path, global_batch: int, window: int) -> list[float]:
    """Step times (s) per logged window of exactly ``window`` steps, warm-up dropped: global batch /
    the window's samples/s. An epoch's last step also logs, cutting a shorter window, which is left
    out. (Each epoch's first window starts after the previous epoch's evaluation: eval is not timed.)"""
    steps = [r for r in read_records(metrics_jsonl) if r["event"] == "step"]
    rates = [r["samples_per_s"] for prev, r in zip([{"step": 0}, *steps], steps) if r["step"] - prev["step"] == window]
    if len(rates) < 2:
        raise ConfigError(
            f"only {len(rates)} whole window(s) of {window} steps: an epoch of this dataset holds fewer "
            f"steps than a window, or --steps is too small; raise --limit-train or --steps, or lower "
            f"--window"
        )
    drop = max(1, int(len(rates) * WARMUP_FRAC))
    return [global_batch / r for r in rates[drop:]]


def spread(values: list[float]) -> dict:
    return {"median": statistics.median(values), "min": min(values), "max": max(values), "windows": len(values)}


def probe_worker(device: str, sizes: tuple, repeats: int) -> list[float]:
    """Median seconds of one all-reduce of each size (float32) on every rank; rank 0's figures."""
    with distributed(device) as ctx:
        out = []
        for size in sizes:
            buf = torch.ones(size // 4, dtype=torch.float32, device=ctx.device)
            ctx.all_reduce(buf)  # warm-up: connections, allocations
            times = []
            for _ in range(repeats):
                ctx.barrier()
                t = time.perf_counter()
                ctx.all_reduce(buf)
                if ctx.device.type == "cuda":
                    torch.cuda.synchronize(ctx.device)
                times.append(time.perf_counter() - t)
            out.append(statistics.median(times))
        return out


def bench(
    config: TrainConfig,
    nprocs: list[int],
    steps: int = 200,
    strong: bool = False,
    window: int = 0,
    comm_hook: str | None = None,
    zero: bool | None = None,
    predict_worlds: tuple = (2, 4, 8),
    gpu_step_s: float | None = None,
    gpu_link: Link | None = None,
    model=None,
    train_data=None,
    test_data=None,
    loss_fn=None,
    metrics=None,
) -> dict:
    """Run the workload at each world size in ``nprocs``; return the report (see the module docstring)."""
    import copy
    import os
    import sys

    if steps < 1 or window < 0:
        raise ConfigError(f"--steps must be at least 1 and --window at least 0; got {steps} and {window}")
    _check_gpu_step(gpu_step_s)
    comm_hook = config.comm_hook if comm_hook is None else comm_hook
    zero = config.zero if zero is None else zero
    if not nprocs or any(n < 1 for n in nprocs):
        raise ConfigError(f"--nproc takes a list of positive world sizes, e.g. 1,2; got {nprocs}")
    if 1 not in nprocs:
        nprocs = [1, *nprocs]  # speedup and the cost model are relative to world 1
    nprocs = sorted(set(nprocs))
    device = resolve_device_type(config.device)
    if device == "cuda" and max(nprocs) > torch.cuda.device_count():
        raise ConfigError(f"--nproc {max(nprocs)} needs {max(nprocs)} GPUs; this node has {torch.cuda.device_count()}")
    base = config.resolved()
    per_rank = base.batch_size
    if strong and any(per_rank % n for n in nprocs):
        raise ConfigError(f"--strong keeps the global batch {per_rank}; it must divide by every world size {nprocs}")
    window = window or max(1, steps // 10)
    if steps < 2 * window:
        raise ConfigError(
            f"--steps {steps} gives fewer than two windows of {window} steps: nothing is left after "
            f"the warm-up; raise --steps"
        )
    before = {"other_processes_cores": hostload.sample(), "load_average_1min": round(os.getloadavg()[0], 2)}
    if (before["other_processes_cores"] or 0.0) > LOAD_LIMIT:
        print(
            f"ddpkit: warning: other processes are using {before['other_processes_cores']:.2f} of {cpu_cores()} "
            f"cores before the runs: the figures will be slow and noisy, and marked invalid if it goes on",
            file=sys.stderr,
        )
    work = Path(tempfile.mkdtemp(prefix="ddpkit-bench-"))
    rows = []
    try:
        for n in nprocs:
            global_batch = per_rank if strong else per_rank * n
            cfg = dataclasses.replace(
                base,
                nproc=str(n),
                batch_size=global_batch,
                max_steps=steps,
                epochs=10**6,
                log_every=window,
                progress=False,
                quiet=True,
                resume="never",
                save_every_steps=0,
                plots=False,
                log="",  # its own runs: bench draws scaling.png instead
                comm_hook=comm_hook,
                zero=zero,
                limit_test=max(global_batch, 2 * n),
                max_restarts=0,
                replicas=1,
                sample_log=False,
                run_dir="",
            )
            threads = cpu_threads(n) if device == "cpu" else None  # what distributed() gives each rank
            row = {
                "world_size": n,
                "global_batch": global_batch,
                "conditions": {
                    "threads_per_rank": threads,
                    "oversubscribed": device == "cpu" and n * threads > cpu_cores(),
                },
            }
            # ZeRO's parameter broadcast is part of its step, and with unsynced gradients an fp16
            # scaler may skip the step on one rank only, leaving the others in that broadcast.
            for sync in (True, False) if n > 1 and not zero else (True,):
                run_cfg = dataclasses.replace(
                    cfg, grad_sync=sync, run_dir=str(work / f"w{n}-{'sync' if sync else 'nosync'}")
                )
                others, t = hostload.others(), time.perf_counter()
                result = Trainer(
                    run_cfg,
                    model=copy.deepcopy(model),
                    train_data=train_data,
                    test_data=test_data,
                    loss_fn=loss_fn,
                    metrics=metrics,
                ).fit()  # a copy: fit() trains the object it gets
                busy = hostload.busy_cores(others, hostload.others(), time.perf_counter() - t)
                key = "other_processes_cores" if sync else "other_processes_cores_no_sync"
                row["conditions"][key] = None if busy is None else round(busy, 3)
                s = spread(windows(RunFiles(result.run_dir).metrics, global_batch, window))
                if sync:
                    row.update(
                        step_s=s, samples_per_s=global_batch / s["median"], ddp_timers=result.summary.get("ddp_timers")
                    )
                    # The run's one snapshot, at its end: how long it held the step, and how
                    row["snapshot"] = {
                        "mode": result.summary.get("snapshots"),
                        "blocked_ms": result.summary.get("snapshot_blocked_ms_median"),
                    }
                    # The strategy and the parameter bytes each rank held (its shards under FSDP2), as the
                    # start record says them; with gradients and an optimizer's state, a multiple of them
                    start = next(
                        (r for r in read_records(RunFiles(result.run_dir).metrics) if r["event"] == "start"), {}
                    )
                    row["memory"] = {k: start.get(k) for k in ("strategy", "param_mb_per_rank")}
                    flops, peak = result.summary.get("flops_per_step"), result.summary.get("peak_tflops")
                    if flops:  # one rank's step (train/flops.py), at the median step time
                        row["tflops_per_device"] = flops / s["median"] / 1e12
                        row["mfu"] = row["tflops_per_device"] / peak if peak else None
                else:
                    row["compute_step_s"] = s
            if "compute_step_s" in row:
                row["comm_s"] = max(0.0, row["step_s"]["median"] - row["compute_step_s"]["median"])
            if n > 1:
                times = run_workers(
                    probe_worker,
                    (base.device, PROBE_BYTES, 5),
                    LaunchSpec.from_config(dataclasses.replace(cfg, run_dir=str(work / "probe"))),
                )
                row["allreduce_probe"] = {"bytes": list(PROBE_BYTES), "seconds": times}
            rows.append(row)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    model_obj = model if model is not None else _registry_model(base)  # for its gradient bytes
    rep = report(
        base,
        rows,
        model_obj,
        device,
        strong,
        predict_worlds,
        gpu_step_s,
        gpu_link,
        per_rank,
        comm_hook,
        zero,
        steps,
        window,
    )
    _name_model(rep, model)
    rep["conditions_before"] = before
    return judge(rep)


def judge(rep: dict) -> dict:
    """Mark each row valid or not (see the module docstring), and the report with it."""
    rows = rep["rows"]
    for r in rows:
        why = []
        for key in ("other_processes_cores", "other_processes_cores_no_sync"):
            busy = r["conditions"].get(key)
            if busy is not None and busy > LOAD_LIMIT:
                what = "during it" if key == "other_processes_cores" else "during its no_sync run"
                why.append(f"other processes used {busy:.2f} cores {what}")
        if r["efficiency"] > 1.0:
            why.append(
                f"efficiency {r['efficiency']:.0%} is above 100%: the world-1 run it divides by was slower than "
                f"1/{r['world_size']} of this one (load, its threads waiting on each other, or noise); rerun"
            )
        r["invalid"] = why
    if rows and rows[0]["invalid"]:
        for r in rows[1:]:
            r["invalid"].append("its speedup is relative to the world-1 run, which is not valid")
    for r in rows:
        r["valid"] = not r["invalid"]
    rep["invalid"] = [f"world {r['world_size']}: {', '.join(r['invalid'])}" for r in rows if r["invalid"]]
    rep["valid"] = not rep["invalid"]
    return rep


def predict_only(
    config: TrainConfig,
    gpu_step_s: float,
    link: Link | None = None,
    predict_worlds=(2, 4, 8),
    strong: bool = False,
    model=None,
) -> dict:
    """The cost model alone: what ``predict_worlds`` GPUs would give, from a world-1 step time
    measured on such a GPU, without running anything here."""
    _check_gpu_step(gpu_step_s)
    base = config.resolved()
    rep = report(
        base,
        [],
        model if model is not None else _registry_model(base),
        "cuda",
        strong,
        predict_worlds,
        gpu_step_s,
        link,
        base.batch_size,
        base.comm_hook,
        base.zero,
        0,
        0,
    )
    _name_model(rep, model)
    return rep


def _check_gpu_step(gpu_step_s: float | None) -> None:
    if gpu_step_s is not None and not (math.isfinite(gpu_step_s) and gpu_step_s > 0):
        raise ConfigError(f"--gpu-step-ms must be a positive number of milliseconds, got {gpu_step_s * 1e3:g}")


def _name_model(rep: dict, model) -> None:
    """The model measured, not the config's default name: a model object passed in by its class."""
    if model is not None:
        rep["config"]["model"] = f"{type(model).__module__}.{type(model).__qualname__}"


def _registry_model(cfg: TrainConfig):
    return model_for(cfg, load_dataset(cfg).meta)


def report(
    cfg: TrainConfig,
    rows,
    model,
    device,
    strong,
    predict_worlds,
    gpu_step_s,
    gpu_link,
    per_rank,
    comm_hook,
    zero,
    steps,
    window,
) -> dict:
    """Speedup, efficiency and the cost model's prediction beside each measurement."""
    t1 = rows[0]["step_s"]["median"] if rows else gpu_step_s
    rate1 = rows[0]["samples_per_s"] if rows else None
    # bytes on the wire: the gradients' dtype, halved by a bf16/fp16 hook; PowerSGD is not modelled
    wire = (2.0 if cfg.dtype == "float64" else 1.0) * (0.5 if comm_hook in ("bf16", "fp16") else 1.0)
    buckets = [int(b * wire) for b in ddp_buckets(model)]
    cores = cpu_cores() if device == "cpu" else 1
    probes = [r for r in rows if "allreduce_probe" in r]
    link = None
    if probes:
        widest = probes[-1]
        link = Link.fit(
            f"measured {'gloo' if device == 'cpu' else 'nccl'} at world {widest['world_size']}",
            widest["world_size"],
            widest["allreduce_probe"]["bytes"],
            widest["allreduce_probe"]["seconds"],
        )
    for r in rows:
        r["speedup"] = r["samples_per_s"] / rate1
        r["efficiency"] = r["speedup"] / r["world_size"]
        if link is not None:
            # Beside a measurement the model predicts the comm alone: the compute is the one measured
            # under no_sync at that world size (on CPU it depends on how the cores are shared, which
            # the thread-ratio rule used for unmeasured sizes only bounds).
            compute = r["compute_step_s"]["median"] if "compute_step_s" in r else t1
            p = predict_step(
                compute, buckets, r["world_size"], link, device, per_rank, strong, cores, compute_measured=True
            )
            rate = r["global_batch"] / p.step_s
            r["predicted"] = {
                **p.to_dict(),
                "samples_per_s": rate,
                "speedup": rate / rate1,
                "efficiency": rate / rate1 / r["world_size"],
            }
            r["prediction_error"] = p.step_s / r["step_s"]["median"] - 1
    predictions = {}
    if device == "cuda" or gpu_step_s:
        t_gpu = gpu_step_s or t1
        fabric = gpu_link or LINKS["h100-nvlink"]
        predictions[fabric.name] = [
            predict_step(t_gpu, buckets, n, fabric, "cuda", per_rank, strong).to_dict() for n in (1, *predict_worlds)
        ]
    if link is not None and device == "cpu":
        predictions[link.name] = [
            predict_step(t1, buckets, n, link, device, per_rank, strong, cores).to_dict() for n in (1, *predict_worlds)
        ]
    return {
        "config": {
            "model": cfg.model,
            "dataset": cfg.dataset,
            "device": device,
            "dtype": cfg.dtype,
            "amp": cfg.amp,
            "per_rank_batch" if not strong else "global_batch": per_rank,
            "scaling": "strong" if strong else "weak",
            "steps": steps,
            "window_steps": window,
            "warmup_windows_dropped_frac": WARMUP_FRAC,
            "comm_hook": comm_hook,
            "zero": zero,
            "cores": cpu_cores(),
            "torch": torch.__version__,
            "comm_modelled": comm_hook != "powersgd",
        },
        "gradient_bytes": sum(buckets),
        "ddp_buckets": buckets,
        "link": dataclasses.asdict(link) if link else None,
        "gpu_step_s": gpu_step_s,
        "rows": rows,
        "predictions": predictions,
    }


def write_outputs(rep: dict, out: str | Path) -> list[Path]:
    out = Path(out)
    paths = [out / "bench.json", out / "bench.md", out / "scaling.png"]
    atomic_write(paths[0], (json.dumps(rep, indent=2) + "\n").encode(), "--out")
    atomic_write(paths[1], markdown(rep).encode(), "--out")
    scaling_plot(rep, paths[2])
    return paths


def markdown(rep: dict) -> str:
    c = rep["config"]
    buckets = f"Gradients: {rep['gradient_bytes'] / 2**20:.1f} MiB in {len(rep['ddp_buckets'])} DDP bucket(s)."
    lines = [f"# ddpkit bench: {c['model']} on {c['dataset']}, {c['device']}, {c['scaling']} scaling", ""]
    if not rep["rows"]:
        batch = c.get("per_rank_batch") or c.get("global_batch")
        lines.append(
            f"Predictions only, from a world-1 step of {rep['gpu_step_s'] * 1e3:.2f} ms at batch {batch}. {buckets}"
        )
        return _predictions_md(rep, lines)
    before = rep.get("conditions_before") or {}
    if not rep.get("valid", True):
        lines += ["**NOT VALID**: " + "; ".join(rep["invalid"]) + ". Rerun on a quiet machine.", ""]
    if before:
        busy = before.get("other_processes_cores")
        lines += [
            f"Conditions: {c['cores']} cores; before the runs other processes used "
            f"{'unmeasured' if busy is None else f'{busy:.2f}'} cores "
            f"(load average {before.get('load_average_1min')}); "
            f"a run is invalid when others use more than {LOAD_LIMIT:g} cores during it.",
            "",
        ]
    lines += [
        f"{c['steps']} steps per run in windows of {c['window_steps']}; the first "
        f"{int(c['warmup_windows_dropped_frac'] * 100)}% of windows (at least one) dropped as warm-up; "
        f"median (min-max) over the rest. Predicted step = compute measured under no_sync + the cost "
        f"model's comm. {buckets}",
        "",
        "| world | global batch | samples/s | step ms (min-max) | compute ms (no_sync) | comm ms | speedup | "
        "efficiency | predicted step ms | prediction error | threads x ranks | others' CPU (cores) | "
        "TFLOP/s per device (MFU) |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rep["rows"]:
        s, comp, pred = r["step_s"], r.get("compute_step_s"), r.get("predicted")
        cells = [
            str(r["world_size"]),
            str(r["global_batch"]),
            f"{r['samples_per_s']:,.0f}",
            f"{s['median'] * 1e3:.1f} ({s['min'] * 1e3:.1f}-{s['max'] * 1e3:.1f})",
            f"{comp['median'] * 1e3:.1f}" if comp else "-",
            f"{r.get('comm_s', 0.0) * 1e3:.1f}",
            f"{r['speedup']:.2f}x" + ("" if r.get("valid", True) else " INVALID"),
            f"{r['efficiency']:.0%}" + ("" if r.get("valid", True) else " INVALID"),
            f"{pred['step_s'] * 1e3:.1f}" if pred else "-",
            f"{r['prediction_error']:+.0%}" if pred else "-",
            _threads(r),
            _busy(r),
            _utilisation(r),
        ]
        lines.append("| " + " | ".join(cells) + " |")
    held = [(r["world_size"], r["snapshot"]) for r in rep["rows"] if (r.get("snapshot") or {}).get("blocked_ms")]
    if held:
        lines += [
            "",
            "A snapshot held the step "
            + ", ".join(f"{snap['blocked_ms']:.1f} ms at world {n}" for n, snap in held)
            + f" (the run's last, {held[0][1]['mode']}; not in the windows above). Written in the background, its "
            "thread on rank 0 takes a core while it writes: where the ranks use every core, the steps meanwhile "
            "are slower (the step records' snapshot_write_s, beside samples_per_s).",
        ]
    held_mb = [(r["world_size"], r["memory"]) for r in rep["rows"] if (r.get("memory") or {}).get("param_mb_per_rank")]
    if held_mb:
        strategy = held_mb[0][1]["strategy"]
        lines += [
            "",
            f"Parameters held per rank ({strategy}): "
            + ", ".join(f"{m['param_mb_per_rank']:.3g} MiB at world {n}" for n, m in held_mb)
            + (
                "; sharded over the ranks, with their gradients and optimizer state (DDP holds the whole at "
                f"every world size: {held_mb[0][1]['param_mb_per_rank'] * held_mb[0][0]:.3g} MiB)."
                if strategy == "fsdp2"
                else "; with their gradients and an optimizer's state, a multiple of that on every rank "
                "(--strategy fsdp2 divides all of it by the world size: docs/fsdp2.md)."
            ),
        ]
    return _predictions_md(rep, lines)


def _utilisation(row: dict) -> str:
    if row.get("tflops_per_device") is None:
        return "-"
    mfu = row.get("mfu")
    return f"{row['tflops_per_device']:.3g}" + (f" ({mfu:.1%})" if mfu is not None else "")


def _threads(row: dict) -> str:
    cond = row.get("conditions", {})
    if cond.get("threads_per_rank") is None:
        return "-"
    return f"{cond['threads_per_rank']} x {row['world_size']}" + (" (oversubscribed)" if cond["oversubscribed"] else "")


def _busy(row: dict) -> str:
    busy = row.get("conditions", {}).get("other_processes_cores")
    return "unmeasured" if busy is None else f"{busy:.2f}"


def _predictions_md(rep: dict, lines: list[str]) -> str:
    if not rep["config"].get("comm_modelled", True):
        lines += ["", "PowerSGD's compressed all-reduce is not modelled: the predictions count full gradients."]
    timers = [r for r in rep["rows"] if r.get("ddp_timers")]
    if timers:
        lines += [
            "",
            "DDP's own timers (private API `_get_ddp_logging_data`, averaged over sampled iterations, ms):",
            "",
        ]
        for r in timers:
            lines.append(
                f"- world {r['world_size']}: " + ", ".join(f"{k} {v / 1e6:.2f}" for k, v in r["ddp_timers"].items())
            )
    if rep["link"]:
        link = rep["link"]
        lines += [
            "",
            f"All-reduce probe ({link['name']}): bus bandwidth {link['busbw'] / 1e9:.2f} GB/s, "
            f"latency {link['latency_s'] * 1e6:.0f} us per ring step.",
        ]
    for name, preds in rep["predictions"].items():
        how = (
            "compute = the world-1 step, scaled by core sharing (N ranks on "
            f"{rep['config']['cores']} cores get cores/N threads each, a fraction of a core past N = cores), "
            "+ the modelled comm; the table above instead uses the compute measured at each size"
            if name.startswith("measured")
            else "compute = the GPU's world-1 step (each GPU computes alone), + the comm the backward does not hide"
        )
        lines += [
            "",
            f"Predicted from the world-1 step with {name} ({how}):",
            "",
            "| world | step ms | comm ms | exposed comm ms | samples/s | efficiency |",
            "|---|---|---|---|---|---|",
        ]
        for p in preds:
            lines.append(
                f"| {p['world']} | {p['step_s'] * 1e3:.2f} | {p['comm_s'] * 1e3:.2f} | "
                f"{p['exposed_comm_s'] * 1e3:.2f} | {p['samples_per_s']:,.0f} | {p['efficiency']:.0%} |"
            )
    return "\n".join(lines) + "\n"
