"""What the load generator's HTTP client costs: the client's CPU per streamed request and the
TTFT it reports, against the TTFT the server measures (its ``/metrics`` histogram, from the
request's arrival at the front end), on an all-hit load that makes the server's own work small.

    python -m loadgen.bench.client_cost [--clients aiohttp httpx] [--requests 960]
        [--concurrency 32] [--rounds 2] -- [dasc-serve flags]

One dasc-serve; ``--prompts`` distinct prompts are sent once (warm-up, stored at their ends),
then ``--requests`` repeats of them in a seeded shuffled order, once per client and round,
the clients alternating.  ``aiohttp`` is dasc-loadgen's own path (``loadgen.stream``);
``httpx`` is the client it used before: one ``httpx.AsyncClient`` pool, ``aiter_lines``.
A gap between client and server TTFT is time spent in the client, the network stack or the
front end's accept queue; on a small machine a costly client takes CPU from the server too.
Beside the client's CPU, each row gives the CPU per request of the server's processes by role
(front end, scheduler, ranks: from /proc, Linux only), which is where a hit's cost goes when
its compute is small.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import re
import statistics
import sys
import time
from pathlib import Path

import httpx

from client.cli_help import DefaultsHelpFormatter
from loadgen.bench.seed_metrics import markdown_table
from loadgen.sender import run_sequential, run_window
from loadgen.spawn import descendants, running_server
from loadgen.stream import make_client, request_body
from loadgen.workload import Request, random_ids

TTFT_SUM = re.compile(r"^dasc_time_to_first_token_seconds_(sum|count)\S* ([0-9.e+-]+)$", re.M)


def server_ttft(base_url: str) -> tuple[float, float]:
    """(sum of seconds, count) of the server's TTFT histogram."""
    got = {"sum": 0.0, "count": 0.0}
    for kind, value in TTFT_SUM.findall(httpx.get(f"{base_url}/metrics", timeout=60).text):
        got[kind] += float(value)
    return got["sum"], got["count"]


async def httpx_ttfts(base_url: str, requests: list[Request], concurrency: int) -> list[float]:
    """The previous client: one httpx pool, SSE lines through ``aiter_lines``."""
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    gate = asyncio.Semaphore(concurrency)

    async def one(client: httpx.AsyncClient, req: Request) -> float:
        async with gate:
            start, ttft = time.perf_counter(), None
            async with client.stream("POST", "/v1/completions",
                                     json=request_body(req, None)) as resp:
                async for line in resp.aiter_lines():
                    if ttft is None and line.startswith("data:") and '"text"' in line:
                        ttft = time.perf_counter() - start
            return ttft * 1e3

    async with httpx.AsyncClient(base_url=base_url, limits=limits, timeout=600) as client:
        return await asyncio.gather(*[one(client, r) for r in requests])


async def aiohttp_ttfts(base_url: str, requests: list[Request], concurrency: int
                        ) -> list[float]:
    async with make_client(base_url, concurrency) as client:
        win = await run_window(client, requests, concurrency)
    failed = [r.error for r in win.results if not r.ok]
    if failed:
        raise RuntimeError(f"{len(failed)} requests failed, first: {failed[0]}")
    return [r.ttft_ms for r in win.results]


CLIENTS = {"aiohttp": aiohttp_ttfts, "httpx": httpx_ttfts}
# role of a server process, by a word of its command line (the launcher runs the front end)
ROLES = (("serve_rank", "ranks"), ("-m scheduler", "scheduler"), ("torchrun", "torchrun"),
         ("dasc_server.launch", "front end"))


def server_cpu(launcher_pid: int) -> dict[str, float]:
    """CPU seconds (user + system) so far of the launcher and every process below it, summed
    by role."""
    tick = os.sysconf("SC_CLK_TCK")
    out: dict[str, float] = {}
    for pid in [launcher_pid, *descendants(launcher_pid)]:
        try:
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:  # gone meanwhile
            continue
        role = next((name for word, name in ROLES if word in cmd), "other")
        out[role] = out.get(role, 0.0) + (int(fields[11]) + int(fields[12])) / tick
    return out


def measure(base_url: str, client: str, requests: list[Request], concurrency: int,
            launcher_pid: int) -> dict:
    s0, c0 = server_ttft(base_url)
    before = server_cpu(launcher_pid)
    cpu, wall = time.process_time(), time.perf_counter()
    ttfts = asyncio.run(CLIENTS[client](base_url, requests, concurrency))
    cpu, wall = time.process_time() - cpu, time.perf_counter() - wall
    after = server_cpu(launcher_pid)
    s1, c1 = server_ttft(base_url)
    return {"client": client, "requests": len(requests), "wall_s": wall,
            "client_cpu_ms_per_request": 1e3 * cpu / len(requests),
            "server_cpu_ms_per_request": {role: 1e3 * (t - before.get(role, 0.0)) / len(requests)
                                          for role, t in sorted(after.items())},
            "requests_per_s": len(requests) / wall,
            "client_mean_ttft_ms": statistics.fmean(ttfts),
            "server_mean_ttft_ms": 1e3 * (s1 - s0) / max(c1 - c0, 1.0)}


def markdown(rows: list[dict]) -> str:
    roles = [name for _, name in ROLES if name != "torchrun"]
    header = ["client", "round", "client CPU / request (ms)",
              *[f"{name} CPU / request (ms)" for name in roles], "requests/s",
              "client mean TTFT (ms)", "server mean TTFT (ms)"]
    return markdown_table(header, [
        [r["client"], str(r["round"]), f"{r['client_cpu_ms_per_request']:.2f}",
         *[f"{r['server_cpu_ms_per_request'].get(name, 0.0):.2f}" for name in roles],
         f"{r['requests_per_s']:.1f}", f"{r['client_mean_ttft_ms']:.1f}",
         f"{r['server_mean_ttft_ms']:.1f}"] for r in rows])


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m loadgen.bench.client_cost",
                                description=__doc__.split("\n\n")[0],
                                formatter_class=DefaultsHelpFormatter)
    p.add_argument("--clients", nargs="+", choices=sorted(CLIENTS), default=["aiohttp", "httpx"])
    p.add_argument("--prompts", type=int, default=60, help="distinct prompts")
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--requests", type=int, default=960, help="timed requests per client and round")
    p.add_argument("--concurrency", type=int, default=32)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=None, help="JSON file of the rows (default: none)")
    p.add_argument("serve_flags", nargs="*", help="dasc-serve flags, after --")
    args = p.parse_args(argv)
    rng = random.Random(args.seed)
    with running_server(*args.serve_flags) as server:
        vocab = httpx.get(f"{server.base_url}/server_info", timeout=60).json()["vocab_size"]
        prompts = [random_ids(rng, args.prompt_len, (0, vocab)) for _ in range(args.prompts)]

        async def warm() -> None:
            async with make_client(server.base_url, 1) as client:
                await run_sequential(client, [Request(q) for q in prompts])

        asyncio.run(warm())
        requests = [Request(prompts[i % len(prompts)]) for i in range(args.requests)]
        rng.shuffle(requests)
        rows = []
        for round_ in range(args.rounds):
            for client in args.clients:
                row = {"round": round_, **measure(server.base_url, client, requests,
                                                   args.concurrency, server.proc.pid)}
                print(json.dumps(row), file=sys.stderr, flush=True)
                rows.append(row)
    print(markdown(rows))
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"command": " ".join(["python -m loadgen.bench.client_cost", *(argv or
                       sys.argv[1:])]), "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
