"""A checkpoint with tied embeddings and no ``lm_head.weight`` (Qwen3.5 as shipped): the LM head
reads the embedding's own tensor, not a copy, and a bf16 model whose GEMM weights are held in
fp32 (``--cpu-fp32-weights on``) converts the LM head's and leaves the embedding bf16."""

from __future__ import annotations

import torch
from support.random_checkpoints import make_model
from support.runner_scenarios import PAGE

from model_runner.batch import SeqInput
from model_runner.runner import ModelRunner, RunnerConfig


def _runner(model_dir, **kw) -> ModelRunner:
    return ModelRunner(RunnerConfig(str(model_dir), num_pages=64, page_size=PAGE,
                                    num_state_slots=3, **kw))


def test_tied_lm_head_is_the_embedding(tmp_path):
    make_model("qwen3_5", tmp_path)
    runner = _runner(tmp_path)
    assert runner.cfg.tie_word_embeddings
    assert runner.model.lm_head.weight is runner.model.model.embed_tokens.weight


def test_fp32_held_lm_head_leaves_the_embedding_bf16(tmp_path):
    make_model("qwen3_5", tmp_path)
    # (without coded copies: with them the untied embedding would read its rows from its own)
    held = _runner(tmp_path, dtype="bfloat16", fp32_weights=True, packed_weights=False,
                   coded_weights=False)
    embedding, head = held.model.model.embed_tokens.weight, held.model.lm_head.weight
    assert embedding.dtype == torch.bfloat16 and head.dtype == torch.float32
    assert torch.equal(head, embedding.float())
    plain = _runner(tmp_path, dtype="bfloat16", fp32_weights=False, packed_weights=False,
                    coded_weights=False)
    prompt = list(range(3, 30))
    with torch.inference_mode():
        got = held.forward([SeqInput(prompt, 0, list(range(12)), 1)])
        want = plain.forward([SeqInput(prompt, 0, list(range(12)), 1)])
    assert got.shape == want.shape and torch.isfinite(got).all()
    # fp32 GEMMs rounded once against bf16 GEMMs: the same next token on this prompt
    assert torch.equal(got.argmax(-1), want.argmax(-1))
