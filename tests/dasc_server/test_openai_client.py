"""OpenAI's request shapes beyond one prompt and one sample, against a real dasc-serve with the
official ``openai`` client: prompt batches (text and token-id lists, as lm-eval sends them),
``n`` samples with seeds derived per sample and the prompt prefilled once and shared through
the prefix cache, ``best_of``, OpenAI's choice numbering and usage sums, aborting every choice
when the client leaves, chat's default ``max_tokens`` (the rest of the context, bounded by the
KV pool) and OpenAI's error body on unknown routes.

The server runs with a small KV pool (``POOL`` rows), so a default-length request ends quickly
and shows the pool bound; every request here fits it.
"""

from __future__ import annotations

import json

import httpx
import openai
import pytest
from support.http_helpers import complete, post, stats, stream_chunks, wait_idle
from support.serving import KIMI, ids, running_server

MODEL_NAME = KIMI.name
POOL = 512  # --max-total-tokens: below the 8192-token context, so it is the bound


@pytest.fixture(scope="module")
def url():
    with running_server("--max-total-tokens", str(POOL)) as s:
        yield s.base_url


@pytest.fixture(scope="module")
def oai(url):
    with openai.OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0, timeout=60) as client:
        yield client


def token_ids(choice) -> list[int]:
    return choice.model_extra["token_ids"]


def sampled(url: str, prompt, seed: int | None, max_tokens: int = 12) -> list[int]:
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 1.0, "seed": seed,
            "ignore_eos": True, "return_token_ids": True}
    return complete(url, body)["choices"][0]["token_ids"]


# ---- prompt batches ----------------------------------------------------------------------------


@pytest.mark.parametrize("as_ids", [False, True], ids=["text", "token-ids"])
def test_prompt_batch_gives_one_choice_per_prompt_in_order(url, oai, as_ids):
    texts = ["The grass is green. The sky is", "Hello", "Counting: one, two, three,"]
    prompts = [ids(t) for t in texts] if as_ids else texts
    alone = [complete(url, {"prompt": p, "max_tokens": 10, "temperature": 0,
                            "return_token_ids": True})["choices"][0] for p in prompts]
    batch = oai.completions.create(model=MODEL_NAME, prompt=prompts, max_tokens=10,
                                   temperature=0, extra_body={"return_token_ids": True})
    assert [c.index for c in batch.choices] == [0, 1, 2]
    assert [c.text for c in batch.choices] == [a["text"] for a in alone]
    assert [token_ids(c) for c in batch.choices] == [a["token_ids"] for a in alone]
    assert [c.model_extra["prompt_token_ids"] for c in batch.choices] == [
        ids(t) for t in texts]
    usage = batch.usage
    assert usage.prompt_tokens == sum(len(ids(t)) for t in texts)
    assert usage.completion_tokens == sum(len(a["token_ids"]) for a in alone)
    assert usage.total_tokens == usage.prompt_tokens + usage.completion_tokens

    chunks = list(oai.completions.create(model=MODEL_NAME, prompt=prompts, max_tokens=10,
                                         temperature=0, stream=True,
                                         stream_options={"include_usage": True}))
    *deltas, last = chunks
    assert last.choices == [] and last.usage.completion_tokens == usage.completion_tokens
    texts_by_index: dict[int, str] = {}
    for chunk in deltas:
        assert len(chunk.choices) == 1
        c = chunk.choices[0]
        texts_by_index[c.index] = texts_by_index.get(c.index, "") + c.text
    assert texts_by_index == {i: a["text"] for i, a in enumerate(alone)}
    assert len({c.id for c in chunks}) == 1


def test_a_single_token_id_list_stays_one_prompt(oai):
    out = oai.completions.create(model=MODEL_NAME, prompt=ids("Hello there"), max_tokens=3,
                                 temperature=0)
    assert len(out.choices) == 1 and out.usage.prompt_tokens == len(ids("Hello there"))


# ---- n samples ---------------------------------------------------------------------------------


def test_n_samples_are_seeded_per_sample_and_numbered_prompt_major(url, oai):
    prompts = ["Facts to remember. The grass is", "Another prompt: "]
    out = oai.completions.create(model=MODEL_NAME, prompt=prompts, n=3, max_tokens=12,
                                 temperature=1.0, seed=7,
                                 extra_body={"ignore_eos": True, "return_token_ids": True})
    assert [c.index for c in out.choices] == list(range(6))
    got = [token_ids(c) for c in out.choices]
    # sample j of prompt i draws with seed 7 + j: the same as the lone request with that seed
    assert got == [sampled(url, p, 7 + j) for p in prompts for j in range(3)]
    assert len({tuple(g) for g in got}) == 6, "samples are not independent"
    assert [c.model_extra["prompt_token_ids"] for c in out.choices] == [
        ids(p) for p in prompts for _ in range(3)]
    usage = out.usage  # each prompt once, every sample's completion
    assert usage.prompt_tokens == sum(len(ids(p)) for p in prompts)
    assert usage.completion_tokens == 6 * 12
    unseeded = oai.completions.create(model=MODEL_NAME, prompt=prompts[0], n=3, max_tokens=12,
                                      extra_body={"ignore_eos": True, "return_token_ids": True})
    assert len({tuple(token_ids(c)) for c in unseeded.choices}) == 3


@pytest.mark.parametrize("stream", [False, True], ids=["json", "sse"])
def test_n_samples_prefill_the_prompt_once(url, stream):
    prompt = f"A prompt nobody sent before ({stream}), long enough to be worth sharing: " * 2
    n, prompt_len = 4, len(ids(prompt))
    before = wait_idle(url)["counters"]
    body = {"prompt": prompt, "n": n, "max_tokens": 6, "temperature": 1.0, "seed": 1,
            "ignore_eos": True, "return_token_ids": True}
    if stream:
        chunks = stream_chunks(url, body)
        assert {c["choices"][0]["index"] for c in chunks} == set(range(n))
    else:
        assert [c["index"] for c in complete(url, body)["choices"]] == list(range(n))
    after = wait_idle(url)["counters"]
    assert after["prompt_tokens"] - before["prompt_tokens"] == n * prompt_len
    # sample 0 prefills; the other n - 1 restore its checkpoint at prompt_len - 1
    assert after["cached_tokens"] - before["cached_tokens"] == (n - 1) * (prompt_len - 1)


def test_chat_n(oai):
    messages = [{"role": "user", "content": "Name a colour."}]
    out = oai.chat.completions.create(model=MODEL_NAME, messages=messages, n=3, max_tokens=8,
                                      temperature=1.0, seed=11,
                                      extra_body={"ignore_eos": True})
    assert [c.index for c in out.choices] == [0, 1, 2]
    assert all(c.message.role == "assistant" and c.finish_reason == "length"
               for c in out.choices)
    assert len({c.message.content for c in out.choices}) == 3
    assert out.usage.completion_tokens == 24
    chunks = list(oai.chat.completions.create(model=MODEL_NAME, messages=messages, n=3,
                                              max_tokens=8, temperature=1.0, seed=11,
                                              stream=True, extra_body={"ignore_eos": True}))
    contents: dict[int, str] = {}
    for chunk in chunks:
        c = chunk.choices[0]
        if c.index not in contents:
            assert c.delta.role == "assistant"  # each choice's first chunk carries the role
        contents[c.index] = contents.get(c.index, "") + (c.delta.content or "")
    assert contents == {c.index: c.message.content for c in out.choices}


def test_best_of_returns_the_n_likeliest_samples(url, oai):
    prompts = ["Best of: ", "Another best of: "]
    out = oai.completions.create(model=MODEL_NAME, prompt=prompts, n=2, best_of=4,
                                 max_tokens=8, temperature=1.0, seed=3,
                                 extra_body={"ignore_eos": True, "return_token_ids": True})
    assert [c.index for c in out.choices] == [0, 1, 2, 3]
    assert out.usage.completion_tokens == 2 * 4 * 8  # every sample drawn counts, as OpenAI's
    for i, prompt in enumerate(prompts):
        samples = []  # (mean log-probability, token ids) of each seed's lone answer
        for seed in range(3, 7):
            body = {"prompt": prompt, "max_tokens": 8, "temperature": 1.0, "seed": seed,
                    "ignore_eos": True, "return_token_ids": True, "logprobs": 0}
            choice = complete(url, body)["choices"][0]
            logprobs = choice["logprobs"]["token_logprobs"]
            samples.append((sum(logprobs) / len(logprobs), choice["token_ids"]))
        best = [ids_ for _, ids_ in sorted(samples, key=lambda s: -s[0])[:2]]
        assert [token_ids(c) for c in out.choices[2 * i:2 * i + 2]] == best
    same = oai.completions.create(model=MODEL_NAME, prompt="Hi", n=2, best_of=2, max_tokens=2)
    assert len(same.choices) == 2
    with pytest.raises(openai.BadRequestError) as info:
        oai.completions.create(model=MODEL_NAME, prompt="Hi", n=3, best_of=2, max_tokens=2)
    assert info.value.body["param"] == "best_of"


def test_leaving_a_stream_of_n_samples_aborts_every_one(url):
    before = wait_idle(url)["num_steps"]
    long = 400  # each sample reserves ~long rows of the pool: some wait for rows, some run
    body = {"prompt": [ids("Story one:"), ids("Story two:")], "n": 3, "max_tokens": long,
            "temperature": 1.0, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=60) as r:
        assert r.status_code == 200
        payloads = (line for line in r.iter_lines() if line.startswith("data: "))
        assert [json.loads(next(payloads)[6:])["choices"] for _ in range(3)]
    assert wait_idle(url)["num_steps"] - before < long // 2, "samples ran on"
    assert stats(url)["num_running"] == 0


def test_leaving_a_json_request_of_n_samples_aborts_every_one(url):
    before = wait_idle(url)["num_steps"]
    # Each sample reserves ~long rows of the pool, so they run one after another: ~4 * long
    # steps in all, which no machine finishes within the 0.5 s the client waits.
    long = 400
    body = {"prompt": "Long stories:", "n": 4, "max_tokens": long, "temperature": 1.0,
            "ignore_eos": True}
    with pytest.raises(httpx.ReadTimeout):
        post(url, "/v1/completions", body, timeout=httpx.Timeout(30, read=0.5))
    assert wait_idle(url)["num_steps"] - before < 4 * long // 2, "samples ran on"


# ---- defaults and errors -----------------------------------------------------------------------


def test_chat_default_max_tokens_is_the_rest_of_the_pool(oai):
    """No max_tokens: the rest of min(context, KV pool), which the scheduler accepts."""
    messages = [{"role": "user", "content": "Talk for as long as you can."}]
    out = oai.chat.completions.create(model=MODEL_NAME, messages=messages, temperature=0,
                                      extra_body={"ignore_eos": True})
    assert out.choices[0].finish_reason == "length"
    assert out.usage.completion_tokens == POOL - out.usage.prompt_tokens > 16
    with pytest.raises(openai.BadRequestError, match="pool"):
        oai.chat.completions.create(model=MODEL_NAME, messages=messages, max_tokens=POOL)


def test_unknown_routes_answer_like_openai(url, oai):
    with pytest.raises(openai.NotFoundError) as info:
        oai.embeddings.create(model=MODEL_NAME, input="hi")
    assert info.value.body == {"message": "Invalid URL (POST /v1/embeddings)",
                               "type": "invalid_request_error", "param": None, "code": None}
    with pytest.raises(openai.NotFoundError, match="Invalid URL"):
        oai.responses.create(model=MODEL_NAME, input="hi")
    r = httpx.get(url + "/v1/completions", timeout=30)
    assert r.status_code == 405 and r.headers["allow"] == "POST"
    assert set(r.json()["error"]) == {"message", "type", "param", "code"}
    r = httpx.get(url + "/nowhere", timeout=30)
    assert r.status_code == 404 and r.json()["error"]["message"] == "Invalid URL (GET /nowhere)"
    assert complete(url, {"prompt": "still there?", "max_tokens": 2})["choices"][0]["text"]


# ---- logit controls ----------------------------------------------------------------------------

def greedy(oai, prompt: str = "The sky is", max_tokens: int = 8, **extra) -> tuple[list, object]:
    out = oai.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=max_tokens,
                                 temperature=0, extra_body={"return_token_ids": True,
                                                            **extra.pop("extra_body", {})},
                                 **extra)
    return token_ids(out.choices[0]), out


def test_logit_bias_bans_and_forces_tokens(oai):
    plain, _ = greedy(oai, extra_body={"ignore_eos": True})
    banned, _ = greedy(oai, logit_bias={str(plain[0]): -100}, extra_body={"ignore_eos": True})
    assert banned[0] != plain[0]
    forced, _ = greedy(oai, logit_bias={"65": 100}, extra_body={"ignore_eos": True})
    assert forced == [65] * 8


def test_min_tokens_holds_eos_back(url, oai):
    eos = httpx.get(f"{url}/server_info", timeout=30).json()["eos_token_id"]
    ids_, out = greedy(oai, logit_bias={str(eos): 100})
    assert out.choices[0].finish_reason == "stop" and out.usage.completion_tokens <= 1
    ids_, out = greedy(oai, logit_bias={str(eos): 100}, extra_body={"min_tokens": 4})
    assert out.choices[0].finish_reason == "stop" and eos not in ids_[:4]
    assert out.usage.completion_tokens == 5  # four held back, then the forced EOS


def test_penalties_change_greedy_repetition(oai):
    plain, _ = greedy(oai, max_tokens=24, extra_body={"ignore_eos": True})
    assert len(set(plain)) < len(plain)  # the tiny model repeats itself
    for extra in ({"frequency_penalty": 2.0}, {"presence_penalty": 2.0},
                  {"extra_body": {"repetition_penalty": 3.0}}):
        body = dict(extra)
        body["extra_body"] = {"ignore_eos": True, **body.get("extra_body", {})}
        penalised, _ = greedy(oai, max_tokens=24, **body)
        assert penalised != plain, extra
        assert len(set(penalised)) > len(set(plain)), extra
