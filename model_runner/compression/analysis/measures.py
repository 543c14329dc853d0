"""Validation measures of paper sec. 3.4: empirical horizons, state and readout activity, Spearman.

Pure functions over captured tensors of one linear layer (the quality work hooks them):
    gates g  [T, H] (GDN, per value head) or [T, H, K] (KDA) observed log-decays
    state S  [H, K, V] fp32 at the final prefix position (row [h, k, :] is KDA unit h*K + k)
    query q  [H, K] final query per value head (a GDN caller may pass [H_k, K] key-head queries;
             they are repeated to the value heads, value head h reading key head h // (H / H_k))
Every measure returns one value per unit in the unit numbering of `compression/horizons.py`: [H]
for GDN, [H*K] for KDA.
"""

from __future__ import annotations

import math

import numpy as np
import torch
from scipy.stats import spearmanr

from model_runner.compression.defaults import DEFAULT_EPS


def empirical_horizons(
    g: torch.Tensor, eps: float = DEFAULT_EPS, valid: torch.Tensor | None = None
) -> torch.Tensor:
    """Eq. 4: H_e = ln(eps) / mean_t g over the valid (non-padding) tokens.

    g: [T, H] or [T, H, K]; valid: bool [T] or None (all tokens). Returns fp32 [H] or [H*K].
    """
    if g.dim() not in (2, 3):
        raise ValueError(f"gates must be [T, H] or [T, H, K], got {tuple(g.shape)}")
    if valid is not None:
        if valid.shape != g.shape[:1]:
            raise ValueError(f"valid mask {tuple(valid.shape)} does not match T={g.shape[0]}")
        g = g[valid]
    if g.shape[0] == 0:
        raise ValueError("no valid token to average the gates over")
    mean = g.double().mean(dim=0).flatten()  # [H] or [H*K]
    return (math.log(eps) / mean).float()


def state_norms(state: torch.Tensor, kind: str) -> torch.Tensor:
    """M_S: GDN ||S_h||_F per head [H]; KDA ||S_{h,k,:}||_2 per channel [H*K]."""
    _check_state(state)
    s = state.double()
    if kind == "gdn":
        return s.flatten(1).norm(dim=1).float()
    if kind == "kda":
        return s.norm(dim=2).flatten().float()
    raise ValueError(f"kind must be 'gdn' or 'kda', got {kind!r}")


def readout_norms(state: torch.Tensor, q: torch.Tensor, kind: str) -> torch.Tensor:
    """M_R: GDN ||S_h^T q_h||_2 per head [H]; KDA |q_{h,k}| * ||S_{h,k,:}||_2 per channel [H*K]."""
    _check_state(state)
    heads, k_dim, _ = state.shape
    if q.dim() != 2 or q.shape[1] != k_dim or heads % q.shape[0]:
        raise ValueError(f"query must be [H or H_k, {k_dim}], got {tuple(q.shape)}")
    q = q.double().repeat_interleave(heads // q.shape[0], dim=0)  # [H, K]
    s = state.double()
    if kind == "gdn":
        return torch.einsum("hkv,hk->hv", s, q).norm(dim=1).float()
    if kind == "kda":
        return (q.abs() * s.norm(dim=2)).flatten().float()
    raise ValueError(f"kind must be 'gdn' or 'kda', got {kind!r}")


def spearman(static: torch.Tensor, observed: torch.Tensor) -> float:
    """Spearman rho across units of one (prefix, layer) pair; NaN when either side is constant."""
    a, b = _np(static), _np(observed)
    if a.shape != b.shape or a.ndim != 1:
        raise ValueError(f"need two equal 1-D unit vectors, got {a.shape} and {b.shape}")
    if a.size < 2 or np.all(a == a[0]) or np.all(b == b[0]):
        return math.nan
    return float(spearmanr(a, b).statistic)


def spearman_by_layer(static: torch.Tensor, observed: torch.Tensor) -> np.ndarray:
    """rho per (prefix, layer): static [L, n] horizons vs observed [P, L, n] -> [P, L]."""
    if observed.dim() != 3 or tuple(observed.shape[1:]) != tuple(static.shape):
        raise ValueError(
            f"observed must be [P, {static.shape[0]}, {static.shape[1]}], "
            f"got {tuple(observed.shape)}"
        )
    out = np.empty(observed.shape[:2])
    for p in range(observed.shape[0]):
        for l in range(observed.shape[1]):
            out[p, l] = spearman(static[l], observed[p, l])
    return out


def median_iqr(values: np.ndarray) -> tuple[float, float, float]:
    """(median, q25, q75) over finite values, as Table 1(b) reports them."""
    v = np.asarray(values, dtype=float).ravel()
    v = v[np.isfinite(v)]
    if v.size == 0:
        return math.nan, math.nan, math.nan
    q25, med, q75 = np.quantile(v, [0.25, 0.5, 0.75])
    return float(med), float(q25), float(q75)


def _check_state(state: torch.Tensor) -> None:
    if state.dim() != 3:
        raise ValueError(f"state must be [H, K, V], got {tuple(state.shape)}")


def _np(x: torch.Tensor) -> np.ndarray:
    return x.detach().to("cpu", torch.float64).numpy()
