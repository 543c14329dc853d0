"""Byte accounting of state checkpoints per TP rank (paper sec. 4.1, App. B, C.1, E.1).

Bytes of one checkpoint slot on rank r:
    temporal_r = rows_r * unit_bytes      unit_bytes = 4*D (fp32) or D + 4*rows_per_unit (int8:
                                          payload plus one fp32 scale per (head, k) row over V)
    conv       = L * (conv_dim / T) * (kernel - 1) * 2   (BF16, never compressed)
rows_r: dense L * n / T; ragged U_r; padded L * max_l r_{l,r}; with storage balancing C for all.
Slots under a per-rank budget B: N = floor(B / max_r(temporal_r + conv)) - 1 (slot 0 reserved).
Temporal ratios are the paper's global ones, C_pad = sum n_l / (L R_max) and
C_rag = sum n_l / (L r_bar), scaled by fp32/int8 unit bytes when the payload is INT8.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from model_runner.compression.balance import balance_storage
from model_runner.compression.placement import (
    PLACEMENTS,
    check_bundle_split,
    placement_head_order,
    rank_row_counts,
)
from model_runner.compression.plan import PlanError, SelectionPlan
from model_runner.config import ModelConfig

FP32_BYTES = 4
CONV_BYTES = 2  # BF16, as the paper counts it whatever the runner's conv dtype
DEFAULT_DENSE_SLOTS = 128


def unit_bytes(cfg: ModelConfig, int8: bool = False) -> int:
    """Bytes of one stored unit: fp32 D values, or int8 D values plus fp32 scales."""
    if not int8:
        return FP32_BYTES * cfg.unit_numel
    rows_per_unit = 1 if cfg.is_kda else cfg.linear_key_head_dim
    return cfg.unit_numel + FP32_BYTES * rows_per_unit


def conv_bytes_per_rank(cfg: ModelConfig, tp_size: int) -> int:
    check_bundle_split(cfg, tp_size)
    channels = cfg.linear_conv_dim // tp_size
    return cfg.num_linear_layers * channels * (cfg.linear_conv_kernel_dim - 1) * CONV_BYTES


def dense_rows_per_rank(cfg: ModelConfig, tp_size: int) -> int:
    check_bundle_split(cfg, tp_size)
    heads = cfg.linear_num_value_heads // tp_size
    return cfg.num_linear_layers * heads * cfg.units_per_head


def dense_slot_bytes(cfg: ModelConfig, tp_size: int) -> int:
    """Bytes per rank of one dense mixed-precision checkpoint (FP32 temporal + BF16 conv)."""
    temporal = dense_rows_per_rank(cfg, tp_size) * unit_bytes(cfg)
    return temporal + conv_bytes_per_rank(cfg, tp_size)


def slots_at_budget(budget_bytes: int, slot_bytes: int) -> int:
    """N = floor(B / slot_bytes) - 1 (slot 0 is reserved); 0 when not even that fits."""
    if slot_bytes <= 0:
        raise PlanError(f"slot bytes must be positive, got {slot_bytes}")
    if budget_bytes < 0:
        raise PlanError(f"budget must be >= 0 bytes, got {budget_bytes}")
    return max(budget_bytes // slot_bytes - 1, 0)


def dense_budget(cfg: ModelConfig, tp_size: int, dense_slots: int = DEFAULT_DENSE_SLOTS) -> int:
    """The paper's matched budget: `dense_slots` physical dense slots per rank."""
    if dense_slots < 1:
        raise PlanError(f"dense slots must be >= 1, got {dense_slots}")
    return dense_slots * dense_slot_bytes(cfg, tp_size)


@dataclass(frozen=True, slots=True)
class PlacementReport:
    placement: str
    rows_per_rank: tuple[int, ...]  # compute-local packed rows per rank (before balancing)
    stored_rows: int  # rows per slot on the worst rank after placement
    moved_rows: int  # rows that cross ranks per stored checkpoint
    temporal_bytes: int  # worst rank, per slot
    slot_bytes: int  # worst rank, per slot, temporal + BF16 conv
    complete_ratio: float  # dense slot bytes / slot_bytes
    slots: int  # deployable slots at the budget


@dataclass(frozen=True, slots=True)
class PlanReport:
    selector: str
    w_max: float
    tp_size: int
    layout: str
    int8: bool
    retained_fraction: float
    r_max: int
    r_bar: float
    c_temp_pad: float
    c_temp_rag: float
    refresh_window: int
    conv_bytes: int
    dense_slot_bytes: int
    budget_bytes: int
    dense_slots: int  # deployable dense slots at the budget
    placements: tuple[PlacementReport, ...]

    @property
    def layout_gain(self) -> float:
        """R_max / r_bar = C_rag / C_pad."""
        return self.r_max / self.r_bar if self.r_bar else math.inf


def report_plan(
    plan: SelectionPlan,
    cfg: ModelConfig,
    tp_size: int,
    budget_bytes: int | None = None,
    int8: bool = False,
    layout: str = "ragged",
    placements: tuple[str, ...] = PLACEMENTS,
) -> PlanReport:
    """Accounting of `plan` at TP `tp_size`; budget defaults to 128 dense slots per rank."""
    plan.check_config(cfg)
    check_bundle_split(cfg, tp_size)
    dense = dense_slot_bytes(cfg, tp_size)
    budget = dense_budget(cfg, tp_size) if budget_bytes is None else budget_bytes
    conv = conv_bytes_per_rank(cfg, tp_size)
    ub, ub_dense = unit_bytes(cfg, int8), unit_bytes(cfg)
    total_units = plan.num_layers * plan.num_units
    byte_scale = ub_dense / ub
    rows = []
    for placement in placements:
        order = placement_head_order(plan, cfg, tp_size, placement)
        counts = rank_row_counts(plan, cfg, order, tp_size, layout)
        bal = balance_storage(counts)
        stored = max(counts) if placement == "off" else bal.width
        moved = 0 if placement == "off" else bal.moved_rows
        slot = stored * ub + conv
        rows.append(PlacementReport(placement, tuple(counts), stored, moved, stored * ub, slot,
                                    dense / slot, slots_at_budget(budget, slot)))
    r_max, r_bar = plan.r_max, plan.r_bar
    layers = plan.num_layers
    return PlanReport(
        selector=plan.selector,
        w_max=plan.w_max,
        tp_size=tp_size,
        layout=layout,
        int8=int8,
        retained_fraction=plan.retained_fraction,
        r_max=r_max,
        r_bar=r_bar,
        c_temp_pad=total_units / (layers * r_max) * byte_scale if r_max else math.inf,
        c_temp_rag=total_units / (layers * r_bar) * byte_scale if r_bar else math.inf,
        refresh_window=plan.refresh_window,
        conv_bytes=conv,
        dense_slot_bytes=dense,
        budget_bytes=budget,
        dense_slots=slots_at_budget(budget, dense),
        placements=tuple(rows),
    )
