"""The runner against transformers at the real models' per-layer shapes (fp32, short prompts).

The tiny models' heads are 32 wide; these are the benchmark models of
``model_runner/bench/real_shape_models`` (Qwen3-Next-80B's GDN 16 key / 32 value heads of 128
and gated
attention 16 q / 2 kv heads of 256; Kimi-Linear-48B's KDA 32 heads of 128, MLA with kv_lora_rank
512 and rope 64, hidden 2,304, experts 1,024 wide, a dense first layer of 9,216; Qwen3.5-0.8B's
and 35B-A3B's layers; OLMo-Hybrid-7B's 30 GDN heads of 96 / 192 and post-norm attention), cut to
4 layers, 2-4 experts and the byte tokenizer's vocabulary so that a reference and a runner fit
the test machine. Prefill logits at every
position, greedy decode, batched unequal prompts and a state round trip are checked, as for the
tiny models.
"""

from __future__ import annotations

import importlib

import pytest
import torch
from support.runner_scenarios import check_against_reference, make_runner, run_scenarios

STEPS = 4


def _shapes_module():
    # Imported when the test runs, not at collection: the module hides fla from transformers.
    return importlib.import_module("model_runner.bench.real_shape_models")


@pytest.mark.parametrize("name,num_experts", [
    ("qwen3-next-shape", 4), ("kimi-linear-shape", 2), ("qwen3.5-0.8b", 0),
    ("qwen3.5-35b-a3b-shape", 2), ("olmo-hybrid-7b-shape", 0)])
def test_real_shapes_match_transformers(name, num_experts, tmp_path):
    shapes = _shapes_module()
    hf = shapes.build(name, num_layers=4, num_experts=num_experts, vocab_size=264, seed=3,
                      dtype=torch.float32)
    hf.save_pretrained(str(tmp_path))
    if name == "kimi-linear-shape":  # the decays must give a spread of retention horizons
        a_log = torch.cat([m.A_log.reshape(-1) for m in hf.modules() if hasattr(m, "dt_bias")])
        assert a_log.exp().min() < 2 and a_log.exp().max() > 8
    runner = make_runner(str(tmp_path))
    text = hf.config.get_text_config()
    assert (runner.cfg.linear_key_head_dim, runner.cfg.linear_value_head_dim) == (
        text.linear_key_head_dim if name != "kimi-linear-shape" else 128,
        text.linear_value_head_dim if name != "kimi-linear-shape" else 128)
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, text.vocab_size, (n,), generator=gen).tolist()
               for n in (19, 7)]
    res = run_scenarios(runner, prompts, STEPS)
    del runner
    check_against_reference(hf, prompts, STEPS, res)
