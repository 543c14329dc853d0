"""torch.compile (inductor's CPU backend) on the chunked delta rule, against eager.

    OMP_NUM_THREADS=1 python -m model_runner.bench.delta_rule_compile [--lengths 256 512 320]

GDN at the Qwen3-Next-80B layer shape (16 key / 32 value heads of 128, one sequence).  Per
length, one line: the eager time, the compiled first call (compile included), the compiled
second call and the largest difference from eager.  The chunk loop is Python, so every new
chunk count is a new graph.
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F

from kernels.delta_rule.naive import chunk_delta_rule


def inputs(length: int, gen: torch.Generator) -> tuple[torch.Tensor, ...]:
    q, k = (F.normalize(torch.randn(1, length, 16, 128, generator=gen), dim=-1)
            for _ in range(2))
    v = torch.randn(1, length, 32, 128, generator=gen)
    g = -torch.rand(1, length, 32, generator=gen) * 0.1
    beta = torch.rand(1, length, 32, generator=gen)
    return q, k, v, g, beta, torch.zeros(1, 32, 128, 128)


def timed(fn, args) -> tuple[float, tuple[torch.Tensor, torch.Tensor]]:
    start = time.perf_counter()
    out = fn(*args, 128**-0.5)
    return time.perf_counter() - start, out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--lengths", type=int, nargs="+", default=[256, 512, 320])
    args = p.parse_args()
    gen = torch.Generator().manual_seed(0)
    compiled = torch.compile(chunk_delta_rule, dynamic=True)
    with torch.inference_mode():
        for length in args.lengths:
            x = inputs(length, gen)
            timed(chunk_delta_rule, x)
            eager, ref = timed(chunk_delta_rule, x)
            first, _ = timed(compiled, x)
            second, out = timed(compiled, x)
            diff = (out[0] - ref[0]).abs().max().item()
            print(f"tokens {length}: eager {eager * 1e3:.0f} ms, compiled first call "
                  f"{first:.1f} s, second {second * 1e3:.0f} ms, max |diff| {diff:.1e}",
                  flush=True)


if __name__ == "__main__":
    main()
