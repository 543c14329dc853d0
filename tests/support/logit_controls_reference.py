"""The logit controls (logit_bias, presence, frequency and repetition penalties, min_tokens)
written out token by token from their documented semantics: the reference the sampler's
vectorised controls are checked against, on its own and end to end."""

from __future__ import annotations

from collections import Counter

import torch

from scheduler.wire.rank_messages import LogitControls


def reference(logits: torch.Tensor, c: LogitControls, prompt: list[int], output: list[int]
              ) -> torch.Tensor:
    """The controlled logits, written out token by token from the documented semantics."""
    x = logits.double().clone()
    for t in set(prompt) | set(output) if c.repetition_penalty != 1.0 else ():
        x[t] = x[t] / c.repetition_penalty if x[t] > 0 else x[t] * c.repetition_penalty
    for t, n in Counter(output).items():
        x[t] -= c.frequency_penalty * n + c.presence_penalty
    for t, b in c.logit_bias.items():
        x[t] += b
    if len(output) < c.min_tokens:
        x[c.banned_ids] = float("-inf")
    return x.float()
