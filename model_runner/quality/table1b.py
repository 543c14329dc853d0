"""Paper Table 1(b): do weight-derived static horizons track what the model does on real prefixes?

For each prefix (length-stratified task-suite contexts) the runner prefills it with tensor
capture on; per linear layer we take the observed log-decays (empirical horizon, eq. 4), the
final recurrent state (state norm) and the final query (readout norm), and compute Spearman's
rho across the layer's units against the static horizon H_s.  Reported: median [IQR] over all
(prefix, layer) pairs.  Runs on one rank (the analysis needs whole layers).

    python -m model_runner.quality.table1b [--model DIR] [--prefixes 32] [--json]
"""

from __future__ import annotations

import argparse
import json
import sys

import numpy as np
import torch

from client.cli_help import DefaultsHelpFormatter
from model_runner.batch import SeqInput
from model_runner.byte_tokenizer import encode_bytes
from model_runner.compression.analysis.measures import (
    empirical_horizons,
    median_iqr,
    readout_norms,
    spearman_by_layer,
    state_norms,
)
from model_runner.compression.horizons import static_horizons
from model_runner.compression.weights import load_decay_params
from model_runner.quality.tasks import TASKS, make_instances
from model_runner.runner import ModelRunner, RunnerConfig

PAIRS = ("H_e", "state_norm", "readout_norm")


def prefixes(count: int, seed: int) -> list[list[int]]:
    """``count`` contexts cycling through tasks and lengths 256..2048 (length-stratified)."""
    tasks, lengths = list(TASKS), [256, 512, 1024, 2048]
    out = []
    for i in range(count):
        inst = make_instances(tasks[i % len(tasks)], lengths[i % len(lengths)], 1, seed + i)[0]
        out.append(encode_bytes(inst.context))
    return out


def observe(runner: ModelRunner, ids: list[int]) -> dict[str, torch.Tensor]:
    """Observed measures for one prefix: each [L, n_units]."""
    kind = runner.cfg.linear_kind
    page = runner.rc.page_size
    capture: dict = {}
    runner.forward([SeqInput(ids, 0, list(range(-(-len(ids) // page))), 1)], capture=capture)
    state = runner.read_state(1).temporal  # [L, H, K, V]
    rows = {p: [] for p in PAIRS}
    for layer in range(runner.cfg.num_linear_layers):
        rows["H_e"].append(empirical_horizons(capture["g"][layer]))
        rows["state_norm"].append(state_norms(state[layer], kind))
        rows["readout_norm"].append(readout_norms(state[layer], capture["q"][layer][-1], kind))
    return {p: torch.stack(v) for p, v in rows.items()}


def table1b(model_dir: str, count: int, seed: int) -> dict[str, dict[str, float]]:
    runner = ModelRunner(RunnerConfig(model_dir, num_pages=140, page_size=16,
                                      num_state_slots=2))
    static = static_horizons(runner.cfg, load_decay_params(model_dir, runner.cfg))
    observed = [observe(runner, ids) for ids in prefixes(count, seed)]
    table = {}
    for pair in PAIRS:
        rho = spearman_by_layer(static, torch.stack([o[pair] for o in observed]))
        med, q25, q75 = median_iqr(rho)
        table[pair] = {"median": med, "q25": q25, "q75": q75, "pairs": int(np.isfinite(rho).sum())}
    return table


def build_parser() -> argparse.ArgumentParser:
    from model_runner.config import DEFAULT_MODEL

    p = argparse.ArgumentParser(prog="python -m model_runner.quality.table1b",
                                description=__doc__.split("\n\n")[0],
                                formatter_class=DefaultsHelpFormatter)
    p.add_argument("--model", default=str(DEFAULT_MODEL), help="model folder with weights")
    p.add_argument("--prefixes", type=int, default=32, help="task-suite contexts analysed")
    p.add_argument("--seed", type=int, default=0, help="seed of the contexts")
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        table = table1b(args.model, args.prefixes, args.seed)
    except (ValueError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    if args.json:
        print(json.dumps(table))
    else:
        print("| Pair | Median | IQR | (prefix, layer) pairs |\n|---|---|---|---|")
        for pair, row in table.items():
            print(f"| H_s, {pair} | {row['median']:.3f} | [{row['q25']:.3f}, {row['q75']:.3f}] "
                  f"| {row['pairs']} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
