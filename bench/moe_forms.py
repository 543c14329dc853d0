"""The three forms of one MoE layer, timed alone: routed (eager), gathered and all experts
(fixed-shape).

    python bench/moe_forms.py --model DIR [--dtype float32] [--tokens 1 4 8 32 64 128 256]

Random weights in the model's MoE shape (only config.json is read); one JSON line per token
count with the median of ``--repeats`` calls of each form (all experts: at most 3).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from model_runner.config import ModelConfig
from model_runner.host_memory import keep_freed_memory
from model_runner.layers.mlp import SparseMoE
from model_runner.parallel import TPGroup


def median_ms(fn, args: tuple, repeats: int) -> float:
    fn(*args)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn(*args)
        times.append(time.perf_counter() - start)
    return round(1000 * statistics.median(times), 2)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", required=True)
    p.add_argument("--dtype", default="float32")
    p.add_argument("--tokens", type=int, nargs="+", default=[1, 4, 8, 32, 64, 128, 256])
    p.add_argument("--repeats", type=int, default=5)
    a = p.parse_args()
    keep_freed_memory()  # as the runner does
    cfg, dtype = ModelConfig.from_dir(a.model), getattr(torch, a.dtype)
    layer = SparseMoE(cfg, TPGroup(), dtype)
    gen = torch.Generator().manual_seed(0)
    for param in layer.parameters():
        param.data.copy_(torch.randn(param.shape, generator=gen) * 0.02)
    with torch.inference_mode():
        for n in a.tokens:
            x = torch.randn(n, cfg.hidden_size, generator=gen).to(dtype)
            weights, ids = layer.route(x)
            out = torch.zeros_like(x)
            row = {"tokens": n, "pairs": n * cfg.num_experts_per_tok}
            for form in ("routed", "gathered", "all"):
                fn = getattr(layer, f"_{form}_experts")
                repeats = min(a.repeats, 3) if form == "all" else a.repeats
                row[f"{form}_ms"] = median_ms(fn, (x, weights, ids, out), repeats)
            print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
