"""Scheduler policy (scheduler/scheduler.py), targeted: hits and their lengths, checkpoint
stores, dasc-wr refresh plans, capacity pressure, aborts and refusals at ``add``.  Every plan runs
on the symbolic ranks (tests/support/fake_ranks.py)."""

from __future__ import annotations

import pytest
from support.fake_ranks import tree_ckpts
from support.scheduler_helpers import Loop, assert_drained, make, prompt_of, random_tokens, run_one

from scheduler.wire.messages import SamplingParams
from scheduler.wire.serve_config import LoadPolicy


@pytest.mark.parametrize("n", [2, 5, 21, 37])
def test_exact_repeat_hits_one_token_early_and_tail_of_one_is_sampled(n):
    s = make(checkpoint_interval=8)
    loop = Loop(s, random_tokens())
    prompt = prompt_of(n)
    run_one(loop, "a", prompt, 3)
    assert loop.final("a").cached_tokens == 0
    plan = run_one(loop, "b", prompt, 3)
    assert loop.final("b").cached_tokens == n - 1
    assert len(plan.loads) == 1
    (seq,) = plan.seqs  # SGLang #29633: a 1-token tail, sampled
    assert seq.token_ids == prompt[-1:] and seq.prefix_len == n - 1 and seq.sample is not None
    assert seq.rid == "b" and len(plan.tables["b"]) >= n
    assert_drained(s)


def test_prompt_shorter_than_the_interval_hits_on_repeat():
    s = make(checkpoint_interval=64)
    loop = Loop(s, random_tokens())
    prompt = prompt_of(6)
    run_one(loop, "a", prompt, 1)
    run_one(loop, "b", prompt, 1)
    assert loop.final("b").cached_tokens == len(prompt) - 1


@pytest.mark.parametrize("park", [True, False], ids=["parked", "checkpoint"])
def test_second_turn_hits_at_the_processed_length_of_the_first(park):
    """With ``park_finished`` the second turn adopts the first turn's own slot (no load, no
    refresh); without, it loads the checkpoint stored when the first turn finished."""
    s = make(checkpoint_interval=8, park_finished=park, load_policy=LoadPolicy.WR,
             refresh_window=6)
    loop = Loop(s, random_tokens(3))
    prompt = prompt_of(19)
    run_one(loop, "t1", prompt, 5)
    out1 = loop.output("t1")
    assert len(out1) == 5 and loop.final("t1").finish_reason == "length"
    turn2 = prompt + out1 + prompt_of(7, seed=9)
    plan = run_one(loop, "t2", turn2, 4)
    processed = len(prompt) + len(out1) - 1  # the last sampled token was never fed
    assert loop.final("t2").cached_tokens == processed
    assert len(plan.loads) == len(plan.refresh) == (0 if park else 1)
    assert plan.seqs[0].prefix_len == processed
    assert s.stats.parked_hits == (1 if park else 0)
    assert_drained(s)


@pytest.mark.parametrize("slots", [1, 2])
def test_a_parked_slot_serves_the_next_turn_until_an_admission_needs_it(slots):
    """One active slot: the unrelated request in between takes the parked slot (its state is
    zeroed by its own prefill), so the next turn falls back to the checkpoint.  Two: the
    parked slot survives and the next turn adopts it."""
    s = make(checkpoint_interval=8, max_running_requests=slots)
    loop = Loop(s, random_tokens(4))
    prompt = prompt_of(19)
    run_one(loop, "t1", prompt, 5)
    assert s.cache.num_parked == 1 and s.slots.num_free == slots - 1
    run_one(loop, "other", prompt_of(11, seed=5), 3)  # parks its own slot when it ends
    turn2 = prompt + loop.output("t1") + prompt_of(7, seed=9)
    plan = run_one(loop, "t2", turn2, 4)
    assert loop.final("t2").cached_tokens == len(prompt) + 5 - 1
    assert s.stats.parked_hits == slots - 1 and len(plan.loads) == 2 - slots
    assert s.cache.num_parked == min(slots, 2)  # the latest finished ones
    assert_drained(s)


def test_a_parked_slot_goes_back_when_its_kv_is_evicted():
    """KV pressure evicts the parked leaf: its slot returns to the free pool, nothing leaks."""
    s = make(checkpoint_interval=0, max_total_tokens=40, max_running_requests=2)
    loop = Loop(s, random_tokens(5))
    run_one(loop, "a", prompt_of(20), 4)
    assert s.cache.num_parked == 1
    run_one(loop, "b", prompt_of(30, seed=6), 4)  # needs rows the parked leaf holds
    assert s.cache.kv_pool.num_free + s.cache.num_cached_rows == s.cache.kv_pool.size
    assert s.cache.num_parked == 1 and s.slots.num_free == 1  # b's slot parked, a's freed
    assert_drained(s)


def test_every_checkpoint_store_is_counted():
    """The stores made when a request finishes (prompt + output) are counted too, so
    /v1/stats never shows fewer checkpoints stored than cached.  With no eviction the counter
    is the number of slots the ranks wrote and the tree holds."""
    s = make(num_checkpoint_slots=16, checkpoint_interval=8)
    loop = Loop(s, random_tokens())
    prompt = prompt_of(20)
    run_one(loop, "a", prompt, 4)  # prefill stores at 8, 16, 19; on finish at 23
    turn2 = prompt + loop.output("a") + prompt_of(5, seed=7)
    run_one(loop, "b", turn2, 3)  # hit at 23; stores at 24, 28; on finish at 31
    assert loop.final("b").cached_tokens == 23
    assert sum(len(p.stores_before) for p in loop.plans) == 2  # the finish stores
    assert s.cache.num_ckpt_evicted == 0
    assert s.stats.checkpoints_stored == loop.ranks.num_stores == s.cache.num_cached_ckpts \
        == 7
    assert_drained(s)


def test_shared_prefix_hits_at_the_interval_grid():
    """SGLang #28222: requests sharing a prefix hit at the last grid point inside it."""
    every = 8
    s = make(checkpoint_interval=every)
    loop = Loop(s, random_tokens())
    shared, tail_a, tail_b = prompt_of(29), prompt_of(11, seed=2), prompt_of(5, seed=3)
    assert tail_a[0] != tail_b[0]
    run_one(loop, "a", shared + tail_a, 2)
    run_one(loop, "b", shared + tail_b, 2)
    assert loop.final("b").cached_tokens == len(shared) // every * every


def test_no_prefix_cache_matches_and_stores_nothing():
    s = make(prefix_cache=False)
    loop = Loop(s, random_tokens())
    prompt = prompt_of(30)
    run_one(loop, "a", prompt, 3)
    run_one(loop, "b", prompt, 3)
    assert loop.final("b").cached_tokens == 0
    for plan in loop.plans:
        assert not plan.loads and not plan.stores_after and not plan.stores_before
    assert not s.cache.root.children and s.cache.ckpt_pool.num_free == s.limits.num_checkpoint_slots
    assert_drained(s)


@pytest.mark.parametrize("window,hit_len", [(4, 20), (50, 20), (1, 3)])
def test_wr_hit_plans_a_refresh_into_a_scratch_slot(window, hit_len):
    s = make(load_policy=LoadPolicy.WR, refresh_window=window, checkpoint_interval=0)
    loop = Loop(s, random_tokens())
    prompt = prompt_of(hit_len + 1)
    run_one(loop, "a", prompt, 1)
    plan = run_one(loop, "b", prompt, 2)
    (q,) = plan.refresh
    replay = min(window, hit_len)
    assert q.token_ids == prompt[hit_len - replay : hit_len] and q.prefix_len == hit_len - replay
    assert q.state_slot == plan.seqs[0].state_slot == plan.loads[0][1]
    assert plan.refresh_scratch[0] >= s.cfg.scratch_slot_base
    assert s.stats.loads_wr == 1 and s.stats.refresh_tokens == replay
    assert s.stats.loads(LoadPolicy.WR) == 1 and s.stats.loads(LoadPolicy.NR) == 0
    assert_drained(s)


@pytest.mark.parametrize("policy", [LoadPolicy.NR, LoadPolicy.WR])
def test_the_first_token_comes_in_the_step_that_stores_the_prompt_end(policy):
    """A miss, then a turn that extends it: each prompt's last chunk runs to its end, samples
    the first token, and stores its prompt-end checkpoint from the snapshot slot, in one step.
    A dasc-wr hit's replay and snapshot share one scratch slot."""
    s = make(load_policy=policy, refresh_window=8, checkpoint_interval=0,
             cache_finished=False, park_finished=False)
    loop = Loop(s, random_tokens())
    first = prompt_of(20)
    plan = run_one(loop, "a", first, 1)
    assert len([p for p in loop.plans if p.seqs]) == 1
    (q,) = plan.seqs
    assert (q.prefix_len, len(q.token_ids)) == (0, 20) and q.sample is not None
    ((cut, slot),) = q.snapshots
    assert cut == 19 and slot >= s.cfg.scratch_slot_base
    (ckpt,) = tree_ckpts(s)
    assert plan.stores_after == [(slot, ckpt)]
    assert s.cache.ckpt_at(first[:19]) is not None
    num_plans = len(loop.plans)
    plan = run_one(loop, "b", first + prompt_of(7, seed=2), 1)
    assert len([p for p in loop.plans[num_plans:] if p.seqs]) == 1
    (q,) = plan.seqs
    assert (q.prefix_len, len(q.token_ids)) == (19, 8) and q.sample is not None
    ((cut, slot),) = q.snapshots
    assert cut == 7
    if policy is LoadPolicy.WR:
        assert plan.refresh_scratch == [slot]
    assert [a for a, _ in plan.stores_after] == [slot]
    assert_drained(s)


def test_nr_plans_no_refresh():
    s = make(load_policy=LoadPolicy.NR, refresh_window=8)
    loop = Loop(s, random_tokens())
    run_one(loop, "a", prompt_of(20), 1)
    plan = run_one(loop, "b", prompt_of(20), 1)
    assert plan.loads and not plan.refresh and not plan.refresh_scratch
    assert s.stats.loads(LoadPolicy.NR) == 1 and s.stats.loads_wr == s.stats.refresh_tokens == 0


@pytest.mark.parametrize("pressure", ["slots", "rows", "ckpts"])
def test_more_requests_than_capacity_wait_and_all_finish(pressure):
    kw = {"slots": dict(max_running_requests=2),
          "rows": dict(max_total_tokens=60, max_running_requests=8),
          "ckpts": dict(num_checkpoint_slots=1, max_running_requests=8)}[pressure]
    s = make(**kw)
    loop = Loop(s, random_tokens())
    num = 12
    for i in range(num):
        assert loop.add(f"r{i}", prompt_of(13 + 3 * i, seed=i % 4)[: 50 - 8], 8) is None
    waited = waited_with_free_slot = False
    while s.has_work:
        assert loop.step() is not None
        assert len(s.running) <= s.cfg.max_running_requests
        waited |= bool(s.waiting)
        waited_with_free_slot |= bool(s.waiting) and s.slots.num_free > 0
    for i in range(num):
        assert loop.final(f"r{i}").finish_reason == "length"
    assert waited
    if pressure == "rows":
        assert waited_with_free_slot
    if pressure == "ckpts":
        assert s.cache.num_ckpt_evicted > 0
    assert_drained(s)


def test_consumed_checkpoint_survives_stores_planned_in_the_same_step():
    """One checkpoint slot: a hit locks it, so the store its own chunk wants gets nothing
    rather than evicting (and overwriting) the state being loaded in the same step."""
    s = make(num_checkpoint_slots=1, checkpoint_interval=0, cache_finished=False)
    loop = Loop(s, random_tokens())
    prompt = prompt_of(17)
    run_one(loop, "a", prompt, 1)
    (cached,) = tree_ckpts(s)
    assert s.cache.ckpt_at(prompt[:16]) == cached
    longer = prompt + prompt_of(9, seed=5)
    assert s.add("b", longer, SamplingParams(max_tokens=2)) is None
    plan = s.schedule()
    assert plan.loads == [(cached, plan.seqs[0].state_slot)]
    # the chunk runs through the new prompt-end boundary, but the only slot is being loaded:
    # no store, so no snapshot either
    assert plan.seqs[0].prefix_len + len(plan.seqs[0].token_ids) == len(longer)
    assert plan.seqs[0].snapshots == []
    assert plan.stores_after == []
    assert s.cache.ckpt_at(prompt[:16]) == cached
    s.check_integrity()


def test_abort_waiting_and_running_requests():
    s = make(max_running_requests=1, schedule_policy="fcfs")  # "run" first
    loop = Loop(s, random_tokens())
    loop.add("run", prompt_of(30), 5)
    loop.add("wait", prompt_of(12, seed=4), 5)
    loop.step()
    assert [r.rid for r in s.running] == ["run"] and [r.rid for r in s.waiting] == ["wait"]
    loop.abort("wait")  # asserts abort() is True, the request's reason "abort"
    loop.abort("run")
    assert set(loop.aborted) == {"wait", "run"} and not s.running and not s.waiting
    assert not loop.outs["wait"] and not any(o.finished for o in loop.outs["run"])
    assert s.abort("nobody") is False and s.abort("run") is False
    assert_drained(s)


def test_a_request_id_in_flight_is_refused_until_it_ends():
    s = make()
    loop = Loop(s, random_tokens())
    assert loop.add("a", prompt_of(9), 3) is None
    dup = s.add("a", prompt_of(5, seed=2), SamplingParams(max_tokens=2))  # would share
    # the outputs and the ranks' KV-row table
    assert dup.finished and dup.finish_reason == "error" and "already in flight" in dup.error
    loop.step()
    assert s.add("a", prompt_of(5), SamplingParams(max_tokens=2)).finish_reason == "error"
    loop.run()
    assert loop.add("a", prompt_of(5, seed=2), 2) is None  # ended: the id is free again
    loop.abort("a")
    assert loop.add("a", prompt_of(7, seed=3), 2) is None  # aborted while waiting: free too
    loop.run()
    assert_drained(s)


def test_requests_that_can_never_fit_are_refused_at_add():
    s = make(max_total_tokens=100, max_context_len=80, vocab_size=64)
    bad = {
        "empty": ([], 4),
        "vocab": ([1, 64], 4),
        "negative": ([1, -1], 4),
        "zero": ([1, 2], 0),
        "context": (prompt_of(78), 3),
    }
    for rid, (prompt, max_tokens) in bad.items():
        out = s.add(rid, prompt, SamplingParams(max_tokens=max_tokens))
        assert out is not None and out.finished and out.finish_reason == "error"
        assert out.error and out.rid == rid and out.token_ids == []
    s2 = make(max_total_tokens=50, max_context_len=4096)
    out = s2.add("rows", prompt_of(45), SamplingParams(max_tokens=6))
    assert out is not None and out.finish_reason == "error"
    assert not s.has_work and not s2.has_work
    assert s.add("ok", prompt_of(78), SamplingParams(max_tokens=2)) is None  # at the limit
