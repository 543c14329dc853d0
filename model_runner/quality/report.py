"""``dasc-eval report``: the quality study's tables, paired inference, targets and plot from the
JSON lines ``dasc-eval --out`` writes.

    dasc-eval report RESULTS.jsonl [MORE.jsonl ...] [--md quality_tables.md] [--png quality.png]

Tables in the shape of the paper's: 2 (dense vs dasc-nr at the extreme W_max), 4 (INT8 at the
smallest W_max), 5 (paired dasc - random per task family and W_max, in accuracy and in KL), 6 /
7 (the full sweep per model), a per-W_max summary, and the study's three targets checked.
Paired inference (Table 5 style): the unit is an instance (task, length, index) of the family;
its difference is the dasc-nr value minus the mean over the random masks; 10,000 bootstrap
resamples (``model_runner.quality.paired_stats``), Holm over the comparisons of one (model, metric)
table.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from dataclasses import dataclass
from pathlib import Path

from client.cli_help import DefaultsHelpFormatter
from model_runner.quality.paired_stats import NUM_RESAMPLES, PairedDiff, holm, paired_bootstrap
from model_runner.quality.tables import (
    Runs,
    arm_name,
    fmt,
    fmt_kl,
    summary_table,
    sweep_table,
    table2,
    table4,
)
from model_runner.quality.tasks import TASKS

METRICS = {"accuracy": "score", "kl": "kl"}  # report metric -> per-instance field
ALPHA = 0.05


@dataclass(frozen=True, slots=True)
class Comparison:
    model: str
    family: str
    w_max: float
    metric: str
    stat: PairedDiff
    p_holm: float


def paired_diffs(runs: Runs, model: str, w: float, family: str, metric: str) -> list[float]:
    """Per instance of the family: dasc-nr value minus the mean over random masks."""
    field = METRICS[metric]

    def values(arm: str, seed) -> dict[tuple, float]:
        return {(r.task, r.length, s.index): getattr(s, field)
                for r in runs.select(model, arm) if TASKS[r.task].family == family
                and r.mask_seed == seed for s in r.instances}

    dasc = values(arm_name("nr", w), None)
    masks = [values(arm_name("random", w), s) for s in runs.seeds(model, arm_name("random", w))]
    units = [u for u in dasc if masks and all(u in m for m in masks)]
    return [dasc[u] - statistics.fmean(m[u] for m in masks) for u in units]


def compare(runs: Runs, metric: str, resamples: int, seed: int, log=None) -> list[Comparison]:
    """Every (model, family, W_max) with both dasc-nr and random results; Holm per model."""
    out = []
    for model in runs.models:
        ws = [w for w in runs.w_values(model, "nr") if w in runs.w_values(model, "random")]
        stats = []
        for family in runs.families(model):
            for w in ws:
                diffs = paired_diffs(runs, model, w, family, metric)
                if diffs:
                    stats.append((family, w, paired_bootstrap(diffs, resamples, seed=seed)))
        if log is not None:
            log(f"{model} {metric}: {len(stats)} paired comparisons")
        adjusted = holm([s.p for _, _, s in stats])
        out += [Comparison(model, f, w, metric, s, float(p))
                for (f, w, s), p in zip(stats, adjusted)]
    return out


def fmt_p(p: float, resamples: int) -> str:
    return f"<{1 / resamples:.4f}" if p <= 1 / (resamples + 1) else f"{p:.4f}"


def table5(comparisons: list[Comparison], resamples: int) -> str:
    """Paper Table 5: paired dasc - random; accuracy in percentage points, KL in nats."""
    lines = ["| Model | Metric | Family | W_max | N | dasc − random | 95% CI | p | p_Holm |",
             "|---|---|---|---|---|---|---|---|---|"]
    for c in comparisons:
        scale, f = (100.0, lambda x: f"{x:+.2f}") if c.metric == "accuracy" else (
            1.0, lambda x: f"{x:+.2e}")
        s = c.stat
        mark = "†" if c.p_holm < ALPHA else ""
        lines.append(f"| {c.model} | {'acc (pp)' if c.metric == 'accuracy' else 'KL'} | "
                     f"{c.family} | {c.w_max:g} | {s.n} | {f(scale * s.diff)} | "
                     f"[{f(scale * s.ci_low)}, {f(scale * s.ci_high)}] | "
                     f"{fmt_p(s.p, resamples)} | {fmt_p(c.p_holm, resamples)}{mark} |")
    return "\n".join(lines)


def targets(runs: Runs, kl_comparisons: list[Comparison]) -> str:
    """The study's three targets, checked (reported against, not tuned to): dasc-nr within
    0.01 of dense on every family, dasc KL below random KL, wr closer to dense than nr at large
    W_max."""
    lines = []
    for model in runs.models:
        ws = runs.w_values(model, "nr")
        if ws:
            w0 = 16.0 if 16.0 in ws else ws[0]
            gaps = {f: abs(runs.family_mean(model, arm_name("nr", w0), f, "accuracy")
                           - runs.family_mean(model, "dense", f, "accuracy"))
                    for f in runs.families(model)
                    if runs.family_mean(model, "dense", f, "accuracy") is not None
                    and runs.family_mean(model, arm_name("nr", w0), f, "accuracy") is not None}
            worst = max(gaps, key=gaps.get) if gaps else None
            ok = bool(gaps) and gaps[worst] <= 0.01 + 1e-9
            lines.append(f"- {model}, dasc-nr at W_max={w0:g} within 0.01 of dense on every "
                         f"family aggregate: **{'holds' if ok else 'fails'}** (largest gap "
                         f"{fmt(gaps.get(worst), 3)} on {worst})")
        per_w = {}
        for c in kl_comparisons:
            if c.model == model:
                per_w.setdefault(c.w_max, []).append(c.stat.diff < 0 and c.p_holm < ALPHA)
        if per_w:
            ok = all(all(v) for v in per_w.values())
            detail = ", ".join(f"W={w:g}: {sum(v)}/{len(v)}" for w, v in sorted(per_w.items()))
            lines.append(f"- {model}, dasc KL below random KL with Holm p < {ALPHA} in every "
                         f"family at every W_max: **{'holds' if ok else 'fails'}** (families "
                         f"significant: {detail})")
        dense = runs.mean(model, "dense", "accuracy")
        for w in [w for w in runs.w_values(model, "wr") if w >= 512 and w in ws]:
            if dense is None:
                break
            kl_nr, kl_wr = (runs.mean(model, arm_name(k, w), "kl") for k in ("nr", "wr"))
            gap_nr, gap_wr = (abs(runs.mean(model, arm_name(k, w), "accuracy") - dense)
                              for k in ("nr", "wr"))
            ok = kl_wr < kl_nr and gap_wr <= gap_nr
            lines.append(f"- {model}, W_max={w:g}: wr closer to dense than nr: "
                         f"**{'holds' if ok else 'fails'}** (KL wr {fmt_kl(kl_wr)} vs nr "
                         f"{fmt_kl(kl_nr)}; |acc - dense| wr {gap_wr:.3f} vs nr {gap_nr:.3f})")
    return "\n".join(lines)


def report(runs: Runs, resamples: int = NUM_RESAMPLES, seed: int = 0, log=None) -> str:
    acc = compare(runs, "accuracy", resamples, seed, log)
    kl = compare(runs, "kl", resamples, seed, log)
    parts = ["## Targets", targets(runs, kl),
             "## Summary per W_max (all tasks and lengths; random: mean ± SD over masks)",
             summary_table(runs),
             "## Table 2 shape: dense vs dasc-nr at the extreme W_max", table2(runs),
             "## Table 4 shape: INT8 composition", table4(runs),
             "## Table 5 shape: paired dasc − random (instance = unit; † Holm p < 0.05)",
             table5(acc + kl, resamples)]
    for model in runs.models:
        parts += [f"## Table 6 / 7 shape: full sweep, {model}", sweep_table(runs, model)]
    return "\n\n".join(parts) + "\n"


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="dasc-eval report", description="Quality tables, paired "
                                "inference and a W_max plot from dasc-eval JSON lines.",
                                formatter_class=DefaultsHelpFormatter)
    p.add_argument("results", nargs="+", help="JSON-lines files written by dasc-eval --out")
    p.add_argument("--md", help="write the markdown here (default: stdout)")
    p.add_argument("--png", help="also plot accuracy and KL vs W_max (nr, wr, random) here "
                   "(default: no plot)")
    p.add_argument("--resamples", type=int, default=NUM_RESAMPLES, help="bootstrap resamples")
    p.add_argument("--seed", type=int, default=0, help="bootstrap seed")
    return p


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    return build_parser().parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    from model_runner.quality.results import load_results

    args = parse_args(argv)

    def log(msg: str) -> None:
        print(f"[dasc-eval report] {msg}", file=sys.stderr, flush=True)

    missing = [p for p in args.results if not Path(p).exists()]
    if missing:
        print(f"error: no such file {missing[0]}", file=sys.stderr)
        return 2
    results = [r for path in args.results for r in load_results(path)]
    if not results:
        print("error: no results in the given files", file=sys.stderr)
        return 2
    runs = Runs(results)
    log(f"{len(results)} results, models {', '.join(runs.models)}")
    text = report(runs, args.resamples, args.seed, log)
    if args.md:
        Path(args.md).parent.mkdir(parents=True, exist_ok=True)
        Path(args.md).write_text(text)
        log(f"wrote {args.md}")
    else:
        print(text, end="")
    if args.png:
        from model_runner.quality.plot import plot_w_sweep

        plot_w_sweep(runs, args.png)
        log(f"wrote {args.png}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
