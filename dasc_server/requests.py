"""What a request may ask, and the one place it is checked: the pydantic models of the
bodies (completions, chat completions, SGLang's ``/generate``), the errors they raise in OpenAI's
shape, structured output's grammars, and the checks that need the server's state (the served
model name, the vocabulary, the context and the KV pool).  The scheduler keeps only cheap
invariant checks on the typed messages it receives (``scheduler/refusals.py``)."""

from __future__ import annotations

from typing import Any, ClassVar, Literal

import llguidance
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    StrictBool,
    StrictInt,
    ValidationInfo,
    field_validator,
)

# Refusals of the HTTP front end as OpenAI words them: ``RequestError`` and the body
# ``{"error": {message, type, param, code}}`` every refusal becomes.

INVALID_REQUEST = "invalid_request_error"


class RequestError(Exception):
    """A request refused before or while it runs; rendered by ``error_body``."""

    def __init__(self, message: str, *, param: str | None = None, status: int = 400,
                 type: str = INVALID_REQUEST, code: str | None = None,
                 headers: dict[str, str] | None = None):
        super().__init__(message)
        self.message, self.param, self.status, self.type, self.code = (
            message, param, status, type, code)
        self.headers = headers

    def body(self) -> dict:
        return error_body(self.message, param=self.param, type=self.type, code=self.code)


def error_body(message: str, *, param: str | None = None, type: str = INVALID_REQUEST,
               code: str | None = None) -> dict:
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


def validation_error_body(errors: list[dict]) -> dict:
    """Turn pydantic/FastAPI validation errors into one OpenAI-style 400 body."""
    parts, param = [], None
    for err in errors:
        if err.get("type") == "json_invalid":  # its loc is a character position, not a field
            parts.append(f"the body is not valid JSON: {err.get('ctx', {}).get('error', '')}")
            continue
        loc = [str(x) for x in err.get("loc", ()) if x != "body"]
        if param is None and loc:
            param = loc[0]
        msg = str(err.get("msg", "invalid value")).removeprefix("Value error, ")
        parts.append(f"{'.'.join(loc)}: {msg}" if loc else msg)
    return error_body("; ".join(dict.fromkeys(parts)) or "invalid request", param=param)


# Fields shared by the OpenAI-compatible request bodies (``CompletionRequest``,
# ``ChatCompletionRequest``): sampling, stops, logit controls, streaming, and the refusal of fields
# this server cannot honour.
#
# Defaults follow OpenAI's API, not ``SamplingParams``: ``temperature`` defaults to 1.0 (random
# sampling; send 0 for greedy); completions' ``max_tokens`` to 16, chat's to the rest of the
# context (as does an explicit ``"max_tokens": null`` on either route).  ``prompt`` is a string, a
# token-id list, or a batch of either; ``n`` samples per prompt (the best ``n`` of ``best_of``).
# Extensions beyond OpenAI: ``top_k`` (0 or -1 = off), ``ignore_eos``, ``stop_token_ids`` and
# ``return_token_ids`` (adds ``token_ids`` and ``prompt_token_ids`` to each choice).
#
# A field that OpenAI (or vLLM / SGLang) defines and this server cannot honour is refused with a
# 400 naming it in ``param`` unless it holds a neutral value (``UNSUPPORTED``): never accepted
# and ignored.  ``user`` and other metadata that do not change the output are accepted.
#
# Checks that need the server's state (token ids against the vocabulary, the context length, the
# model name) are ``check_model`` and ``check_prompt`` below; the models check only the body
# itself.  Every refusal becomes an OpenAI-style body (``RequestError``, ``error_body`` above).

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
    # text, json_object or json_schema, checked and compiled by ``response_format_grammar``
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


# ``POST /v1/completions``' body: one prompt (text or token ids) or a batch of them, with
# echo, logprobs and ``suffix`` (refused unless empty) on top of the shared fields.

class CompletionRequest(GenerationRequest):
    """``POST /v1/completions``: one prompt (text or token ids) or a batch of them."""

    UNSUPPORTED: ClassVar[dict[str, tuple]] = {
        **GenerationRequest.UNSUPPORTED, "suffix": (None, "")}

    prompt: str | list[StrictInt] | list[str] | list[list[StrictInt]]
    max_tokens: int | None = Field(default=16, ge=0)  # 0 only with echo (checked in ``app``)
    echo: StrictBool | None = False  # the prompt before the completion (and its logprobs)
    logprobs: int | None = Field(default=None, ge=0, le=MAX_TOP_LOGPROBS)  # top-k per token
    suffix: Any = None

    @field_validator("prompt")
    @classmethod
    def _non_empty(cls, prompt: Any) -> Any:
        if len(prompt) == 0:
            raise ValueError("prompt must not be empty")
        if isinstance(prompt, list) and any(isinstance(p, str | list) and not p for p in prompt):
            raise ValueError("no prompt of a batch may be empty")
        return prompt

    @property
    def wants_logprobs(self) -> bool:
        return self.logprobs is not None

    @property
    def num_top_logprobs(self) -> int:
        return self.logprobs or 0

    @property
    def prompts(self) -> list[Prompt]:
        """The batch; a lone string or token-id list is a batch of one."""
        if isinstance(self.prompt, str) or not isinstance(self.prompt[0], str | list):
            return [self.prompt]
        return list(self.prompt)


# ``POST /v1/chat/completions``' body: messages (text or text parts, tool turns), logprobs,
# tools, and the chat-only fields this server refuses unless neutral, on top of the shared
# fields.

# the arguments the server gives the chat template itself
RESERVED_TEMPLATE_KWARGS = ("messages", "conversation", "tools", "documents", "tokenize",
                            "add_generation_prompt", "continue_final_message", "chat_template")


class TextPart(BaseModel):
    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")

    role: str = Field(min_length=1)
    content: str | list[TextPart] | None = None
    # an assistant turn's calls and a tool turn's answer, for templates with a tool format
    tool_calls: list[dict] | None = None
    tool_call_id: str | None = None
    name: str | None = None

    @field_validator("content", mode="before")
    @classmethod
    def _text_parts_only(cls, content: Any) -> Any:
        """Image, video and audio parts get a 400 that says why (the text model is served)."""
        if isinstance(content, list):
            for i, part in enumerate(content):
                kind = part.get("type") if isinstance(part, dict) else None
                if kind not in (None, "text"):
                    raise ValueError(f"content part {i} has type {kind!r}: this server serves "
                                     "the model's text only (no image, video or audio input)")
        return content

    @property
    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(part.text for part in self.content)
        return self.content or ""


class ChatCompletionRequest(GenerationRequest):
    """``POST /v1/chat/completions``; ``max_completion_tokens`` wins over ``max_tokens``; with
    neither, the rest of the context."""

    UNSUPPORTED: ClassVar[dict[str, tuple]] = {
        **GenerationRequest.UNSUPPORTED,
        "functions": (None, []), "function_call": (None, "none", "auto"),
        "audio": (None,), "modalities": (None, ["text"]), "prediction": (None,),
        "reasoning_effort": (None,), "web_search_options": (None,),
        "add_generation_prompt": (None, True), "continue_final_message": (None, False),
        "chat_template": (None,),
    }

    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(default=None, ge=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    logprobs: bool | None = None
    top_logprobs: int | None = Field(default=None, ge=0, le=MAX_TOP_LOGPROBS)
    # checked against the chat template by ``dasc_server.chat``
    tools: Any = None
    tool_choice: Any = None
    parallel_tool_calls: bool | None = None
    functions: Any = None
    function_call: Any = None
    audio: Any = None
    modalities: Any = None
    prediction: Any = None
    reasoning_effort: Any = None
    web_search_options: Any = None
    add_generation_prompt: Any = None
    continue_final_message: Any = None
    chat_template: Any = None
    # extra variables for the model's chat template, e.g. {"enable_thinking": false}
    chat_template_kwargs: dict[str, Any] | None = None

    @field_validator("chat_template_kwargs")
    @classmethod
    def _not_the_servers(cls, kwargs: dict[str, Any] | None) -> dict[str, Any] | None:
        taken = sorted(set(kwargs or {}) & set(RESERVED_TEMPLATE_KWARGS))
        if taken:
            raise ValueError(f"{', '.join(taken)} cannot be set here: the server passes them "
                             "to the template itself")
        return kwargs

    @field_validator("top_logprobs")
    @classmethod
    def _top_needs_logprobs(cls, top: int | None, info: ValidationInfo) -> int | None:
        if top and not info.data.get("logprobs"):
            raise ValueError("top_logprobs needs logprobs: true")
        return top

    @property
    def wants_logprobs(self) -> bool:
        return bool(self.logprobs)

    @property
    def num_top_logprobs(self) -> int:
        return (self.top_logprobs or 0) if self.logprobs else 0

    @property
    def requested_max_tokens(self) -> int | None:
        if self.max_completion_tokens is not None:
            return self.max_completion_tokens
        return self.max_tokens


# SGLang's native ``POST /generate`` body (served by ``dasc_server.app``): one prompt and
# SGLang's ``sampling_params``, turned into the same ``CompletionRequest`` the OpenAI route runs.

class NativeSamplingParams(NeutralOnly):
    """SGLang's ``sampling_params`` with SGLang's defaults (``max_new_tokens`` 128).  Unknown
    keys are refused, and so are the known ones this server cannot honour, unless neutral."""

    model_config = ConfigDict(extra="forbid")

    UNSUPPORTED: ClassVar[dict[str, tuple]] = {
        "min_p": (None, 0), "n": (None, 1), "json_schema": (None,), "regex": (None,),
        "ebnf": (None,), "structural_tag": (None,), "no_stop_trim": (None, False),
        "skip_special_tokens": (None, True), "spaces_between_special_tokens": (None, True),
        "stop_regex": (None,), "custom_params": (None,)}

    max_new_tokens: int | None = Field(default=128, ge=1)
    temperature: float = Field(default=1.0, ge=0.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    top_k: int = Field(default=-1, ge=-1)
    min_new_tokens: int = Field(default=0, ge=0)
    stop: str | list[str] | None = None
    stop_token_ids: list[StrictInt] | None = None
    ignore_eos: bool = False
    frequency_penalty: float = Field(default=0.0, ge=-2.0, le=2.0)
    presence_penalty: float = Field(default=0.0, ge=-2.0, le=2.0)
    repetition_penalty: float = Field(default=1.0, gt=0.0)
    logit_bias: dict[str, float] | None = None
    sampling_seed: int | None = Field(default=None, ge=0, lt=2**63)
    min_p: Any = None
    n: Any = None
    json_schema: Any = None
    regex: Any = None
    ebnf: Any = None
    structural_tag: Any = None
    no_stop_trim: Any = None
    skip_special_tokens: Any = None
    spaces_between_special_tokens: Any = None
    stop_regex: Any = None
    custom_params: Any = None


class NativeGenerateRequest(NeutralOnly):
    """``POST /generate`` as SGLang takes it, one prompt: ``text`` or ``input_ids``.  Fields
    beyond these are refused (a batch, logprobs, LoRA, images...), never ignored; ``rid``,
    ``log_metrics`` and ``no_logs`` do not change the output and are accepted."""

    model_config = ConfigDict(extra="forbid")

    UNSUPPORTED: ClassVar[dict[str, tuple]] = {
        "return_logprob": (None, False), "logprob_start_len": (None, -1),
        "top_logprobs_num": (None, 0), "token_ids_logprob": (None,),
        "return_text_in_logprobs": (None, False), "return_hidden_states": (None, False),
        "lora_path": (None,), "image_data": (None,), "audio_data": (None,),
        "video_data": (None,), "input_embeds": (None,), "custom_logit_processor": (None,),
        "data_parallel_rank": (None,), "session_params": (None,),
        "background": (None, False), "return_bytes": (None, False),
        "return_entropy": (None, False)}

    text: str | None = None
    input_ids: list[StrictInt] | None = Field(default=None, validate_default=True)
    sampling_params: NativeSamplingParams = Field(default_factory=NativeSamplingParams)
    stream: bool = False
    model: str | None = None  # the gateway sends null
    rid: str | None = None
    log_metrics: bool = True
    no_logs: bool = False
    background: Any = None
    return_bytes: Any = None
    return_entropy: Any = None
    return_logprob: Any = None
    logprob_start_len: Any = None
    top_logprobs_num: Any = None
    token_ids_logprob: Any = None
    return_text_in_logprobs: Any = None
    return_hidden_states: Any = None
    lora_path: Any = None
    image_data: Any = None
    audio_data: Any = None
    video_data: Any = None
    input_embeds: Any = None
    custom_logit_processor: Any = None
    data_parallel_rank: Any = None
    session_params: Any = None

    @field_validator("input_ids")
    @classmethod
    def _one_prompt(cls, input_ids: list[int] | None, info: ValidationInfo) -> list[int] | None:
        if (info.data.get("text") is None) == (input_ids is None):
            raise ValueError("send exactly one of text and input_ids")
        if input_ids == [] or info.data.get("text") == "":
            raise ValueError("the prompt must not be empty")
        return input_ids

    def completion_request(self) -> CompletionRequest:
        """The same request on the OpenAI route's path (``prepare`` in ``app``)."""
        s = self.sampling_params
        return CompletionRequest(
            model=self.model, prompt=self.text if self.text is not None else self.input_ids,
            max_tokens=s.max_new_tokens, temperature=s.temperature, top_p=s.top_p,
            top_k=s.top_k, seed=s.sampling_seed, stop=s.stop, stop_token_ids=s.stop_token_ids,
            ignore_eos=s.ignore_eos, presence_penalty=s.presence_penalty,
            frequency_penalty=s.frequency_penalty, repetition_penalty=s.repetition_penalty,
            logit_bias=s.logit_bias, min_tokens=s.min_new_tokens)


# Structured output: OpenAI's ``response_format`` -> an llguidance grammar for rank 0's mask.
#
# ``{"type": "text"}`` (or none) constrains nothing; ``{"type": "json_object"}`` makes the output
# one JSON object; ``{"type": "json_schema", "json_schema": {"name", "schema", "strict"}}`` makes
# it a JSON value the schema accepts.  The JSON is compact (``,`` and ``:`` without spaces, no
# newlines) unless the schema's own ``x-guidance`` options say otherwise, so a small model cannot
# spend its tokens on whitespace.  A schema llguidance cannot enforce (an unknown ``format``, a
# keyword it does not implement) is a 400 naming ``response_format``, never a looser grammar.
#
# Once the JSON is complete, rank 0 allows only EOS, so a request that ends with
# ``finish_reason: "stop"`` holds valid JSON; ``"length"`` means ``max_tokens`` cut it.

COMPACT = {"whitespace_flexible": False}  # llguidance's JsonCompileOptions
PARAM = "response_format"


def json_schema_grammar(schema: dict) -> str:
    """A JSON schema -> llguidance grammar (compact JSON unless the schema says otherwise)."""
    return llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=COMPACT)


def checked(grammar: str, param: str) -> str:
    """The grammar, or a 400 naming ``param`` with llguidance's reason."""
    error = llguidance.LLMatcher.validate_grammar(grammar)
    if error:
        raise RequestError(f"{param}: the grammar cannot be enforced: {error}", param=param)
    return grammar


def response_format_grammar(response_format: Any) -> str:
    """``response_format`` -> grammar ("" for text or none); 400 for anything else."""
    if response_format is None:
        return ""
    if not isinstance(response_format, dict) or not isinstance(response_format.get("type"),
                                                               str):
        raise RequestError("response_format must be an object with a type", param=PARAM)
    kind = response_format["type"]
    if kind == "text":
        return ""
    if kind == "json_object":
        return checked(json_schema_grammar({"type": "object"}), PARAM)
    if kind != "json_schema":
        raise RequestError(f"response_format type {kind!r} is not supported (text, "
                           "json_object, json_schema)", param=PARAM)
    spec = response_format.get("json_schema")
    if not isinstance(spec, dict) or not isinstance(spec.get("name"), str):
        raise RequestError("response_format json_schema needs an object with a name",
                           param=PARAM)
    schema = spec.get("schema", True)  # OpenAI: absent means any JSON value
    if schema is True:
        schema = {}
    if not isinstance(schema, dict):
        raise RequestError("response_format json_schema.schema must be a JSON schema object",
                           param=PARAM)
    try:
        grammar = json_schema_grammar(schema)
    except ValueError as e:
        raise RequestError(f"response_format: {e}", param=PARAM) from e
    return checked(grammar, PARAM)


# Checks of a request that need the server's state (the served model name, the vocabulary,
# the context length, the KV pool); the request models check only the body itself.

def check_model(requested: str | None, served: str) -> None:
    """Absent ``model`` means the served one; any other name is a 404 like OpenAI's."""
    if requested is not None and requested != served:
        raise RequestError(f"The model `{requested}` does not exist (this server serves "
                           f"`{served}`).", param="model", status=404, code="model_not_found")


def check_prompt(prompt_ids: list[int], max_tokens: int | None, *, vocab_size: int,
                 max_context_len: int, max_total_tokens: int | None = None,
                 param: str = "prompt") -> int:
    """Check ids and lengths; return the effective max_tokens (``None``: what is left of the
    context and of the KV pool, ``max_total_tokens`` rows, as the scheduler bounds a request:
    prompt + max_tokens within both, so a default is never refused)."""
    if not prompt_ids:
        raise RequestError("the prompt is empty (after tokenisation)", param=param)
    bad = next((t for t in prompt_ids if not 0 <= t < vocab_size), None)
    if bad is not None:
        raise RequestError(f"token id {bad} is outside the vocabulary [0, {vocab_size})",
                           param=param)
    prompt_len = len(prompt_ids)
    pool_len = max_context_len if max_total_tokens is None else max_total_tokens
    if max_tokens is None:
        max_tokens = min(max_context_len, pool_len) - prompt_len
    if max_tokens < 1 or prompt_len + max_tokens > max_context_len:
        raise RequestError(
            f"This model's maximum context length is {max_context_len} tokens; the request "
            f"needs {prompt_len + max(max_tokens, 1)} ({prompt_len} in the prompt, "
            f"{max(max_tokens, 1)} to generate).", param=param, code="context_length_exceeded")
    if prompt_len + max_tokens > pool_len:
        raise RequestError(
            f"the request needs {prompt_len + max_tokens} KV rows ({prompt_len} in the prompt, "
            f"{max_tokens} to generate), more than the server's pool of {pool_len} "
            "(--max-total-tokens)", param=param, code="context_length_exceeded")
    return max_tokens
