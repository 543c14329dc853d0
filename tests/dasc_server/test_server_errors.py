"""Bad requests to a real dasc-serve: each gets an OpenAI error body (type, param, message,
code) with its HTTP status, and the server keeps serving."""

from __future__ import annotations

import httpx
import pytest
from support.http_helpers import complete, post

MAX_CONTEXT = 8192


@pytest.fixture(scope="module")
def url(default_server) -> str:
    return default_server.base_url


# ---- errors ------------------------------------------------------------------------------------


BAD_REQUESTS = {
    "empty-prompt": ({"prompt": ""}, 400, "prompt"),
    "token-outside-vocab": ({"prompt": [65, 300]}, 400, "prompt"),
    "max-tokens-0": ({"prompt": "a", "max_tokens": 0}, 400, "max_tokens"),
    "negative-temperature": ({"prompt": "a", "temperature": -0.5}, 400, "temperature"),
    "top-p-0": ({"prompt": "a", "top_p": 0}, 400, "top_p"),
    "n-0": ({"prompt": "a", "n": 0}, 400, "n"),
    "too-many-choices": ({"prompt": ["a", "b"], "n": 200}, 400, "n"),
    "too-many-prompts": ({"prompt": ["a"] * 300}, 400, "prompt"),
    "best-of-below-n": ({"prompt": "a", "n": 2, "best_of": 1}, 400, "best_of"),
    "best-of-streamed": ({"prompt": "a", "best_of": 2, "stream": True}, 400, "best_of"),
    "batch-outside-vocab": ({"prompt": [[65], [300]]}, 400, "prompt"),
    "batch-with-empty": ({"prompt": ["a", ""]}, 400, "prompt"),
    "echo-not-bool": ({"prompt": "a", "echo": "yes"}, 400, "echo"),
    "logprobs-21": ({"prompt": "a", "logprobs": 21}, 400, "logprobs"),
    "chat-max-tokens-0": ({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 0},
                          400, "max_tokens"),
    "suffix": ({"prompt": "a", "suffix": "b"}, 400, "suffix"),
    "logit-bias-range": ({"prompt": "a", "logit_bias": {"65": -101}}, 400, "logit_bias"),
    "logit-bias-vocab": ({"prompt": "a", "logit_bias": {"300": 1}}, 400, "logit_bias"),
    "min-tokens-over-max": ({"prompt": "a", "min_tokens": 9, "max_tokens": 4}, 400,
                            "min_tokens"),
    "penalty-range": ({"prompt": "a", "presence_penalty": 3}, 400, "presence_penalty"),
    "response-format-kind": ({"prompt": "a", "response_format": {"type": "regex"}}, 400,
                             "response_format"),
    "json-schema-unenforceable": ({"prompt": "a", "response_format": {
        "type": "json_schema", "json_schema": {"name": "x", "schema": {"format": "odd"}}}},
        400, "response_format"),
    "chat-tools": ({"messages": [{"role": "user", "content": "hi"}],
                    "tools": [{"type": "function", "function": {"name": "f"}}],
                    "tool_choice": "required"}, 400, "tools"),
    "chat-tool-choice": ({"messages": [{"role": "user", "content": "hi"}],
                          "tool_choice": "required"}, 400, "tool_choice"),
    "chat-top-logprobs-alone": ({"messages": [{"role": "user", "content": "hi"}],
                                 "top_logprobs": 3}, 400, "top_logprobs"),
    "chat-top-logprobs-21": ({"messages": [{"role": "user", "content": "hi"}],
                              "logprobs": True, "top_logprobs": 21}, 400, "top_logprobs"),
    "chat-json-schema": ({"messages": [{"role": "user", "content": "hi"}],
                          "response_format": {"type": "json_schema", "json_schema": {}}},
                         400, "response_format"),
    "unknown-model": ({"prompt": "a", "model": "gpt-4"}, 404, "model"),
    "beyond-context": ({"prompt": [65] * 8000, "max_tokens": 500}, 400, "prompt"),
    "stream-outside-vocab": ({"prompt": [300], "stream": True}, 400, "prompt"),
    "chat-no-messages": ({"messages": []}, 400, "messages"),
    "wrong-type-max-tokens": ({"prompt": "a", "max_tokens": "ten"}, 400, "max_tokens"),
    "wrong-type-prompt": ({"prompt": 12}, 400, "prompt"),
    "seed-beyond-int63": ({"prompt": "a", "seed": 2**63}, 400, "seed"),  # would collide
    "negative-seed": ({"prompt": "a", "seed": -1}, 400, "seed"),
}


@pytest.mark.parametrize("name", list(BAD_REQUESTS) + ["invalid-json"])
def test_errors_are_openai_bodies_and_the_server_keeps_serving(url, name):
    if name == "invalid-json":
        r = httpx.post(url + "/v1/completions", content=b'{"prompt": "a",',
                       headers={"content-type": "application/json"}, timeout=30)
        status, param = 400, None
    else:
        body, status, param = BAD_REQUESTS[name]
        path = "/v1/chat/completions" if "messages" in body else "/v1/completions"
        r = post(url, path, body)
    assert r.status_code == status, r.text
    assert r.headers["content-type"].startswith("application/json")
    error = r.json()["error"]
    assert isinstance(error["message"], str) and error["message"]
    assert error["type"] == "invalid_request_error" and error["param"] == param
    if name == "beyond-context":
        assert error["code"] == "context_length_exceeded" and str(MAX_CONTEXT) in error["message"]
    if name == "token-outside-vocab":
        assert "300" in error["message"]
    assert complete(url, {"prompt": "still there?", "max_tokens": 2})["choices"][0]["text"]
