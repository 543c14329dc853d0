"""Qwen3.5, dense and MoE: Qwen3-Next's layers with the GDN projections stored apart.

On disk a GDN layer has ``in_proj_qkv`` (rows ``[q (Hk*Dk) | k (Hk*Dk) | v (Hv*Dv)]``, the conv
channels' order), ``in_proj_z`` (Hv*Dv), ``in_proj_b`` and ``in_proj_a`` (Hv each); value head
``kh*r + j`` belongs to key head kh, as in Qwen3-Next, so a rank keeps whole bundles the same
way.  The loader fills Qwen3-Next's merged projections from them (``in_proj_qkvz`` from
``in_proj_qkv`` and ``in_proj_z``, ``in_proj_ba`` from ``in_proj_b`` and ``in_proj_a``).

The gated attention, the (1 + w) norms, the MLP and the MoE block (softmax top-k, renormalised,
sigmoid-gated shared expert) are Qwen3-Next's.  Rotary: Qwen3.5's multimodal rope interleaves
three position streams, which are equal for text, so it is plain partial rotary.

Checkpoints: ``Qwen3_5ForCausalLM`` / ``Qwen3_5MoeForCausalLM`` keep the language model under
``model.``; ``...ForConditionalGeneration`` (what Qwen ships) under ``model.language_model.``
beside a vision tower ``model.visual.``, which is not loaded.  Multi-token-prediction weights
(``mtp.``) are not loaded either.  MoE experts come per expert (``experts.{e}.gate_proj``, as
transformers saves them) or fused (``experts.gate_up_proj`` [E, 2I, H] and
``experts.down_proj`` [E, H, I], as Qwen publishes them).
"""

from __future__ import annotations

import torch

from model_runner.config import ModelConfig
from model_runner.layers.linear import ColumnParallelLinear, group_rows
from model_runner.models.qwen3_next import GatedDeltaNet, Qwen3NextForCausalLM

LANGUAGE_MODEL = "model.language_model."


class SplitProjectionGDN(GatedDeltaNet):
    """GDN whose q/k/v, z, b and a projections are separate tensors on disk."""

    def build_projections(self, cfg: ModelConfig, dtype: torch.dtype, bundles: list[int],
                          v_heads: list[int]) -> None:
        heads = torch.tensor(v_heads)
        self.in_proj_qkvz = ColumnParallelLinear(cfg.hidden_size, {
            "qkv": torch.cat(self.qkv_rows), "z": group_rows(v_heads, self.dv)}, dtype)
        self.in_proj_ba = ColumnParallelLinear(cfg.hidden_size, {"b": heads, "a": heads}, dtype)


class Qwen3_5ForCausalLM(Qwen3NextForCausalLM):
    """Every Qwen3.5 architecture, dense or MoE, text-only or as shipped with vision."""

    gdn_class = SplitProjectionGDN
    name_rules = [
        (r"^(mtp|model\.visual)\.", None, None),
        (r"\.linear_attn\.in_proj_qkv\.weight$", ".linear_attn.in_proj_qkvz.weight", "qkv"),
        (r"\.linear_attn\.in_proj_z\.weight$", ".linear_attn.in_proj_qkvz.weight", "z"),
        (r"\.linear_attn\.in_proj_b\.weight$", ".linear_attn.in_proj_ba.weight", "b"),
        (r"\.linear_attn\.in_proj_a\.weight$", ".linear_attn.in_proj_ba.weight", "a"),
        (r"\.mlp\.experts\.gate_up_proj$", ".mlp.w13", "fused"),
        (r"\.mlp\.experts\.down_proj$", ".mlp.w2", "fused"),
        *Qwen3NextForCausalLM.name_rules[1:],
    ]

    @classmethod
    def map_name(cls, name: str) -> tuple[str | None, object]:
        if name.startswith(LANGUAGE_MODEL):
            name = "model." + name[len(LANGUAGE_MODEL):]
        return super().map_name(name)
