"""A runner with the screened LM head (``lm_head_screen="on"``) gives, for every decode step of a
bf16 model, the greedy tokens of its full head; "auto" builds no screen for a small head."""

from __future__ import annotations

import pytest
import torch
from support.random_checkpoints import make_model
from support.runner_scenarios import PAGE

from kernels import lm_head
from kernels.gemv import simd_available as gemv_simd
from model_runner.batch import SeqInput
from model_runner.runner import ModelRunner, RunnerConfig

pytestmark = pytest.mark.skipif(
    not (lm_head.simd_available() and gemv_simd()),
    reason="the screen runs where AVX-512 VNNI and the AVX-512 GEMV do")


def _runner(model_dir, screen: str) -> ModelRunner:
    return ModelRunner(RunnerConfig(str(model_dir), dtype="bfloat16", num_pages=128,
                                    page_size=PAGE, num_state_slots=4, lm_head_screen=screen))


@torch.inference_mode()
def test_screened_greedy_is_the_full_heads(tmp_path):
    make_model("qwen3_5", tmp_path)  # tied embeddings: the head is the embedding
    runner = _runner(tmp_path, "on")
    assert runner.screened_head is not None
    assert _runner(tmp_path, "auto").screened_head is None  # 96 x 64 weights
    seqs = [SeqInput(list(range(3 + i, 40 + 3 * i)), 0, list(range(32 * i, 32 * (i + 1))), i + 1)
            for i in range(3)]
    hidden = runner.forward(seqs, head=False)
    for _ in range(12):
        want = runner.head_logits(hidden).max(dim=-1).indices.tolist()
        assert runner.greedy(hidden) == want
        for s, token in zip(seqs, want):
            s.prefix_len += len(s.token_ids)
            s.token_ids = [token]
        hidden = runner.forward(seqs, head=False)
