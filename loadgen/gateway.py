"""Data-parallel serving behind the SGLang model gateway (``smg``): the prefix-cache hit rate of
dasc-serve replicas under one routing policy.

    python -m loadgen.gateway --smg PATH [--replicas 2] [--groups 7] [--per-group 4]
                              [--policies cache_aware round_robin]

Each policy gets fresh replicas' caches (``/flush_cache``) and a fresh gateway; the workload is
``--groups`` shared prefixes, each asked ``--per-group`` times with a different suffix,
interleaved (group 0, 1, ..., then again), sent one at a time.  The hit rate is the replicas'
cached tokens over their prompt tokens (``/v1/stats``).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager

import httpx

from client.cli_help import DefaultsHelpFormatter
from loadgen.spawn import Server, running_server
from scheduler.wire.ipc import free_port


@contextmanager
def running_gateway(smg: str, workers: list[str], policy: str,
                    timeout: float = 60.0) -> Iterator[str]:
    """``smg launch`` in a session of its own, until it routes; killed on exit."""
    port = free_port()
    cmd = [smg, "launch", "--host", "127.0.0.1", "--port", str(port), "--worker-urls", *workers,
           "--policy", policy, "--prometheus-port", str(free_port())]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + timeout
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"smg exited with {proc.returncode}")
            try:
                if httpx.get(f"{url}/v1/models", timeout=5).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"smg not routing after {timeout:.0f} s")
            time.sleep(0.3)
        yield url
    finally:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.wait()


def workload(groups: int, per_group: int, prefix_len: int = 400, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    words = ["green", "sky", "river", "stone", "code", "seven", "night", "blue", "paper"]

    def text(n: int) -> str:
        out = ""
        while len(out) < n:
            out += rng.choice(words) + " "
        return out[:n]

    prefixes = [text(prefix_len) for _ in range(groups)]
    return [prefixes[g] + text(24) for _ in range(per_group) for g in range(groups)]


def hit_rate(gateway: str, replicas: list[Server], prompts: list[str], model: str) -> dict:
    for r in replicas:
        r.flush()
    before = [r.stats()["counters"] for r in replicas]
    for prompt in prompts:
        body = {"model": model, "prompt": prompt, "max_tokens": 1, "temperature": 0}
        httpx.post(f"{gateway}/v1/completions", json=body, timeout=120).raise_for_status()
    after = [r.stats()["counters"] for r in replicas]
    prompt = [a["prompt_tokens"] - b["prompt_tokens"] for a, b in zip(after, before)]
    cached = [a["cached_tokens"] - b["cached_tokens"] for a, b in zip(after, before)]
    return {"prompt_tokens": sum(prompt), "cached_tokens": sum(cached),
            "hit_rate": round(sum(cached) / max(1, sum(prompt)), 3),
            "prompt_tokens_per_replica": prompt}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m loadgen.gateway",
                                formatter_class=DefaultsHelpFormatter,
                                description=__doc__.split("\n\n")[0])
    p.add_argument("--smg", required=True, help="the gateway's binary (pip sglang-router)")
    p.add_argument("--replicas", type=int, default=2, help="dasc-serve replicas")
    p.add_argument("--groups", type=int, default=7,
                   help="shared prefixes (odd, so round_robin does not pin a group to a replica)")
    p.add_argument("--per-group", type=int, default=4, help="requests per prefix")
    p.add_argument("--policies", nargs="+", default=["cache_aware", "round_robin"],
                   help="gateway routing policies to compare")
    p.add_argument("--serve-args", default="", help="extra dasc-serve flags (one string)")
    args = p.parse_args(argv)
    prompts = workload(args.groups, args.per_group)
    with ExitStack() as stack:
        replicas = [stack.enter_context(running_server(*args.serve_args.split()))
                    for _ in range(args.replicas)]
        model = httpx.get(f"{replicas[0].base_url}/v1/models", timeout=30).json()["data"][0]["id"]
        for policy in args.policies:
            with running_gateway(args.smg, [r.base_url for r in replicas], policy) as gateway:
                row = {"policy": policy, "replicas": args.replicas, "requests": len(prompts),
                       **hit_rate(gateway, replicas, prompts, model)}
            print(json.dumps(row), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
