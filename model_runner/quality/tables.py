"""Markdown tables from ``dasc-eval`` results, in the shape of the paper's quality tables.

``Runs`` indexes results by (model, arm, mask seed, task, length).  Random arms hold one result
per mask seed; a random cell is the mean over seeds and a random aggregate is reported as mean ±
sample SD over seeds.  Aggregates ("Avg", "KL", "Δ NLL") are means over the (task, length)
cells, i.e. every cell weighs the same.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable

from model_runner.quality.arms import parse_arm
from model_runner.quality.sweep import Result
from model_runner.quality.tasks import TASKS

KINDS = ("nr", "wr", "nr-int8", "random")
LABELS = {"nr": "dasc-nr", "wr": "dasc-wr", "nr-int8": "dasc-nr INT8", "random": "random"}
FAMILY_ORDER = ("retrieval", "multi_key", "multi", "aggregation", "qa", "tracking")


class Runs:
    def __init__(self, results: list[Result]):
        self.cells: dict[tuple, Result] = {}
        for r in results:  # a later line for the same key wins (a rerun)
            self.cells[(r.model, r.arm, r.mask_seed, r.task, r.length)] = r
        self.models = list(dict.fromkeys(r.model for r in results))

    def select(self, model: str, arm: str, task: str | None = None, length: int | None = None
               ) -> list[Result]:
        return [r for (m, a, _, t, n), r in self.cells.items() if m == model and a == arm
                and (task is None or t == task) and (length is None or n == length)]

    def tasks(self, model: str) -> list[str]:
        present = {k[3] for k in self.cells if k[0] == model}
        return [t for t in TASKS if t in present]

    def lengths(self, model: str) -> list[int]:
        return sorted({k[4] for k in self.cells if k[0] == model})

    def w_values(self, model: str, kind: str) -> list[float]:
        ws = {parse_arm(k[1])[1] for k in self.cells if k[0] == model and k[1] != "dense"
              and parse_arm(k[1])[0] == kind}
        return sorted(ws)

    def seeds(self, model: str, arm: str) -> list[int | None]:
        return sorted({k[2] for k in self.cells if k[0] == model and k[1] == arm},
                      key=lambda s: -1 if s is None else s)

    def mean(self, model: str, arm: str, metric: str, task: str | None = None,
             length: int | None = None, seed: int | None | str = "all") -> float | None:
        """Mean of ``metric`` over the matching (task, length) cells; over all seeds' cells unless
        ``seed`` names one.  None when nothing matches."""
        rows = [r for r in self.select(model, arm, task, length)
                if seed == "all" or r.mask_seed == seed]
        return statistics.fmean(getattr(r, metric) for r in rows) if rows else None

    def seed_spread(self, model: str, arm: str, metric: str, **where) -> tuple[float, float]:
        """(mean, sample SD) over mask seeds of the per-seed aggregate of ``metric``."""
        values = [self.mean(model, arm, metric, seed=s, **where) for s in self.seeds(model, arm)]
        values = [v for v in values if v is not None]
        sd = statistics.stdev(values) if len(values) > 1 else 0.0
        return statistics.fmean(values), sd

    def families(self, model: str) -> list[str]:
        present = {TASKS[t].family for t in self.tasks(model)}
        return [f for f in FAMILY_ORDER if f in present]

    def family_mean(self, model: str, arm: str, family: str, metric: str) -> float | None:
        """Mean over the family's (task, length) cells; family "all": over every cell."""
        rows = [r for t in self.tasks(model) if family in ("all", TASKS[t].family)
                for r in self.select(model, arm, t)]
        return statistics.fmean(getattr(r, metric) for r in rows) if rows else None


def arm_name(kind: str, w: float) -> str:
    return f"{kind}@{w:g}"


def fmt(x: float | None, digits: int = 2) -> str:
    return "–" if x is None else f"{x:.{digits}f}"


def fmt_kl(x: float | None) -> str:
    return "–" if x is None else f"{x:.2e}" if 0 < abs(x) < 1e-3 else f"{x:.4f}"


def sweep_rows(runs: Runs, model: str, configs: list[tuple[str, str]],
               lead: Callable[[str, str], str]) -> list[str]:
    """One row per (config, length): subtask accuracies, Avg, mean KL and Δ NLL."""
    tasks = runs.tasks(model)
    lines = []
    for label, arm in configs:
        for j, length in enumerate(runs.lengths(model)):
            if not runs.select(model, arm, length=length):
                continue
            cells = [fmt(runs.mean(model, arm, "accuracy", t, length)) for t in tasks]
            if arm.startswith("random@") and len(runs.seeds(model, arm)) > 1:
                avg = "{:.2f} ± {:.2f}".format(*runs.seed_spread(model, arm, "accuracy",
                                                                   length=length))
            else:
                avg = fmt(runs.mean(model, arm, "accuracy", length=length))
            kl = fmt_kl(runs.mean(model, arm, "kl", length=length))
            dnll = fmt_kl(runs.mean(model, arm, "delta_nll", length=length))
            head = lead(label, arm) if j == 0 else " | "
            lines.append(f"| {head} | {length} | " + " | ".join(cells)
                         + f" | {avg} | {kl} | {dnll} |")
    return lines


def _header(tasks: list[str], lead: str) -> list[str]:
    cols = [t.upper().replace("_", "-") for t in tasks]
    head = f"| {lead} | Len | " + " | ".join(cols) + " | Avg | KL | Δ NLL |"
    return [head, "|" + "---|" * (len(tasks) + lead.count("|") + 5)]


def table2(runs: Runs) -> str:
    """Paper Table 2: dense and dasc-nr at the smallest and largest W_max, per model."""
    lines = []
    for model in runs.models:
        ws = runs.w_values(model, "nr")
        configs = [("dense", "dense")] + [(f"W_max={w:g}", arm_name("nr", w))
                                          for w in dict.fromkeys(ws[:1] + ws[-1:])]
        if not lines:
            lines = _header(runs.tasks(model), "Model | Config")
        lines += sweep_rows(runs, model, configs, lambda label, _, m=model: f"{m} | {label}")
    return "\n".join(lines)


def sweep_table(runs: Runs, model: str) -> str:
    """Paper Tables 6 / 7: the full sweep of one model (every kind at every W_max)."""
    configs = [("baseline | dense", "dense")]
    for kind in KINDS:
        configs += [(f"{LABELS[kind]} | W_max {w:g}", arm_name(kind, w))
                    for w in runs.w_values(model, kind)]
    return "\n".join(_header(runs.tasks(model), "Group | Arm")
                     + sweep_rows(runs, model, configs, lambda label, _: label))


def table4(runs: Runs) -> str:
    """Paper Table 4: dense vs dasc-nr native vs INT8 at the smallest INT8 W_max, per family."""
    lines = ["| Model | W_max | Family | Dense | dasc native | dasc INT8 | KL native | KL INT8 |",
             "|---|---|---|---|---|---|---|---|"]
    for model in runs.models:
        ws = runs.w_values(model, "nr-int8")
        if not ws:
            continue
        w = ws[0]
        nr, int8 = arm_name("nr", w), arm_name("nr-int8", w)
        for family in runs.families(model) + ["all"]:
            def m(arm, metric, model=model, family=family):
                return runs.family_mean(model, arm, family, metric)
            lines.append(f"| {model} | {w:g} | {family} | {fmt(m('dense', 'accuracy'))} | "
                         f"{fmt(m(nr, 'accuracy'))} | {fmt(m(int8, 'accuracy'))} | "
                         f"{fmt_kl(m(nr, 'kl'))} | {fmt_kl(m(int8, 'kl'))} |")
    return "\n".join(lines)


def summary_table(runs: Runs) -> str:
    """Per W_max, all tasks and lengths: accuracy and KL of every kind (random: mean ± SD)."""
    lines = ["| Model | W_max | Dense acc | nr acc | wr acc | random acc | INT8 acc | "
             "nr KL | wr KL | random KL | INT8 KL |", "|" + "---|" * 11]
    for model in runs.models:
        dense = fmt(runs.mean(model, "dense", "accuracy"))
        for w in runs.w_values(model, "nr") or runs.w_values(model, "random"):
            cells = []
            for metric, f in (("accuracy", fmt), ("kl", fmt_kl)):
                for kind in ("nr", "wr", "random", "nr-int8"):
                    arm = arm_name(kind, w)
                    if kind == "random" and runs.select(model, arm):
                        mean, sd = runs.seed_spread(model, arm, metric)
                        cells.append(f"{f(mean)} ± {f(sd)}")
                    else:
                        cells.append(f(runs.mean(model, arm, metric)))
            lines.append(f"| {model} | {w:g} | {dense} | " + " | ".join(cells) + " |")
    return "\n".join(lines)
