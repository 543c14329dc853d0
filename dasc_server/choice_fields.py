"""The fields every choice of an answer carries, streamed or not: ``index``, ``finish_reason``,
OpenAI's ``logprobs`` (completions' and chat's forms) and, when asked, the token ids."""

from __future__ import annotations

from typing import Any

from dasc_server.detokenizer import token_bytes, token_text
from dasc_server.jobs import Choice, Collected, Delta, Job


def choice_fields(job: Job, choice: Choice, body: dict, got: Delta | Collected,
                  tokenizer: Any | None, with_prompt_ids: bool) -> dict:
    """One choice of an answer: ``body`` (text, message or delta) with the common fields."""
    out = {"index": choice.index, **body, "finish_reason": got.finish_reason,
           "logprobs": _logprobs(job, choice, got, tokenizer) if job.logprobs else None}
    if job.return_token_ids:
        out["token_ids"] = got.token_ids
        if with_prompt_ids:
            out["prompt_token_ids"] = choice.prompt_ids
    return out


def _logprobs(job: Job, choice: Choice, got: Delta | Collected, tokenizer: Any | None
              ) -> dict:
    """OpenAI's ``logprobs`` of the generated tokens, under the model (temperature 1).
    Completions: token texts, their logprobs, maps text -> logprob of the likeliest tokens and
    the sampled one (up to k + 1 entries, most likely first), and each token's offset in the
    completion.  Chat: ``content``, one entry per token with its k likeliest alternatives.
    A token that holds part of a character is written ``bytes:\\xNN``; tokens are their ids as
    strings when there is no tokenizer."""
    def raw(token_id: int) -> bytes:
        return str(token_id).encode() if tokenizer is None else token_bytes(tokenizer, token_id)

    tops = zip(got.top_ids or [[]] * len(got.token_ids),
               got.top_logprobs or [[]] * len(got.token_ids), strict=True)
    if job.is_chat:
        def entry(token_id: int, logprob: float) -> dict:
            b = raw(token_id)
            return {"token": token_text(b), "logprob": logprob, "bytes": list(b)}

        return {"content": [{**entry(t, lp), "top_logprobs": [entry(*p) for p in zip(*top)]}
                            for t, lp, top in zip(got.token_ids, got.logprobs, tops)]}
    entries = list(zip(got.token_ids, got.logprobs, tops))
    if got.echo_ids:  # the prompt's first token has no logprob (nothing predicts it)
        num = len(got.echo_ids) - 1
        echo_tops = zip(got.echo_top_ids or [[]] * num, got.echo_top_logprobs or [[]] * num,
                        strict=True)
        prompt = list(zip(got.echo_ids[1:], got.echo_logprobs or [None] * num, echo_tops))
        entries = [(got.echo_ids[0], None, None), *prompt, *entries]
    maps: list[dict | None] = []
    for t, lp, top in entries:
        if lp is None:
            maps.append(None)
            continue
        ranked = sorted({**dict(zip(*top)), t: lp}.items(), key=lambda p: -p[1])
        maps.append({})
        for token_id, logprob in ranked:
            maps[-1].setdefault(token_text(raw(token_id)), logprob)
    return {"tokens": [token_text(raw(t)) for t, _, _ in entries],
            "token_logprobs": [lp for _, lp, _ in entries], "top_logprobs": maps,
            "text_offset": [choice.offsets.step(raw(t)) for t, _, _ in entries]}
