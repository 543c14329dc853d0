"""Time per output token of a real dasc-serve with and without ``response_format``.

    OMP_NUM_THREADS=1 python -m loadgen.bench.grammar_serving [--concurrency 1 8] [--max-tokens 64]

Starts one dasc-serve (the built-in tiny model unless ``--model``), then for each concurrency
streams that many requests at once, ``--rounds`` times: plain ones (``ignore_eos``, so each
makes ``--max-tokens`` tokens) and ones under a JSON schema whose output is longer than
``--max-tokens`` (an array of at least 256 two-letter strings), so both run to the same cut.
TPOT per request = (last token time - first token time) / (tokens - 1), from the client.
Prints one JSON line per (concurrency, arm) and a markdown table of mean TPOT.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from concurrent.futures import ThreadPoolExecutor

import httpx

from loadgen.spawn import running_server

SCHEMA = {"type": "array", "minItems": 256, "items": {"enum": ["ab", "cd", "ef"]}}


def one_stream(url: str, body: dict) -> float | None:
    """TPOT in ms of one streamed completion (None if it made fewer than two tokens)."""
    times = []
    with httpx.stream("POST", f"{url}/v1/completions", json={**body, "stream": True},
                      timeout=600) as r:
        for line in r.iter_lines():
            if line.startswith("data: {") and '"text":""' not in line:
                times.append(time.perf_counter())
    return (times[-1] - times[0]) / (len(times) - 1) * 1e3 if len(times) > 1 else None


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None)
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    flags = ["--model", args.model] if args.model else []
    arms = {"plain": {"ignore_eos": True},
            "json_schema": {"response_format": {"type": "json_schema", "json_schema": {
                "name": "long", "schema": SCHEMA}}}}
    rows = []
    with running_server(*flags) as server:
        for concurrency in args.concurrency:
            for arm, extra in arms.items():
                tpots = []
                for r in range(args.rounds):
                    bodies = [{"prompt": f"Request {r}-{i}: list them.", "temperature": 1.0,
                               "seed": i, "max_tokens": args.max_tokens, **extra}
                              for i in range(concurrency)]
                    with ThreadPoolExecutor(concurrency) as pool:
                        tpots += [t for t in pool.map(lambda b: one_stream(server.base_url, b),
                                                      bodies) if t is not None]
                row = {"concurrency": concurrency, "arm": arm, "requests": len(tpots),
                       "mean_tpot_ms": round(statistics.mean(tpots), 2)}
                print(json.dumps(row), flush=True)
                rows.append(row)
    print("\n| concurrency | plain TPOT ms | json_schema TPOT ms |\n|---|---|---|")
    for c in args.concurrency:
        got = {r["arm"]: r["mean_tpot_ms"] for r in rows if r["concurrency"] == c}
        print(f"| {c} | {got['plain']} | {got['json_schema']} |")


if __name__ == "__main__":
    main()
