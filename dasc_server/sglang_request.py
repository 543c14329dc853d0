"""SGLang's native ``POST /generate`` body (served by ``dasc_server.sglang_routes``): one prompt and
SGLang's ``sampling_params``, turned into the same ``CompletionRequest`` the OpenAI route runs."""

from __future__ import annotations

from typing import Any, ClassVar

from pydantic import ConfigDict, Field, StrictInt, ValidationInfo, field_validator

from dasc_server.completion_request import CompletionRequest
from dasc_server.generation_request import NeutralOnly


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
