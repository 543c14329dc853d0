"""A routed-experts MoE layer of either router (Kimi's grouped routing with a shared expert,
Qwen3-Next's normalised top-k) with seeded random weights, and one of its expert forms run on
its own, for the tests that compare the forms."""

from __future__ import annotations

import torch

from model_runner.config import ModelConfig
from model_runner.layers.mlp import SparseMoE
from model_runner.parallel import TPGroup
from support.random_checkpoints import kimi_linear_config, qwen3_next_config


def moe(arch: str, num_experts: int, top_k: int) -> SparseMoE:
    if arch == "kda":
        raw = kimi_linear_config(num_local_experts=num_experts, num_experts_per_tok=top_k,
                                 num_shared_experts=1, n_group=4, topk_group=2)
        raw["architectures"] = ["KimiLinearForCausalLM"]
    else:
        raw = qwen3_next_config(num_experts=num_experts, num_experts_per_tok=top_k,
                                norm_topk_prob=True)
        raw["architectures"] = ["Qwen3NextForCausalLM"]
    layer = SparseMoE(ModelConfig.from_dict(raw), TPGroup(), torch.float32)
    gen = torch.Generator().manual_seed(num_experts + top_k)
    for p in layer.parameters():
        p.data.copy_(torch.randn(p.shape, generator=gen) * 0.1)
    return layer


def run(layer: SparseMoE, form: str, x: torch.Tensor) -> torch.Tensor:
    weights, ids = layer.route(x)
    out = torch.zeros_like(x)
    getattr(layer, f"_{form}_experts")(x, weights, ids, out)
    return out
