"""Budget-driven plans: the smallest W_max whose checkpoint slots fit a target count.

A larger W_max keeps fewer units, so a slot's worst-rank bytes never grow with W_max, and the
plan only changes where W_max crosses a unit's horizon (``keep = H_s > W_max``).  The candidates
are therefore W_max = 0 (dense) and every distinct finite horizon; a binary search over them
finds the smallest that fits ``target_slots`` slots in the per-rank budget: the plan that keeps
the most state at that capacity.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from model_runner.compression.accounting import PlanReport, report_plan
from model_runner.compression.defaults import DEFAULT_EPS, DEFAULT_GATE_INPUT
from model_runner.compression.plan import ModelIdentity, PlanError, SelectionPlan, dasc_plan
from model_runner.config import ModelConfig


@dataclass(frozen=True, slots=True)
class TargetFit:
    """The chosen plan and its accounting at the one placement asked for."""

    plan: SelectionPlan
    report: PlanReport  # report.placements[0] is the placement the slots were counted for

    @property
    def slots(self) -> int:
        return self.report.placements[0].slots

    @property
    def capacity(self) -> float:
        """Slots at the budget over the dense slots at the same budget."""
        dense = self.report.dense_slots
        return self.slots / dense if dense else float("inf")

    @property
    def omitted_fraction(self) -> float:
        return 1.0 - self.report.retained_fraction


def w_max_candidates(horizons: torch.Tensor) -> list[float]:
    """0 (dense), then each distinct finite horizon in increasing order."""
    finite = horizons[torch.isfinite(horizons) & (horizons > 0)]
    return [0.0] + [float(h) for h in torch.unique(finite).tolist()]


def plan_for_slots(
    identity: ModelIdentity,
    horizons: torch.Tensor,
    cfg: ModelConfig,
    tp_size: int,
    target_slots: int,
    budget_bytes: int,
    int8: bool = False,
    layout: str = "ragged",
    placement: str = "off",
    gate_input: float = DEFAULT_GATE_INPUT,
    eps: float = DEFAULT_EPS,
) -> TargetFit:
    """The smallest W_max whose worst-rank slot bytes fit ``target_slots`` slots in
    ``budget_bytes`` per rank (slot 0 reserved, as the pool counts them)."""
    if target_slots < 1:
        raise PlanError(f"target slots must be >= 1, got {target_slots}")

    def fit(w_max: float) -> TargetFit:
        plan = dasc_plan(identity, horizons, w_max, gate_input, eps)
        return TargetFit(plan, report_plan(plan, cfg, tp_size, budget_bytes, int8, layout,
                                           (placement,)))

    candidates = w_max_candidates(horizons)
    lo, hi = 0, len(candidates) - 1
    best = fit(candidates[hi])
    if best.slots < target_slots:
        raise PlanError(
            f"{target_slots} slots do not fit in {budget_bytes:,} bytes per rank: even W_max "
            f"{candidates[hi]:g}, which omits every unit with a finite horizon, gives "
            f"{best.slots} ({best.report.placements[0].slot_bytes:,} bytes per slot)")
    while lo < hi:  # invariant: candidates[hi] fits
        mid = (lo + hi) // 2
        trial = fit(candidates[mid])
        if trial.slots >= target_slots:
            hi, best = mid, trial
        else:
            lo = mid + 1
    return best
