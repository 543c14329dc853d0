"""Schedule policies (scheduler/policy.py): fcfs keeps arrival order; lpm takes
the shortest remaining prefill first (hits before misses, the longest cached prefix first),
keeps misses' prefill out of a step of hits, and bounds how often a request can be passed.

Every plan runs on the FakeRanks of tests/support/fake_ranks.py, which checks rows, slots and
checkpoints symbolically, so a reordering that breaks the cache's books fails here too."""

from __future__ import annotations

import pytest
from support.scheduler_helpers import Loop, assert_drained, make, prompt_of, random_tokens

from scheduler.policy import SchedulePolicy, count_passes
from scheduler.request import Req
from scheduler.wire.serve_config import SchedulePolicyName, SchedulingConfig

POLICIES = list(SchedulePolicyName)

LPM = dict(schedule_policy="lpm", schedule_max_passes=1000)


def cached(loop: Loop, prompts: list[list[int]]) -> None:
    """Run each prompt once, so that its exact repeat hits one token before its end."""
    for i, p in enumerate(prompts):
        assert loop.add(f"warm{i}", p, 1) is None
    loop.run()


def first_step_of(loop: Loop, rid: str, since: int = 0) -> int:
    """Index (in loop.plans) of the first plan that gives ``rid`` a sequence."""
    for i, plan in enumerate(loop.plans[since:], since):
        if any(q.rid == rid for q in plan.seqs):
            return i
    raise AssertionError(f"{rid} never ran")


def policy_fields(name: str = "lpm", **kw) -> dict:
    """A scheduling config's policy fields."""
    return dict(schedule_policy=name, **kw)


def policy_scheduler(fields: dict, **kw):
    base = dict(checkpoint_interval=0, num_checkpoint_slots=16, max_total_tokens=2000,
                max_running_requests=8, chunked_prefill_size=64, **fields)
    base.update(kw)
    return make(**base)


@pytest.mark.parametrize("policy", POLICIES)
def test_a_hit_queued_behind_a_miss(policy):
    """fcfs: the miss that came first shares the hit's step.  lpm: the hit runs alone (its one
    token) and the miss prefills in the next step."""
    s = policy_scheduler(policy_fields(policy))
    loop = Loop(s, random_tokens())
    hot = prompt_of(30, seed=1)
    cached(loop, [hot])
    since = len(loop.plans)
    assert loop.add("miss", prompt_of(40, seed=2), 1) is None
    assert loop.add("hit", hot, 1) is None
    loop.run()
    hit_step, miss_step = first_step_of(loop, "hit", since), first_step_of(loop, "miss", since)
    assert loop.final("hit").cached_tokens == 29 and loop.final("miss").cached_tokens == 0
    if policy == "fcfs":
        assert hit_step == miss_step == since
        assert [q.rid for q in loop.plans[since].seqs] == ["miss", "hit"]
    else:
        assert [q.rid for q in loop.plans[since].seqs] == ["hit"]
        assert miss_step == since + 1
    assert_drained(s)


def test_lpm_longest_prefix_first_and_shortest_remaining_first():
    """Order only (no deferral): among the candidates of one step the shortest remaining
    prefill goes first, whatever the arrival order; equal remainders keep arrival order."""
    s = policy_scheduler(policy_fields("lpm", prefill_mix_ratio=0), chunked_prefill_size=512,
                         checkpoint_interval=8)
    loop = Loop(s, random_tokens())
    base = prompt_of(40, seed=3)
    cached(loop, [base])  # checkpoints at 8, 16, 24, 32 and 39
    since = len(loop.plans)
    tail = prompt_of(8, seed=4)
    prompts = {
        "miss": prompt_of(48, seed=5),  # 48 to go
        "short-hit": base[:17] + tail,  # hit at 16: 9 to go
        "long-hit": base + tail,  # hit at 40, where the warm request ended: 8 to go
        "repeat": base,  # hit at 39: 1 to go
        "twin": base,  # same remainder as "repeat", arrived later
    }
    for rid, p in prompts.items():
        assert loop.add(rid, p, 1) is None
    loop.run()
    plan = loop.plans[since]
    assert [q.rid for q in plan.seqs] == ["repeat", "twin", "long-hit", "short-hit", "miss"]
    assert [loop.final(r).cached_tokens for r in ("short-hit", "long-hit", "repeat")] == \
        [16, 40, 39]
    assert_drained(s)


def test_lpm_keeps_a_long_chunk_out_of_a_step_of_hits():
    """A request mid-prefill (its prompt is longer than the budget) yields the next step to a
    batch of hits, then resumes; fcfs would have given it the step's budget first."""
    s = policy_scheduler(LPM, chunked_prefill_size=32)
    loop = Loop(s, random_tokens())
    hot = [prompt_of(12, seed=10 + i) for i in range(4)]
    cached(loop, hot)
    since = len(loop.plans)
    assert loop.add("long", prompt_of(100, seed=6), 1) is None
    loop.step()  # the long prompt's first 32 tokens
    for i, p in enumerate(hot):
        assert loop.add(f"hit{i}", p, 3) is None
    plan = loop.step()
    assert sorted(q.rid for q in plan.seqs) == [f"hit{i}" for i in range(4)]
    assert all(len(q.token_ids) == 1 for q in plan.seqs)
    loop.run()
    long_plans = [p for p in loop.plans[since:] if any(q.rid == "long" for q in p.seqs)]
    assert sum(len(q.token_ids) for p in long_plans for q in p.seqs if q.rid == "long") == 100
    assert loop.final("long").finish_reason == "length"
    assert_drained(s)


def test_lpm_hits_fill_the_budget_before_a_miss_gets_any():
    """Within one step's budget the short remainders come first: eight hits take one token
    each even though a 200-token miss arrived before them and fcfs would spend the budget on
    it."""
    hot = [prompt_of(10, seed=20 + i) for i in range(8)]
    for policy in POLICIES:
        s = policy_scheduler(policy_fields(policy, schedule_max_passes=1000),
                             chunked_prefill_size=64, max_total_tokens=1000)
        loop = Loop(s, random_tokens())
        cached(loop, hot)
        assert loop.add("miss", prompt_of(200, seed=7), 1) is None
        for i, p in enumerate(hot):
            assert loop.add(f"hit{i}", p, 1) is None
        plan = loop.step()
        rids = {q.rid for q in plan.seqs}
        if policy == "fcfs":
            assert rids == {"miss"}  # 64 tokens of the miss, nothing left for the hits
        else:
            assert rids == {f"hit{i}" for i in range(8)}
        loop.run()
        assert_drained(s)


@pytest.mark.parametrize("schedule_max_passes", [0, 3, 7])
def test_lpm_bounds_how_often_a_miss_is_passed(schedule_max_passes):
    """A steady stream of hits (two new ones every step) would keep a miss waiting for ever
    under plain shortest-first; with the bound it runs once ``schedule_max_passes`` later
    arrivals have gone before it, and then first, ahead of that step's hits."""
    per_step = 2
    s = policy_scheduler(policy_fields("lpm", schedule_max_passes=schedule_max_passes),
                         max_running_requests=4, num_checkpoint_slots=80, max_total_tokens=4000)
    loop = Loop(s, random_tokens())
    hot = [prompt_of(12, seed=100 + i) for i in range(30)]
    cached(loop, hot)
    assert loop.add("miss", prompt_of(60, seed=8), 1) is None
    stream = iter(enumerate(hot))
    hits_before, miss_step = 0, None
    for step in range(14):
        for _ in range(per_step):
            i, p = next(stream)
            assert loop.add(f"hit{i}", p, 1) is None
        plan = loop.step()
        rids = [q.rid for q in plan.seqs]
        if "miss" in rids:
            miss_step = step
            assert rids[0] == "miss"  # overdue: ahead of the step's hits
            break
        hits_before += len(rids)
    assert miss_step is not None, "the miss starved"
    assert schedule_max_passes <= hits_before < schedule_max_passes + per_step
    loop.run()
    assert {loop.final(f"hit{i}").cached_tokens for i in range(i + 1)} == {11}  # all hits
    assert_drained(s)


def test_without_the_bound_the_miss_waits_for_the_whole_stream():
    """The same stream with an unreachable bound: the miss is deferred while hits keep coming
    (what the bound exists to stop), and still runs once they stop."""
    s = policy_scheduler(LPM, max_running_requests=4, num_checkpoint_slots=80,
                         max_total_tokens=4000)
    loop = Loop(s, random_tokens())
    hot = [prompt_of(12, seed=100 + i) for i in range(20)]
    cached(loop, hot)
    since = len(loop.plans)
    assert loop.add("miss", prompt_of(60, seed=8), 1) is None
    for i in range(0, 20, 2):
        for j in (i, i + 1):
            assert loop.add(f"hit{j}", hot[j], 1) is None
        assert "miss" not in {q.rid for q in loop.step().seqs}
    loop.run()
    assert first_step_of(loop, "miss", since) == since + 10
    assert s.waiting == type(s.waiting)() and loop.final("miss").cached_tokens == 0
    assert_drained(s)


def test_lpm_falls_back_to_arrival_order_when_a_request_cannot_be_admitted():
    """Admission stops at the first waiting request that does not fit (here: no free active
    slot), and admitted requests still prefill, so a full server never stalls."""
    s = policy_scheduler(LPM, max_running_requests=1, chunked_prefill_size=16)
    loop = Loop(s, random_tokens())
    hot = prompt_of(12, seed=30)
    cached(loop, [hot])
    assert loop.add("long", prompt_of(50, seed=9), 2) is None
    loop.step()
    assert loop.add("hit", hot, 1) is None  # shorter, but the one slot is taken
    plan = loop.step()
    assert [q.rid for q in plan.seqs] == ["long"]
    loop.run()
    assert loop.final("hit").cached_tokens == 11
    assert_drained(s)


def test_count_passes_counts_later_arrivals_served():
    reqs = [Req(f"r{i}", [1], None, 0, arrival=i) for i in range(5)]
    count_passes([reqs[0], reqs[2]], [reqs[1], reqs[3], reqs[4]])
    assert [r.num_passed for r in reqs] == [3, 0, 2, 0, 0]


def test_policy_order_puts_overdue_first_in_arrival_order():
    p = SchedulePolicy(SchedulingConfig(schedule_policy="lpm", schedule_max_passes=2))
    reqs = [Req(f"r{i}", [1] * (10 - i), None, 0, arrival=i) for i in range(4)]
    reqs[1].num_passed = reqs[0].num_passed = 2
    order = p.order([], reqs, lambda r: len(r.prompt))
    assert [r.rid for r in order] == ["r0", "r1", "r3", "r2"]
    assert [r.rid for r in SchedulePolicy(SchedulingConfig(schedule_policy="fcfs")).order(
        reqs[2:], reqs[:2], len)] == \
        ["r2", "r3", "r0", "r1"]
    assert p.defers(reqs[3], 17, 2) and not p.defers(reqs[3], 16, 2)
    assert not p.defers(reqs[0], 100, 1)  # overdue: never deferred
    with pytest.raises(ValueError, match="--schedule-policy must be one of fcfs, lpm, got 'sjf'"):
        SchedulingConfig(schedule_policy="sjf")


def test_flags_reach_the_scheduler_process():
    """dasc-serve's scheduling flags travel in the ServeConfig JSON the scheduler process
    reads; left out, they are the scheduling config's own defaults."""
    from dasc_server.flags import parse_args, serve_config
    from scheduler.__main__ import scheduler_args
    from scheduler.wire.rank_messages import RankInfo
    from scheduler.wire.serve_config import ServeConfig

    info = RankInfo("kimi_linear", 1, 64, None, 4096, 4, 100, 100, 0)

    def policy_of(*flags: str):
        sent = serve_config(parse_args(list(flags))).to_json()
        cfg, _ = scheduler_args(ServeConfig.from_json(sent), info)
        return (cfg.schedule_policy, cfg.schedule_max_passes, cfg.prefill_mix_ratio,
                cfg.decode_interleave, cfg.decode_first, cfg.checkpoint_eviction)

    assert policy_of("--schedule-policy", "fcfs", "--schedule-max-passes", "5",
                     "--prefill-mix-ratio", "4", "--decode-interleave", "6",
                     "--decode-first", "cost", "--checkpoint-eviction", "lru") == \
        ("fcfs", 5, 4.0, 6, "cost", "lru")
    assert policy_of() == ("lpm", 32, 8.0, 0, "off", "reuse")


@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("interleave", [0, 1, 4])
def test_decode_interleave_bounds_prefill_steps_among_decodes(policy, interleave):
    """While a request decodes, a step carries prefill only after ``interleave`` decode-only
    steps: a new prompt waits exactly that many steps (none once enough decode-only steps have
    run), its chunks come one step in interleave + 1, and both requests finish intact."""
    s = policy_scheduler(policy_fields(policy, decode_interleave=interleave),
                         chunked_prefill_size=8)
    loop = Loop(s, random_tokens())
    assert loop.add("long", prompt_of(8, seed=6), 40) is None
    loop.step()
    while s.running[0].is_prefilling:
        loop.step()
    for _ in range(2):  # two decode-only steps
        loop.step()
    assert loop.add("new", prompt_of(24, seed=7), 2) is None  # three chunks of 8
    since = len(loop.plans)
    loop.run()
    steps = [i for i, plan in enumerate(loop.plans[since:])
             if any(q.rid == "new" for q in plan.seqs)]
    chunks = steps[:3]  # new's prefill chunks; "long" decodes through all of them
    wait = max(0, interleave - 2)  # two decode-only steps already ran before "new" arrived
    assert chunks[0] == wait
    assert all(b - a == interleave + 1 for a, b in zip(chunks, chunks[1:]))
    for plan in loop.plans[since:]:
        assert any(q.rid == "long" for q in plan.seqs) or not s.running
    assert len(loop.output("long")) == 40 and len(loop.output("new")) == 2
    assert_drained(s)


def test_decode_interleave_never_delays_prefill_without_decodes():
    s = policy_scheduler(policy_fields("fcfs", decode_interleave=5), chunked_prefill_size=8)
    loop = Loop(s, random_tokens())
    assert loop.add("a", prompt_of(24, seed=8), 1) is None
    loop.run()
    # chunks of 8, back to back (the last snapshots the prompt-end checkpoint at 23)
    assert [[q.rid for q in p.seqs] for p in loop.plans if p.seqs] == [["a"]] * 3
    with pytest.raises(ValueError, match="--decode-interleave must be >= 0"):
        SchedulingConfig(decode_interleave=-1)
