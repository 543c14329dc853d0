"""Prefixes shared in flight (scheduler/step_planner.py): requests that arrive together with one
system prompt wait for the first of them to prefill it, which stores a checkpoint where their
prompts part (under ``--checkpoint-admission all``: the interval point below it), and then
each prefills only its own suffix: the prefix is hit from its second sharer on.  The scheduler
runs against the symbolic ranks of tests/support/fake_ranks.py, with the integrity check after every
operation."""

from __future__ import annotations

import pytest
from support.fake_ranks import tree_ckpts
from support.scheduler_helpers import Loop, assert_drained, make, random_tokens

from scheduler.admission import MIN_BRANCH_GAIN
from scheduler.wire.serve_config import CheckpointAdmission

SYSTEM = [1 + i % 61 for i in range(100)]  # off the interval grid (64)


def users(n: int, suffix: int = 10) -> list[list[int]]:
    return [SYSTEM + [1 + (7 * u + i) % 63 for i in range(suffix)] for u in range(n)]


def scheduler(**kw):
    base = dict(max_total_tokens=2000, max_running_requests=4, num_checkpoint_slots=16,
                chunked_prefill_size=256, checkpoint_interval=64)
    return make(**{**base, **kw})


def prefill_tokens(loop: Loop) -> int:
    """Prompt tokens the ranks computed (one-token decode steps left out)."""
    return sum(len(q.token_ids) for p in loop.plans for q in p.seqs
               if q.prefix_len < len(loop.reqs[q.rid].prompt))


@pytest.mark.parametrize("admission", list(CheckpointAdmission))
def test_sharers_that_arrive_together_hit_from_the_second_on(admission):
    loop = Loop(scheduler(checkpoint_admission=admission), random_tokens())
    prompts = users(4)
    for i, p in enumerate(prompts):
        assert loop.add(f"u{i}", p, 4) is None
    loop.run()
    # `all` stores no branch point: the followers hit the leader's interval point (64)
    hit = 64 if admission == "all" else 100
    assert [loop.final(f"u{i}").cached_tokens for i in range(4)] == [0, hit, hit, hit]
    assert prefill_tokens(loop) == 110 + 3 * (110 - hit)
    assert any(len(path) == hit for path, _ in tree_ckpts(loop.s).values())
    assert_drained(loop.s)


def test_followers_wait_for_the_leader_and_leave_the_budget_to_it():
    loop = Loop(scheduler(), random_tokens())
    for i, p in enumerate(users(3)):
        loop.add(f"u{i}", p, 4)
    first = loop.step()
    assert [q.rid for q in first.seqs] == ["u0"]  # alone: it runs through its store points
    assert len(first.seqs[0].token_ids) == 110
    second = loop.step()
    assert {q.rid for q in second.seqs} >= {"u1", "u2"}
    assert all(q.prefix_len == 100 for q in second.seqs if q.rid != "u0")


def test_a_short_share_does_not_wait():
    loop = Loop(scheduler(), random_tokens())
    short = SYSTEM[: MIN_BRANCH_GAIN - 1]
    loop.add("a", short + [5] * 40, 4)
    loop.add("b", short + [6] * 40, 4)
    plan = loop.step()
    assert {q.rid for q in plan.seqs} == {"a", "b"}
    loop.run()
    assert loop.final("b").cached_tokens == 0
    assert_drained(loop.s)


def test_a_follower_goes_on_when_its_leader_is_aborted():
    loop = Loop(scheduler(chunked_prefill_size=32), random_tokens())
    for i, p in enumerate(users(2)):
        loop.add(f"u{i}", p, 4)
    loop.step()  # u0's first 32 tokens; u1 waits
    assert [r.rid for r in loop.s.waiting] == ["u1"]
    loop.abort("u0")
    loop.run()
    assert loop.final("u1").cached_tokens == 0
    assert_drained(loop.s)


def test_without_a_prefix_cache_nobody_waits():
    loop = Loop(scheduler(prefix_cache=False), random_tokens())
    for i, p in enumerate(users(3)):
        loop.add(f"u{i}", p, 4)
    plan = loop.step()
    assert {q.rid for q in plan.seqs} == {"u0", "u1", "u2"}
    loop.run()
    assert_drained(loop.s)
