"""``POST /tokenize`` and ``POST /detokenize`` as vLLM serves them (its ``bench serve`` asks
for ``/tokenize`` and warns on a 404).

``/tokenize`` takes a ``prompt`` (text, ``add_special_tokens`` as vLLM: default true) or chat
``messages`` (rendered as ``/v1/chat/completions`` renders them, with the open assistant turn)
and answers ``{"count", "max_model_len", "tokens", "token_strs"}``; ``/detokenize`` takes
``tokens`` and answers ``{"prompt"}``.  A server without a tokenizer answers 400 for both.
"""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI
from pydantic import BaseModel, ConfigDict, Field, model_validator

from dasc_server.chat import chat_prompt_ids
from dasc_server.chat_request import ChatMessage
from dasc_server.request_checks import check_model
from dasc_server.request_errors import RequestError
from dasc_server.tokenizer_threads import TokenizerThreads


class TokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = Field(default=None, min_length=1)
    add_special_tokens: bool = True
    return_token_strs: bool = False
    chat_template_kwargs: dict[str, Any] | None = None

    @model_validator(mode="after")
    def _one_input(self) -> TokenizeRequest:
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("give exactly one of prompt and messages")
        return self


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    model: str | None = None
    tokens: list[int]


def add_tokenize_routes(app: FastAPI, threads: TokenizerThreads, model_name: str,
                        vocab_size: int) -> None:
    """Both routes encode and decode in ``threads``' pool, off the event loop."""

    def needs_tokenizer(param: str) -> None:
        if threads.tokenizer is None:
            raise RequestError("this server has no tokenizer (it serves token ids only)",
                               param=param)

    def encode(req: TokenizeRequest) -> dict:
        tok = threads.here()
        if req.messages is not None:
            ids = chat_prompt_ids(tok, req.messages, template_kwargs=req.chat_template_kwargs)
        else:
            threads.check_fits(req.prompt, "prompt")
            ids = list(tok.encode(req.prompt, add_special_tokens=req.add_special_tokens))
        strs = tok.convert_ids_to_tokens(ids) if req.return_token_strs else None
        return {"count": len(ids), "max_model_len": threads.max_context_len, "tokens": ids,
                "token_strs": strs}

    @app.post("/tokenize")
    async def tokenize(req: TokenizeRequest) -> dict:
        check_model(req.model, model_name)
        needs_tokenizer("messages" if req.messages is not None else "prompt")
        return await threads.run(encode, req)

    @app.post("/detokenize")
    async def detokenize(req: DetokenizeRequest) -> dict:
        check_model(req.model, model_name)
        needs_tokenizer("tokens")
        bad = next((t for t in req.tokens if not 0 <= t < vocab_size), None)
        if bad is not None:
            raise RequestError(f"token id {bad} is outside the vocabulary [0, {vocab_size})",
                               param="tokens")
        return {"prompt": await threads.run(lambda: threads.here().decode(req.tokens))}
