"""What ``Scheduler.add`` refuses: an empty or out-of-vocabulary prompt, a length past the
context or the KV pool, and logit controls out of range.  Each check returns the error message
the refusing frame carries, or None."""

from __future__ import annotations

import math

from scheduler.limits import RankLimits
from scheduler.wire.messages import SamplingParams


def _is_real(x: object) -> bool:
    if isinstance(x, bool):
        return False
    return isinstance(x, int) or (isinstance(x, float) and math.isfinite(x))


def check_request(limits: RankLimits, max_total_tokens: int, prompt: list[int],
                  s: SamplingParams) -> str | None:
    if not prompt:
        return "the prompt is empty"
    if any(not 0 <= t < limits.vocab_size for t in prompt):
        return f"token ids must lie in [0, {limits.vocab_size})"
    if s.max_tokens < 1:
        return "max_tokens must be at least 1"
    total = len(prompt) + s.max_tokens
    limit = min(limits.max_context_len, max_total_tokens)
    if total > limit:
        return (f"prompt ({len(prompt)} tokens) + max_tokens ({s.max_tokens}) = {total} "
                f"exceeds the limit of {limit} tokens")
    return check_logit_controls(limits.vocab_size, s) if s.has_logit_controls else None


def check_logit_controls(vocab: int, s: SamplingParams) -> str | None:
    if not isinstance(s.logit_bias, dict):
        return "logit_bias must map token ids to biases"
    for token, bias in s.logit_bias.items():
        if isinstance(token, bool) or not isinstance(token, int) or not 0 <= token < vocab:
            return f"logit_bias token ids must lie in [0, {vocab}), got {token!r}"
        if not _is_real(bias) or not -100 <= bias <= 100:
            return f"logit_bias values must lie in [-100, 100], got {bias!r} for {token}"
    for name in ("presence_penalty", "frequency_penalty"):
        value = getattr(s, name)
        if not _is_real(value) or not -2 <= value <= 2:
            return f"{name} must lie in [-2, 2], got {value!r}"
    if not _is_real(s.repetition_penalty) or not s.repetition_penalty > 0:
        return f"repetition_penalty must be a number > 0, got {s.repetition_penalty!r}"
    if not isinstance(s.min_tokens, int) or s.min_tokens < 0:
        return f"min_tokens must be at least 0, got {s.min_tokens!r}"
    if s.min_tokens > s.max_tokens:
        return f"min_tokens ({s.min_tokens}) must not exceed max_tokens ({s.max_tokens})"
    return None
