"""Two random prompts sent together to a dasc server, REPS times, the cache flushed first:
each stream's TTFT, the gap to its second token and its end, one JSON line per repetition.

python pair.py PORT PROMPT_TOKENS REPS
"""

import concurrent.futures as cf
import json
import random
import sys
import time

import httpx

port, n, reps = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])


def one(seed: int) -> list[float]:
    rng = random.Random(seed)
    prompt = [rng.randrange(3, 256) for _ in range(n)]
    body = {"prompt": prompt, "max_tokens": 16, "temperature": 0, "stream": True,
            "ignore_eos": True}
    start, times = time.perf_counter(), []
    with httpx.stream("POST", f"http://127.0.0.1:{port}/v1/completions", json=body,
                      timeout=600) as r:
        for line in r.iter_lines():
            if line.startswith("data:") and '"text"' in line:
                times.append(time.perf_counter() - start)
    return times


for _ in range(reps):
    httpx.post(f"http://127.0.0.1:{port}/flush_cache", timeout=60)
    base = random.randrange(10**9)
    with cf.ThreadPoolExecutor(2) as ex:
        results = list(ex.map(one, [base, base + 1]))
    out = [dict(ttft=round(t[0], 3), first_gap=round(t[1] - t[0], 3), end=round(t[-1], 3))
           for t in results]
    print(json.dumps(out), flush=True)
