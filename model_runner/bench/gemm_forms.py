"""CPU GEMM forms of one linear weight: torch's ``F.linear`` vs the oneDNN-packed weight that
``model_runner.layers.linear.pack_weight`` makes (what ``--cpu-packed-weights on`` runs): bf16
for a bf16 weight on a CPU with native bf16, else fp32; and, for bf16 and at most
``GEMV_MAX_ROWS`` rows, the C GEMV that decode's rows take (``kernels.gemv``), over the weight
and over its coded copy (``code_weight``, what ``--cpu-coded-weights on`` streams).

    python -m model_runner.bench.gemm_forms [--shapes 12288x1024 1024x4096 ...]
        [--rows 1 2 4 17 64 256 1024] [--repeats 5] [--cold-bytes 1e9]

One JSON line per (weight [out x in], rows M): the median milliseconds of each form and their
ratio.  Run it with ``OMP_NUM_THREADS=1`` to match one serving rank per core.  The default
shapes are the Qwen3-Next-80B layer shapes of the real-shape bench model (GDN in/out
projections, attention q, one expert's gate|up and down, shared expert).  ``--cold-bytes B``
cycles each call through copies of the weight of B bytes in all, so that every call reads its
weight from memory, as a decode step does (its weights do not stay in cache between steps);
the lines then add ``gb_per_s``, the weight's bytes over each form's time (the coded form's
too: it reads ~0.77x of them).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
import torch.nn.functional as F

from kernels.gemv import GEMV_MAX_ROWS, code_weight, gemv
from model_runner.layers.linear import pack_weight, packed_linear

DEFAULT_SHAPES = ["12288x1024", "1024x4096", "8192x1024", "1024x1024", "1024x512"]


def median_ms(fn, arg_sets: list[tuple], repeats: int) -> float:
    """Median milliseconds of ``fn``, each call on the next of ``arg_sets`` (cyclically)."""
    fn(*arg_sets[-1])
    times = []
    for i in range(repeats):
        args = arg_sets[i % len(arg_sets)]
        start = time.perf_counter()
        fn(*args)
        times.append(time.perf_counter() - start)
    return 1000 * statistics.median(times)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--shapes", nargs="+", default=DEFAULT_SHAPES, help="weights as OUTxIN")
    p.add_argument("--rows", type=int, nargs="+", default=[1, 2, 4, 17, 64, 256, 1024])
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"],
                   help="the weight's and activations' dtype (bf16: torch's emulated GEMM where "
                        "the CPU lacks bf16 dot products, and an fp32 packed form there)")
    p.add_argument("--cold-bytes", type=float, default=0,
                   help="cycle through copies of each weight of this many bytes in all (0: "
                        "one copy, warm in cache after the first call)")
    args = p.parse_args()
    dtype = getattr(torch, args.dtype)
    gen = torch.Generator().manual_seed(0)
    torch.set_grad_enabled(False)
    for shape in args.shapes:
        out_f, in_f = (int(n) for n in shape.split("x"))
        w = (torch.randn(out_f, in_f, generator=gen) * 0.03).to(dtype)
        bytes_ = w.numel() * w.element_size()
        weights = [w] + [w.clone() for _ in range(1, int(args.cold_bytes // bytes_))]
        packs = [pack_weight(c) for c in weights]
        codes = [code_weight(c) for c in weights]
        for rows in args.rows:
            x = torch.randn(rows, in_f, generator=gen).to(dtype)
            line = {"weight": shape, "rows": rows, "dtype": args.dtype,
                    "copies": len(weights)}
            forms = {"torch": (F.linear, [(x, c) for c in weights])}
            if packs[0] is not None:
                forms["packed"] = (packed_linear, [(x, c) for c in packs])
            if rows <= GEMV_MAX_ROWS and gemv(x, w) is not None:
                forms["gemv"] = (gemv, [(x, c) for c in weights])
                if codes[0] is not None:
                    forms["coded"] = (lambda x, c, code: gemv(x, c, coded=code),
                                      [(x, c, code) for c, code in zip(weights, codes)])
            for name, (fn, arg_sets) in forms.items():
                line[f"{name}_ms"] = median_ms(fn, arg_sets, args.repeats)
                if args.cold_bytes:
                    line[f"{name}_gb_per_s"] = bytes_ / line[f"{name}_ms"] / 1e6
            for name in ("packed", "gemv"):
                if name in forms:
                    line[f"torch_over_{name}"] = line["torch_ms"] / line[f"{name}_ms"]
            if "coded" in forms:
                line["coded_over_gemv"] = line["coded_ms"] / line["gemv_ms"]
            print(json.dumps(line), flush=True)


if __name__ == "__main__":
    main()
