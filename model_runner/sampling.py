"""Token sampling on rank 0: greedy, temperature, top-k, top-p, reproducible per request.

Each sampled token gets its own generator seeded from (request seed, output position), so a
request's tokens do not depend on which other requests share its batch.
"""

from __future__ import annotations

import torch

from scheduler.messages import Sample

_MIX = 0x9E3779B97F4A7C15


def sample_tokens(logits: torch.Tensor, specs: list[Sample]) -> tuple[list[int], list[float]]:
    """logits [B, vocab] (one row per spec) -> one token per row and its log-probability
    under the model's distribution (temperature 1, no truncation), as OpenAI reports it."""
    greedy = logits.argmax(dim=-1).tolist()
    tokens = [best if spec.temperature <= 0 else _sample_row(row, spec)
              for row, spec, best in zip(logits, specs, greedy)]
    logprobs = torch.log_softmax(logits.float(), dim=-1)  # [B, vocab]
    picked = logprobs.gather(1, torch.tensor(tokens, device=logits.device)[:, None])
    return tokens, picked.squeeze(1).tolist()


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
