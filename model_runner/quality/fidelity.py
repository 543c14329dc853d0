"""Logit fidelity: how far an arm's next-token distributions drift from the dense arm's while
both teacher-force the same suffix on top of the restored prefix.

The suffix is T = question + gold completion, t tokens.  The logits at suffix position i predict
T[i + 1], so positions [0, t - 1) are scored: the prediction of T[0] comes from the context's
last token, before any arm acts, and the one after the final newline has no gold token.  Per
instance we report KL(p_dense || p_arm) averaged over the scored positions (nats) and the
per-token negative log-likelihood of T[1:]; Δ NLL = NLL_arm - NLL_dense.  Unlike accuracy these
move with any change of the state, whether or not the task is solved from it.
"""

from __future__ import annotations

import torch


def scored_logprobs(logits: torch.Tensor) -> torch.Tensor:
    """Suffix logits [t, V] -> log-probabilities [t - 1, V] (fp64) of the scored positions."""
    return torch.log_softmax(logits[:-1].double(), dim=-1)


def mean_kl(ref: torch.Tensor, arm: torch.Tensor) -> float:
    """KL(ref || arm) per position, averaged; both are log-probabilities [P, V]."""
    return float((ref.exp() * (ref - arm)).sum(-1).mean())


def mean_nll(logp: torch.Tensor, suffix: list[int]) -> float:
    """Per-token NLL of T[1:] under log-probabilities [t - 1, V] of the scored positions."""
    targets = torch.tensor(suffix[1:], device=logp.device).unsqueeze(-1)
    return float(-logp.gather(-1, targets).mean())


def greedy_reproduces(logits: torch.Tensor, question_len: int, completion: list[int]) -> bool:
    """Whether greedy decoding after the question would emit exactly ``completion``: every
    teacher-forced argmax along the gold completion is the gold token.  ``logits``: [t, V]."""
    a, b = question_len - 1, question_len - 1 + len(completion)
    predicted = logits[a:b].argmax(-1).tolist()
    return predicted == list(completion)
