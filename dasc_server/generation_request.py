"""Fields shared by the OpenAI-compatible request bodies (completions: completion_request.py,
chat: chat_request.py): sampling, stops, logit controls, streaming, and the refusal of fields
this server cannot honour.

Defaults follow OpenAI's API, not ``SamplingParams``: ``temperature`` defaults to 1.0 (random
sampling; send 0 for greedy); completions' ``max_tokens`` to 16, chat's to the rest of the
context (as does an explicit ``"max_tokens": null`` on either route).  ``prompt`` is a string, a
token-id list, or a batch of either; ``n`` samples per prompt (the best ``n`` of ``best_of``).
Extensions beyond OpenAI: ``top_k`` (0 or -1 = off), ``ignore_eos``, ``stop_token_ids`` and
``return_token_ids`` (adds ``token_ids`` and ``prompt_token_ids`` to each choice).

A field that OpenAI (or vLLM / SGLang) defines and this server cannot honour is refused with a
400 naming it in ``param`` unless it holds a neutral value (``UNSUPPORTED``): never accepted
and ignored.  ``user`` and other metadata that do not change the output are accepted.

Checks that need the server's state (token ids against the vocabulary, the context length, the
model name) live in ``dasc_server.request_checks``; the models check only the body itself.
Every refusal becomes an OpenAI-style body (``dasc_server.request_errors``).
"""

from __future__ import annotations

from typing import Any, ClassVar

from pydantic import BaseModel, ConfigDict, Field, StrictInt, ValidationInfo, field_validator


class StreamOptions(BaseModel):
    include_usage: bool = False


def refuse_unless_neutral(value: Any, neutral: tuple) -> Any:
    if value not in neutral:
        allowed = " or ".join("unset" if v is None else repr(v) for v in neutral)
        raise ValueError(f"not supported by this server (send it {allowed})")
    return value


class NeutralOnly(BaseModel):
    """A request body whose ``UNSUPPORTED`` fields (field -> the values that mean "off", each
    declared as ``Any = None``) are refused at any other value; a subclass extends the map."""

    UNSUPPORTED: ClassVar[dict[str, tuple]] = {}

    @field_validator("*")
    @classmethod
    def _unsupported(cls, value: Any, info: ValidationInfo) -> Any:
        neutral = cls.UNSUPPORTED.get(info.field_name)
        return value if neutral is None else refuse_unless_neutral(value, neutral)


class GenerationRequest(NeutralOnly):
    """Fields shared by both routes.  Unknown fields are ignored (clients send many); the known
    ones this server cannot honour are refused (``UNSUPPORTED``)."""

    model_config = ConfigDict(extra="ignore")

    UNSUPPORTED: ClassVar[dict[str, tuple]] = {
        "min_p": (None, 0),
        "use_beam_search": (None, False),
        "prompt_logprobs": (None,),
        "guided_json": (None,),
        "guided_regex": (None,),
        "guided_choice": (None,),
        "guided_grammar": (None,),
        "include_stop_str_in_output": (None, False),
        "skip_special_tokens": (None, True),
        "truncate_prompt_tokens": (None,),
    }

    model: str | None = None
    max_tokens: int | None = Field(default=16, ge=1)
    temperature: float = Field(default=1.0, ge=0.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    top_k: int = Field(default=0, ge=-1)
    seed: int | None = Field(default=None, ge=0, lt=2**63)  # distinct seeds, distinct samples
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int = Field(default=1, ge=1)
    best_of: int | None = Field(default=None, ge=1)
    ignore_eos: bool = False
    stop_token_ids: list[StrictInt] | None = None
    return_token_ids: bool = False
    # logit controls, applied by rank 0's sampler (OpenAI / vLLM semantics); token ids of
    # logit_bias are checked against the vocabulary where the server's state is known
    presence_penalty: float = Field(default=0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(default=0.0, ge=-2.0, le=2.0)
    repetition_penalty: float = Field(default=1.0, gt=0.0)
    logit_bias: dict[str, float] | None = None
    min_tokens: int = Field(default=0, ge=0)
    # text, json_object or json_schema, checked and compiled by ``dasc_server.structured``
    response_format: Any = None
    # Accepted only at their neutral values: silently ignoring them would change the output.
    min_p: Any = None
    use_beam_search: Any = None
    prompt_logprobs: Any = None
    guided_json: Any = None
    guided_regex: Any = None
    guided_choice: Any = None
    guided_grammar: Any = None
    include_stop_str_in_output: Any = None
    skip_special_tokens: Any = None
    truncate_prompt_tokens: Any = None

    @field_validator("best_of")
    @classmethod
    def _best_of_at_least_n(cls, best_of: int | None, info: ValidationInfo) -> int | None:
        n = info.data.get("n", 1)
        if best_of is not None and best_of < n:
            raise ValueError(f"best_of must be at least n ({n})")
        if best_of is not None and best_of > n and info.data.get("stream"):
            raise ValueError("best_of > n cannot be streamed")
        return best_of

    @field_validator("logit_bias")
    @classmethod
    def _bias_by_token_id(cls, bias: dict[str, float] | None) -> dict[str, float] | None:
        for key, value in (bias or {}).items():
            if not key.lstrip("-").isdigit():
                raise ValueError(f"logit_bias keys are token ids, got {key!r}")
            if not -100.0 <= value <= 100.0:
                raise ValueError(f"logit_bias values must lie in [-100, 100], got {value}")
        return bias

    @property
    def token_bias(self) -> dict[int, float]:
        return {int(k): float(v) for k, v in (self.logit_bias or {}).items()}

    @property
    def stop_strings(self) -> list[str]:
        """``stop`` as a list; empty strings are dropped (they would match at once)."""
        stops = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        return [s for s in stops if s]

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage

    @property
    def requested_max_tokens(self) -> int | None:
        return self.max_tokens

    @property
    def num_samples(self) -> int:
        """Samples drawn per prompt: ``best_of`` of them, of which the ``n`` with the highest
        mean token log-probability are returned."""
        return self.best_of or self.n


Prompt = str | list[StrictInt]
MAX_TOP_LOGPROBS = 20  # OpenAI's bound on completions' logprobs and chat's top_logprobs
