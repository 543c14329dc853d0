"""Head bundles per rank, the balancing permutation and the storage redistribution schedule."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from support.paths import DATA

from model_runner.compression.accounting import report_plan, unit_bytes
from model_runner.compression.balance import balance_storage
from model_runner.compression.horizons import random_decay_params, static_horizons
from model_runner.compression.placement import (
    bundle_weights,
    head_permutation,
    local_units,
    local_value_heads,
    rank_row_counts,
    units_per_bundle,
)
from model_runner.compression.plan import ModelIdentity, PlanError, dasc_plan
from model_runner.config import ModelConfig


def gdn_config(layers: int, key_heads: int, ratio: int, k: int = 4, v: int = 4) -> ModelConfig:
    return ModelConfig.from_dict({
        "architectures": ["Qwen3NextForCausalLM"], "vocab_size": 32, "hidden_size": 16,
        "num_hidden_layers": layers, "layer_types": ["linear_attention"] * layers,
        "intermediate_size": 16, "num_attention_heads": 2, "num_key_value_heads": 1,
        "linear_num_key_heads": key_heads, "linear_num_value_heads": key_heads * ratio,
        "linear_key_head_dim": k, "linear_value_head_dim": v,
    })


def kda_config(layers: int, heads: int, head_dim: int) -> ModelConfig:
    return ModelConfig.from_dict({
        "architectures": ["KimiLinearForCausalLM"], "vocab_size": 32, "hidden_size": 16,
        "num_hidden_layers": layers, "layer_types": ["linear_attention"] * layers,
        "intermediate_size": 16, "num_attention_heads": 2, "kv_lora_rank": 4,
        "qk_nope_head_dim": 4, "qk_rope_head_dim": 4, "v_head_dim": 4, "first_k_dense_replace": 99,
        "linear_attn_config": {"num_heads": heads, "head_dim": head_dim},
    })


def test_local_units_follow_head_order() -> None:
    cfg = gdn_config(layers=2, key_heads=4, ratio=2)
    order = [[0, 1, 2, 3], [3, 0, 2, 1]]
    assert local_units(cfg, order, 0, 2) == [[0, 1, 2, 3], [6, 7, 0, 1]]
    assert local_units(cfg, order, 1, 2) == [[4, 5, 6, 7], [4, 5, 2, 3]]
    assert local_value_heads(cfg, order, 1, 2) == [[4, 5, 6, 7], [4, 5, 2, 3]]
    kda = kda_config(layers=1, heads=4, head_dim=3)
    assert local_units(kda, [[2, 0, 3, 1]], 0, 2) == [[6, 7, 8, 0, 1, 2]]
    assert local_value_heads(kda, [[2, 0, 3, 1]], 0, 2) == [[2, 0]]
    assert local_units(kda, None, 1, 4) == [[3, 4, 5]]


def test_bad_tp_and_head_order_are_rejected() -> None:
    cfg = gdn_config(layers=2, key_heads=4, ratio=2)
    with pytest.raises(PlanError, match="does not divide the 4 linear-attention key heads"):
        local_units(cfg, None, 0, 3)
    with pytest.raises(PlanError, match="rank 2 is outside"):
        local_units(cfg, None, 2, 2)
    with pytest.raises(PlanError, match="not a permutation"):
        local_units(cfg, [[0, 1, 2, 3], [0, 0, 1, 2]], 0, 2)
    with pytest.raises(PlanError, match="has 1 layers"):
        local_units(cfg, [[0, 1, 2, 3]], 0, 2)


def _plan(cfg: ModelConfig, seed: int, quantile: float):
    params = random_decay_params(cfg, seed)
    horizons = static_horizons(cfg, params)
    w = float(torch.quantile(horizons.double().flatten(), quantile))
    return dasc_plan(ModelIdentity.of(cfg, params), horizons, w)


@settings(max_examples=60, deadline=None)
@given(
    kind=st.sampled_from(["gdn", "kda"]),
    layers=st.integers(1, 6),
    bundles_per_rank=st.integers(1, 4),
    tp_size=st.sampled_from([1, 2, 4, 8]),
    ratio=st.integers(1, 3),
    seed=st.integers(0, 10_000),
    quantile=st.floats(0.0, 0.98),
)
def test_permutation_properties(kind, layers, bundles_per_rank, tp_size, ratio, seed,
                                quantile) -> None:
    nb = bundles_per_rank * tp_size
    cfg = (gdn_config(layers, nb, ratio) if kind == "gdn" else kda_config(layers, nb, 2 + ratio))
    plan = _plan(cfg, seed, quantile)
    order = head_permutation(plan, cfg, tp_size)
    assert all(sorted(row) == list(range(nb)) for row in order)  # a permutation per layer
    # every rank owns the same number of bundles per layer, and the units partition [0, n)
    per_rank = [local_units(cfg, order, r, tp_size) for r in range(tp_size)]
    for l in range(cfg.num_linear_layers):
        owned = [u for r in range(tp_size) for u in per_rank[r][l]]
        assert sorted(owned) == list(range(plan.num_units))
        assert {len(per_rank[r][l]) for r in range(tp_size)} == {bundles_per_rank
                                                                   * units_per_bundle(cfg)}
    counts = rank_row_counts(plan, cfg, order, tp_size)
    assert sum(counts) == sum(plan.retained_counts)
    width = math.ceil(sum(counts) / tp_size)
    heaviest = max(map(max, bundle_weights(plan, cfg)))
    assert max(counts) <= width + heaviest  # documented guarantee
    assert max(counts) <= max(rank_row_counts(plan, cfg, None, tp_size))
    # ragged rows = sum r_l; padded rows = L * R_max (per rank)
    padded = rank_row_counts(plan, cfg, order, tp_size, "padded")
    assert all(p >= c for p, c in zip(padded, counts, strict=True))
    if tp_size == 1:
        assert counts == [sum(plan.retained_counts)]
        assert padded == [plan.num_layers * plan.r_max]


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(0, 50), min_size=1, max_size=8))
def test_storage_schedule_properties(counts) -> None:
    bal = balance_storage(counts)
    tp_size = len(counts)
    assert bal.width == math.ceil(sum(counts) / tp_size)
    for r in range(tp_size):
        sent, got = sum(bal.send[r]), sum(bal.received(r))
        assert sent == max(counts[r] - bal.width, 0)
        assert bal.send[r][r] == 0 and (sent == 0 or got == 0)
        assert bal.kept(r) + got <= bal.width  # nobody exceeds the slot width C
    assert sum(bal.kept(r) + sum(bal.received(r)) for r in range(tp_size)) == sum(counts)


def _placement_bytes(cfg: ModelConfig, plan, tp_size: int) -> dict[str, tuple[int, int, int]]:
    report = report_plan(plan, cfg, tp_size)
    return {p.placement: (max(p.rows_per_rank), p.temporal_bytes, p.moved_rows)
            for p in report.placements}


@pytest.mark.parametrize(
    "name, make, tp_size",
    [("tiny-gdn", lambda: ModelConfig.from_dir(DATA / "compression/tiny-gdn"), 2),
     ("tiny-kda", lambda: ModelConfig.from_dir(DATA / "compression/tiny-kda"), 4),
     ("kimi-like", lambda: ModelConfig.from_dir(DATA / "configs/kimi-linear-48b-a3b-instruct"), 8),
     ("qwen-like", lambda: ModelConfig.from_dir(DATA / "configs/qwen3-next-80b-a3b-instruct"), 8)],
)
def test_balance_report(name, make, tp_size) -> None:
    """off >= storage == hybrid worst-rank bytes; hybrid compute-local payload <= C + one head."""
    cfg = make()
    params = random_decay_params(cfg, seed=11)  # A_log = log U(1,16), dt ~ logU(1e-3, 1e-1)
    horizons = static_horizons(cfg, params)
    ident = ModelIdentity.of(cfg, params)
    ub = unit_bytes(cfg)
    for w_max in (16.0, 64.0, 128.0, 512.0):
        plan = dasc_plan(ident, horizons, w_max)
        got = _placement_bytes(cfg, plan, tp_size)
        width = math.ceil(sum(plan.retained_counts) / tp_size)
        head = units_per_bundle(cfg)
        assert got["storage"][1] == got["hybrid"][1] == width * ub
        assert got["off"][1] >= got["storage"][1]
        assert got["hybrid"][0] <= width + head
        assert got["hybrid"][2] <= got["storage"][2]
