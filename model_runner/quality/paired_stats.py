"""Paired inference for arm comparisons (paper Table 5): the instance is the statistical unit.

Given per-instance differences d_i (e.g. dasc score minus the mean of the random masks' scores
on the same instance), ``paired_bootstrap`` resamples instances with replacement (scipy's
``stats.bootstrap``, 10,000 resamples) and reports the mean difference, its percentile 95% CI
and a two-sided centred-bootstrap p: the share of resampled means at least as far from the
observed mean as the observed mean is from 0, i.e. p = (#{|m*_b - d̄| >= |d̄|} + 1) / (B + 1).
Identical arms give d̄ = 0 and p = 1.  ``holm`` adjusts a family of p-values (scipy has only
Benjamini-Hochberg, ``stats.false_discovery_control``).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from scipy import stats

NUM_RESAMPLES = 10_000


@dataclass(frozen=True, slots=True)
class PairedDiff:
    n: int
    diff: float  # mean of the per-instance differences
    ci_low: float
    ci_high: float
    p: float  # two-sided centred-bootstrap p, never below 1 / (B + 1)
    num_resamples: int

    @property
    def p_at_floor(self) -> bool:
        """No resample was as extreme: report ``p < 1/B`` rather than the floor itself."""
        return self.p <= 1.0 / (self.num_resamples + 1)


def paired_bootstrap(diffs, num_resamples: int = NUM_RESAMPLES, confidence: float = 0.95,
                     seed: int = 0) -> PairedDiff:
    """Mean of ``diffs`` with a percentile bootstrap CI and a centred-bootstrap p-value."""
    d = np.asarray(diffs, dtype=np.float64)
    if d.ndim != 1 or d.size == 0:
        raise ValueError("need a non-empty 1-D array of per-instance differences")
    mean = float(d.mean())
    if d.size == 1 or np.all(d == d[0]):
        # every resample has the observed mean: a point CI; p = 1 only if that mean is 0
        p = 1.0 if mean == 0 else 1.0 / (num_resamples + 1)
        return PairedDiff(int(d.size), mean, mean, mean, p, num_resamples)
    res = stats.bootstrap((d,), np.mean, n_resamples=num_resamples, vectorized=True,
                          confidence_level=confidence, method="percentile",
                          rng=np.random.default_rng(seed))
    boot = res.bootstrap_distribution  # [B] resampled means
    extreme = int(np.count_nonzero(np.abs(boot - mean) >= abs(mean)))
    p = (extreme + 1) / (num_resamples + 1)
    return PairedDiff(int(d.size), mean, float(res.confidence_interval.low),
                      float(res.confidence_interval.high), min(p, 1.0), num_resamples)


def holm(pvalues) -> np.ndarray:
    """Holm's step-down adjustment: sort p ascending, p_adj(i) = max_{j <= i} min(1, (m - j) *
    p(j)) with j counted from 0, returned in the input order.  NaNs are left out of m and stay
    NaN."""
    p = np.asarray(pvalues, dtype=np.float64)
    out = np.full(p.shape, np.nan)
    valid = np.flatnonzero(~np.isnan(p))
    m = valid.size
    if m == 0:
        return out
    order = valid[np.argsort(p[valid], kind="stable")]
    scaled = (m - np.arange(m)) * p[order]
    out[order] = np.minimum(np.maximum.accumulate(scaled), 1.0)
    return out
