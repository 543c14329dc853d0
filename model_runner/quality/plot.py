"""Accuracy and mean KL vs W_max for dasc-nr, dasc-wr and random (paper Figure 3(g,h) style):
one row per model; the dense accuracy as a dashed line, random as mean ± SD over masks."""

from __future__ import annotations

from pathlib import Path

from model_runner.quality.tables import Runs, arm_name

STYLE = {"nr": ("dasc-nr", "o-"), "wr": ("dasc-wr", "s-"), "random": ("random", "^--")}


def plot_w_sweep(runs: Runs, path: str | Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(len(runs.models), 2, figsize=(9, 3.2 * len(runs.models)),
                             squeeze=False)
    for row, model in zip(axes, runs.models):
        acc_ax, kl_ax = row
        dense = runs.mean(model, "dense", "accuracy")
        if dense is not None:
            acc_ax.axhline(dense, color="gray", ls=":", label="dense")
        for kind, (label, style) in STYLE.items():
            ws = runs.w_values(model, kind)
            if not ws:
                continue
            for ax, metric in ((acc_ax, "accuracy"), (kl_ax, "kl")):
                if kind == "random":
                    spread = [runs.seed_spread(model, arm_name(kind, w), metric) for w in ws]
                    ax.errorbar(ws, [m for m, _ in spread], yerr=[s for _, s in spread],
                                fmt=style, capsize=3, label=label)
                else:
                    ax.plot(ws, [runs.mean(model, arm_name(kind, w), metric) for w in ws],
                            style, label=label)
        ticks = sorted({w for kind in STYLE for w in runs.w_values(model, kind)})
        for ax, name, title in ((acc_ax, "accuracy", "accuracy"),
                                (kl_ax, "mean KL vs dense (nats)", "KL vs dense")):
            ax.set_xscale("log", base=2)
            ax.set_xticks(ticks, [f"{w:g}" for w in ticks])
            ax.set_xlabel("W_max")
            ax.set_ylabel(name)
            ax.set_title(f"{model}: {title}")
            ax.grid(alpha=0.3)
        kl_ax.set_yscale("symlog", linthresh=1e-5)  # wr can be exact (KL 0) at W_max >= length
        kl_ax.set_ylim(bottom=0)
        acc_ax.legend(fontsize=8)
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
