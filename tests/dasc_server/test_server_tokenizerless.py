"""A model folder without a tokenizer: the server takes and returns token ids only, and refuses
what needs text (a text prompt, chat, stop strings) with a clear error."""

from __future__ import annotations

import shutil

import pytest
from support.http_helpers import complete, post, stream_chunks
from support.serving import KIMI, ids, running_server


@pytest.fixture(scope="module")
def url(default_server) -> str:
    return default_server.base_url


# ---- a model folder without a tokenizer --------------------------------------------------------


@pytest.fixture(scope="module")
def bare_url(tmp_path_factory):
    folder = tmp_path_factory.mktemp("bare") / "bare-model"
    folder.mkdir()
    for name in ("config.json", "model.safetensors"):
        shutil.copy(KIMI / name, folder / name)
    with running_server("--model", str(folder)) as s:
        yield s.base_url


def test_tokenizerless_server_takes_token_ids(url, bare_url):
    body = {"prompt": ids("The grass is green."), "max_tokens": 6, "temperature": 0,
            "ignore_eos": True}
    choice = complete(bare_url, body)["choices"][0]
    assert choice["text"] == "" and len(choice["token_ids"]) == 6
    assert choice["prompt_token_ids"] == body["prompt"]
    # the same weights behind a tokenizer give the same tokens
    with_tok = complete(url, {**body, "return_token_ids": True})["choices"][0]
    assert with_tok["token_ids"] == choice["token_ids"]
    choices = [c["choices"][0] for c in stream_chunks(bare_url, body)]
    assert sum((c["token_ids"] for c in choices), []) == choice["token_ids"]
    assert all(c["text"] == "" for c in choices)


@pytest.mark.parametrize("path,body", [
    ("/v1/completions", {"prompt": "text"}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}),
    ("/v1/completions", {"prompt": [65, 66], "stop": ["x"]}),
], ids=["text-prompt", "chat", "stop-string"])
def test_tokenizerless_server_refuses_text(bare_url, path, body):
    r = post(bare_url, path, body)
    assert r.status_code == 400, r.text
    assert "tokenizer" in r.json()["error"]["message"]
    assert complete(bare_url, {"prompt": [65], "max_tokens": 1})["choices"][0]["token_ids"]
