"""Logit controls at the scheduler: refused at ``add`` with a clear message when out of range,
sent once with a request's first sample otherwise."""

from __future__ import annotations

from support.scheduler_helpers import EOS, Loop, assert_drained, make, prompt_of, random_tokens

from scheduler.wire.messages import SamplingParams


def test_bad_logit_controls_are_refused_at_add_with_a_clear_message():
    import math
    import re

    s = make()
    bad = {
        "logit_bias token ids must lie in \\[0, 64\\), got 64": dict(logit_bias={64: 1.0}),
        "logit_bias token ids must lie in \\[0, 64\\), got -1": dict(logit_bias={-1: 1.0}),
        "logit_bias token ids must lie in \\[0, 64\\), got '5'": dict(logit_bias={"5": 1.0}),
        "logit_bias values must lie in \\[-100, 100\\], got 100.5 for 3":
            dict(logit_bias={3: 100.5}),
        "logit_bias values must lie in \\[-100, 100\\], got nan": dict(logit_bias={3: math.nan}),
        "logit_bias must map token ids": dict(logit_bias=[3], min_tokens=1),
        "presence_penalty must lie in \\[-2, 2\\], got 2.5": dict(presence_penalty=2.5),
        "frequency_penalty must lie in \\[-2, 2\\], got -3": dict(frequency_penalty=-3),
        "frequency_penalty must lie in \\[-2, 2\\], got inf": dict(frequency_penalty=math.inf),
        "repetition_penalty must be a number > 0, got 0": dict(repetition_penalty=0.0),
        "repetition_penalty must be a number > 0, got -1": dict(repetition_penalty=-1.0),
        "min_tokens must be at least 0, got -1": dict(min_tokens=-1),
        "min_tokens \\(5\\) must not exceed max_tokens \\(4\\)": dict(min_tokens=5),
    }
    for i, (message, kw) in enumerate(bad.items()):
        out = s.add(f"bad{i}", prompt_of(5), SamplingParams(max_tokens=4, **kw))
        assert out is not None and out.finish_reason == "error", kw
        assert re.search(message, out.error), (message, out.error)
    good = [dict(logit_bias={0: -100, 63: 100.0}), dict(presence_penalty=-2.0),
            dict(frequency_penalty=2), dict(repetition_penalty=0.01), dict(min_tokens=4)]
    for i, kw in enumerate(good):
        assert s.add(f"good{i}", prompt_of(5), SamplingParams(max_tokens=4, **kw)) is None
    assert not s.running and len(s.waiting) == len(good)


def test_logit_controls_travel_once_with_the_first_sample():
    s = make(chunked_prefill_size=8, eos_token_id=EOS)
    loop = Loop(s, random_tokens(1))
    prompt = [5, 9, 5, 11] * 5  # three prefill chunks
    loop.add("plain", prompt_of(6), 5)
    loop.add("ctl", prompt, 6, logit_bias={3: 2.5}, repetition_penalty=1.2, min_tokens=2,
             stop_token_ids=[4, 99], presence_penalty=0.5)
    loop.add("eos", prompt_of(7), 3, min_tokens=1, ignore_eos=True, frequency_penalty=1.0)
    loop.run()
    samples = {rid: [] for rid in ("plain", "ctl", "eos")}
    for plan in loop.plans:
        for q in plan.seqs:
            if q.sample is not None:
                samples[q.rid].append(q.sample)
    assert [len(v) for v in samples.values()] == [5, 6, 3]
    assert all(x.controls is None for x in samples["plain"])
    for rid in ("ctl", "eos"):
        assert samples[rid][0].index == 0 and samples[rid][0].controls is not None
        assert all(x.controls is None for x in samples[rid][1:])
    c = samples["ctl"][0].controls
    assert c.logit_bias == {3: 2.5} and c.repetition_penalty == 1.2 and c.min_tokens == 2
    assert c.presence_penalty == 0.5 and c.frequency_penalty == 0.0
    assert c.banned_ids == [4, EOS]  # 99 lies outside the vocabulary: never sampled anyway
    assert c.prompt_ids == [5, 9, 11]
    e = samples["eos"][0].controls
    assert e.banned_ids == [] and e.prompt_ids == []  # ignore_eos: EOS is not a stop
    assert_drained(s)
