"""Decode first (``--decode-first cost``, scheduler/step_costs.py): a step defers its prefill
while the running decodes, finished first, delay the waiting prompts less than the prefill
would delay the decodes, by the ranks' step times; a prompt never waits as long as its own
prefill takes, and nothing is deferred before both times have been measured.

The plans run on tests/support/fake_ranks.py (rows, slots and checkpoints checked
symbolically), with step times from a cost model: ``DECODE_S`` a step plus ``TOKEN_S`` per
prefill token."""

from __future__ import annotations

from collections.abc import Callable

import pytest
from support.scheduler_helpers import Loop, assert_drained, make, prompt_of, random_tokens

from scheduler.step_costs import MIN_SAMPLE_TOKENS, StepCosts
from scheduler.wire.rank_messages import BatchPlan
from scheduler.wire.serve_config import SchedulingConfig

DECODE_S, TOKEN_S = 0.010, 0.002  # a CPU-like ratio: a prefill token costs a fifth of a step


def test_costs_average_decode_steps_and_prefill_tokens_beyond_them():
    c = StepCosts()
    c.observe(1, 64, 1.0)  # no decode step seen yet: a token's cost is unknown
    assert c.decode_s is None and c.token_s is None
    c.observe(0, 0, 5.0)  # checkpoint stores alone: ignored
    c.observe(2, 0, 0.010)
    c.observe(2, 0, 0.014)
    assert c.decode_s == pytest.approx(0.011)
    c.observe(3, MIN_SAMPLE_TOKENS - 1, 9.0)  # too few prefill tokens to say anything
    assert c.token_s is None
    c.observe(3, 100, 0.011 + 0.2)
    assert c.token_s == pytest.approx(0.002)
    c.observe(3, 100, 0.001)  # faster than a decode step: the token costs nothing, not < 0
    assert c.token_s == pytest.approx(0.0015)


@pytest.mark.parametrize(("decoding", "left", "waiting", "tokens", "defers"), [
    (1, 10, 1, 400, True),  # waits 0.1 s, saves the decode 0.8 s
    (1, 400, 1, 400, False),  # would wait 4 s for a 0.8 s prefill
    (8, 100, 1, 400, False),  # 8 x 0.8 s outweighs 1 s, but 1 s is longer than the prefill
    (1, 10, 9, 400, False),  # nine prompts x 0.1 s outweigh one decode x 0.8 s
    (4, 10, 9, 400, True),
    (1, 10, 1, 40, False),  # 0.08 s of prefill is shorter than the 0.1 s wait
    (0, 10, 1, 400, False),
    (1, 10, 0, 400, False),
])
def test_defers_by_total_delay_and_never_longer_than_the_prefill(decoding, left, waiting,
                                                                  tokens, defers):
    c = StepCosts(decode_s=DECODE_S, token_s=TOKEN_S)
    assert c.defers(decoding, left, waiting, tokens) is defers
    assert StepCosts().defers(decoding, left, waiting, tokens) is False  # nothing measured


def step_s(loop: Loop) -> Callable[[BatchPlan], float]:
    """The cost model over a plan: prefill tokens are those of sequences still in their
    prompt (the loop's requests, looked up by rid)."""
    def cost(plan: BatchPlan) -> float:
        tokens = sum(len(q.token_ids) for q in plan.seqs
                     if q.prefix_len < len(loop.reqs[q.rid].prompt))
        return (DECODE_S if plan.seqs else 0.0) + TOKEN_S * tokens
    return cost


def decoding_loop(decode_first: str, max_tokens: int, measured: bool = True):
    """A loop where request "a" decodes with ``max_tokens`` to sample and, if ``measured``,
    the scheduler has seen decode-only steps and a prefill step of 64 tokens."""
    s = make(max_total_tokens=4000, chunked_prefill_size=512, checkpoint_interval=0,
             schedule_policy="lpm", decode_first=decode_first)
    loop = Loop(s, random_tokens())
    loop.step_s = step_s(loop)
    assert loop.add("a", prompt_of(8, seed=1), max_tokens) is None
    loop.step()
    if measured:
        loop.step()
        assert loop.add("warm", prompt_of(64, seed=2), 1) is None  # 64 tokens beside "a"
        loop.step()
        assert s.planner.costs.token_s == pytest.approx(TOKEN_S)
        loop.step()
        assert s.planner.costs.decode_s == pytest.approx(DECODE_S)
    return s, loop


def steps_with(loop: Loop, rid: str, since: int) -> list[int]:
    return [i for i, p in enumerate(loop.plans[since:], since) if any(q.rid == rid for q in p.seqs)]


def test_a_long_prompt_waits_for_a_short_answer_to_finish():
    s, loop = decoding_loop("cost", max_tokens=16)
    left = 16 - len(loop.output("a"))
    assert 0 < left * DECODE_S < 400 * TOKEN_S
    assert loop.add("big", prompt_of(400, seed=3), 2) is None
    since = len(loop.plans)
    loop.run()
    a_steps, big_steps = steps_with(loop, "a", since), steps_with(loop, "big", since)
    assert len(a_steps) == left and big_steps[0] == a_steps[-1] + 1  # right after a's last
    assert len(loop.output("a")) == 16 and len(loop.output("big")) == 2
    assert_drained(s)


@pytest.mark.parametrize(("decode_first", "max_tokens", "prompt_len", "measured"), [
    ("off", 16, 400, True),  # never deferred
    ("cost", 400, 400, True),  # "a" would keep "big" waiting longer than its prefill takes
    ("cost", 16, 40, True),  # a short prompt: its prefill costs "a" less than the wait
    ("cost", 16, 400, False),  # no prefill step measured yet
])
def test_the_prompt_joins_the_next_step(decode_first, max_tokens, prompt_len, measured):
    s, loop = decoding_loop(decode_first, max_tokens, measured)
    assert loop.add("new", prompt_of(prompt_len, seed=3), 2) is None
    since = len(loop.plans)
    loop.run()
    assert steps_with(loop, "new", since)[0] == since
    assert steps_with(loop, "a", since)[0] == since  # sharing it with a's decode
    assert len(loop.output("a")) == max_tokens and len(loop.output("new")) == 2
    assert_drained(s)


def test_a_decode_first_policy_must_be_known():
    with pytest.raises(ValueError, match="--decode-first must be one of off, cost, got 'always'"):
        SchedulingConfig(decode_first="always")
