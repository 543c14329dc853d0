"""Budget-driven plans: ``dasc-plan --target-slots N`` picks the smallest W_max
whose worst-rank slot bytes fit N slots in the budget; checked against every candidate W_max on
the shipped models' real decay weights."""

from __future__ import annotations

import pytest
from support.serving import KIMI, QWEN

from model_runner.compression.accounting import dense_budget, report_plan
from model_runner.compression.analysis.plan_cli import main as plan_main
from model_runner.compression.horizons import static_horizons
from model_runner.compression.plan import ModelIdentity, PlanError, dasc_plan
from model_runner.compression.target import plan_for_slots, w_max_candidates
from model_runner.compression.weights import load_decay_params
from model_runner.config import ModelConfig


def setting(model, tp):
    cfg = ModelConfig.from_dir(model)
    params = load_decay_params(model, cfg)
    return cfg, ModelIdentity.of(cfg, params), static_horizons(cfg, params)


def slots_at(identity, horizons, cfg, tp, w, budget, placement):
    plan = dasc_plan(identity, horizons, w)
    return report_plan(plan, cfg, tp, budget, placements=(placement,)).placements[0].slots


@pytest.mark.parametrize("model, tp, placement", [(KIMI, 1, "off"), (KIMI, 2, "storage"),
                                                  (QWEN, 2, "off")])
def test_the_smallest_w_max_that_fits(model, tp, placement):
    cfg, identity, horizons = setting(model, tp)
    budget = dense_budget(cfg, tp, 32)
    candidates = w_max_candidates(horizons)
    slots = [slots_at(identity, horizons, cfg, tp, w, budget, placement) for w in candidates]
    assert slots == sorted(slots)  # the search relies on this: more W_max, never fewer slots
    assert slots[0] == 31  # dense: 32 physical slots, slot 0 reserved
    for target in sorted({32, (slots[0] + slots[-1]) // 2, slots[-1]}):
        fit = plan_for_slots(identity, horizons, cfg, tp, target, budget, placement=placement)
        i = candidates.index(fit.plan.w_max)
        assert fit.slots == slots[i] >= target
        assert i == 0 or slots[i - 1] < target  # nothing smaller fits
        assert fit.omitted_fraction == pytest.approx(1 - fit.plan.retained_fraction)
        assert fit.capacity == pytest.approx(fit.slots / 31)
    dense = plan_for_slots(identity, horizons, cfg, tp, 31, budget, placement=placement)
    assert dense.plan.w_max == 0 and dense.omitted_fraction == 0


def test_an_impossible_target_is_a_clear_error():
    cfg, identity, horizons = setting(KIMI, 1)
    budget = dense_budget(cfg, 1, 4)
    with pytest.raises(PlanError, match="do not fit"):
        plan_for_slots(identity, horizons, cfg, 1, 10_000, budget)
    with pytest.raises(PlanError, match=">= 1"):
        plan_for_slots(identity, horizons, cfg, 1, 0, budget)


def test_dasc_plan_cli_reports_the_choice(capsys, tmp_path):
    cfg, identity, horizons = setting(KIMI, 1)
    target = 48
    fit = plan_for_slots(identity, horizons, cfg, 1, target, dense_budget(cfg, 1, 32))
    out = tmp_path / "plan.json"
    assert plan_main([str(KIMI), "--tp", "1", "--dense-slots", "32", "--target-slots",
                      str(target), "--save-plan", str(out)]) == 0
    err = capsys.readouterr().err
    assert f"W_max {fit.plan.w_max:.9g} (the smallest that fits), {fit.slots} slots" in err
    assert f"{fit.omitted_fraction:.1%} of units omitted" in err
    saved = type(fit.plan).load(out)
    assert saved.w_max == fit.plan.w_max and saved.retained == fit.plan.retained
    # the printed W_max, given back as --wmax, is the same plan
    assert dasc_plan(identity, horizons, float(f"{fit.plan.w_max:.9g}")).retained == \
        fit.plan.retained
    assert plan_main([str(KIMI), "--tp", "1", "--target-slots", "100000"]) == 2
    assert "do not fit" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        plan_main([str(KIMI), "--tp", "1", "--target-slots", "8", "--wmax", "64"])
