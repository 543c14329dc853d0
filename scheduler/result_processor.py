"""The ranks' result of one step back into request state: computed lengths, prompt logprobs,
the checkpoints stored at chunk ends, sampled tokens and finishes, and the step's ``TokenOut``s
(one ``TokenBatch`` frame)."""

from __future__ import annotations

from scheduler.request import Req
from scheduler.request_table import RequestTable
from scheduler.step_planner import InFlight
from scheduler.wire.messages import TokenOut
from scheduler.wire.rank_messages import StepResult


def process_result(table: RequestTable, inflight: list[InFlight],
                   result: StepResult) -> list[TokenOut]:
    """``inflight``: the plan's sequences in plan order, as ``StepPlanner`` recorded them."""
    outs: list[TokenOut] = []
    sampled = iter(zip(result.token_ids, result.logprobs, strict=True))
    tops = iter(zip(result.top_ids, result.top_logprobs, strict=True))
    targets = iter(zip(result.target_logprobs, result.target_top_ids,
                       result.target_top_logprobs, strict=True))
    for r, n, is_sampled, has_targets, _ in inflight:
        r.computed += n
        if has_targets:
            lps, top_ids, top_lps = next(targets)
            r.prompt_logprobs += lps
            if r.sampling.top_logprobs:
                r.prompt_top_ids += top_ids
                r.prompt_top_logprobs += top_lps
        for end, ckpt in r.pending_stores:
            table.cache_prefix(r, end, ckpt)
        r.pending_stores = []
        if not is_sampled:
            continue
        token, logprob = next(sampled)
        top_ids, top_logprobs = next(tops, ([], []))
        r.output.append(token)
        reason = finish_reason(r, token, table.limits.eos_token_id)
        out = TokenOut(r.rid, [token], [logprob], finished=reason is not None,
                       finish_reason=reason, prompt_tokens=len(r.prompt),
                       cached_tokens=r.hit_len)
        if r.sampling.top_logprobs:
            out.top_ids, out.top_logprobs = [top_ids], [top_logprobs]
        if r.sampling.prompt_logprobs and len(r.output) == 1:
            out.prompt_logprobs, out.prompt_top_ids, out.prompt_top_logprobs = (
                r.prompt_logprobs, r.prompt_top_ids, r.prompt_top_logprobs)
            r.prompt_logprobs, r.prompt_top_ids, r.prompt_top_logprobs = [], [], []
        outs.append(out)
        if reason is not None:
            table.finish(r, reason)
    return outs


def finish_reason(r: Req, token: int, eos_token_id: int | None) -> str | None:
    s = r.sampling
    if (token == eos_token_id and not s.ignore_eos) or token in s.stop_token_ids:
        return "stop"
    return "length" if len(r.output) >= s.max_tokens else None
