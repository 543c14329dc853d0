"""Log probabilities as OpenAI shapes them, through the official ``openai`` client against a real
dasc-serve: completions' ``logprobs`` k (token texts, their logprobs, text -> logprob maps of the
k likeliest tokens and the sampled one, text offsets) and chat's ``logprobs`` /
``top_logprobs`` (``content`` entries with bytes and alternatives), JSON and streamed."""

from __future__ import annotations

import openai
import pytest
from support.logprob_helpers import joined_logprobs, text_of
from support.serving import KIMI, running_server

from dasc_server.tokenizer import TextOffsets

MODEL_NAME = KIMI.name
PROMPT = "The grass is green. The sky is"


@pytest.fixture(scope="module")
def oai():
    with running_server("--max-total-tokens", "512") as s, openai.OpenAI(
            base_url=f"{s.base_url}/v1", api_key="x", max_retries=0, timeout=60) as client:
        yield client


def complete(oai, stream: bool = False, **kwargs):
    args = {"model": MODEL_NAME, "prompt": PROMPT, "max_tokens": 10, "temperature": 0,
            "extra_body": {"ignore_eos": True, "return_token_ids": True}, **kwargs}
    return oai.completions.create(stream=stream, **args)


@pytest.mark.parametrize("k", [0, 1, 5, 20])
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_completion_top_logprobs(oai, k, temperature):
    choice = complete(oai, logprobs=k, temperature=temperature, seed=5).choices[0]
    ids, lp = choice.model_extra["token_ids"], choice.logprobs
    assert lp.tokens == [text_of(t) for t in ids]
    assert len(lp.token_logprobs) == len(ids) == len(lp.top_logprobs) == 10
    for token, logprob, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
        assert logprob <= 0 and all(v <= 0 for v in top.values())
        assert max(k, 1) <= len(top) <= k + 1  # the k likeliest, and the sampled one
        assert list(top.values()) == sorted(top.values(), reverse=True)
        assert top[token] == logprob  # the same number, from the same distribution
        if temperature == 0:
            assert next(iter(top)) == token  # greedy: the top-1
    assert lp.text_offset[0] == 0
    assert all(b >= a for a, b in zip(lp.text_offset, lp.text_offset[1:]))
    seeded = complete(oai, temperature=temperature, seed=5).choices[0]
    assert seeded.model_extra["token_ids"] == ids  # logprobs change no sampled token
    assert seeded.logprobs is None


def test_completion_logprobs_stream_as_json(oai):
    whole = complete(oai, logprobs=3, temperature=1.0, seed=2).choices[0].logprobs
    streamed = joined_logprobs(complete(oai, stream=True, logprobs=3, temperature=1.0, seed=2))
    assert streamed == (whole.tokens, whole.token_logprobs, whole.top_logprobs,
                        whole.text_offset)


def test_text_offsets_count_characters():
    offsets = TextOffsets()
    pieces = [b"a", "é".encode()[:1], "é".encode()[1:], b"b"]
    assert [offsets.step(p) for p in pieces] == [0, 1, 1, 2]


def chat(oai, stream: bool = False, **kwargs):
    return oai.chat.completions.create(
        model=MODEL_NAME, messages=[{"role": "user", "content": "Name a colour."}],
        max_tokens=8, temperature=0, stream=stream, extra_body={"ignore_eos": True}, **kwargs)


@pytest.mark.parametrize("k", [0, 3])
def test_chat_logprobs(oai, k):
    choice = chat(oai, logprobs=True, top_logprobs=k).choices[0]
    content = choice.logprobs.content
    assert len(content) == 8
    for entry in content:
        assert entry.logprob <= 0 and bytes(entry.bytes).decode(errors="replace")
        assert len(entry.top_logprobs) == k
        values = [alt.logprob for alt in entry.top_logprobs]
        assert values == sorted(values, reverse=True) and all(v <= 0 for v in values)
        if k:
            assert entry.top_logprobs[0].token == entry.token  # greedy: the top-1
            assert entry.top_logprobs[0].logprob == entry.logprob
    if all(entry.token != "<eos>" for entry in content):
        assert b"".join(bytes(e.bytes) for e in content).decode() == choice.message.content
    assert chat(oai).choices[0].logprobs is None
    streamed = []
    for chunk in chat(oai, stream=True, logprobs=True, top_logprobs=k):
        if chunk.choices and chunk.choices[0].logprobs is not None:
            streamed += chunk.choices[0].logprobs.content
    assert_same_logprobs(streamed, content)


def assert_same_logprobs(got, want) -> None:
    """Same tokens, bytes and alternatives; logprobs within 1e-5.  The first call prefilled
    the prompt and the later ones hit its checkpoint, so the prompt's last token ran inside
    its prefill chunk once and in a step of its own after: GEMMs over other row counts, which
    round differently (measured: 1.2e-6)."""
    def tokens(entries):
        return [(e.token, e.bytes, [(a.token, a.bytes) for a in e.top_logprobs]) for e in entries]

    def values(entries):
        return [[e.logprob] + [a.logprob for a in e.top_logprobs] for e in entries]

    assert tokens(got) == tokens(want)
    for g, w in zip(values(got), values(want), strict=True):
        assert g == pytest.approx(w, abs=1e-5)


@pytest.mark.parametrize("kwargs,param", [
    ({"logprobs": 21}, "logprobs"), ({"logprobs": 1, "echo": "yes"}, "echo")])
def test_refused_logprobs_name_the_param(oai, kwargs, param):
    with pytest.raises(openai.BadRequestError) as info:
        complete(oai, **kwargs)
    assert info.value.body["param"] == param
