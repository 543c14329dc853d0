"""SGLang's native worker routes (``dasc_server.app``) on a real dasc-serve, over httpx:
the metadata the SGLang model gateway reads, ``/health_generate``, and ``/generate`` in
SGLang's request/response shape, JSON and SSE, agreeing with ``/v1/completions``."""

from __future__ import annotations

import json

import httpx
import pytest
from support.serving import KIMI

GREEDY = {"max_new_tokens": 6, "temperature": 0}


@pytest.fixture(scope="module")
def url(default_server) -> str:
    return default_server.base_url


def generate(url: str, body: dict) -> httpx.Response:
    return httpx.post(f"{url}/generate", json=body, timeout=60)


def test_model_and_server_info(url):
    for path in ("/model_info", "/get_model_info"):
        info = httpx.get(url + path, timeout=10).json()
        assert info["model_path"] == info["tokenizer_path"] == str(KIMI)
        assert info["is_generation"] is True
        assert info["architectures"] == ["KimiLinearForCausalLM"]
    server = httpx.get(f"{url}/get_server_info", timeout=10).json()
    assert server["model_path"] == str(KIMI) and server["served_model_name"] == KIMI.name
    assert server["tp_size"] == 1 and server["dp_size"] == 1


def test_health_generate(url):
    assert httpx.get(f"{url}/health_generate", timeout=30).status_code == 200


def test_generate_matches_completions(url):
    r = generate(url, {"text": "hello hello", "sampling_params": GREEDY})
    assert r.status_code == 200, r.text
    body = r.json()
    ref = httpx.post(f"{url}/v1/completions", timeout=60, json={
        "prompt": "hello hello", "max_tokens": 6, "temperature": 0,
        "return_token_ids": True}).json()["choices"][0]
    assert body["text"] == ref["text"] and body["output_ids"] == ref["token_ids"]
    meta = body["meta_info"]
    assert meta["prompt_tokens"] == len("hello hello") and meta["completion_tokens"] == 6
    assert meta["finish_reason"] == {"type": "length", "length": 6}
    again = generate(url, {"input_ids": list(b"hello hello"), "sampling_params": GREEDY}).json()
    assert again["output_ids"] == body["output_ids"]
    assert again["meta_info"]["cached_tokens"] > 0  # the same prompt hits the prefix cache


def test_generate_as_the_gateway_sends_it(url):
    body = {"text": "hi", "model": None, "sampling_params": GREEDY,
            "return_text_in_logprobs": False, "stream": False, "log_metrics": True,
            "return_hidden_states": False, "background": False, "no_logs": False,
            "return_bytes": False, "return_entropy": False}
    assert generate(url, body).status_code == 200


def test_generate_stream(url):
    body = {"text": "hello hello", "sampling_params": GREEDY, "stream": True}
    with httpx.stream("POST", f"{url}/generate", json=body, timeout=60) as r:
        lines = [ln for ln in r.iter_lines() if ln]
    assert lines[-1] == "data: [DONE]"
    frames = [json.loads(ln.removeprefix("data: ")) for ln in lines[:-1]]
    whole = generate(url, {"text": "hello hello", "sampling_params": GREEDY}).json()
    assert frames[-1]["text"] == whole["text"]  # cumulative, as SGLang streams by default
    assert frames[-1]["output_ids"] == whole["output_ids"]
    assert frames[-1]["meta_info"]["finish_reason"]["type"] == "length"
    assert all(f["meta_info"]["finish_reason"] is None for f in frames[:-1])


@pytest.mark.parametrize("body, param", [
    ({"text": "a", "return_logprob": True}, "return_logprob"),
    ({"text": "a", "input_ids": [1]}, "input_ids"),
    ({}, "input_ids"),
    ({"text": "a", "sampling_params": {"bogus": 1}}, "sampling_params"),
    ({"text": "a", "sampling_params": {"n": 2}}, "sampling_params"),
    ({"text": ["a", "b"]}, "text"),
    ({"input_ids": [999999]}, "prompt"),
])
def test_generate_refuses(url, body, param):
    r = generate(url, body)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param
