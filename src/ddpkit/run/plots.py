"""Figures as PNG files (matplotlib, rendered off-screen).

    training_plots(["runs/a", "runs/b"], "plots/")   # loss.png, <metric>.png, throughput.png
    scaling_plot(bench_report, "bench/scaling.png")

Styled to survive greyscale printing: runs, and measured against predicted series, differ in
line style and marker, not only in colour. Each PNG is written atomically (rendered in memory,
then :func:`ddpkit.files.atomic_write`): a kill mid-draw leaves the previous figure whole.
"""

from __future__ import annotations

import io
import math
import re
import sys
from pathlib import Path

from ..errors import RunDirError
from ..files import atomic_write, describe_io_error
from .paths import RunFiles
from .records import scan_records

THROUGHPUT = "throughput"  # the samples/s panel's file name: a metric of that name is drawn under another

# One style per run, told apart without colour: line style, marker, and a luminance spread
RUN_STYLES = [
    ("-", "o", "black"),
    ("--", "s", "tab:blue"),
    (":", "^", "tab:orange"),
    ("-.", "D", "tab:green"),
    ((0, (5, 1, 1, 1)), "v", "tab:purple"),
    ((0, (1, 2)), "P", "tab:brown"),
]

# Step-record fields that get no plot of their own (each metric of the model does): the run's timing
# (samples/s, or a Loop's steps/s, has the throughput plot), the lr, and the seconds snapshots held the steps or
# were written
NOT_CURVES = frozenset(
    {"event", "time", "epoch", "step", "lr", "samples_per_s", "steps_per_s", "grad_norm", "tflops", "mfu"}
    | {"snapshot_blocked_s", "snapshot_write_s"}
)
# The throughput panel's figure, the first any run records: a Trainer's step records give samples/s, and so do a
# Loop's when its step reads through loop.data(); a Loop's always give steps/s (a loop may read from a loader of its
# own, or none)
RATES = (("samples_per_s", "samples/s"), ("steps_per_s", "optimizer steps/s"))


def _stderr(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def read_run(run_dir: str | Path, warn=_stderr) -> dict:
    """A run's curves from its metrics.jsonl: step records, epoch records, and a label naming the
    run and its world size. A directory without records is a one-line error; lines that are not
    records are skipped, said in one ``warn`` line."""
    path = RunFiles(run_dir).metrics
    if not path.is_file():
        raise RunDirError(f"{path} not found; is {run_dir} a ddpkit run directory?")
    try:
        scan = scan_records(path)
    except OSError as exc:
        raise RunDirError(f"cannot read {path}: {exc.strerror or exc}") from None
    if scan.skipped:
        warn(scan.warning(path, "skipped"))
    records = scan.records
    steps = [r for r in records if r["event"] == "step"]
    if not steps:
        raise RunDirError(f"{path} holds no training steps yet; nothing to plot")
    world = next((r.get("world_size") for r in reversed(records) if r["event"] == "start"), None)
    label = Path(run_dir).resolve().name + (f" (world {world})" if world else "")
    return {
        "label": label,
        "steps": steps,
        "epochs": [r for r in records if r["event"] == "epoch"],
        "evals": [r for r in records if r["event"] == "eval"],  # the validation split's, by step
    }


def import_matplotlib() -> None:
    """Import what drawing needs (~0.8 s on a 2-core machine) now. A launcher does it while its workers'
    forkserver still imports torch (an idle core then), so that the plots it draws after the run cost it the
    drawing alone (~0.45 s for three PNGs), where the workers' rank 0 once imported it after the run too."""
    try:
        import matplotlib.backends.backend_agg  # noqa: F401 - savefig's canvas
        import matplotlib.figure  # noqa: F401
    except Exception:  # noqa: BLE001 - a broken matplotlib never stops a run: draw_run_plots warns of it after
        pass


def draw_run_plots(run_dir: str | Path, warn=_stderr) -> None:
    """RUN/plots/*.png, drawn by the run dir's owner once everything else is written: the launcher after its
    workers, or global rank 0 where no launcher holds the run dir (torchrun, several nodes). A figure that
    fails to draw is a warning; the run itself is complete."""
    try:
        training_plots([run_dir], RunFiles(run_dir).plots, warn=warn, flag="--run-dir")
    except Exception as exc:  # noqa: BLE001 - matplotlib, fonts, a full disk: none undoes the run
        warn(
            f"ddpkit: warning: could not draw the plots ({type(exc).__name__}: {exc}); "
            f"`ddpkit plot {run_dir}` draws them later"
        )


def training_plots(run_dirs: list, out_dir: str | Path, warn=_stderr, flag: str = "--out") -> list[Path]:
    """loss.png (train per log interval, test per epoch), one PNG per other metric (accuracy, the
    user's), and throughput.png (samples/s; a Loop's steps/s; none where no run records either), for one run or
    several overlaid. Returns the files written.
    ``warn`` gets one line per metrics.jsonl with lines that are not records; a write error names
    ``flag``, the caller's flag that moves the figures (plot's ``--out``, train's ``--run-dir``)."""
    runs = [read_run(d, warn) for d in run_dirs]
    out = Path(out_dir)
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise RunDirError(describe_io_error(exc, out, flag=flag)) from None
    metrics = list(
        dict.fromkeys(
            k for run in runs for r in run["steps"] for k in r if k not in NOT_CURVES and isinstance(r[k], (int, float))
        )
    )
    written = []
    for metric, stem in zip(metrics, file_stems(metrics)):
        pct = metric == "accuracy"
        written.append(
            _curve_figure(runs, metric, out / f"{stem}.png", pct, ylabel=f"{metric} (%)" if pct else metric, flag=flag)
        )
    # Regression (the porter's seed-000 port): a Loop's run, which records steps/s, got an empty samples/s panel
    recorded = [
        (key, label) for key, label in RATES if any(r.get(key) is not None for run in runs for r in run["steps"])
    ]
    for key, label in recorded[:1]:
        written.append(
            _curve_figure(
                runs,
                key,
                out / f"{THROUGHPUT}.png",
                False,
                ylabel=label,
                test=False,
                title="Training throughput per log interval",
                flag=flag,
            )
        )
    return written


def file_stems(metrics: list[str]) -> list[str]:
    """A file name (without .png) per metric, each its own: characters a file name cannot hold
    become ``_``, and a name taken already (the samples/s panel's ``throughput``, another metric's,
    the same but for case on a case-insensitive disk) gets ``metric-`` in front, then a number."""
    taken, stems = {THROUGHPUT}, []
    for metric in metrics:
        base = re.sub(r"[^A-Za-z0-9._-]", "_", metric).lstrip(".") or "metric"
        stem, n = base, 1
        while stem.lower() in taken:
            stem = f"metric-{base}" if n == 1 else f"metric-{base}-{n}"
            n += 1
        taken.add(stem.lower())
        stems.append(stem)
    return stems


def _curve_figure(
    runs: list, metric: str, path: Path, pct: bool, ylabel: str, test: bool = True, title: str = "", flag: str = "--out"
) -> Path:
    from matplotlib.figure import Figure
    from matplotlib.ticker import FuncFormatter, MaxNLocator

    fig = Figure(figsize=(7, 4.2), dpi=120)
    ax = fig.subplots()
    scale = 100.0 if pct else 1.0
    for run, (line, marker, colour) in zip(runs, RUN_STYLES * 4):
        who = f"{run['label']}: " if len(runs) > 1 else ""
        pts = [(r["step"], r[metric]) for r in run["steps"] if r.get(metric) is not None]
        label = f"{who}train (per log interval)" if test else who[:-2] or None
        _series(ax, pts, scale, line, colour, label, lw=1.6, marker=marker if len(pts) <= 30 else None, ms=4)
        if not test:
            continue
        ends = [(r.get("step"), r.get(f"test_{metric}")) for r in run["epochs"]]
        ends = [(x, y) for x, y in ends if x is not None and y is not None]
        _series(ax, ends, scale, line, colour, f"{who}test (epoch end)", lw=0.8, marker=marker, ms=8, edge=1.8)
        vals = [(r["step"], r[f"val_{metric}"]) for r in run.get("evals", []) if r.get(f"val_{metric}") is not None]
        square = "s" if len(vals) <= 30 else None
        _series(ax, vals, scale, line, colour, f"{who}validation", lw=1.0, marker=square, ms=5, edge=1.0)
    ax.set_xlabel("optimizer step")
    ax.set_ylabel(ylabel)
    xs = {x for line in ax.get_lines() for x in line.get_xdata()}
    if len(xs) == 1:  # one step (say, --max-steps below --log-every): MaxNLocator would tick 7.6, 7.7, ... as 8, 8, ...
        ax.set_xticks(list(xs))
    else:
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))  # steps are whole: no 14, 14, 15, 15 ticks
    ax.xaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:,.0f}"))
    if metric == "samples_per_s":
        ax.set_ylim(bottom=0)
        ax.yaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:,.0f}"))
    elif metric == "steps_per_s":  # a few a second, or a fraction of one: matplotlib's own ticks (0.5, 1.0, ...)
        ax.set_ylim(bottom=0)
    elif metric == "loss" and _spread(ax) > 30:
        ax.set_yscale("log")
    ax.grid(True, alpha=0.3)
    if ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize=9)
    names = runs[0]["label"] if len(runs) == 1 else f"{len(runs)} runs"
    ax.set_title(f"{title or ylabel.split(' (')[0].capitalize()}: {names}", fontsize=11)
    fig.tight_layout()
    if path.exists() and path.read_bytes()[:8] != b"\x89PNG\r\n\x1a\n":
        raise RunDirError(
            f"{path} exists and is not a PNG; ddpkit replaces only its own figures: choose another {flag}"
        )
    return _save(fig, path, flag)


def _series(ax, pts: list, scale: float, line: str, colour, label, lw: float, marker, ms: float, edge=None) -> None:
    """One curve of (step, value) points, scaled (x100 for a percentage); hollow markers with an ``edge`` width."""
    if not pts:
        return
    x, y = zip(*pts)
    hollow = {"markerfacecolor": "white", "markeredgewidth": edge} if edge is not None else {}
    ax.plot(x, [v * scale for v in y], linestyle=line, color=colour, lw=lw, marker=marker, ms=ms, label=label, **hollow)


def _save(fig, path: Path, flag: str) -> Path:
    """The figure as a PNG at ``path``, atomically: rendered in memory (about 50 kB), then written
    through a temporary file and a rename, so no reader ever sees half a PNG."""
    buf = io.BytesIO()
    fig.savefig(buf, format="png")
    atomic_write(path, buf.getvalue(), flag)
    return path


def _spread(ax) -> float:
    """max / min of the finite positive values plotted: a loss falling 30-fold reads better on a log scale."""
    ys = [y for line in ax.get_lines() for y in line.get_ydata() if math.isfinite(y) and y > 0]
    return max(ys) / min(ys) if ys else 1.0


def scaling_plot(rep: dict, path: str | Path, flag: str = "--out") -> Path:
    """Throughput and scaling efficiency against world size: measured (solid, circles) and
    predicted by the cost model (dashed, squares; one series per fabric)."""
    # A bare Figure renders with Agg on any machine, and leaves pyplot's backend (the caller's) alone.
    from matplotlib.figure import Figure
    from matplotlib.ticker import FuncFormatter

    c = rep["config"]
    fig = Figure(figsize=(10, 4.2), dpi=120)
    ax1, ax2 = fig.subplots(1, 2)
    worlds = [r["world_size"] for r in rep["rows"]]
    if worlds:
        ax1.plot(worlds, [r["samples_per_s"] for r in rep["rows"]], "o-", color="black", label="measured", lw=2)
        ax2.plot(worlds, [100 * r["efficiency"] for r in rep["rows"]], "o-", color="black", label="measured", lw=2)
    styles = [("s--", "tab:blue"), ("^:", "tab:orange"), ("D-.", "tab:green")]
    for (name, preds), (style, colour) in zip(rep["predictions"].items(), styles):
        w = [p["world"] for p in preds]
        label = f"predicted: {name}" + (
            ", cores shared"
            if name.startswith("measured")
            else f" (world-1 step {rep['gpu_step_s'] * 1e3:.2g} ms)"
            if rep.get("gpu_step_s")
            else ""
        )
        ax1.plot(w, [p["samples_per_s"] for p in preds], style, color=colour, label=label)
        ax2.plot(w, [100 * p["efficiency"] for p in preds], style, color=colour, label=label)
    all_worlds = sorted({*worlds, *(p["world"] for preds in rep["predictions"].values() for p in preds)})
    for ax in (ax1, ax2):
        ax.set_xscale("log", base=2)
        ax.set_xticks(all_worlds)
        ax.set_xticklabels([str(w) for w in all_worlds])
        ax.set_xlabel("world size (processes)")
        ax.grid(True, alpha=0.3)
    rates = [line_y for line in ax1.get_lines() for line_y in line.get_ydata()]
    wide = max(rates) / max(min(rates), 1e-9) > 20  # a GPU prediction beside CPU figures: log scale
    if wide:
        ax1.set_yscale("log")
        ax1.yaxis.set_minor_formatter(FuncFormatter(lambda v, _: ""))
    else:
        ax1.set_ylim(0, 1.1 * max(rates))
    ax1.yaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:,.0f}"))
    ax1.set_ylabel("throughput (samples/s" + (", log scale)" if wide else ")"))
    ax1.set_title("Throughput")
    ax2.set_ylabel("scaling efficiency (%)")
    ax2.set_ylim(0, 110)
    ax2.axhline(100, color="grey", lw=0.8)
    ax2.set_title("Efficiency = speedup / world size")
    ax2.legend(loc="lower left", fontsize=8)
    fig.suptitle(f"ddpkit bench: {c['model']} on {c['dataset']} ({c['device']}, {c['scaling']} scaling)")
    fig.tight_layout()
    return _save(fig, Path(path), flag)
