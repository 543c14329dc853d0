"""More concurrent requests than active slots, checkpoint slots and KV rows: requests wait, the
cache evicts, and every request still gets the tokens it gets alone; afterwards the books
balance (free + cached = total) and the integrity check holds.  Which pool evicts first under
concurrency depends on arrival order, so a short sequential tail forces KV eviction."""

from __future__ import annotations

import random
from concurrent.futures import ThreadPoolExecutor

from support.serving import KIMI, running_server
from support.serving_reference import Reference

NUM_REQUESTS = 24


def workload(seed: int) -> list[tuple[list[int], int]]:
    """Families of prompts sharing prefixes, lengths that are no multiple of anything."""
    rng = random.Random(seed)
    stems = [list(f"Note {i}: the code word is {rng.randrange(10**5):05d}. ".encode())
             for i in range(4)]
    out = []
    for _ in range(NUM_REQUESTS):
        stem = rng.choice(stems)
        tail = list(f"Query {rng.randrange(100)} asks about it{'?' * rng.randrange(1, 40)}"
                    .encode())
        out.append((stem * rng.randrange(1, 3) + tail, rng.randrange(2, 7)))
    return out


def test_overload_waits_evicts_and_stays_exact():
    ref = Reference(KIMI)
    flags = ["--max-running-requests", "3", "--checkpoint-slots", "8", "--max-total-tokens",
             "400", "--checkpoint-interval", "16", "--chunked-prefill-size", "64"]
    with running_server("--model", str(KIMI), *flags) as server:
        jobs = workload(7)
        expected = [ref.engine.generate([p], n)[0] for p, n in jobs]

        def send(job):
            prompt, n = job
            return server.complete(prompt, max_tokens=n, ignore_eos=True)

        with ThreadPoolExecutor(NUM_REQUESTS) as pool:
            bodies = list(pool.map(send, jobs))
        for body, want in zip(bodies, expected):
            assert body["choices"][0]["token_ids"] == want
        # Two distinct 250-token prompts one after another: the first stays cached (its leaf
        # holds the newest checkpoint) and the second needs 250 of the 400 rows, so KV rows
        # must be evicted whatever the concurrent phase left behind.
        for i in range(2):
            prompt = (list(f"Distinct text {i}: ".encode()) * 16)[:250]
            got = server.complete(prompt, max_tokens=1)
            assert got["choices"][0]["token_ids"] == ref.engine.generate([prompt], 1)[0]
        stats = server.stats()
    assert stats["integrity"] == "ok"
    assert stats["num_running"] == stats["num_waiting"] == 0
    assert stats["kv_rows_free"] + stats["kv_rows_cached"] == stats["kv_rows_total"]
    assert (stats["checkpoint_slots_free"] + stats["checkpoint_slots_cached"]
            == stats["checkpoint_slots_total"])
    counters = stats["counters"]
    assert counters["cached_tokens"] > 0  # the cache was used under pressure...
    assert counters["checkpoints_evicted"] > 0 and counters["kv_evicted_rows"] > 0  # ...and full
