"""Time to a prompt's first token when its chunk holds checkpoint store points: one forward
that snapshots the state at each (``SeqInput.snapshots``, what the scheduler plans now) against
one forward per store point, the chunk split there (what it planned before: the state before the
last token, and with ``--interval N`` every N-th position).  One rank, in-process, the two forms
alternating, so drift hits both alike.

    python -m model_runner.bench.snapshot_step [--model DIR] [--dtype float32] [--prefix 256]
        [--chunks 32 256] [--interval 0] [--reps 7]

A chunk of ``C`` tokens follows a cached prefix of ``--prefix`` tokens (a hit's suffix; a miss
when the prefix is 0).  Each repetition restores the prefix's state, then times each form up to
its logits; the checkpoint stores that follow are the same work in both and not timed.  Prints
one JSON line per chunk length: medians, their ratio, and the largest relative difference of
the two forms' logits (the same math on different GEMM row counts).
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time

import torch

from model_runner.batch import SeqInput
from model_runner.config import DEFAULT_MODEL
from model_runner.runner import DTYPES, ModelRunner, RunnerConfig

PAGE = 16


def store_cuts(start: int, n: int, interval: int) -> list[int]:
    """Offsets into a chunk of ``n`` tokens after ``start`` cached ones where a prompt that
    ends with the chunk stores: every ``interval``-th position inside it, and its end minus one."""
    every = range(interval * (start // interval + 1), start + n - 1, interval) if interval else []
    return [b - start for b in every] + [n - 1]


def measure(runner: ModelRunner, prefix: list[int], chunk: list[int], reps: int,
            interval: int = 0) -> dict:
    table = list(range(-(-(len(prefix) + len(chunk)) // PAGE)))
    start = len(prefix)
    if prefix:
        runner.forward([SeqInput(prefix, 0, table, 1)])
    cached = runner.read_state(1)
    cuts = store_cuts(start, len(chunk), interval)

    def split() -> torch.Tensor:
        bounds = [0, *cuts, len(chunk)]
        for a, b in zip(bounds, bounds[1:]):
            logits = runner.forward([SeqInput(chunk[a:b], start + a, table, 1)])
        return logits

    def fused() -> torch.Tensor:
        return runner.forward([SeqInput(chunk, start, table, 1,
                                        [(c, 2 + i) for i, c in enumerate(cuts)])])

    times: dict[str, list[float]] = {"split": [], "fused": []}
    logits = {}
    for rep in range(reps + 1):  # the first round warms up and is dropped
        for name, form in (("split", split), ("fused", fused)):
            if start:
                runner.write_state(1, cached)
            t0 = time.perf_counter()
            logits[name] = form()
            if rep:
                times[name].append(time.perf_counter() - t0)
    split_ms = 1e3 * statistics.median(times["split"])
    fused_ms = 1e3 * statistics.median(times["fused"])
    diff = (logits["fused"] - logits["split"]).abs().max() / logits["split"].abs().max()
    return {"prefix": len(prefix), "chunk": len(chunk), "cuts": len(cuts),
            "split_ms": round(split_ms, 2),
            "fused_ms": round(fused_ms, 2), "fused_over_split": round(fused_ms / split_ms, 3),
            "logits_rel_diff": float(diff)}


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--model", default=str(DEFAULT_MODEL))
    p.add_argument("--dtype", default="float32", choices=sorted(DTYPES))
    p.add_argument("--prefix", type=int, default=256, help="cached tokens before the chunk")
    p.add_argument("--chunks", type=int, nargs="+", default=[32, 256],
                   help="chunk lengths (at least 2)")
    p.add_argument("--interval", type=int, default=0,
                   help="also a store point every N prompt tokens (0: only the end minus one)")
    p.add_argument("--reps", type=int, default=7)
    a = p.parse_args(argv)
    if min(a.chunks) < 2 or a.prefix < 0 or a.reps < 1 or a.interval < 0:
        p.error("--chunks must be >= 2, --prefix and --interval >= 0 and --reps >= 1")
    longest = a.prefix + max(a.chunks)
    most_cuts = max(len(store_cuts(a.prefix, n, a.interval)) for n in a.chunks)
    runner = ModelRunner(RunnerConfig(a.model, dtype=a.dtype, num_pages=-(-longest // PAGE) + 1,
                                      page_size=PAGE, num_state_slots=2 + most_cuts))
    rng = random.Random(0)
    vocab = runner.vocab_size
    prefix = [rng.randrange(vocab) for _ in range(a.prefix)]
    for n in a.chunks:
        chunk = [rng.randrange(vocab) for _ in range(n)]
        row = measure(runner, prefix, chunk, a.reps, a.interval)
        print(json.dumps({"model": a.model, "dtype": a.dtype, "interval": a.interval, **row}),
              flush=True)


if __name__ == "__main__":
    main()
