"""Coded weights (``--cpu-coded-weights``, ``kernels.gemv.CodedWeight``): a bf16 runner gives its
linears and MoE layers coded copies of their weights, its decode steps stream those, and its
tokens and logits have the same bits with and without them, through prefill and batched
decode."""

from __future__ import annotations

import pytest
import torch
from support.random_checkpoints import make_model
from support.runner_scenarios import PAGE, greedy, prompts

from kernels.gemv import CODE_BLOCK, native_library, simd_available
from model_runner.batch import SeqInput
from model_runner.layers.linear import PackedGemm
from model_runner.layers.mlp import SparseMoE
from model_runner.runner import ModelRunner, RunnerConfig

pytestmark = pytest.mark.skipif(native_library() is None or not simd_available(),
                                reason="the coded GEMV needs a C compiler and AVX-512")


def bf16_runner(model_dir: str, coded: bool) -> ModelRunner:
    return ModelRunner(RunnerConfig(model_dir, dtype="bfloat16", num_pages=256, page_size=PAGE,
                                    num_state_slots=12, coded_weights=coded))


@pytest.mark.parametrize("arch", ["gdn", "qwen3_5"])
def test_the_same_bits_with_and_without_coded_copies(tmp_path, arch):
    make_model(arch, tmp_path)
    runs = {}
    for coded in (True, False):
        runner = bf16_runner(str(tmp_path), coded)
        linears = [m for m in runner.model.modules() if isinstance(m, PackedGemm)]
        # every bf16 weight whose rows are whole 64-element blocks, where decode runs its GEMV
        assert all((m.coded is not None) == (coded and m.weight.shape[1] % CODE_BLOCK == 0
                                             and m.decode_gemv) for m in linears)
        moes = [m for m in runner.model.modules() if isinstance(m, SparseMoE)]
        assert all((m.coded is not None) == coded for m in moes)
        assert any(m.coded is not None for m in linears) == coded
        seqs = [SeqInput(p, 0, list(range(i * 60, (i + 1) * 60)), i + 1)
                for i, p in enumerate(prompts(runner.vocab_size))]
        with torch.inference_mode():
            runs[coded] = greedy(runner, seqs, steps=6)
    (tokens, logits), (want_tokens, want_logits) = runs[True], runs[False]
    assert torch.equal(tokens, want_tokens) and torch.equal(logits, want_logits)
