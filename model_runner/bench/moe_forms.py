"""The four forms of one MoE layer, timed alone: routed and grouped (eager), gathered, grouped
and all experts (fixed-shape).

    python -m model_runner.bench.moe_forms --model DIR [--dtype float32]
        [--tokens 1 4 8 32 64 128 256]
        [--forms routed grouped gathered all] [--packed-weights on] [--cpu-fp32-weights auto]

Random weights in the model's MoE shape (only config.json is read), prepared as the runner
prepares them: oneDNN-packed expert copies for the routed form (``--packed-weights``, the
runner's ``--cpu-packed-weights``) and, for bf16 on a CPU that emulates it, weights held in fp32
(``--cpu-fp32-weights``).  One JSON line per token count with the median of ``--repeats`` calls
of each form (all experts: at most 3), the forms alternating call by call so that the load of
other processes hits them alike, and each form's largest difference from the routed form
relative to the routed output's largest magnitude (``*_err``).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from model_runner.config import ModelConfig
from model_runner.host_memory import keep_freed_memory
from model_runner.layers.linear import hold_fp32, should_hold_fp32
from model_runner.layers.mlp import SparseMoE, grouped_mm_runs
from model_runner.parallel import TPGroup

FORMS = ("routed", "grouped", "gathered", "all")


def time_forms(layer: SparseMoE, forms: list[str], x: torch.Tensor, repeats: int) -> dict:
    """Median ms per form and each form's error against the routed form (when timed)."""
    weights, ids = layer.route(x)
    outs = {}
    for form in forms:  # warm-up call, kept for the comparison
        outs[form] = torch.zeros_like(x)
        getattr(layer, f"_{form}_experts")(x, weights, ids, outs[form])
    times: dict[str, list[float]] = {form: [] for form in forms}
    for i in range(repeats):
        for form in forms:
            if form == "all" and i >= 3:
                continue
            out = torch.zeros_like(x)
            start = time.perf_counter()
            getattr(layer, f"_{form}_experts")(x, weights, ids, out)
            times[form].append(time.perf_counter() - start)
    row = {f"{form}_ms": round(1000 * statistics.median(times[form]), 2) for form in forms}
    if "routed" in outs:
        ref = outs["routed"].float()
        scale = ref.abs().max().item() or 1.0
        for form in forms:
            if form != "routed":
                err = (outs[form].float() - ref).abs().max().item() / scale
                row[f"{form}_err"] = float(f"{err:.2e}")
    return row


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", required=True)
    p.add_argument("--dtype", default="float32")
    p.add_argument("--tokens", type=int, nargs="+", default=[1, 4, 8, 32, 64, 128, 256])
    p.add_argument("--forms", nargs="+", choices=FORMS, default=list(FORMS))
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--packed-weights", choices=("on", "off"), default="on")
    p.add_argument("--cpu-fp32-weights", choices=("auto", "on", "off"), default="auto")
    a = p.parse_args()
    keep_freed_memory()  # as the runner does
    cfg, dtype = ModelConfig.from_dir(a.model), getattr(torch, a.dtype)
    layer = SparseMoE(cfg, TPGroup(), dtype)
    gen = torch.Generator().manual_seed(0)
    for param in layer.parameters():
        param.data.copy_(torch.randn(param.shape, generator=gen) * 0.02)
    if a.packed_weights == "on":  # the runner's order: pack, then hold in fp32
        layer.pack_weights()
    held = {"auto": should_hold_fp32(dtype, torch.device("cpu")), "on": True, "off": False}
    if held[a.cpu_fp32_weights]:
        hold_fp32(layer)
    print(json.dumps({"model": a.model, "dtype": a.dtype, "experts": cfg.num_experts,
                      "top_k": cfg.num_experts_per_tok, "hidden": cfg.hidden_size,
                      "moe_intermediate": cfg.moe_intermediate_size,
                      "weights": str(layer.w13.dtype), "packed": bool(layer.packed_experts),
                      "threads": torch.get_num_threads()}), flush=True)
    with torch.inference_mode():
        for n in a.tokens:
            x = torch.randn(n, cfg.hidden_size, generator=gen).to(dtype)
            forms = [f for f in a.forms if f != "grouped" or grouped_mm_runs(x, layer.w13,
                                                                             layer.w2)]
            row = {"tokens": n, "pairs": n * cfg.num_experts_per_tok}
            row.update(time_forms(layer, forms, x, a.repeats))
            print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
