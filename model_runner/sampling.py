"""Token sampling on rank 0: greedy, temperature, top-k, top-p, reproducible per request, and
the logit controls (logit_bias, presence/frequency/repetition penalties, min_tokens), and the
log-probabilities OpenAI reports (the sampled token's, and the k likeliest tokens' for requests
that ask for them), and structured output (a grammar's token mask, ``model_runner.grammar``).

Each sampled token gets its own generator seeded from (request seed, output position), so a
request's tokens do not depend on which other requests share its batch; the logit controls
keep that property because each one reads only its own request's row and history.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from model_runner.grammar import GrammarMatcher, TokenizerCache
from scheduler.wire.rank_messages import LogitControls, Sample

_MIX = 0x9E3779B97F4A7C15


class RequestControls:
    """One request's logit controls on rank 0 and the history they need: counts of the tokens
    sampled for it (presence/frequency) and the set of prompt or sampled tokens (repetition),
    each a [vocab] tensor on the logits' device, allocated only when its penalty is on, and
    the grammar's matcher (``grammar_tokenizer`` builds the tokenizer it needs)."""

    def __init__(self, c: LogitControls, vocab_size: int, device: torch.device,
                 grammar_tokenizer: TokenizerCache | None = None):
        self.c = c
        self.num_sampled = 0
        self.bias_ids = self.bias = self.counts = self.seen = self.banned = None
        self.matcher = None
        if c.grammar:
            if grammar_tokenizer is None:
                raise RuntimeError("a request has a grammar, but rank 0 has no tokenizer")
            self.matcher = GrammarMatcher(grammar_tokenizer, c.grammar, vocab_size)
        if c.logit_bias:
            self.bias_ids = torch.tensor(list(c.logit_bias), dtype=torch.long, device=device)
            self.bias = torch.tensor(list(c.logit_bias.values()), dtype=torch.float32,
                                     device=device)
        if c.presence_penalty or c.frequency_penalty:
            self.counts = torch.zeros(vocab_size, dtype=torch.float32, device=device)
        if c.repetition_penalty != 1.0:
            self.seen = torch.zeros(vocab_size, dtype=torch.bool, device=device)
            self.seen[torch.tensor(c.prompt_ids, dtype=torch.long, device=device)] = True
        if c.min_tokens and c.banned_ids:
            self.banned = torch.tensor(c.banned_ids, dtype=torch.long, device=device)

    def apply(self, row: torch.Tensor) -> torch.Tensor:
        """logits [vocab] -> controlled float32 logits [vocab] (a new tensor), in the order
        ``LogitControls`` documents."""
        c, x = self.c, row.float().clone()  # never write into the batch's logits
        if self.seen is not None:
            penalised = torch.where(x > 0, x / c.repetition_penalty, x * c.repetition_penalty)
            x = torch.where(self.seen, penalised, x)
        if self.counts is not None:
            x = (x - c.frequency_penalty * self.counts
                 - c.presence_penalty * (self.counts > 0).float())
        if self.bias is not None:
            x.index_add_(0, self.bias_ids, self.bias)
        is_banning = self.banned is not None and self.num_sampled < c.min_tokens
        if is_banning:
            x[self.banned] = float("-inf")
        if self.matcher is not None:
            allowed = self.matcher.allowed(x.device)  # [vocab] bool
            masked = x.masked_fill(~allowed, float("-inf"))
            # only the ban makes logits -inf: if it leaves the grammar nothing, the grammar wins
            if is_banning and not torch.isfinite(masked).any():
                masked = row.float().masked_fill(~allowed, float("-inf"))
            x = masked
        return x

    def record(self, token: int) -> None:
        self.num_sampled += 1
        if self.counts is not None:
            self.counts[token] += 1
        if self.seen is not None:
            self.seen[token] = True
        if self.matcher is not None:
            self.matcher.consume(token)


class LogitControlTable:
    """Rank 0's ``RequestControls`` by request id: created from the controls a request's first
    ``Sample`` carries, dropped with its row table (``release``).  Requests without controls
    have no entry and cost one dict miss per sampled token.  ``grammar_tokenizer`` (a
    ``model_runner.grammar.TokenizerCache``) serves requests with a grammar."""

    def __init__(self, grammar_tokenizer: TokenizerCache | None = None):
        self._reqs: dict[str, RequestControls] = {}
        self.grammar_tokenizer = grammar_tokenizer

    def __len__(self) -> int:
        return len(self._reqs)

    def release(self, rids: list[str]) -> None:
        for rid in rids:
            self._reqs.pop(rid, None)

    def holds(self, rids: list[str]) -> bool:
        """Whether any of these requests has controls."""
        return bool(self._reqs) and any(rid in self._reqs for rid in rids)

    def for_batch(self, rids: list[str], specs: list[Sample], logits: torch.Tensor
                  ) -> list[RequestControls | None] | None:
        """Each row's controls (None: no controls in this batch at all)."""
        if not self._reqs and all(spec.controls is None for spec in specs):
            return None
        out = []
        for rid, spec in zip(rids, specs, strict=True):
            if spec.controls is not None:
                self._reqs[rid] = RequestControls(spec.controls, logits.shape[-1],
                                                  logits.device, self.grammar_tokenizer)
            ctl = self._reqs.get(rid)
            if ctl is not None and ctl.num_sampled != spec.index:
                raise RuntimeError(f"request {rid!r}: rank 0 sampled {ctl.num_sampled} tokens, "
                                   f"the plan asks for token {spec.index}")
            out.append(ctl)
        return out if any(ctl is not None for ctl in out) else None


class Sampled(NamedTuple):
    """Rank 0's answer for the sampled rows of a batch, in row order.  Log-probabilities are
    the model's (log-softmax at temperature 1, no truncation, no logit controls), as OpenAI
    reports them."""

    token_ids: list[int]
    logprobs: list[float]  # of each sampled token
    # each row's ``num_top_logprobs`` likeliest tokens, most likely first ([] for a row that
    # asks for none); both lists are empty when no row of the batch asks
    top_ids: list[list[int]]
    top_logprobs: list[list[float]]
    # prompt logprobs of the step's sequences that ask (``target_logprobs``), in plan order;
    # left empty by ``sample_tokens``
    target_logprobs: list[list[float]] = []
    target_top_ids: list[list[list[int]]] = []
    target_top_logprobs: list[list[list[float]]] = []


def target_logprobs(logits: torch.Tensor, targets: list[int], k: int
                    ) -> tuple[list[float], list[list[int]], list[list[float]]]:
    """logits [n, vocab] of consecutive positions, the token that follows each (n of them)
    -> each target's logprob and, per row, the k likeliest ids and logprobs (as
    ``top_logprobs``; [] per row when k is 0).  The model's distribution, as ``Sampled``'s."""
    logprobs = torch.log_softmax(logits.float(), dim=-1)  # [n, vocab]
    index = torch.tensor(targets, dtype=torch.long, device=logits.device)[:, None]
    picked = logprobs.gather(1, index).squeeze(1).tolist()
    top_ids, top_values = top_logprobs(logprobs, [k] * len(targets))
    if not k:
        top_ids, top_values = [[] for _ in targets], [[] for _ in targets]
    return picked, top_ids, top_values


def sample_tokens(logits: torch.Tensor, specs: list[Sample],
                  controls: list[RequestControls | None] | None = None) -> Sampled:
    """logits [B, vocab] (one row per spec) -> one token per row and the log-probabilities
    ``Sampled`` describes.  ``controls`` (one per row, from ``LogitControlTable.for_batch``)
    change the logits a row samples from, and record the token sampled."""
    # max's indices are argmax's (the first maximum; NaN wins) at a third of the time on a CPU:
    # 0.24 against 0.72 ms for FP32 logits [2, 248320] (as the LM head returns them), one thread
    greedy = logits.max(dim=-1).indices.tolist()
    tokens = []
    for i, (row, spec, best) in enumerate(zip(logits, specs, greedy)):
        ctl = controls[i] if controls is not None else None
        if ctl is not None:
            row = ctl.apply(row)
            best = int(row.argmax())
        tokens.append(best if spec.temperature <= 0 else _sample_row(row, spec))
        if ctl is not None:
            ctl.record(tokens[-1])
    logprobs = _log_softmax(logits)  # [B, vocab], read before the next call
    picked = logprobs.gather(1, torch.tensor(tokens, device=logits.device)[:, None])
    top_ids, top_values = top_logprobs(logprobs, [spec.num_top_logprobs for spec in specs])
    return Sampled(tokens, picked.squeeze(1).tolist(), top_ids, top_values)


# ``_log_softmax``'s output, kept from call to call (one per device).  A fresh [B, vocab] FP32
# tensor every step is fresh memory the kernel must fault in: on the 2-core VM, ~330 page faults
# a decode step at Qwen3.5-0.8B's 248k-token vocabulary, ~7 % of a serving decode step.
_LOGPROBS: dict[torch.device, torch.Tensor] = {}


def _log_softmax(logits: torch.Tensor) -> torch.Tensor:
    """log_softmax of logits [B, vocab] in FP32, into the kept buffer (valid until the next
    call)."""
    size = logits.numel()
    buf = _LOGPROBS.get(logits.device)
    if buf is None or buf.numel() < size:
        buf = _LOGPROBS[logits.device] = torch.empty(size, device=logits.device)
    return torch.log_softmax(logits.float(), dim=-1, out=buf[:size].view(logits.shape))


def top_logprobs(logprobs: torch.Tensor, ks: list[int]
                 ) -> tuple[list[list[int]], list[list[float]]]:
    """logprobs [B, vocab], k per row -> each row's k likeliest token ids and their
    log-probabilities, most likely first; ([], []) when every k is 0, so batches without such
    requests pay one scan of ``ks``.  Row by row: a row's answer never depends on its batch."""
    if not any(ks):
        return [], []
    ids, values = [], []
    for row, k in zip(logprobs, ks, strict=True):
        top = row.topk(min(k, row.numel())) if k > 0 else None
        ids.append(top.indices.tolist() if top is not None else [])
        values.append(top.values.tolist() if top is not None else [])
    return ids, values


def _sample_row(row: torch.Tensor, spec: Sample) -> int:
    probs = torch.softmax(row.float().cpu() / spec.temperature, dim=-1)  # [vocab]
    if spec.top_k > 0:
        kth = torch.topk(probs, min(spec.top_k, probs.numel())).values[-1]
        probs = torch.where(probs >= kth, probs, 0.0)
    if spec.top_p < 1.0:
        sorted_probs, order = torch.sort(probs, descending=True)
        before = torch.cumsum(sorted_probs, 0) - sorted_probs  # mass strictly above each token
        sorted_probs[before >= spec.top_p * sorted_probs.sum()] = 0.0
        probs = torch.zeros_like(probs).scatter_(0, order, sorted_probs)
    gen = torch.Generator().manual_seed((spec.seed * _MIX + spec.index) % (1 << 63))
    return int(torch.multinomial(probs, 1, generator=gen))
