"""Tiny random Qwen3-Next / Kimi-Linear checkpoints written by transformers itself.

The reference classes are transformers' own (pure-torch path: fla must be blocked before they
are imported, see ENVIRONMENT.md).  Decay parameters get a realistic spread (fla's init: A_log =
log U(1, 16), dt_bias = softplus^-1(dt), dt ~ logU(1e-3, 1e-1)) and norm weights are perturbed so
that no parameter is trivially 0 or 1.
"""

from __future__ import annotations

import math
import sys
from pathlib import Path

sys.modules.setdefault("fla", None)  # transformers' pure-torch path on CPU

import torch  # noqa: E402


def _spread_decay(module_a_log: torch.Tensor, module_dt_bias: torch.Tensor, gen) -> None:
    a = torch.empty(module_a_log.shape).uniform_(1.0, 16.0, generator=gen).log()
    dt = torch.empty(module_dt_bias.shape).uniform_(math.log(1e-3), math.log(1e-1),
                                                    generator=gen).exp()
    module_a_log.data.copy_(a)
    module_dt_bias.data.copy_(dt + torch.log(-torch.expm1(-dt)))


def _perturb(model, gen, std: float) -> None:
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(("A_log", "dt_bias")):
                continue
            if p.dim() == 1 or "norm" in name:
                p.add_(torch.randn(p.shape, generator=gen) * 0.1)
            else:
                p.normal_(0.0, std, generator=gen)
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.copy_(torch.randn(b.shape, generator=gen) * 0.05)


def qwen3_next_config(**overrides) -> dict:
    cfg = dict(vocab_size=96, hidden_size=64, intermediate_size=64, moe_intermediate_size=32,
               shared_expert_intermediate_size=32, num_hidden_layers=4, num_attention_heads=4,
               num_key_value_heads=2, head_dim=16, linear_key_head_dim=16,
               linear_value_head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4,
               num_experts=4, num_experts_per_tok=2, rms_norm_eps=1e-6,
               rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                                "partial_rotary_factor": 0.25})
    cfg.update(overrides)
    return cfg


def kimi_linear_config(**overrides) -> dict:
    num_layers = overrides.pop("num_hidden_layers", 4)
    full = overrides.pop("full_attn_layers", [2, 4])
    lin = dict(head_dim=16, num_heads=4, short_conv_kernel_size=4, full_attn_layers=full,
               kda_layers=[i for i in range(1, num_layers + 1) if i not in full])
    lin.update(overrides.pop("linear_attn_config", {}))
    cfg = dict(vocab_size=96, hidden_size=64, intermediate_size=64, moe_intermediate_size=32,
               num_hidden_layers=num_layers, num_attention_heads=4, num_key_value_heads=4,
               kv_lora_rank=32, qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=16,
               q_lora_rank=None, num_local_experts=4, num_experts_per_tok=2, n_group=1,
               topk_group=1, first_k_dense_replace=1, pad_token_id=0, bos_token_id=1,
               eos_token_id=2, rms_norm_eps=1e-5, linear_attn_config=lin)
    cfg.update(overrides)
    return cfg


def make_model(arch: str, out_dir: str | Path, seed: int = 0, std: float = 0.08, **overrides):
    """Create, perturb and save a tiny model; returns the transformers model (eval, fp32)."""
    from transformers import (
        KimiLinearConfig,
        KimiLinearForCausalLM,
        Qwen3NextConfig,
        Qwen3NextForCausalLM,
    )

    gen = torch.Generator().manual_seed(seed)
    torch.manual_seed(seed)
    if arch == "kda":
        model = KimiLinearForCausalLM(KimiLinearConfig(**kimi_linear_config(**overrides)))
        attn = [layer.self_attn for layer in model.model.layers]
        decays = [(a.forget_gate.A_log, a.forget_gate.dt_bias) for a in attn
                  if hasattr(a, "forget_gate")]
    else:
        model = Qwen3NextForCausalLM(Qwen3NextConfig(**qwen3_next_config(**overrides)))
        decays = [(layer.linear_attn.A_log, layer.linear_attn.dt_bias)
                  for layer in model.model.layers if hasattr(layer, "linear_attn")]
    _perturb(model, gen, std)
    for a_log, dt_bias in decays:
        _spread_decay(a_log, dt_bias, gen)
    model.config._attn_implementation = "eager"
    model.eval()
    model.save_pretrained(str(out_dir))
    return model
