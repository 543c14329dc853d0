"""CPU GEMM forms of one linear weight: torch's ``F.linear`` vs the oneDNN-packed weight that
``model_runner.layers.linear.pack_weight`` makes (what ``--cpu-packed-weights on`` runs): bf16
for a bf16 weight on a CPU with native bf16, else fp32.

    python -m model_runner.bench.gemm_forms [--shapes 12288x1024 1024x4096 ...]
        [--rows 1 2 4 17 64 256 1024] [--repeats 5]

One JSON line per (weight [out x in], rows M): the median milliseconds of each form and their
ratio.  Run it with ``OMP_NUM_THREADS=1`` to match one serving rank per core.  The default
shapes are the Qwen3-Next-80B layer shapes of the real-shape bench model (GDN in/out
projections, attention q, one expert's gate|up and down, shared expert).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
import torch.nn.functional as F

from model_runner.layers.linear import pack_weight, packed_linear

DEFAULT_SHAPES = ["12288x1024", "1024x4096", "8192x1024", "1024x1024", "1024x512"]


def median_ms(fn, args: tuple, repeats: int) -> float:
    fn(*args)
    times = []
    for _ in range(repeats):
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
    args = p.parse_args()
    dtype = getattr(torch, args.dtype)
    gen = torch.Generator().manual_seed(0)
    for shape in args.shapes:
        out_f, in_f = (int(n) for n in shape.split("x"))
        w = (torch.randn(out_f, in_f, generator=gen) * 0.03).to(dtype)
        packed = pack_weight(w)
        for rows in args.rows:
            x = torch.randn(rows, in_f, generator=gen).to(dtype)
            torch_ms = median_ms(F.linear, (x, w), args.repeats)
            line = {"weight": shape, "rows": rows, "dtype": args.dtype, "torch_ms": torch_ms}
            if packed is not None:
                line["packed_ms"] = median_ms(packed_linear, (x, packed),
                                              args.repeats)
                line["torch_over_packed"] = torch_ms / line["packed_ms"]
            print(json.dumps(line), flush=True)


if __name__ == "__main__":
    main()
