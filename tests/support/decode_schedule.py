"""Two decode paths compared step by step: runners whose every KV row and state slot starts as
a random sentinel (so a stray write shows), one schedule of prefills and decode steps with
scattered slots and pages, batches that pad (5 -> 8, 3 -> 4) and a context crossing the 256 ->
512 bucket, and an elementwise closeness check."""

from __future__ import annotations

import torch

from model_runner.batch import SeqInput
from model_runner.runner import ModelRunner, RunnerConfig
from support.runner_scenarios import PAGE, Pages, prompts

PROMPT_LENS = (250, 37, 5, 20, 61)  # the first crosses the 256 -> 512 context bucket


def assert_near(ours: torch.Tensor, ref: torch.Tensor, rel: float = 1e-5) -> None:
    """Elementwise within ``rel`` of the reference's largest magnitude (FP32 reassociation)."""
    torch.testing.assert_close(ours, ref, rtol=0, atol=rel * ref.abs().max().item())


def new_runner(model_dir, device: str, max_bs: int) -> ModelRunner:
    runner = ModelRunner(RunnerConfig(str(model_dir), device=device, num_pages=160,
                                      page_size=PAGE, num_state_slots=12,
                                      cuda_graph_max_bs=max_bs, cuda_graph_max_context=512))
    gen = torch.Generator().manual_seed(3)  # sentinels: every row and slot starts non-zero
    for cache in runner.kv.caches:
        cache.copy_(torch.randn(cache.shape, generator=gen))
    runner.state.temporal.copy_(torch.randn(runner.state.temporal.shape, generator=gen))
    runner.state.conv.copy_(torch.randn(runner.state.conv.shape, generator=gen))
    return runner


def decode_schedule(vocab: int) -> list[list[SeqInput]]:
    """Sequences and the decode steps they join: 5 (pads to 8), 3 (pads to 4), then 2 plus a
    fresh one-token prompt.  Slots and pages are scattered."""
    pages = Pages(160)
    seqs = [SeqInput(p, 0, pages.take(len(p) + 12), slot)
            for p, slot in zip(prompts(vocab, PROMPT_LENS), (7, 2, 11, 4, 9))]
    fresh = SeqInput([5], 0, pages.take(8), 3)
    return [seqs] * 4 + [seqs[1:4]] * 3 + [[seqs[0], seqs[4], fresh]] * 3


def run_schedule(runner: ModelRunner, tokens_from: list[torch.Tensor] | None = None):
    """Prefill, then the schedule; the next tokens are ``tokens_from`` when given (so two
    runners see the same inputs), else greedy.  Returns per-step logits."""
    steps = decode_schedule(runner.vocab_size)
    logits = [runner.forward(steps[0])]
    for i, step in enumerate(steps):
        chosen = (tokens_from[i] if tokens_from else logits[-1]).argmax(-1).tolist()
        for s, t in zip(steps[i - 1] if i else steps[0], chosen):
            s.prefix_len += len(s.token_ids)
            s.token_ids = [t]
        logits.append(runner.forward(step))
    return logits, steps
