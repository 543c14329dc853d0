"""The HTTP API of a real dasc-serve as clients meet it: the official ``openai`` client unchanged,
the raw SSE wire format, incremental UTF-8 detokenisation, stop strings, seeded sampling, the admin
routes and client disconnects (bad requests: ``test_server_errors.py``; a model folder without
a tokenizer: ``test_server_tokenizerless.py``).

Whenever a request ends early (stop string, client gone) the scheduler must abort the rest: it
goes idle within a bounded wait, having run far fewer steps than the request asked for, with a
passing integrity check and every pool row / checkpoint slot either free or cached.
"""

from __future__ import annotations

import json
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest
from safetensors import safe_open
from support.http_helpers import cached_tokens, complete, post, stream_chunks, wait_idle
from support.serving import EOS, KIMI, ids

from model_runner.generate import load_tokenizer

MODEL_NAME = KIMI.name  # the default model, served under its folder name
VOCAB_SIZE, MAX_CONTEXT = 264, 8192
REPLACEMENT_CHAR = "\ufffd"
LONG = 4000  # max_tokens of requests that must end early: a full run takes ~LONG steps


@pytest.fixture(scope="module")
def url(default_server) -> str:
    return default_server.base_url


@pytest.fixture(scope="module")
def oai(url):
    with openai.OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0, timeout=60) as client:
        yield client


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer(KIMI)


# ---- the official openai client ----------------------------------------------------------------


def test_openai_models_list(oai):
    assert [m.id for m in oai.models.list().data] == [MODEL_NAME]


def test_openai_completions(oai, tokenizer):
    prompt = "The grass is green. The sky is"
    full = oai.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=12, temperature=0,
                                  extra_body={"return_token_ids": True})
    choice = full.choices[0]
    token_ids = choice.model_extra["token_ids"]
    assert choice.text and choice.text == tokenizer.decode(token_ids, skip_special_tokens=True)
    assert choice.model_extra["prompt_token_ids"] == ids(prompt)
    usage = full.usage
    assert usage.completion_tokens == len(token_ids) and 1 <= len(token_ids) <= 12
    assert usage.prompt_tokens == len(ids(prompt))
    assert usage.total_tokens == usage.prompt_tokens + usage.completion_tokens

    chunks = list(oai.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=12,
                                         temperature=0, stream=True,
                                         stream_options={"include_usage": True}))
    *texts, last = chunks
    assert last.choices == [] and last.usage is not None
    assert "".join(c.choices[0].text for c in texts) == choice.text
    assert texts[-1].choices[0].finish_reason == choice.finish_reason
    assert last.usage.completion_tokens == usage.completion_tokens
    assert last.usage.prompt_tokens_details.cached_tokens > 0  # the same prompt again


def test_openai_chat_completions(oai):
    messages = [{"role": "system", "content": "Be brief."},
                {"role": "user", "content": "What colour is the sky?"}]
    full = oai.chat.completions.create(model=MODEL_NAME, messages=messages, max_tokens=12,
                                       temperature=0, extra_body={"ignore_eos": True})
    message = full.choices[0].message
    assert message.role == "assistant" and message.content
    assert full.choices[0].finish_reason == "length" and full.usage.completion_tokens == 12

    chunks = list(oai.chat.completions.create(model=MODEL_NAME, messages=messages,
                                              max_tokens=12, temperature=0, stream=True,
                                              extra_body={"ignore_eos": True},
                                              stream_options={"include_usage": True}))
    *deltas, last = chunks
    assert deltas[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in deltas) == message.content
    assert deltas[-1].choices[0].finish_reason == "length"
    assert last.choices == [] and last.usage.completion_tokens == 12
    assert last.usage.prompt_tokens == full.usage.prompt_tokens
    assert last.usage.prompt_tokens_details.cached_tokens > 0


def test_openai_errors_become_its_exceptions(oai):
    with pytest.raises(openai.BadRequestError, match="outside the vocabulary"):
        oai.completions.create(model=MODEL_NAME, prompt=[65, 300], max_tokens=2)
    with pytest.raises(openai.NotFoundError, match="no-such-model"):
        oai.chat.completions.create(model="no-such-model", max_tokens=2,
                                    messages=[{"role": "user", "content": "hi"}])
    with pytest.raises(openai.BadRequestError, match="max_tokens"):
        oai.completions.create(model=MODEL_NAME, prompt="a", max_tokens=0, stream=True)


# ---- the wire format ---------------------------------------------------------------------------


@pytest.mark.parametrize("path,prompt", [
    ("/v1/completions", {"prompt": "Here we go.\nvalue of kqzvb:"}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Name a colour."}]}),
], ids=["completions", "chat"])
def test_sse_frames_and_stream_equals_json(url, path, prompt):
    body = {**prompt, "max_tokens": 24, "temperature": 0, "return_token_ids": True}
    whole = complete(url, body, path)["choices"][0]
    chunks = stream_chunks(url, {**body, "stream_options": {"include_usage": True}}, path)
    *deltas, usage = chunks
    assert usage["choices"] == [] and usage["usage"]["completion_tokens"] == len(
        whole["token_ids"])
    assert all(len(c["choices"]) == 1 for c in deltas)
    choices = [c["choices"][0] for c in deltas]
    assert [c["finish_reason"] for c in choices[:-1]] == [None] * (len(choices) - 1)
    assert choices[-1]["finish_reason"] == whole["finish_reason"]
    assert choices[0]["prompt_token_ids"] == whole["prompt_token_ids"]
    assert sum((c["token_ids"] for c in choices), []) == whole["token_ids"]
    if "messages" in prompt:
        text = "".join(c["delta"].get("content", "") for c in choices)
        assert choices[0]["delta"]["role"] == "assistant"
        assert text == whole["message"]["content"]
    else:
        assert "".join(c["text"] for c in choices) == whole["text"]
    assert len({c["id"] for c in chunks}) == 1


def test_stream_without_usage_option_has_no_usage_frame(url):
    chunks = stream_chunks(url, {"prompt": "Hello", "max_tokens": 4, "temperature": 0})
    assert all(c["choices"] and "usage" not in c for c in chunks)


def test_streamed_text_is_the_decode_of_the_streamed_ids(url, tokenizer):
    """Near-uniform sampling emits arbitrary bytes: lone continuation bytes, split multi-byte
    characters, special ids.  Text may only leave once final, so the concatenated deltas equal
    one decode of all ids, and a delta shows U+FFFD only if the whole decode has one."""
    saw_split_char = False
    prompts = [ids("héllo wörld, 日本語: "), ids("日本")[:-1]]  # the second ends mid-character
    for seed in range(4):
        body = {"prompt": prompts[seed % 2], "max_tokens": 160, "temperature": 100.0,
                "seed": seed, "ignore_eos": True, "return_token_ids": True}
        choices = [c["choices"][0] for c in stream_chunks(url, body)]
        token_ids = sum((c["token_ids"] for c in choices), [])
        assert len(token_ids) == 160
        decoded = tokenizer.decode(token_ids, skip_special_tokens=True)
        assert "".join(c["text"] for c in choices) == decoded
        if REPLACEMENT_CHAR not in decoded:
            assert all(REPLACEMENT_CHAR not in c["text"] for c in choices)
        saw_split_char |= any(ord(ch) > 127 and ch != REPLACEMENT_CHAR for ch in decoded)
    assert saw_split_char, "no valid multi-byte character was sampled: the check proves little"
    greedy = {"prompt": ids("The grass is green."), "max_tokens": 32, "temperature": 0,
              "return_token_ids": True}
    choices = [c["choices"][0] for c in stream_chunks(url, greedy)]
    decoded = tokenizer.decode(sum((c["token_ids"] for c in choices), []),
                               skip_special_tokens=True)
    assert REPLACEMENT_CHAR not in decoded and "".join(c["text"] for c in choices) == decoded


# ---- request semantics -------------------------------------------------------------------------


@pytest.mark.parametrize("stream", [False, True], ids=["json", "sse"])
def test_stop_string_cuts_the_text_and_aborts_the_rest(url, stream):
    prompt = f"The sky is blue. mdrte: 90318. Here we go ({stream}).\nvalue of"
    base = {"prompt": prompt, "temperature": 0, "ignore_eos": True}
    text = complete(url, {**base, "max_tokens": 40})["choices"][0]["text"]
    # a 3-character piece that first occurs at its own position, well inside the text
    start = next(i for i in range(8, 30) if text.find(text[i:i + 3]) == i)
    stop = text[start:start + 3]
    before = wait_idle(url)["num_steps"]
    body = {**base, "max_tokens": LONG, "stop": [stop]}
    if stream:
        choices = [c["choices"][0] for c in stream_chunks(url, body)]
        got, finish = "".join(c["text"] for c in choices), choices[-1]["finish_reason"]
    else:
        choice = complete(url, body)["choices"][0]
        got, finish = choice["text"], choice["finish_reason"]
    assert (got, finish) == (text[:start], "stop")
    assert wait_idle(url)["num_steps"] - before < LONG // 4, "the rest was not aborted"
    assert complete(url, {**base, "max_tokens": 40})["choices"][0]["text"] == text


def test_return_token_ids_and_max_tokens(url):
    prompt = "héllo, wörld"
    body = complete(url, {"prompt": prompt, "max_tokens": 7, "temperature": 0.7, "seed": 5,
                          "ignore_eos": True, "return_token_ids": True})
    choice = body["choices"][0]
    assert choice["prompt_token_ids"] == ids(prompt) and choice["finish_reason"] == "length"
    assert len(choice["token_ids"]) == 7 and body["usage"]["completion_tokens"] == 7
    assert all(0 <= t < VOCAB_SIZE for t in choice["token_ids"])
    chat = complete(url, {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 3,
                          "temperature": 0, "ignore_eos": True, "return_token_ids": True},
                    "/v1/chat/completions")["choices"][0]
    assert chat["prompt_token_ids"] == ids("user: Hi\nassistant:")  # the built-in template
    assert len(chat["token_ids"]) == 3 and chat["finish_reason"] == "length"
    plain = complete(url, {"prompt": prompt, "max_tokens": 2})["choices"][0]
    assert "token_ids" not in plain and "prompt_token_ids" not in plain


def test_seeded_sampling_repeats_alone_and_in_a_batch(url):
    def run(prompt: str, seed: int | None, temperature: float = 1.0) -> list[int]:
        body = {"prompt": prompt, "max_tokens": 24, "temperature": temperature, "seed": seed,
                "ignore_eos": True, "return_token_ids": True}
        return complete(url, body)["choices"][0]["token_ids"]

    prompt = "Facts to remember. The grass is"
    first = run(prompt, 1234)
    assert run(prompt, 1234) == first
    assert run(prompt, 4321) != first and run(prompt, None, 0.0) != first  # the seed matters
    others = [(f"Other prompt number {i}: ", 99 + i, 1.0) for i in range(5)] + [
        ("Greedy neighbour ", None, 0.0)]
    jobs = [(prompt, 1234, 1.0), *others, (prompt, 1234, 1.0)]
    with ThreadPoolExecutor(len(jobs)) as pool:
        results = list(pool.map(lambda job: run(*job), jobs))
    assert results[0] == results[-1] == first


# ---- admin routes ------------------------------------------------------------------------------


def test_health_models_and_server_info(url):
    assert httpx.get(url + "/health", timeout=30).json() == {"status": "ok"}
    models = httpx.get(url + "/v1/models", timeout=30).json()
    assert models["object"] == "list"
    assert [(m["id"], m["max_model_len"]) for m in models["data"]] == [(MODEL_NAME, MAX_CONTEXT)]
    info = httpx.get(url + "/server_info", timeout=30).json()
    assert (info["vocab_size"], info["eos_token_id"], info["max_context_len"]) == (
        VOCAB_SIZE, EOS, MAX_CONTEXT)
    assert info["tp_size"] == 1 and info["prefix_cache"] is True
    assert info["chunked_prefill_size"] == 2048  # the default budget, reported
    # an FP32 model too small for packed copies: its weights as the checkpoint stores them
    with safe_open(KIMI / "model.safetensors", "pt") as f:
        assert info["weight_bytes"] == sum(f.get_tensor(k).nbytes for k in f.keys())


def test_flush_cache_forgets_every_prefix(url):
    body = {"prompt": "A prompt to flush away, long enough to checkpoint.", "max_tokens": 3,
            "temperature": 0, "return_token_ids": True}
    first = complete(url, body)
    assert cached_tokens(complete(url, body)) > 0
    r = httpx.post(url + "/flush_cache", timeout=60)
    assert r.status_code == 200 and r.json()["ok"] is True
    s = wait_idle(url)
    assert s["kv_rows_free"] == s["kv_rows_total"]
    assert s["checkpoint_slots_free"] == s["checkpoint_slots_total"]
    again = complete(url, body)
    assert cached_tokens(again) == 0
    assert again["choices"][0]["token_ids"] == first["choices"][0]["token_ids"]
    assert cached_tokens(complete(url, body)) > 0


# ---- disconnects -------------------------------------------------------------------------------


def test_client_leaving_a_stream_aborts_its_request(url):
    before = wait_idle(url)["num_steps"]
    body = {"prompt": "Tell me a long story.", "max_tokens": LONG, "temperature": 0,
            "ignore_eos": True, "stream": True}
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=60) as r:
        assert r.status_code == 200
        payloads = (line for line in r.iter_lines() if line.startswith("data: "))
        assert [json.loads(next(payloads)[6:])["choices"] for _ in range(2)]
    assert wait_idle(url)["num_steps"] - before < LONG // 4, "the request ran on"
    assert complete(url, {"prompt": "next", "max_tokens": 2})["choices"][0]["finish_reason"]


def test_client_leaving_a_json_request_aborts_it(url):
    before = wait_idle(url)["num_steps"]
    body = {"prompt": "Another long story.", "max_tokens": LONG, "temperature": 0,
            "ignore_eos": True}
    with pytest.raises(httpx.ReadTimeout):
        post(url, "/v1/completions", body, timeout=httpx.Timeout(30, read=1.0))
    assert wait_idle(url)["num_steps"] - before < LONG // 4, "the request ran on"


def test_a_long_prompt_does_not_stall_the_requests_beside_it(default_server):
    """Tokenising runs off the event loop: while a batch of long text prompts (~3 MB, seconds
    to encode, each then too long for the context) is being encoded, /v1/stats and /metrics
    count it as preparing, and short requests sent after it are answered first."""
    url = default_server.base_url
    long_body = {"prompt": ["The grass is green. " * 600] * 250, "max_tokens": 1}
    done: dict[str, float] = {}
    answers: dict[str, httpx.Response] = {}

    def send(name: str, body: dict) -> None:
        answers[name] = httpx.post(f"{url}/v1/completions", json=body, timeout=120)
        done[name] = time.perf_counter()

    long = threading.Thread(target=send, args=("long", long_body))
    long.start()
    time.sleep(0.3)  # its body is in and being encoded
    # the front end shows it, before the scheduler knows of it
    assert httpx.get(f"{url}/v1/stats", timeout=10).json()["num_preparing"] == 1
    assert "dasc_preparing_requests 1.0" in httpx.get(f"{url}/metrics", timeout=10).text
    for i in range(3):
        send(f"short{i}", {"prompt": f"Hi {i}", "max_tokens": 2, "temperature": 0})
    long.join(120)
    assert all(answers[f"short{i}"].status_code == 200 for i in range(3))
    assert answers["long"].status_code == 400
    assert "prompt 0" in answers["long"].json()["error"]["message"]  # encoded, then refused
    assert max(done[f"short{i}"] for i in range(3)) < done["long"]


def test_text_that_cannot_fit_is_refused_before_it_is_encoded(default_server):
    got = httpx.post(f"{default_server.base_url}/v1/completions", timeout=60,
                     json={"prompt": "x" * 3_000_000, "max_tokens": 1})
    error = got.json()["error"]
    assert got.status_code == 400 and error["param"] == "prompt"
    assert "3,000,000 bytes of text" in error["message"]
    assert "can fit the context" in error["message"]


@pytest.mark.parametrize("prefix_len", [192, 300])
def test_a_shared_prefix_is_hit_from_its_third_sharer_with_default_flags(url, prefix_len):
    """vLLM's bench shape (a 192-token shared prefix under the 256-token checkpoint interval)
    and one off the grid: the first sharer stores the interval points inside the prefix, the
    second the point where it branches off the first (its prompt then hits the grid), the third
    hits the whole prefix."""
    wait_idle(url)
    assert httpx.post(url + "/flush_cache", timeout=60).json()["ok"]
    prefix = bytes(range(32, 32 + 95)).decode() * 4  # 380 distinct-ish printable characters
    hits = []
    for i in range(3):
        body = complete(url, {"prompt": prefix[:prefix_len] + f"{i}: and what now?",
                              "max_tokens": 2, "temperature": 0})
        hits.append(cached_tokens(body))
    grid = 256 if prefix_len > 256 else 0
    assert hits == [0, grid, prefix_len]
