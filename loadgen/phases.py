"""The paper's controlled reuse-distance workload (appendix C.2) as a load-generator protocol.

A frozen dataset of D unique prompts (``dataset_seed``) runs through phases, one per capacity
boundary plus the full dataset.  A boundary with N checkpoint slots uses blocks of
Q = ceil(N / 0.85) prompts (a block overflows the cache by ~15 %): D // Q consecutive blocks
(the tail that fills no block is left out), or one block of all D prompts when Q > D.  Per
block:

    flush -> untimed fill (the block in dataset order) -> telemetry
          -> seeded shuffle -> timed replay -> telemetry        (x ``num_replays``)

The first (dense) boundary is replayed ``dense_replays`` times (6 in the paper) after its one
fill, the others once.  Only replay requests are summarised; the replay windows' summed
duration is the throughput denominator (eq. 9).  Boundary slot counts come from the server
(``/server_info``) or from the caller (the bench sizes every arm from the same list).
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass

import aiohttp

from loadgen.sender import Progress, Window, run_window
from loadgen.stream import RequestResult, ServerAdmin
from loadgen.summary import summarize
from loadgen.workload import Request, random_ids

FILL_FRACTION = 0.85


@dataclass(frozen=True, slots=True)
class Phase:
    name: str
    slots: int | None  # the boundary's checkpoint slots; None for the full dataset
    block_len: int  # prompts per block (Q)
    num_blocks: int
    num_replays: int

    @property
    def num_requests(self) -> int:
        return self.block_len * self.num_blocks * (1 + self.num_replays)


def block_len(num_slots: int, num_prompts: int) -> int:
    return min(math.ceil(num_slots / FILL_FRACTION), num_prompts)


def plan_phases(boundaries: list[tuple[str, int]], num_prompts: int, dense_replays: int = 6
                ) -> list[Phase]:
    """``boundaries``: (name, slots), the dense boundary first."""
    phases = []
    for i, (name, slots) in enumerate(boundaries):
        q = block_len(slots, num_prompts)
        phases.append(Phase(name, slots, q, num_prompts // q, dense_replays if i == 0 else 1))
    phases.append(Phase("full", None, num_prompts, 1, 1))
    return phases


def phase_dataset(num_prompts: int, prompt_len: int, token_range: tuple[int, int],
                  dataset_seed: int = 0) -> list[list[int]]:
    rng = random.Random(dataset_seed)
    return [random_ids(rng, prompt_len, token_range) for _ in range(num_prompts)]


def replay_order(n: int, seed: int, phase: str, block: int, replay: int) -> list[int]:
    order = list(range(n))
    random.Random(f"{seed}:{phase}:{block}:{replay}").shuffle(order)
    return order


@dataclass(slots=True)
class PhaseRun:
    results: list[RequestResult]  # replay requests only, tagged phase/block/replay/seed
    replay_s: float  # summed duration of the timed replay windows
    telemetry: list[dict]  # server counters after each fill and each replay
    phase_summaries: list[dict]


def _counter_delta(after: dict | None, before: dict | None) -> dict | None:
    if not after or not before:
        return None
    a, b = after.get("counters", {}), before.get("counters", {})
    delta = {k: a[k] - b.get(k, 0) for k in a}
    for k in ("num_steps", "step_s", "compute_s"):
        if k in after:
            delta[k] = after[k] - before.get(k, 0)
    return delta


async def run_phases(client: aiohttp.ClientSession, phases: list[Phase], dataset: list[list[int]],
                     seed: int, concurrency: int, model: str | None = None,
                     max_tokens: int = 1, show_progress: bool = True) -> PhaseRun:
    admin = ServerAdmin(client)
    total = sum(p.num_requests for p in phases)
    progress = Progress(total, f"phases seed {seed}", show_progress)
    out = PhaseRun([], 0.0, [], [])
    try:
        for phase in phases:
            phase_results, phase_s = [], 0.0
            for b in range(phase.num_blocks):
                block = dataset[b * phase.block_len:(b + 1) * phase.block_len]
                tags = {"phase": phase.name, "block": b, "seed": seed}
                await admin.flush()
                fill = [Request(p, max_tokens, tags=tags) for p in block]
                win = await run_window(client, fill, concurrency, model, progress=progress)
                _check_fill(win, phase.name, b)
                before = await admin.stats()
                out.telemetry.append({**tags, "step": "fill", "stats": before})
                for r in range(phase.num_replays):
                    order = replay_order(len(block), seed, phase.name, b, r)
                    reqs = [Request(block[i], max_tokens, tags={**tags, "replay": r,
                                                                "prompt": b * phase.block_len
                                                                + i}) for i in order]
                    win = await run_window(client, reqs, concurrency, model, progress=progress)
                    after = await admin.stats()
                    out.telemetry.append({**tags, "replay": r, "step": "replay",
                                          "duration": win.duration,
                                          "delta": _counter_delta(after, before)})
                    before = after
                    phase_results += win.results
                    phase_s += win.duration
            out.results += phase_results
            out.replay_s += phase_s
            out.phase_summaries.append(_phase_summary(phase, phase_results, phase_s))
    finally:
        progress.close()
    return out


def _check_fill(win: Window, phase: str, block: int) -> None:
    """A failed fill request would silently lower every arm's hit rate: stop instead."""
    failed = [r.error for r in win.results if not r.ok]
    if failed:
        raise RuntimeError(f"{len(failed)} fill request(s) failed in phase {phase} block "
                           f"{block}: {failed[0]}")


def _phase_summary(phase: Phase, results: list[RequestResult], duration: float) -> dict:
    s = summarize(results, duration)
    keep = ("completed", "failed", "duration", "total_input_tokens", "input_throughput",
            "cache_hit_rate", "mean_ttft_ms", "median_ttft_ms", "p90_ttft_ms")
    return {"phase": phase.name, "slots": phase.slots, "block_len": phase.block_len,
            "num_blocks": phase.num_blocks, "num_replays": phase.num_replays,
            **{k: s[k] for k in keep}}
