"""Serving latency on a real dasc-serve: TTFT of a prefix hit vs a miss, the scheduler's and
IPC's share of a decode step, and the gaps between a stream's frames.

    python -m loadgen.bench.serve_latency [--model DIR] [--tp 1 2] [--prefix-len 2048]
        [--suffix-len 32] [--reps 5] [--batch 8] [--decode-tokens 64]
        [--decode-prompt-len 64] [--gap-streams 8] [--gap-tokens 32]

TTFT is measured client-side, from sending the request to the first SSE frame with text.  A miss
is prefix_i + suffix_a on a flushed cache; the hit is prefix_i + suffix_b right after it (the
prefix checkpoint sits on the --checkpoint-interval grid).  An exact repeat of prefix_i +
suffix_b then hits at its last token: one forward of one token, so its TTFT is mostly the
serving path's own latency (HTTP, IPC, scheduling).  The decode share comes from the
scheduler's own clock: 1 - (rank 0's step time) / (scheduler's whole step: plan, IPC, ranks,
results), over a window where ``--batch`` requests decode together (from the step after the last
of them got its first token).  Frame gaps: ``--gap-streams``
streams one after another, each ``--gap-tokens`` long; a gap is the time between two token
frames arriving, the first excluded (that is TTFT).  Frames held back and then released
together show as a long second gap and a share of gaps under 0.2 ms ("burst").
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx

from loadgen.spawn import running_server
from model_runner.config import DEFAULT_MODEL


def text_ids(rng: random.Random, n: int) -> list[int]:
    words = ["green", "sky", "river", "stone", "code", "seven", "night", "blue", "paper"]
    out: list[int] = []
    while len(out) < n:
        out += list((rng.choice(words) + " ").encode())
    return out[:n]


HTTP = httpx.Client(timeout=600, limits=httpx.Limits(max_keepalive_connections=64))


def stream_ttft(base_url: str, prompt: list[int], max_tokens: int = 1,
                on_first=None) -> tuple[float, int]:
    """(TTFT in ms, cached tokens) of one streaming request over a kept-alive connection
    (a fresh httpx client costs ~20 ms of TLS-context set-up, more than a hit); ``on_first()``
    runs when the first token arrives."""
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "ignore_eos": True, "return_token_ids": True,
            "stream_options": {"include_usage": True}}
    ttft, cached = None, -1
    start = time.perf_counter()
    with HTTP.stream("POST", f"{base_url}/v1/completions", json=body) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            frame = json.loads(line[6:])
            if ttft is None and frame["choices"] and frame["choices"][0].get("token_ids"):
                ttft = (time.perf_counter() - start) * 1e3
                if on_first is not None:
                    on_first()
            if frame.get("usage"):
                cached = frame["usage"]["prompt_tokens_details"]["cached_tokens"]
    return ttft, cached


def hit_vs_miss(server, args) -> dict:
    rng = random.Random(0)
    miss, hit, repeat = [], [], []
    for _ in range(args.reps):
        prefix = text_ids(rng, args.prefix_len)
        server.flush()
        t_miss, c_miss = stream_ttft(server.base_url, prefix + text_ids(rng, args.suffix_len))
        prompt = prefix + text_ids(rng, args.suffix_len)
        t_hit, c_hit = stream_ttft(server.base_url, prompt)
        t_repeat, c_repeat = stream_ttft(server.base_url, prompt)
        assert c_miss == 0 and c_hit >= args.prefix_len, (c_miss, c_hit)
        assert c_repeat == len(prompt) - 1, c_repeat
        miss.append(t_miss)
        hit.append(t_hit)
        repeat.append(t_repeat)
    m, h = statistics.median(miss), statistics.median(hit)
    return {"ttft_miss_ms": round(m, 1), "ttft_hit_ms": round(h, 1),
            "hit_over_miss": round(h / m, 3),
            "ttft_exact_repeat_ms": round(statistics.median(repeat), 1)}


def decode_share(server, args) -> dict:
    """The window opens when every request of the batch has its first token, so it holds
    decode steps only (a window that also held the batch's prefill steps raised the mean: 64
    against ~45 ms a step at batch 2, Qwen shape)."""
    rng = random.Random(1)
    prompts = [text_ids(rng, args.decode_prompt_len) for _ in range(args.batch)]
    first = threading.Barrier(args.batch + 1, timeout=600)  # a failed request breaks it
    with ThreadPoolExecutor(args.batch) as pool:
        done = pool.map(lambda p: stream_ttft(server.base_url, p, args.decode_tokens,
                                              on_first=first.wait), prompts)
        first.wait()
        before = server.stats()
        list(done)
    after = server.stats()
    steps = after["num_steps"] - before["num_steps"]
    step_s = after["step_s"] - before["step_s"]
    compute_s = after["compute_s"] - before["compute_s"]
    return {"steps": steps, "step_ms": round(1e3 * step_s / steps, 2),
            "rank_ms": round(1e3 * compute_s / steps, 2),
            "scheduler_ipc_share": round(1 - compute_s / step_s, 3)}


def frame_gaps(server, args) -> dict:
    rng = random.Random(2)
    gaps, second = [], []
    for _ in range(args.gap_streams):
        body = {"prompt": text_ids(rng, 64), "max_tokens": args.gap_tokens, "temperature": 0,
                "stream": True, "ignore_eos": True, "return_token_ids": True}
        arrivals = []
        with HTTP.stream("POST", f"{server.base_url}/v1/completions", json=body) as r:
            r.raise_for_status()
            for line in r.iter_lines():
                if line.startswith("data: {") and '"token_ids":[' in line.replace(" ", ""):
                    arrivals.append(time.perf_counter())
        steps = [(b - a) * 1e3 for a, b in zip(arrivals, arrivals[1:])]
        gaps += steps
        second.append(steps[0])
    gaps.sort()
    return {"gap_median_ms": round(statistics.median(gaps), 2),
            "gap_p99_ms": round(gaps[min(len(gaps) - 1, int(0.99 * len(gaps)))], 2),
            "second_token_gap_median_ms": round(statistics.median(second), 2),
            "burst_share": round(sum(g < 0.2 for g in gaps) / len(gaps), 3)}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=str(DEFAULT_MODEL))
    p.add_argument("--tp", type=int, nargs="+", default=[1, 2])
    p.add_argument("--prefix-len", type=int, default=2048)
    p.add_argument("--suffix-len", type=int, default=32)
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--decode-tokens", type=int, default=64)
    p.add_argument("--decode-prompt-len", type=int, default=64,
                   help="prompt length of the decode-share requests (their context)")
    p.add_argument("--gap-streams", type=int, default=8, help="streams timed for frame gaps")
    p.add_argument("--gap-tokens", type=int, default=32, help="tokens in each of those streams")
    p.add_argument("--serve-args", default="",
                   help="extra dasc-serve flags, e.g. '--device cuda' (one string)")
    args = p.parse_args()
    for tp in args.tp:
        with running_server("--model", args.model, "--tp", str(tp),
                            *args.serve_args.split()) as server:
            row = {"tp": tp, **hit_vs_miss(server, args), **decode_share(server, args),
                   **frame_gaps(server, args)}
        print(json.dumps(row), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
