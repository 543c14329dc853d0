"""Validation measures (paper sec. 3.4) against explicit per-unit loops."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from model_runner.compression.analysis.measures import (
    empirical_horizons,
    median_iqr,
    readout_norms,
    spearman,
    spearman_by_layer,
    state_norms,
)


def test_empirical_horizon_averages_valid_tokens_only() -> None:
    g = -torch.rand(6, 3, 2) - 0.01  # [T, H, K]
    valid = torch.tensor([True, True, False, True, False, True])
    h = empirical_horizons(g, eps=1e-3, valid=valid)
    assert h.shape == (6,)
    for head in range(3):
        for k in range(2):
            mean = float(g[valid, head, k].double().mean())
            assert float(h[head * 2 + k]) == pytest.approx(math.log(1e-3) / mean, rel=1e-6)
    gdn = empirical_horizons(g[:, :, 0])  # [T, H]
    assert gdn.shape == (3,)
    assert float(gdn[1]) == pytest.approx(math.log(1e-3) / float(g[:, 1, 0].double().mean()),
                                          rel=1e-6)
    with pytest.raises(ValueError, match="no valid token"):
        empirical_horizons(g, valid=torch.zeros(6, dtype=torch.bool))


def test_state_and_readout_norms_per_unit() -> None:
    gen = torch.Generator().manual_seed(0)
    state = torch.randn(4, 3, 5, generator=gen)  # [H, K, V]
    q = torch.randn(4, 3, generator=gen)  # [H, K]
    ms_gdn, mr_gdn = state_norms(state, "gdn"), readout_norms(state, q, "gdn")
    ms_kda, mr_kda = state_norms(state, "kda"), readout_norms(state, q, "kda")
    for h in range(4):
        assert float(ms_gdn[h]) == pytest.approx(float(torch.linalg.norm(state[h])), rel=1e-6)
        readout = state[h].T @ q[h]  # S_h^T q_h: [V]
        assert float(mr_gdn[h]) == pytest.approx(float(readout.norm()), rel=1e-5)
        for k in range(3):
            row = float(state[h, k].norm())
            assert float(ms_kda[h * 3 + k]) == pytest.approx(row, rel=1e-6)
            assert float(mr_kda[h * 3 + k]) == pytest.approx(abs(float(q[h, k])) * row, rel=1e-6)
    # GDN key-head queries are shared by gva_ratio value heads
    shared = readout_norms(state, q[::2], "gdn")
    assert float(shared[1]) == pytest.approx(float((state[1].T @ q[0]).norm()), rel=1e-5)
    with pytest.raises(ValueError, match="kind must be"):
        state_norms(state, "mamba")


def test_spearman_by_prefix_and_layer() -> None:
    static = torch.tensor([[1.0, 2.0, 3.0, 4.0], [4.0, 3.0, 2.0, 1.0]])  # [L, n]
    observed = torch.stack([static, static ** 2, torch.ones(2, 4)])  # [P, L, n]
    observed[1, 1] = torch.tensor([1.0, 2.0, 3.0, 4.0])
    rho = spearman_by_layer(static, observed)
    assert rho.shape == (3, 2)
    assert rho[0].tolist() == [1.0, 1.0] and rho[1].tolist() == [1.0, -1.0]
    assert np.isnan(rho[2]).all()  # constant observation: undefined
    med, q25, q75 = median_iqr(rho)
    assert (med, q25, q75) == (1.0, 0.5, 1.0)  # over [1, 1, 1, -1]; NaNs dropped
    assert spearman(torch.tensor([1.0, 2.0, 3.0]), torch.tensor([3.0, 1.0, 2.0])) == pytest.approx(
        -0.5)
    with pytest.raises(ValueError, match="observed must be"):
        spearman_by_layer(static, observed[0])
