"""Figures as PNG files (matplotlib, rendered off-screen).

    scaling_plot(bench_report, "bench/scaling.png")

Styled to survive greyscale printing: measured and predicted series differ in line style
and marker, not only in colour.
"""

from __future__ import annotations

from pathlib import Path


def scaling_plot(rep: dict, path: str | Path) -> Path:
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
        label = f"predicted: {name}" + (", cores shared" if name.startswith("measured") else
                                        f" (world-1 step {rep['gpu_step_s'] * 1e3:.2g} ms)" if rep.get("gpu_step_s") else "")
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
    fig.savefig(path)
    return Path(path)
