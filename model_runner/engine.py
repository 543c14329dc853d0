"""Offline generation over a ModelRunner: a tiny driver with free-list page and slot allocation.

Used by ``model_runner.generate`` and by tests; the serving scheduler replaces it.  Every TP rank
runs the same engine on the same prompts (SPMD) and therefore samples the same tokens.
"""

from __future__ import annotations

import torch

from model_runner.batch import SeqInput
from model_runner.runner import ModelRunner


def sample(logits: torch.Tensor, temperature: float, generator: torch.Generator | None
           ) -> list[int]:
    """logits [B, vocab] -> one token per row; temperature 0 is greedy."""
    if temperature <= 0:
        return logits.argmax(dim=-1).tolist()
    probs = torch.softmax(logits.float() / temperature, dim=-1)
    return torch.multinomial(probs.cpu(), 1, generator=generator).squeeze(-1).tolist()


def decode_until(runner: ModelRunner, seqs: list[SeqInput], logits: torch.Tensor,
                 max_new_tokens: int, stop_ids: set[int], temperature: float = 0.0,
                 generator: torch.Generator | None = None) -> list[list[int]]:
    """Sample from ``logits`` (the step that ended each sequence's prompt), then decode batched
    steps until each sequence has ``max_new_tokens`` tokens or emitted one of ``stop_ids``
    (kept in its output).  ``seqs`` are advanced in place."""
    tokens = sample(logits, temperature, generator)
    outputs = [[t] for t in tokens]
    active = [i for i, t in enumerate(tokens) if t not in stop_ids]
    for _ in range(max_new_tokens - 1):
        if not active:
            break
        for i in active:
            seqs[i].prefix_len += len(seqs[i].token_ids)
            seqs[i].token_ids = [outputs[i][-1]]
        tokens = sample(runner.forward([seqs[i] for i in active]), temperature, generator)
        for i, t in zip(active, tokens):
            outputs[i].append(t)
        active = [i for i, t in zip(active, tokens) if t not in stop_ids]
    return outputs


class OfflineEngine:
    def __init__(self, runner: ModelRunner):
        self.runner = runner
        self.free_pages = list(range(runner.rc.num_pages))
        self.free_slots = list(range(1, runner.rc.num_state_slots))  # slot 0 reserved

    @property
    def max_batch(self) -> int:
        return self.runner.rc.num_state_slots - 1

    def _allocate(self, num_tokens: int) -> tuple[list[int], int]:
        page_size = self.runner.rc.page_size
        need = -(-num_tokens // page_size)
        if need > len(self.free_pages) or not self.free_slots:
            raise RuntimeError(f"not enough KV pages ({need} needed, {len(self.free_pages)} free) "
                               f"or state slots ({len(self.free_slots)} free)")
        pages = [self.free_pages.pop() for _ in range(need)]
        return pages, self.free_slots.pop()

    def generate(self, prompts: list[list[int]], max_new_tokens: int, temperature: float = 0.0,
                 seed: int = 0, eos_token_id: int | None = None) -> list[list[int]]:
        """Generate up to ``max_new_tokens`` per prompt, batching up to ``max_batch`` prompts."""
        if max_new_tokens < 1:
            raise ValueError("max_new_tokens must be at least 1")
        for p in prompts:
            if not p:
                raise ValueError("empty prompt")
            self.runner.check_tokens(p)
        generator = torch.Generator().manual_seed(seed)
        out: list[list[int]] = []
        for start in range(0, len(prompts), self.max_batch):
            group = prompts[start : start + self.max_batch]
            out.extend(self._generate_group(group, max_new_tokens, temperature, generator,
                                            eos_token_id))
        return out

    def _generate_group(self, prompts, max_new_tokens, temperature, generator, eos_token_id):
        seqs = []
        try:
            for p in prompts:
                pages, slot = self._allocate(len(p) + max_new_tokens)
                seqs.append(SeqInput(list(p), 0, pages, slot))
            stop = {eos_token_id} if eos_token_id is not None else set()
            return decode_until(self.runner, seqs, self.runner.forward(seqs), max_new_tokens,
                                stop, temperature, generator)
        finally:
            for s in seqs:
                self.free_pages.extend(s.page_table)
                self.free_slots.append(s.state_slot)
