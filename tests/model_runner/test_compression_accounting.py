"""Byte accounting: the paper's dense numbers for the public configs, ratios and invariants."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from support.paths import DATA

from model_runner.compression.accounting import (
    conv_bytes_per_rank,
    dense_budget,
    dense_slot_bytes,
    report_plan,
    slots_at_budget,
    unit_bytes,
)
from model_runner.compression.horizons import random_decay_params, static_horizons
from model_runner.compression.plan import ModelIdentity, PlanError, dasc_plan, dense_plan
from model_runner.config import ModelConfig

CONFIGS = DATA / "configs"
KIMI = CONFIGS / "kimi-linear-48b-a3b-instruct"
QWEN = CONFIGS / "qwen3-next-80b-a3b-instruct"


@pytest.mark.parametrize(
    "model_dir, per_slot, conv, budget",
    [(KIMI, 5_427_200, 184_320, 694_681_600), (QWEN, 9_658_368, 221_184, 1_236_271_104)],
)
def test_public_dense_accounting_at_tp8(model_dir: Path, per_slot, conv, budget) -> None:
    cfg = ModelConfig.from_dir(model_dir)
    assert dense_slot_bytes(cfg, 8) == per_slot
    assert conv_bytes_per_rank(cfg, 8) == conv
    assert dense_budget(cfg, 8) == budget
    report = report_plan(dense_plan(ModelIdentity.of(cfg)), cfg, 8)
    assert report.dense_slots == 127
    for row in report.placements:
        assert (row.slot_bytes, row.slots, row.moved_rows) == (per_slot, 127, 0)
        assert row.complete_ratio == 1.0
    assert (report.c_temp_pad, report.c_temp_rag, report.layout_gain) == (1.0, 1.0, 1.0)


def test_public_layer_structure() -> None:
    kimi, qwen = ModelConfig.from_dir(KIMI), ModelConfig.from_dir(QWEN)
    assert (kimi.num_linear_layers, kimi.linear_conv_dim) == (20, 12_288)
    assert (qwen.num_linear_layers, qwen.linear_conv_dim) == (36, 8_192)
    assert ModelIdentity.of(kimi).num_units == 4096 and ModelIdentity.of(qwen).num_units == 32


def test_int8_dense_includes_scales() -> None:
    """Quantisation only: temporal 3.88x (paper App. E.1), less once BF16 conv is counted."""
    cfg = ModelConfig.from_dir(KIMI)
    assert unit_bytes(cfg) == 512 and unit_bytes(cfg, int8=True) == 128 + 4
    report = report_plan(dense_plan(ModelIdentity.of(cfg)), cfg, 8, int8=True)
    assert report.c_temp_rag == pytest.approx(512 / 132)
    assert round(report.c_temp_rag, 2) == 3.88
    row = report.placements[0]
    assert row.slot_bytes == 20 * 512 * 132 + 184_320
    assert row.complete_ratio == pytest.approx(5_427_200 / row.slot_bytes)
    qwen = ModelConfig.from_dir(QWEN)
    assert unit_bytes(qwen, int8=True) == 128 * 128 + 4 * 128  # one scale per (head, k)


def test_slots_at_budget() -> None:
    assert slots_at_budget(694_681_600, 5_427_200) == 127
    assert slots_at_budget(100, 1000) == 0
    with pytest.raises(PlanError):
        slots_at_budget(100, 0)
    with pytest.raises(PlanError):
        slots_at_budget(-1, 10)


def _config(kind: str, layers: int, heads: int, ratio: int, dim: int) -> ModelConfig:
    if kind == "gdn":
        return ModelConfig.from_dict({
            "architectures": ["Qwen3NextForCausalLM"], "vocab_size": 32, "hidden_size": 16,
            "num_hidden_layers": layers, "layer_types": ["linear_attention"] * layers,
            "intermediate_size": 16, "num_attention_heads": 2, "num_key_value_heads": 1,
            "linear_num_key_heads": heads, "linear_num_value_heads": heads * ratio,
            "linear_key_head_dim": dim, "linear_value_head_dim": dim + 1,
        })
    return ModelConfig.from_dict({
        "architectures": ["KimiLinearForCausalLM"], "vocab_size": 32, "hidden_size": 16,
        "num_hidden_layers": layers, "layer_types": ["linear_attention"] * layers,
        "intermediate_size": 16, "num_attention_heads": 2, "kv_lora_rank": 4,
        "qk_nope_head_dim": 4, "qk_rope_head_dim": 4, "v_head_dim": 4,
        "first_k_dense_replace": layers, "linear_attn_config": {"num_heads": heads,
                                                                "head_dim": dim},
    })


@settings(max_examples=60, deadline=None)
@given(
    kind=st.sampled_from(["gdn", "kda"]), layers=st.integers(1, 8),
    heads_per_rank=st.integers(1, 3), tp_size=st.sampled_from([1, 2, 4]),
    ratio=st.integers(1, 2), dim=st.integers(2, 6), seed=st.integers(0, 999),
    w_max=st.sampled_from([1.0, 16.0, 64.0, 128.0, 512.0]), int8=st.booleans(),
    budget=st.integers(0, 10**8),
)
def test_accounting_invariants(kind, layers, heads_per_rank, tp_size, ratio, dim, seed, w_max,
                               int8, budget) -> None:
    cfg = _config(kind, layers, heads_per_rank * tp_size, ratio, dim)
    params = random_decay_params(cfg, seed)
    plan = dasc_plan(ModelIdentity.of(cfg, params), static_horizons(cfg, params), w_max)
    ragged = report_plan(plan, cfg, tp_size, budget, int8)
    padded = report_plan(plan, cfg, tp_size, budget, int8, layout="padded")
    ub = unit_bytes(cfg, int8)
    if plan.r_max:
        assert ragged.c_temp_rag >= ragged.c_temp_pad - 1e-12
        assert ragged.layout_gain == pytest.approx(ragged.c_temp_rag / ragged.c_temp_pad)
    by_place = {p.placement: p for p in ragged.placements}
    total = sum(plan.retained_counts)
    assert sum(by_place["off"].rows_per_rank) == total  # ragged rows = sum r_l
    assert by_place["storage"].stored_rows == math.ceil(total / tp_size)
    assert by_place["hybrid"].slot_bytes == by_place["storage"].slot_bytes
    assert by_place["off"].slot_bytes >= by_place["storage"].slot_bytes
    for p in padded.placements:
        assert sum(p.rows_per_rank) >= total
    if tp_size == 1:
        assert padded.placements[0].rows_per_rank == (layers * plan.r_max,)
    for p in ragged.placements:
        assert p.slot_bytes == p.stored_rows * ub + conv_bytes_per_rank(cfg, tp_size)
        assert p.slots == slots_at_budget(budget, p.slot_bytes)
        # monotone in the budget
        assert slots_at_budget(budget + p.slot_bytes, p.slot_bytes) == p.slots + 1 or p.slots == 0
        assert slots_at_budget(budget // 2, p.slot_bytes) <= p.slots
