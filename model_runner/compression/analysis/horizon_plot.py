"""Horizon profiles in the style of the paper's Figures 2 and 4-6 (matplotlib, Agg backend).

Panels: (1) per-layer map of log10 H_s over all model blocks (full-attention blocks gray),
units in architectural order; (2) fraction of global units per (block, head) at the first
W_max; (3) pooled distribution of log2 H_s with the W_max thresholds marked.  Axes that count
(blocks, units, heads, histogram counts) get integer ticks only.
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import torch

from model_runner.config import ModelConfig


def plot_horizons(
    cfg: ModelConfig, horizons: torch.Tensor, w_maxes: list[float], path: str | Path
) -> None:
    """Write the three panels to `path` (any format matplotlib infers from the suffix)."""
    fig = horizon_figure(cfg, horizons, w_maxes)  # selects the Agg backend first
    import matplotlib.pyplot as plt

    fig.savefig(path, dpi=110)
    plt.close(fig)


def horizon_figure(cfg: ModelConfig, horizons: torch.Tensor, w_maxes: list[float]):
    """The three panels as a matplotlib Figure (the caller closes it)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    h = horizons.double().numpy()  # [L, n]
    finite = np.where(np.isfinite(h), h, np.nan)
    blocks = np.full((cfg.num_hidden_layers, h.shape[1]), np.nan)
    blocks[cfg.linear_layer_ids] = np.log10(finite)
    unit = "channel" if cfg.is_kda else "head"
    fig, axes = plt.subplots(1, 3, figsize=(18, 5.5), constrained_layout=True)

    cmap = matplotlib.colormaps["viridis"].with_extremes(bad="lightgray")
    im = axes[0].imshow(np.ma.masked_invalid(blocks), aspect="auto", cmap=cmap,
                        interpolation="nearest")
    axes[0].set(title=f"static horizon per {unit} (gray: full attention)",
                xlabel=f"{unit} (architectural order)", ylabel="model block")
    fig.colorbar(im, ax=axes[0], label="log10 H_s [tokens]")

    w0 = w_maxes[0] if w_maxes else 16.0
    heads = cfg.linear_num_value_heads
    kept = (h > w0).reshape(h.shape[0], heads, -1).mean(axis=2)  # [L, H]
    frac = np.full((cfg.num_hidden_layers, heads), np.nan)
    frac[cfg.linear_layer_ids] = kept
    im = axes[1].imshow(np.ma.masked_invalid(frac), aspect="auto", cmap=cmap, vmin=0, vmax=1,
                        interpolation="nearest")
    axes[1].set(title=f"global fraction per (block, head) at W_max={w0:g}", xlabel="value head",
                ylabel="model block")
    fig.colorbar(im, ax=axes[1], label="fraction of units with H_s > W_max")

    pooled = np.log2(finite[np.isfinite(finite)])
    if pooled.size:
        axes[2].hist(pooled, bins=60, color="tab:blue")
    for w in w_maxes:
        if w > 0:
            axes[2].axvline(math.log2(w), color="tab:red", linestyle="--", linewidth=1)
            axes[2].text(math.log2(w), axes[2].get_ylim()[1] * 0.95, f" {w:g}", color="tab:red")
    axes[2].set(title=f"pooled static horizons ({h.size} {unit}s)", xlabel="log2 H_s [tokens]",
                ylabel="count")
    for axis in (axes[0].xaxis, axes[0].yaxis, axes[1].xaxis, axes[1].yaxis, axes[2].yaxis):
        axis.set_major_locator(MaxNLocator(integer=True))
    fig.suptitle(f"{cfg.architecture}: static retention horizons (W_max marked)")
    return fig
