"""Static horizons from on-disk decay weights, selection plans, plan identity and JSON."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import save_file
from support.paths import DATA

from model_runner.compression.horizons import (
    DecayParams,
    random_decay_params,
    static_horizons,
    static_log_decay,
)
from model_runner.compression.plan import (
    ModelIdentity,
    PlanError,
    SelectionPlan,
    dasc_plan,
    dense_plan,
    random_plan,
    refresh_window,
)
from model_runner.compression.weights import decay_tensor_names, load_decay_params
from model_runner.config import ModelConfig
from model_runner.model_files import WeightsError

COMPRESSION = DATA / "compression"


def gdn() -> ModelConfig:
    return ModelConfig.from_dir(COMPRESSION / "tiny-gdn")


def kda() -> ModelConfig:
    return ModelConfig.from_dir(COMPRESSION / "tiny-kda")


def write_decay(cfg: ModelConfig, params: DecayParams, model_dir: Path, shards: int = 1) -> None:
    """On-disk shapes: GDN A_log/dt_bias [H_v]; KDA A_log (1,1,H,1), dt_bias (H*K,)."""
    heads = cfg.linear_num_value_heads
    tensors = {}
    for i, layer in enumerate(cfg.linear_layer_ids):
        a_name, dt_name = decay_tensor_names(cfg, layer)
        a = params.A_log[i].clone()
        tensors[a_name] = a.view(1, 1, heads, 1) if cfg.is_kda else a.to(torch.bfloat16)
        tensors[dt_name] = params.dt_bias[i].clone()
    tensors["model.embed_tokens.weight"] = torch.zeros(4, 4)
    model_dir.mkdir(parents=True, exist_ok=True)
    (model_dir / "config.json").write_text((COMPRESSION / ("tiny-kda" if cfg.is_kda else "tiny-gdn")
                                            / "config.json").read_text())
    names = sorted(tensors)
    if shards == 1:
        save_file(tensors, str(model_dir / "model.safetensors"))
        return
    weight_map = {}
    for s in range(shards):
        file = f"model-{s + 1:05d}-of-{shards:05d}.safetensors"
        part = {n: tensors[n].contiguous() for n in names[s::shards]}
        save_file(part, str(model_dir / file))
        weight_map.update(dict.fromkeys(part, file))


    (model_dir / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))


def test_gdn_horizon_matches_formula() -> None:
    cfg = gdn()
    params = random_decay_params(cfg, seed=1)
    h = static_horizons(cfg, params, gate_input=-0.3, eps=1e-3)
    assert h.shape == (6, 8)
    l, head = 2, 5
    g = -math.exp(float(params.A_log[l, head])) * math.log1p(
        math.exp(float(params.dt_bias[l, head]) - 0.3))
    assert float(h[l, head]) == pytest.approx(math.log(1e-3) / g, rel=1e-5)


def test_kda_horizon_uses_channel_dt_bias_and_head_a_log() -> None:
    cfg = kda()
    params = random_decay_params(cfg, seed=2)
    k_dim = cfg.linear_key_head_dim
    g = static_log_decay(cfg, params, gate_input=-0.5)
    assert g.shape == (4, 4 * k_dim) and g.dtype == torch.float32
    l, head, k = 3, 2, 5
    want = -torch.exp(params.A_log[l, head]) * F.softplus(params.dt_bias[l, head * k_dim + k] - 0.5)
    assert float(g[l, head * k_dim + k]) == float(want)
    # a smaller eps means a longer horizon, and a larger gate input a shorter one
    base = static_horizons(cfg, params)
    assert bool((static_horizons(cfg, params, eps=1e-6) > base).all())
    assert bool((static_horizons(cfg, params, gate_input=0.5) < base).all())


@pytest.mark.parametrize("shards", [1, 3])
@pytest.mark.parametrize("make", [gdn, kda])
def test_decay_weights_round_trip_through_safetensors(tmp_path: Path, make, shards) -> None:
    cfg = make()
    params = random_decay_params(cfg, seed=3)
    write_decay(cfg, params, tmp_path / "m", shards)
    loaded = load_decay_params(tmp_path / "m", cfg)
    if cfg.is_kda:
        assert torch.equal(loaded.A_log, params.A_log) and torch.equal(loaded.dt_bias,
                                                                       params.dt_bias)
    else:  # A_log was written as bf16: loaded exactly as its fp32 value
        assert torch.equal(loaded.A_log, params.A_log.to(torch.bfloat16).float())
    assert ModelIdentity.of(cfg, loaded).decay_sha256 == loaded.sha256()


def test_missing_decay_tensor_is_named(tmp_path: Path) -> None:
    cfg = gdn()
    save_file({"model.layers.0.linear_attn.A_log": torch.zeros(8)},
              str(tmp_path / "model.safetensors"))
    with pytest.raises(WeightsError, match="model.layers.0.linear_attn.dt_bias"):
        load_decay_params(tmp_path, cfg)
    with pytest.raises(WeightsError, match="no model.safetensors"):
        load_decay_params(tmp_path / "nowhere", cfg)


def test_selection_threshold_and_refresh_window() -> None:
    cfg = gdn()
    ident = ModelIdentity.of(cfg)
    horizons = torch.full((6, 8), 1000.0)
    horizons[0, :4] = torch.tensor([3.0, 16.0, 16.5, 9.0])  # 16 is not > 16: omitted
    plan = dasc_plan(ident, horizons, 16.0)
    assert plan.retained[0] == (2, 4, 5, 6, 7) and plan.retained_counts[1:] == [8] * 5
    assert plan.refresh_window == 16  # next_pow2(ceil(16)) = 16
    omitted = ~plan.mask()
    assert refresh_window(horizons, omitted, 64.0) == 16
    horizons[0, 0] = 0.4
    only_first = torch.zeros(6, 8, dtype=torch.bool)
    only_first[0, 0] = True
    assert refresh_window(horizons, only_first, 64.0) == 4  # clamped up to 4
    assert refresh_window(torch.full((6, 8), 40.0), omitted, 32.0) == 32  # clamp high
    assert refresh_window(horizons, torch.zeros(6, 8, dtype=torch.bool), 64.0) == 0
    assert refresh_window(torch.full((6, 8), 17.0), omitted, 64.0) == 32
    dense = dasc_plan(ident, horizons, 0)
    assert dense.selector == "dense" and dense.retained_fraction == 1.0 and dense.r_max == 8


def test_random_plan_is_count_matched_and_seeded() -> None:
    cfg = kda()
    params = random_decay_params(cfg, seed=4)
    horizons = static_horizons(cfg, params)
    plan = dasc_plan(ModelIdentity.of(cfg, params), horizons, float(horizons.median()))
    a, b, c = (random_plan(plan, horizons, s) for s in (1, 1, 2))
    assert a.retained_counts == plan.retained_counts == c.retained_counts
    assert a == b and a.retained != c.retained and a.retained != plan.retained
    assert a.selector == "random" and a.seed == 1
    assert 4 <= a.refresh_window <= plan.w_max


def test_plan_json_round_trip_and_identity(tmp_path: Path) -> None:
    cfg = kda()
    params = random_decay_params(cfg, seed=5)
    ident = ModelIdentity.of(cfg, params)
    plan = dasc_plan(ident, static_horizons(cfg, params), 64.0)
    plan.save(tmp_path / "plan.json")
    loaded = SelectionPlan.load(tmp_path / "plan.json")
    assert loaded == plan
    loaded.check_matches(ident)
    other = ModelIdentity.of(cfg, random_decay_params(cfg, seed=6))
    with pytest.raises(PlanError, match="decay_sha256: plan"):
        loaded.check_matches(other)
    with pytest.raises(PlanError, match="needs the model's decay weights"):
        loaded.check_matches(ModelIdentity.of(cfg))
    with pytest.raises(PlanError, match="linear_kind: plan 'kda' vs model 'gdn'"):
        loaded.check_config(gdn())
    dense_plan(ident).check_matches(ModelIdentity.of(cfg))  # dense plans carry no digest


@pytest.mark.parametrize(
    "change, field",
    [({"linear_attn_config": {"full_attn_layers": [4], "kda_layers": [1, 2, 3, 5],
       "num_heads": 4, "head_dim": 8}}, "linear_layer_ids"),
     ({"linear_attn_config": {"full_attn_layers": [3], "kda_layers": [1, 2, 4, 5],
       "num_heads": 8, "head_dim": 8}}, "num_key_heads"),
     ({"linear_attn_config": {"full_attn_layers": [3], "kda_layers": [1, 2, 4, 5],
       "num_heads": 4, "head_dim": 16}}, "key_head_dim")],
)
def test_plan_for_another_geometry_is_rejected(change, field) -> None:
    raw = {**json.loads((COMPRESSION / "tiny-kda" / "config.json").read_text()), **change}
    plan = dense_plan(ModelIdentity.of(kda()))
    with pytest.raises(PlanError, match=f"does not match the model: .*{field}"):
        plan.check_config(ModelConfig.from_dict(raw))


@pytest.mark.parametrize("w_max", [-1.0, float("nan"), float("inf")])
def test_bad_threshold(w_max) -> None:
    cfg = gdn()
    with pytest.raises(PlanError, match="W_max must be a finite number >= 0"):
        dasc_plan(ModelIdentity.of(cfg), torch.ones(6, 8), w_max)


def test_malformed_plans() -> None:
    ident = ModelIdentity.of(gdn())
    with pytest.raises(PlanError, match="sorted, unique"):
        SelectionPlan(ident, "dasc", 4.0, ((1, 0),) + ((),) * 5, 4)
    with pytest.raises(PlanError, match="lists 2 layers for 6"):
        SelectionPlan(ident, "dasc", 4.0, ((), ()), 4)
    with pytest.raises(PlanError, match="not a dasc-plan/1 plan"):
        SelectionPlan.from_dict({"format": "other"})
    with pytest.raises(PlanError, match="horizons have shape"):
        dasc_plan(ident, torch.ones(5, 8), 4.0)
