"""Send a list of requests under a concurrency cap and an optional Poisson arrival rate.

A request starts once (1) its arrival time has come, (2) the request it ``depends_on`` has
finished and (3) fewer than ``concurrency`` requests are in flight.  The window's duration runs
from just before the first send to the end of the last request: the denominator of the
throughputs.
"""

from __future__ import annotations

import asyncio
import math
import random
import sys
import time
from dataclasses import dataclass, replace

import aiohttp
from tqdm import tqdm

from loadgen.stream import RequestResult, send_streaming
from loadgen.workload import Request


@dataclass(slots=True)
class Window:
    results: list[RequestResult]
    duration: float  # seconds


def arrival_offsets(n: int, request_rate: float, seed: int) -> list[float]:
    """Seconds after the window's start; all 0 for an infinite rate."""
    if math.isinf(request_rate):
        return [0.0] * n
    rng = random.Random(seed)
    t, out = 0.0, []
    for _ in range(n):
        out.append(t)
        t += rng.expovariate(request_rate)
    return out


async def run_window(client: aiohttp.ClientSession, requests: list[Request], concurrency: int,
                     model: str | None = None, request_rate: float = math.inf, seed: int = 0,
                     progress: Progress | None = None) -> Window:
    n = len(requests)
    finished = [asyncio.Event() for _ in range(n)]
    results: list[RequestResult | None] = [None] * n
    limit = asyncio.Semaphore(concurrency)
    offsets = arrival_offsets(n, request_rate, seed)
    start = time.perf_counter()

    sent = [r.prompt for r in requests]  # what each request sent (chat turns: grown at send)

    async def one(i: int) -> None:
        req = requests[i]
        delay = start + offsets[i] - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        if req.depends_on is not None:
            await finished[req.depends_on].wait()
        if req.extends_reply:
            before = results[req.depends_on]
            if not before.ok:
                results[i] = RequestResult(error="its previous turn failed", tags=dict(req.tags))
                finished[i].set()
                return
            sent[i] = sent[req.depends_on] + before.output_ids + req.prompt
            req = replace(req, prompt=sent[i], extends_reply=False)
        async with limit:
            results[i] = await send_streaming(client, req, model, start)
        finished[i].set()
        if progress is not None:
            progress.done(results[i])

    tasks = [asyncio.ensure_future(one(i)) for i in range(n)]
    try:
        await asyncio.gather(*tasks)
    finally:
        for t in tasks:
            t.cancel()
    return Window(results, time.perf_counter() - start)


async def run_sequential(client: aiohttp.ClientSession, requests: list[Request],
                         model: str | None = None) -> list[RequestResult]:
    """Warm-up: one at a time, in order, so each may hit the ones before it."""
    start = time.perf_counter()
    return [await send_streaming(client, r, model, start) for r in requests]


class Progress(tqdm):
    """tqdm on stderr that counts failed requests in its postfix."""

    def __init__(self, total: int, desc: str, enabled: bool = True):
        super().__init__(total=total, desc=desc, file=sys.stderr, disable=not enabled,
                         dynamic_ncols=True, leave=False)
        self.num_failed = 0

    def done(self, result: RequestResult) -> None:
        self.update(1)
        if not result.ok:
            self.num_failed += 1
            self.set_postfix(failed=self.num_failed)
