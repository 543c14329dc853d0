"""`dasc-plan`: checkpoint accounting, plan export and horizon plots for one model directory."""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict
from pathlib import Path

from client.cli_help import DefaultsHelpFormatter
from model_runner.compression.accounting import (
    DEFAULT_DENSE_SLOTS,
    PlanReport,
    dense_budget,
    report_plan,
)
from model_runner.compression.defaults import DEFAULT_EPS, DEFAULT_GATE_INPUT
from model_runner.compression.horizons import static_horizons
from model_runner.compression.placement import PLACEMENTS, check_bundle_split
from model_runner.compression.plan import (
    ModelIdentity,
    PlanError,
    check_w_max,
    dasc_plan,
    dense_plan,
    random_plan,
)
from model_runner.compression.target import plan_for_slots
from model_runner.compression.weights import has_weights, load_decay_params
from model_runner.config import ConfigError, ModelConfig
from model_runner.model_files import WeightsError

DEFAULT_WMAX = (16.0, 64.0, 128.0, 512.0)


# Printed above the table's header: what each column is (the paper's symbols, sec. 4.1, App. B).
LEGEND = (
    "columns:",
    "  W_max            horizon threshold (0: dense)",
    "  select, place    dense | dasc | random; placement across ranks: off | storage | hybrid",
    "  dtype, kept      temporal payload; fraction of units retained",
    "  Rmax/rb          R_max / r_bar: most units a layer keeps over the mean (= C_rag / C_pad)",
    "  C_pad, C_rag     temporal compression vs dense fp32, padded and ragged layout",
    "  C_ckpt           dense slot bytes / this slot's bytes (temporal + BF16 conv)",
    "  bytes/rank/slot  one slot on the worst rank; moved: rows that cross ranks per checkpoint",
    "  slots, W_wr      slots at the budget; dasc-wr replay window (0: nothing omitted)",
)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="dasc-plan",
        description="Decay-aware state-checkpoint accounting per TP rank. With weights: one row "
        "per W_max and placement (off | storage | hybrid). With config.json only: the dense row.",
        formatter_class=DefaultsHelpFormatter,
    )
    p.add_argument("model", metavar="MODEL_OR_CONFIG_DIR",
                   help="model directory (config.json, optional safetensors) or a config.json")
    p.add_argument("--tp", type=int, required=True, help="tensor-parallel degree")
    choose = p.add_mutually_exclusive_group()
    choose.add_argument("--wmax", type=float, nargs="+", default=None, metavar="W",
                        help="thresholds W_max (default: "
                        f"{' '.join(f'{w:g}' for w in DEFAULT_WMAX)}, or the dense row alone "
                        "without weights)")
    choose.add_argument("--target-slots", type=int, default=None, metavar="N",
                        help="pick the smallest W_max whose worst-rank slot fits N checkpoint "
                        "slots in the budget, and report the capacity and the omitted fraction "
                        "it implies (needs weights; default: off)")
    p.add_argument("--placement", choices=PLACEMENTS, default="off",
                   help="with --target-slots: the placement whose slots are counted")
    budget = p.add_mutually_exclusive_group()
    budget.add_argument("--budget-bytes", type=int,
                        help="per-rank checkpoint budget in bytes (default: set by --dense-slots)")
    budget.add_argument("--dense-slots", type=int, default=DEFAULT_DENSE_SLOTS,
                        help="budget as this many physical dense slots per rank")
    p.add_argument("--int8", action="store_true", help="INT8 temporal payload (+fp32 scales)")
    p.add_argument("--layout", choices=("ragged", "padded"), default="ragged",
                   help="how the retained units of a layer are stored")
    p.add_argument("--gate-input", type=float, default=DEFAULT_GATE_INPUT,
                   help="representative gate input a")
    p.add_argument("--eps", type=float, default=DEFAULT_EPS, help="decay floor")
    p.add_argument("--random-seed", type=int, default=None,
                   help="count-matched random selection with this seed instead of dasc "
                   "(default: dasc's selection)")
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")
    p.add_argument("--plot", type=Path, metavar="FILE.png",
                   help="write horizon profiles (default: no plot)")
    p.add_argument("--save-plan", type=Path, metavar="FILE.json",
                   help="write the selection plan of the single --wmax given (default: not "
                   "written)")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return _run(args)
    except (ConfigError, PlanError, WeightsError, OSError) as e:
        print(f"dasc-plan: error: {e}", file=sys.stderr)
        return 2


def _run(args: argparse.Namespace) -> int:
    path = Path(args.model)
    model_dir = path.parent if path.name == "config.json" else path
    cfg = ModelConfig.from_dir(model_dir)
    check_bundle_split(cfg, args.tp)
    budget = (dense_budget(cfg, args.tp, args.dense_slots) if args.budget_bytes is None
              else args.budget_bytes)
    if budget < 0:
        raise PlanError(f"budget must be >= 0 bytes, got {budget}")
    if args.target_slots is not None:
        args.wmax = [_target_w_max(args, cfg, model_dir, budget)]
    wmaxes = list(DEFAULT_WMAX) if args.wmax is None else list(args.wmax)
    for w in wmaxes:
        check_w_max(w)
    if args.save_plan is not None and len(wmaxes) != 1:
        raise PlanError("--save-plan needs exactly one --wmax")
    needs_weights = args.plot is not None or (args.wmax is not None and any(wmaxes))
    weights = has_weights(model_dir)
    if needs_weights and not weights:
        raise PlanError(f"{model_dir} has no safetensors weights; W_max > 0 and --plot need "
                        "the decay parameters (W_max 0 works from config.json alone)")
    identity = ModelIdentity.of(cfg)
    plans = [dense_plan(identity, args.gate_input, args.eps)]
    horizons = None
    if weights:
        params = load_decay_params(model_dir, cfg)
        identity = ModelIdentity.of(cfg, params)
        horizons = static_horizons(cfg, params, args.gate_input, args.eps)
        for w in (w for w in wmaxes if w > 0):
            plan = dasc_plan(identity, horizons, w, args.gate_input, args.eps)
            if args.random_seed is not None:
                plan = random_plan(plan, horizons, args.random_seed)
            plans.append(plan)
    if args.save_plan is not None:
        chosen = next((p for p in plans if p.w_max == wmaxes[0]), plans[0])
        chosen.save(args.save_plan)
        print(f"wrote {args.save_plan}", file=sys.stderr)
    if args.plot is not None:
        from model_runner.compression.analysis.horizon_plot import plot_horizons

        plot_horizons(cfg, horizons, wmaxes, args.plot)
        print(f"wrote {args.plot}", file=sys.stderr)
    reports = [report_plan(p, cfg, args.tp, budget, False, args.layout,
                           ("off",) if p.selector == "dense" else PLACEMENTS) for p in plans]
    if args.int8:
        reports += [report_plan(p, cfg, args.tp, budget, True, args.layout,
                                ("off",) if p.selector == "dense" else PLACEMENTS)
                    for p in plans]
    if args.json:
        print(json.dumps(_as_json(cfg, args.tp, reports), indent=1))
    else:
        print(_as_table(cfg, args.tp, reports))
    if not weights:
        print(f"note: {model_dir} has no weights: dense row only", file=sys.stderr)
    return 0


def _target_w_max(args: argparse.Namespace, cfg: ModelConfig, model_dir: Path,
                  budget: int) -> float:
    """--target-slots: the chosen W_max, with one line on what it implies."""
    if not has_weights(model_dir):
        raise PlanError(f"{model_dir} has no safetensors weights; --target-slots needs the "
                        "decay parameters")
    params = load_decay_params(model_dir, cfg)
    horizons = static_horizons(cfg, params, args.gate_input, args.eps)
    fit = plan_for_slots(ModelIdentity.of(cfg, params), horizons, cfg, args.tp,
                         args.target_slots, budget, args.int8, args.layout, args.placement,
                         args.gate_input, args.eps)
    slot = fit.report.placements[0].slot_bytes
    print(f"target {args.target_slots} slots: W_max {fit.plan.w_max:.9g} (the smallest that "
          f"fits), {fit.slots} slots of {slot:,} bytes per rank ({args.placement} placement, "
          f"{'int8' if args.int8 else 'fp32'}), {fit.capacity:.2f}x the {fit.report.dense_slots} "
          f"dense slots, {fit.omitted_fraction:.1%} of units omitted, W_wr "
          f"{fit.plan.refresh_window}", file=sys.stderr)
    return fit.plan.w_max


def _rows(reports: list[PlanReport]) -> list[dict]:
    rows = []
    for r in reports:
        for p in r.placements:
            rows.append(dict(
                w_max=r.w_max, selector=r.selector, placement=p.placement, layout=r.layout,
                payload="int8" if r.int8 else "fp32", retained_fraction=r.retained_fraction,
                r_max=r.r_max, r_bar=r.r_bar, layout_gain=r.layout_gain,
                c_temp_pad=r.c_temp_pad, c_temp_rag=r.c_temp_rag,
                complete_ratio=p.complete_ratio, bytes_per_rank_per_slot=p.slot_bytes,
                temporal_bytes_per_slot=p.temporal_bytes, conv_bytes_per_slot=r.conv_bytes,
                rows_per_rank=list(p.rows_per_rank), stored_rows=p.stored_rows,
                moved_rows=p.moved_rows, slots=p.slots, refresh_window=r.refresh_window,
            ))
    return rows


def _as_json(cfg: ModelConfig, tp_size: int, reports: list[PlanReport]) -> dict:
    dense = reports[0]
    return {
        "model": asdict(ModelIdentity.of(cfg)),
        "tp": tp_size,
        "budget_bytes": dense.budget_bytes,
        "dense": {"bytes_per_rank_per_slot": dense.dense_slot_bytes,
                  "budget_bytes": dense.budget_bytes, "slots": dense.dense_slots},
        "rows": _rows(reports),
    }


def _as_table(cfg: ModelConfig, tp_size: int, reports: list[PlanReport]) -> str:
    dense = reports[0]
    unit = "channels" if cfg.is_kda else "heads"
    lines = [
        f"model: {cfg.architecture} ({cfg.linear_kind}), {cfg.num_linear_layers} linear layers x "
        f"{ModelIdentity.of(cfg).num_units} {unit}, "
        f"TP {tp_size}",
        f"budget: {dense.budget_bytes:,} bytes per rank; dense {dense.dense_slot_bytes:,} bytes "
        f"per rank per slot (conv {dense.conv_bytes:,} BF16) -> {dense.dense_slots} slots",
        *LEGEND,
        f"{'W_max':>6} {'select':>6} {'place':>7} {'dtype':>5} {'kept':>6} {'Rmax/rb':>7} "
        f"{'C_pad':>6} {'C_rag':>6} {'C_ckpt':>6} {'bytes/rank/slot':>15} {'moved':>6} "
        f"{'slots':>6} {'W_wr':>5}",
    ]
    for row in _rows(reports):
        lines.append(
            f"{row['w_max']:>6g} {row['selector']:>6} {row['placement']:>7} {row['payload']:>5} "
            f"{row['retained_fraction']:>6.3f} {row['layout_gain']:>7.2f} "
            f"{row['c_temp_pad']:>6.2f} {row['c_temp_rag']:>6.2f} {row['complete_ratio']:>6.2f} "
            f"{row['bytes_per_rank_per_slot']:>15,} {row['moved_rows']:>6} {row['slots']:>6} "
            f"{row['refresh_window']:>5}"
        )
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
