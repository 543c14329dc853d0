"""Checks of a request that need the server's state (the served model name, the vocabulary,
the context length, the KV pool); the request models check only the body itself."""

from __future__ import annotations

from dasc_server.request_errors import RequestError


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
