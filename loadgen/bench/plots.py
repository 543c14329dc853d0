"""PNG figures in the style of the paper's Figure 3(a-f) and Table 8 (matplotlib, Agg)."""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from loadgen.bench.seed_metrics import mean_sd  # noqa: E402

MARKERS = {"off": "o", "storage": "s", "hybrid": "D"}


def _series(arms: list[dict], key: str) -> tuple[list[float], list[float], list[float]]:
    xs, ys, es = [], [], []
    for a in sorted(arms, key=lambda a: a["w_max"]):
        m, sd = mean_sd([s[key] for s in a["seeds"].values()])
        xs.append(a["w_max"])
        ys.append(m)
        es.append(sd)
    return xs, ys, es


def _w_axis(ax, wmaxes: list[float]) -> None:
    ax.set_xscale("log", base=2)
    ax.set_xticks(wmaxes, [f"{w:g}" for w in wmaxes])
    ax.minorticks_off()
    ax.set_xlabel("W_max")


def plot_matched(result: dict, path: Path) -> None:
    """(a) capacity ratio, (b) mean TTFT, (c) input throughput vs W_max, one line per
    placement x policy, dense as a dashed line (TTFT and throughput: mean +- SD over seeds)."""
    arms = result["arms"]
    dense = next(a for a in arms if a["w_max"] == 0)
    groups: dict[tuple[str, str, bool], list[dict]] = {}
    for a in arms:
        if a["w_max"]:
            groups.setdefault((a["placement"], a["policy"], a["int8"]), []).append(a)
    fig, axes = plt.subplots(1, 3, figsize=(13, 3.8))
    panels = [("capacity", "capacity ratio vs dense (×)", "(a) state-checkpoint capacity"),
              ("mean_ttft_ms", "mean TTFT (ms)", "(b) TTFT ↓"),
              ("input_throughput", "input throughput (tok/s)", "(c) input throughput ↑")]
    for ax, (key, ylabel, title) in zip(axes, panels):
        for (placement, policy, int8), group in sorted(groups.items()):
            label = f"dasc-{policy}{'-int8' if int8 else ''} {placement}"
            if key == "capacity":
                group = sorted(group, key=lambda a: a["w_max"])
                xs, ys = [a["w_max"] for a in group], [a["capacity_ratio"] for a in group]
                ax.plot(xs, ys, marker=MARKERS.get(placement, "o"), label=label)
            else:
                xs, ys, es = _series(group, key)
                ax.errorbar(xs, ys, yerr=es, marker=MARKERS.get(placement, "o"), capsize=3,
                            label=label)
        ref = 1.0 if key == "capacity" else mean_sd([s[key] for s in
                                                     dense["seeds"].values()])[0]
        ax.axhline(ref, color="k", ls="--", lw=1, label="dense")
        _w_axis(ax, sorted({a["w_max"] for a in arms if a["w_max"]}))
        ax.set_ylabel(ylabel)
        ax.set_title(title, fontsize=10)
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=8)
    fig.suptitle(f"Matched budget: {result['budget_bytes_per_rank']:,} bytes per rank", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def plot_refresh(rows: list[dict], path: Path) -> None:
    """Delta TTFT (wr - nr) and cost per hit vs W_max, mean +- SD over paired seeds."""
    fig, axes = plt.subplots(1, 2, figsize=(9, 3.6))
    xs = [r["w_max"] for r in rows]
    for ax, key, ylabel in ((axes[0], "delta_ttft_ms", "ΔTTFT, dasc-wr − dasc-nr (ms)"),
                            (axes[1], "cost_per_hit_ms", "cost per hit (ms)")):
        ys = [mean_sd(r[key])[0] for r in rows]
        es = [mean_sd(r[key])[1] for r in rows]
        ax.errorbar(xs, ys, yerr=es, marker="o", capsize=3)
        _w_axis(ax, xs)
        ax.set_ylabel(ylabel)
        ax.grid(alpha=0.3)
    fig.suptitle("Fixed-slot suffix-refresh cost", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
