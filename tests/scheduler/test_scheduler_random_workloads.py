"""Scheduler policy (scheduler/scheduler.py) under seeded random workloads: repeats, next
turns and shared prefixes, aborts and flushes, over configs that make KV rows, active slots and
checkpoint slots tight.  Every plan runs on the symbolic ranks (tests/support/fake_ranks.py)."""

from __future__ import annotations

import random

import pytest
from support.scheduler_helpers import EOS, Loop, assert_drained, make, make_tier

from scheduler.wire.serve_config import LoadPolicy

CONFIGS = [
    # KV rows, active slots and checkpoint slots all tight
    dict(max_total_tokens=260, max_running_requests=3, num_checkpoint_slots=6,
         chunked_prefill_size=24, checkpoint_interval=8),
    dict(max_total_tokens=400, max_running_requests=5, num_checkpoint_slots=3,
         chunked_prefill_size=64, checkpoint_interval=16),
    dict(max_total_tokens=300, max_running_requests=2, num_checkpoint_slots=12,
         chunked_prefill_size=7, checkpoint_interval=12, load_policy=LoadPolicy.WR,
         refresh_window=6),
    dict(max_total_tokens=500, max_running_requests=6, num_checkpoint_slots=1,
         chunked_prefill_size=40, checkpoint_interval=0),
    dict(max_total_tokens=200, max_running_requests=4, num_checkpoint_slots=5,
         chunked_prefill_size=16, checkpoint_interval=8, cache_finished=False),
    dict(max_total_tokens=300, max_running_requests=3, num_checkpoint_slots=4,
         chunked_prefill_size=24, checkpoint_interval=8, prefix_cache=False),
    # enough checkpoint slots that hits are common; KV rows still tight
    dict(max_total_tokens=330, max_running_requests=4, num_checkpoint_slots=24,
         chunked_prefill_size=32, checkpoint_interval=16),
    # lpm reorders admissions and defers chunks (scheduler/policy.py): the books still balance
    dict(max_total_tokens=330, max_running_requests=4, num_checkpoint_slots=24,
         chunked_prefill_size=32, checkpoint_interval=16, schedule_policy="lpm",
         schedule_max_passes=4),
    dict(max_total_tokens=260, max_running_requests=3, num_checkpoint_slots=6,
         chunked_prefill_size=24, checkpoint_interval=8, load_policy=LoadPolicy.WR,
         refresh_window=6,
         schedule_policy="lpm", schedule_max_passes=1000, prefill_mix_ratio=2),
    # checkpoint eviction by value (scheduler/radix_cache.py, checkpoint_eviction="reuse")
    dict(max_total_tokens=400, max_running_requests=5, num_checkpoint_slots=3,
         chunked_prefill_size=64, checkpoint_interval=16, checkpoint_eviction="reuse"),
    # checkpoint admission by likely reuse (scheduler/admission.py)
    dict(max_total_tokens=400, max_running_requests=4, num_checkpoint_slots=6,
         chunked_prefill_size=32, checkpoint_interval=8, checkpoint_admission="reuse"),
    # finished requests' slots are not parked: every hit loads a checkpoint
    dict(max_total_tokens=330, max_running_requests=4, num_checkpoint_slots=24,
         chunked_prefill_size=32, checkpoint_interval=16, park_finished=False,
         load_policy=LoadPolicy.WR, refresh_window=6),
]


# with a second cache tier (scheduler/cache_tier.py) behind a small pool; one fetch in five
# fails its checks on the ranks
TIER_CONFIGS = [
    dict(max_total_tokens=400, max_running_requests=4, num_checkpoint_slots=3,
         chunked_prefill_size=32, checkpoint_interval=16, park_finished=False,
         tier=dict(budget=3000, eviction="reuse")),
    dict(max_total_tokens=260, max_running_requests=3, num_checkpoint_slots=2,
         chunked_prefill_size=24, checkpoint_interval=8, load_policy=LoadPolicy.WR,
         refresh_window=6, tier=dict(budget=1500, eviction="lru")),
    dict(max_total_tokens=400, max_running_requests=4, num_checkpoint_slots=3,
         chunked_prefill_size=32, checkpoint_interval=16,
         tier=dict(budget=2000, eviction="reuse", host=True)),
]


@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("cfg", CONFIGS + TIER_CONFIGS,
                         ids=[f"cfg{i}" for i in range(len(CONFIGS))]
                         + [f"tier{i}" for i in range(len(TIER_CONFIGS))])
def test_random_workload(cfg, seed, tmp_path):
    run_workload(cfg, seed, tmp_path)


@pytest.mark.parametrize("cfg", TIER_CONFIGS, ids=[f"tier{i}" for i in range(len(TIER_CONFIGS))])
def test_the_tier_workloads_fetch(cfg, tmp_path):
    """The second tier's workloads reach its fetches: over the seeds above, each config fetches
    (one seed's sequence may evict nothing that is asked again)."""
    fetches = [run_workload(cfg, seed, tmp_path / str(seed)) for seed in range(3)]
    assert sum(fetches) > 0, fetches


def run_workload(cfg: dict, seed: int, directory) -> int:
    """One seeded workload under ``cfg``, its books checked; returns its second-tier fetches."""
    directory.mkdir(parents=True, exist_ok=True)
    index = (CONFIGS + TIER_CONFIGS).index(cfg)
    rng = random.Random(seed * 1000 + index)
    cfg = dict(cfg)
    tier = make_tier(directory, **cfg.pop("tier")) if "tier" in cfg else None
    s = make(tier, **cfg)

    def token_fn(q):
        return EOS if rng.random() < 0.08 else rng.randrange(1, 64)

    loop = Loop(s, token_fn, fetch_fails=lambda m: rng.random() < 0.2)
    limit = min(s.cfg.max_total_tokens, s.limits.max_context_len)
    bases = [[rng.randrange(1, 64) for _ in range(rng.randint(3, 70))] for _ in range(4)]
    num_reqs, added, done = 150, 0, {}
    for _ in range(20_000):
        if added < num_reqs and rng.random() < 0.35:
            for _ in range(min(rng.randint(1, 3), num_reqs - added)):
                kind = rng.random()
                if done and kind < 0.15:  # exact repeat
                    prompt = list(rng.choice(list(done.values())).prompt)
                else:
                    if done and kind < 0.4:  # next turn of a conversation, often a recent one
                        r = rng.choice(list(done.values())[-3:] if kind < 0.3 else
                                       list(done.values()))
                        prompt = r.prompt + r.output
                    else:  # shared prefix, cut anywhere
                        base = rng.choice(bases)
                        prompt = base[: rng.randint(1, len(base))]
                    prompt += [rng.randrange(1, 64) for _ in range(rng.randint(0, 30))]
                max_tokens = rng.randint(1, 12)
                prompt = prompt[: limit - max_tokens]
                out = loop.add(f"r{added}", prompt, max_tokens)
                assert out is None, out
                added += 1
        if rng.random() < 0.03 and loop.reqs:
            loop.abort(rng.choice(list(loop.reqs)))
        if rng.random() < 0.02 and s.running:
            loop.abort(rng.choice(s.running).rid)
        if rng.random() < 0.01:
            s.flush()
            s.check_integrity()
        if s.has_work:
            assert loop.step() is not None, "work left but nothing schedulable"
        for rid in list(loop.reqs):
            if loop.outs[rid] and loop.outs[rid][-1].finished:
                done[rid] = loop.reqs.pop(rid)
        assert len(s.running) <= s.cfg.max_running_requests
        if added == num_reqs and not s.has_work:
            break
    else:
        raise AssertionError("the workload did not drain")

    assert not loop.reqs
    reasons = set()
    for rid, r in done.items():
        last = loop.final(rid)
        assert last.finish_reason != "error"
        assert last.finish_reason == r.finish_reason
        reasons.add(last.finish_reason)
        assert loop.output(rid) == r.output and last.prompt_tokens == len(r.prompt)
        assert all(o.cached_tokens == r.hit_len for o in loop.outs[rid])
        assert r.hit_len <= len(r.prompt) - 1
        if r.finish_reason == "length":
            assert len(r.output) == r.sampling.max_tokens and EOS not in r.output
        elif r.finish_reason == "stop":
            assert r.output.index(EOS) == len(r.output) - 1
    assert reasons >= {"length", "stop"} and len(done) + len(loop.aborted) == num_reqs
    assert loop.aborted, "the workload aborted nothing"
    for rid, r in loop.aborted.items():  # no frame ends an aborted stream
        assert not any(o.finished for o in loop.outs[rid]) and loop.output(rid) == r.output
    stats = loop.ranks
    if s.cfg.prefix_cache:
        assert stats.num_stores > 0
        assert stats.num_loads > 0 or s.limits.num_checkpoint_slots == 1  # 1 slot: LRU churns
        if s.limits.load_policy is LoadPolicy.WR:
            assert stats.num_refresh == stats.num_loads
        # a hit adopts a parked slot (the fake ranks check it holds the hit's prefix) or loads
        if not (s.cfg.cache_finished and s.cfg.park_finished):
            assert s.stats.parked_hits == 0
        hits = sum(r.hit_len > 0 for r in [*done.values(), *loop.aborted.values()])
        assert s.stats.parked_hits + stats.num_loads == hits
        if tier is not None:
            assert tier.stats.fetches == stats.num_fetches
            assert tier.stats.evicted > 0
            loop.execute(s.spill_all())  # as at shutdown: the fake ranks check each spill
            assert not tier.has_pending
    else:
        assert stats.num_loads == stats.num_stores == 0 and s.stats.cached_tokens == 0
    assert_drained(s)
    return stats.num_fetches
