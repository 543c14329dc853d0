"""The OpenAI-compatible request models and the checks that need the server's state
(dasc_server/requests.py): defaults, refusals and their error bodies,
prompt batches, ``n`` and the unsupported fields."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from dasc_server.requests import (
    ChatCompletionRequest,
    CompletionRequest,
    RequestError,
    check_model,
    check_prompt,
    validation_error_body,
)

# ---- request models ---------------------------------------------------------------------------


def test_completion_defaults_follow_openai():
    req = CompletionRequest.model_validate({"prompt": "hi", "user": "u", "logprobs": None,
                                            "best_of": 1, "presence_penalty": 0})
    assert (req.max_tokens, req.temperature, req.top_p, req.top_k, req.n) == (16, 1.0, 1.0, 0, 1)
    assert not req.stream and not req.include_usage and req.stop_strings == []
    req = CompletionRequest.model_validate(
        {"prompt": [1, 2], "stop": "x", "stream": True, "stream_options": {"include_usage": True},
         "max_tokens": None, "return_token_ids": True, "ignore_eos": True, "top_k": -1})
    assert req.prompt == [1, 2] and req.stop_strings == ["x"] and req.include_usage
    assert req.requested_max_tokens is None
    req = CompletionRequest.model_validate({"prompt": "a", "stop": ["", "b"]})
    assert req.stop_strings == ["b"]


def test_chat_max_completion_tokens_wins():
    body = {"messages": [{"role": "user", "content": "hi"}]}
    assert ChatCompletionRequest.model_validate(body).requested_max_tokens is None  # the rest
    req = ChatCompletionRequest.model_validate(
        {**body, "max_tokens": 5, "max_completion_tokens": 7})
    assert req.requested_max_tokens == 7


@pytest.mark.parametrize(("body", "param"), [
    ({"prompt": ""}, "prompt"),
    ({"prompt": []}, "prompt"),
    ({"prompt": 5}, "prompt"),
    ({"prompt": [1, "2"]}, "prompt"),
    ({"prompt": [1.5]}, "prompt"),
    ({}, "prompt"),
    ({"prompt": "x", "max_tokens": -1}, "max_tokens"),
    ({"prompt": "x", "temperature": -0.1}, "temperature"),
    ({"prompt": "x", "top_p": 0}, "top_p"),
    ({"prompt": "x", "top_p": 1.5}, "top_p"),
    ({"prompt": "x", "top_k": -2}, "top_k"),
    ({"prompt": "x", "n": 0}, "n"),
    ({"prompt": "x", "n": 2, "best_of": 1}, "best_of"),
    ({"prompt": "x", "n": 1, "best_of": 2, "stream": True}, "best_of"),
    ({"prompt": ["x", ""]}, "prompt"),
    ({"prompt": [[1], []]}, "prompt"),
    ({"prompt": [[1], "x"]}, "prompt"),
    ({"prompt": "x", "echo": "yes"}, "echo"),
    ({"prompt": "x", "logprobs": 21}, "logprobs"),
    ({"prompt": "x", "logprobs": -1}, "logprobs"),
    ({"prompt": "x", "suffix": "tail"}, "suffix"),
    ({"prompt": "x", "logit_bias": {"65": -101}}, "logit_bias"),
    ({"prompt": "x", "logit_bias": {"a": 1}}, "logit_bias"),
    ({"prompt": "x", "min_tokens": -1}, "min_tokens"),
    ({"prompt": "x", "frequency_penalty": 2.5}, "frequency_penalty"),
    ({"prompt": "x", "presence_penalty": -3}, "presence_penalty"),
    ({"prompt": "x", "repetition_penalty": 0}, "repetition_penalty"),
])
def test_bad_completion_bodies(body, param):
    with pytest.raises(ValidationError) as info:
        CompletionRequest.model_validate(body)
    error = validation_error_body(info.value.errors())["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["type"] == "invalid_request_error" and error["param"] == param
    assert error["message"]


@pytest.mark.parametrize("body", [
    {"messages": []},
    {"messages": [{"role": "", "content": "x"}]},
    {"messages": [{"role": "user", "content": "x"}], "max_completion_tokens": 0},
    {"messages": [{"role": "user", "content": "x"}], "top_logprobs": 21, "logprobs": True},
])
def test_bad_chat_bodies(body):
    with pytest.raises(ValidationError):
        ChatCompletionRequest.model_validate(body)


def test_json_decode_error_has_no_param():
    errors = [{"type": "json_invalid", "loc": ("body", 1), "msg": "JSON decode error",
               "ctx": {"error": "Expecting value"}}]
    error = validation_error_body(errors)["error"]
    assert error["param"] is None and "not valid JSON" in error["message"]


def test_check_model():
    check_model(None, "tiny")
    check_model("tiny", "tiny")
    with pytest.raises(RequestError) as info:
        check_model("gpt-4", "tiny")
    assert info.value.status == 404 and info.value.code == "model_not_found"
    assert info.value.body()["error"]["param"] == "model"


def test_check_prompt():
    limits = {"vocab_size": 264, "max_context_len": 10}
    assert check_prompt([1, 2], 8, **limits) == 8  # exactly fits
    assert check_prompt([1, 2], None, **limits) == 8  # null: the rest of the context
    for ids, max_tokens in [([], 1), ([264], 1), ([-1], 1), ([1, 2], 9), (list(range(10)), None)]:
        with pytest.raises(RequestError) as info:
            check_prompt(ids, max_tokens, **limits)
        assert info.value.status == 400 and info.value.param == "prompt"


# ---- prompt batches, n, unsupported fields ----------------------------------------------------


def test_prompt_batches_and_single_prompts():
    def prompts(prompt):
        return CompletionRequest.model_validate({"prompt": prompt}).prompts

    assert prompts("a") == ["a"]
    assert prompts([1, 2]) == [[1, 2]]  # one token-id list stays one prompt
    assert prompts(["a", "b"]) == ["a", "b"]
    assert prompts([[1], [2, 3]]) == [[1], [2, 3]]


def test_sample_seeds_follow_the_request_seed():
    from dasc_server.app import sample_seed

    assert [sample_seed(7, j) for j in range(3)] == [7, 8, 9]
    assert sample_seed(2**63 - 1, 1) == 0  # stays a valid seed
    assert sample_seed(None, 2) is None  # the scheduler draws one per sample


def test_neutral_values_of_unsupported_fields_are_accepted():
    CompletionRequest.model_validate({"prompt": "x", "echo": False, "suffix": "", "logit_bias": {},
                                      "min_tokens": 0, "response_format": {"type": "text"},
                                      "n": 2, "best_of": 2})
    ChatCompletionRequest.model_validate({
        "messages": [{"role": "user", "content": "x"}], "tools": [], "tool_choice": "none",
        "logprobs": False, "top_logprobs": 0, "modalities": ["text"], "user": "u"})


@pytest.mark.parametrize("field,value", [
    ("functions", [{"name": "f"}]), ("top_logprobs", 2), ("top_logprobs", 21),
    ("logit_bias", {"1": 500}),
    ("reasoning_effort", "high"), ("chat_template_kwargs", {"tokenize": True}),
    ("chat_template_kwargs", "enable_thinking"),
])
def test_unsupported_chat_fields_are_named(field, value):
    body = {"messages": [{"role": "user", "content": "x"}], field: value}
    with pytest.raises(ValidationError) as info:
        ChatCompletionRequest.model_validate(body)
    assert validation_error_body(info.value.errors())["error"]["param"] == field


@pytest.mark.parametrize("part", [
    {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}},
    {"type": "video_url", "video_url": {"url": "file:///v.mp4"}},
    {"type": "input_audio", "input_audio": {"data": "AAAA", "format": "wav"}}])
def test_media_content_parts_are_refused_naming_the_field(part):
    body = {"messages": [{"role": "user", "content": [{"type": "text", "text": "What is it?"},
                                                      part]}]}
    with pytest.raises(ValidationError) as info:
        ChatCompletionRequest.model_validate(body)
    error = validation_error_body(info.value.errors())["error"]
    assert error["param"] == "messages"
    assert f"messages.0.content: content part 1 has type {part['type']!r}" in error["message"]
    assert "text only" in error["message"]


def test_chat_template_kwargs_reach_the_request():
    req = ChatCompletionRequest.model_validate({
        "messages": [{"role": "user", "content": "x"}],
        "chat_template_kwargs": {"enable_thinking": False}})
    assert req.chat_template_kwargs == {"enable_thinking": False}


def test_check_prompt_default_is_bounded_by_the_pool():
    limits = {"vocab_size": 264, "max_context_len": 10, "max_total_tokens": 6}
    assert check_prompt([1, 2], None, **limits) == 4  # the pool, not the context, bounds it
    with pytest.raises(RequestError) as info:
        check_prompt([1, 2], 5, **limits)
    assert "pool" in info.value.message and info.value.param == "prompt"
