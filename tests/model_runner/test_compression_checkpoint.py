"""CheckpointPool on one process: exact store/load per format, sizes, and early rejection.

Multi-rank balancing over gloo lives in test_compression_dist.py.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from support.paths import DATA

from model_runner.checkpoints import pool as checkpoint_pool
from model_runner.checkpoints.pool import CheckpointFormat, CheckpointPool
from model_runner.compression.accounting import report_plan
from model_runner.compression.horizons import random_decay_params, static_horizons
from model_runner.compression.placement import head_permutation, local_value_heads
from model_runner.compression.plan import (
    ModelIdentity,
    PlanError,
    SelectionPlan,
    dasc_plan,
    dense_plan,
)
from model_runner.config import ModelConfig

COMPRESSION = DATA / "compression"
FORMATS = [CheckpointFormat(layout, payload, placement)
           for layout in ("ragged", "padded") for payload in ("fp32", "int8")
           for placement in ("off", "storage", "hybrid")]


def load_cfg(name: str) -> ModelConfig:
    return ModelConfig.from_dir(COMPRESSION / name)


def active_state(cfg: ModelConfig, slots: int, tp_size: int = 1, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    heads = cfg.linear_num_value_heads // tp_size
    temporal = torch.randn(cfg.num_linear_layers, slots, heads, cfg.linear_key_head_dim,
                           cfg.linear_value_head_dim, generator=gen)
    temporal[..., 1, :] *= 1e4  # rows of very different magnitudes share nothing
    conv = torch.randn(cfg.num_linear_layers, slots, cfg.linear_conv_dim // tp_size, 3,
                       generator=gen)
    return temporal, conv


def retained_mask(cfg, plan, order, rank, tp_size) -> torch.Tensor:
    """bool [L, 1, H_loc, K or 1, 1] over the local state."""
    mask = plan.mask().view(plan.num_layers, cfg.linear_num_value_heads, -1)  # [L, H, 1 or K]
    heads = local_value_heads(cfg, order, rank, tp_size)
    local = torch.stack([mask[l, h] for l, h in enumerate(heads)])  # [L, H_loc, 1 or K]
    return local[:, None, :, :, None]


def round_trip(cfg, plan, fmt, conv_dtype=torch.float32, tp_rank=0, tp_size=1, order=None):
    temporal, conv = active_state(cfg, slots=6, tp_size=tp_size, seed=tp_rank)
    conv = conv.to(conv_dtype)
    pool = CheckpointPool(cfg, plan, 5, fmt, tp_rank=tp_rank, tp_size=tp_size, head_order=order,
                          conv_dtype=conv_dtype)
    pool.store(temporal, conv, torch.tensor([5, 0, 3]), torch.tensor([4, 1, 2]))
    # Overwrite slot 1 with other content, then put the original back (A -> B -> A).
    pool.store(temporal, conv, torch.tensor([2]), torch.tensor([1]))
    pool.store(temporal, conv, torch.tensor([0]), torch.tensor([1]))
    out = torch.full_like(temporal, float("nan"))
    out_conv = torch.zeros_like(conv)
    pool.load(out, out_conv, torch.tensor([1, 2, 4]), torch.tensor([0, 1, 2]))
    assert torch.equal(out_conv[:, :3], conv[:, [0, 3, 5]])
    assert bool(out[:, 3:].isnan().all())
    keep = retained_mask(cfg, plan, order, tp_rank, tp_size)
    want = torch.where(keep, temporal[:, [0, 3, 5]], torch.zeros(()))
    return pool, out[:, :3], want


@pytest.mark.parametrize("fmt", FORMATS, ids=str)
@pytest.mark.parametrize("name", ["tiny-gdn", "tiny-kda"])
def test_round_trip_exact_or_within_half_scale(name: str, fmt: CheckpointFormat) -> None:
    cfg = load_cfg(name)
    params = random_decay_params(cfg, seed=9)
    horizons = static_horizons(cfg, params)
    ident = ModelIdentity.of(cfg, params)
    for plan in (dense_plan(ident), dasc_plan(ident, horizons, float(horizons.median()))):
        order = head_permutation(plan, cfg, 1) if fmt.placement == "hybrid" else None
        pool, got, want = round_trip(cfg, plan, fmt, order=order)
        if plan.selector == "dasc":
            assert 0 < plan.retained_fraction < 1
            assert bool((got[~retained_mask(cfg, plan, None, 0, 1).expand_as(got)] == 0).all())
        if fmt.payload == "fp32":
            assert torch.equal(got, want)
        else:
            scale = want.abs().amax(-1, keepdim=True).clamp_min(1e-8) / 127  # per (l, h, k)
            assert bool(((got - want).abs() <= scale / 2 * (1 + 1e-6)).all())
            assert not torch.equal(got, want)  # really quantised


@pytest.mark.parametrize("layout", ["ragged", "padded"])
@pytest.mark.parametrize("name", ["tiny-gdn", "tiny-kda"])
def test_each_rank_round_trips_its_shard_without_balancing(name: str, layout: str) -> None:
    cfg = load_cfg(name)
    params = random_decay_params(cfg, seed=10)
    horizons = static_horizons(cfg, params)
    plan = dasc_plan(ModelIdentity.of(cfg, params), horizons, float(horizons.median()))
    for tp_size in (2, 4):
        for rank in range(tp_size):
            _, got, want = round_trip(cfg, plan, CheckpointFormat(layout), tp_rank=rank,
                                      tp_size=tp_size)
            assert torch.equal(got, want)


@pytest.mark.parametrize("payload", ["fp32", "int8"])
@pytest.mark.parametrize("layout", ["ragged", "padded"])
def test_allocation_matches_accounting(layout: str, payload: str) -> None:
    cfg = load_cfg("tiny-kda")
    params = random_decay_params(cfg, seed=12)
    horizons = static_horizons(cfg, params)
    plan = dasc_plan(ModelIdentity.of(cfg, params), horizons, 64.0)
    report = report_plan(plan, cfg, 1, int8=payload == "int8", layout=layout)
    pool = CheckpointPool(cfg, plan, 2, CheckpointFormat(layout, payload))  # BF16 conv
    assert pool.nbytes_per_slot() == report.placements[0].slot_bytes
    rows = sum(plan.retained_counts) if layout == "ragged" else plan.num_layers * plan.r_max
    assert pool.num_rows == rows


@settings(max_examples=25, deadline=None)
@given(data=st.data(), name=st.sampled_from(["tiny-gdn", "tiny-kda"]),
       fmt=st.sampled_from([f for f in FORMATS if f.placement != "hybrid"]))
def test_any_selection_round_trips(data, name: str, fmt: CheckpointFormat) -> None:
    cfg = load_cfg(name)
    ident = ModelIdentity.of(cfg)
    n = ident.num_units
    retained = tuple(tuple(sorted(data.draw(st.sets(st.integers(0, n - 1), max_size=n))))
                     for _ in range(cfg.num_linear_layers))
    plan = SelectionPlan(ident, "dasc", 8.0, retained, 8)
    pool, got, want = round_trip(cfg, plan, fmt)
    assert pool.num_rows == (sum(plan.retained_counts) if fmt.layout == "ragged"
                             else plan.num_layers * plan.r_max)
    if fmt.payload == "fp32":
        assert torch.equal(got, want)
    else:
        scale = want.abs().amax(-1, keepdim=True).clamp_min(1e-8) / 127
        assert bool(((got - want).abs() <= scale / 2 * (1 + 1e-6)).all())


def strided(t: torch.Tensor) -> torch.Tensor:
    """The same values with every other slot of a twice larger buffer: a non-contiguous state
    sends CheckpointPool through its kernel path (the CUDA one) instead of the CPU flat path."""
    big = torch.full((t.shape[0], 2 * t.shape[1], *t.shape[2:]), float("nan"), dtype=t.dtype)
    view = big[:, ::2]
    view.copy_(t)
    return view


@pytest.mark.parametrize("fmt", FORMATS, ids=str)
@pytest.mark.parametrize("name", ["tiny-gdn", "tiny-kda"])
@pytest.mark.parametrize("cpu_path", ["native", "torch"])
def test_cpu_paths_equal_kernel_path(name: str, fmt: CheckpointFormat, cpu_path: str,
                                     monkeypatch) -> None:
    """Both CPU paths (the C runs; torch flat rows where no compiler is) = the kernel path."""
    if cpu_path == "torch":
        monkeypatch.setattr(checkpoint_pool, "native_library", lambda: None)
    elif checkpoint_pool.native_library() is None:
        pytest.skip("no C compiler here")
    cfg = load_cfg(name)
    params = random_decay_params(cfg, seed=11)
    horizons = static_horizons(cfg, params)
    ident = ModelIdentity.of(cfg, params)
    sparse = float(horizons.flatten().sort().values[-max(2, horizons.numel() // 10)])
    for plan in (dense_plan(ident), dasc_plan(ident, horizons, float(horizons.median())),
                 dasc_plan(ident, horizons, sparse)):  # fmt: skip
        order = head_permutation(plan, cfg, 1) if fmt.placement == "hybrid" else None
        temporal, conv = active_state(cfg, slots=6)
        conv = conv.to(torch.bfloat16)
        pools, outs = [], []
        for is_flat in (True, False):
            pool = CheckpointPool(cfg, plan, 5, fmt, head_order=order)  # BF16 conv
            state = (temporal, conv) if is_flat else (strided(temporal), strided(conv))
            pool.store(*state, torch.tensor([5, 0, 3]), torch.tensor([4, 1, 2]))
            out = tuple(torch.full_like(t, 7.0) for t in state)
            out = out if is_flat else tuple(map(strided, out))
            pool.load(*out, torch.tensor([1, 4, 2]), torch.tensor([2, 0, 5]))
            pools.append(pool)
            outs.append(out)
        flat = pools[0].flat  # dense: one row per (layer, slot); sparse: the other load
        assert (flat.group > 1) == (plan.selector == "dense")
        assert flat.is_sparse == (plan.w_max == sparse)
        for a, b in zip(outs[0], outs[1], strict=True):
            assert torch.equal(a, b)
        for attr in ("temporal", "scale", "conv"):
            a, b = getattr(pools[0], attr), getattr(pools[1], attr)
            assert (a is None and b is None) or torch.equal(a, b), attr


def test_empty_calls_change_nothing() -> None:
    cfg = load_cfg("tiny-kda")
    pool = CheckpointPool(cfg, dense_plan(ModelIdentity.of(cfg)), 2, conv_dtype=torch.float32)
    temporal, conv = active_state(cfg, slots=3)
    before = (temporal.clone(), conv.clone(), pool.temporal.clone())
    none = torch.tensor([], dtype=torch.long)
    for state in ((temporal, conv), (strided(temporal), strided(conv))):
        pool.store(*state, none, none)
        pool.load(*state, none, none)
    assert torch.equal(temporal, before[0]) and torch.equal(conv, before[1])
    assert torch.equal(pool.temporal, before[2])


HUGE = 10**13  # would fail with an allocation error if anything were allocated first


def test_mismatched_plans_fail_before_allocation() -> None:
    gdn, kda = load_cfg("tiny-gdn"), load_cfg("tiny-kda")
    params = random_decay_params(kda, seed=1)
    ident = ModelIdentity.of(kda, params)
    plan = dasc_plan(ident, static_horizons(kda, params), 64.0)
    with pytest.raises(PlanError, match="linear_kind: plan 'kda' vs model 'gdn'"):
        CheckpointPool(gdn, plan, HUGE)
    other = ModelIdentity.of(kda, random_decay_params(kda, seed=2))
    with pytest.raises(PlanError, match="decay_sha256"):
        CheckpointPool(kda, plan, HUGE, identity=other)
    with pytest.raises(PlanError, match="TP degree 3 does not divide"):
        CheckpointPool(kda, plan, HUGE, tp_size=3)
    with pytest.raises(PlanError, match="hybrid placement needs"):
        CheckpointPool(kda, plan, HUGE, CheckpointFormat(placement="hybrid"), tp_size=2)
    with pytest.raises(PlanError, match="not a permutation"):
        CheckpointPool(kda, plan, HUGE, head_order=[[0, 0, 1, 2]] * 4)
    with pytest.raises(PlanError, match="payload must be one of fp32, int8"):
        CheckpointFormat(payload="fp16")


def test_wrong_active_state_is_rejected() -> None:
    cfg = load_cfg("tiny-gdn")
    pool = CheckpointPool(cfg, dense_plan(ModelIdentity.of(cfg)), 2)
    temporal, conv = active_state(cfg, slots=3)
    with pytest.raises(ValueError, match="active temporal state must be fp32"):
        pool.store(temporal.double(), conv, torch.tensor([0]), torch.tensor([0]))
    with pytest.raises(ValueError, match="active temporal state must be fp32"):
        pool.store(temporal.transpose(3, 4), conv, torch.tensor([0]), torch.tensor([0]))
    with pytest.raises(ValueError, match="active conv state must be"):
        pool.load(temporal, conv[..., :2], torch.tensor([0]), torch.tensor([0]))
