"""Qwen3-Next: Gated DeltaNet linear attention + gated full attention with partial rotary.

GDN on-disk layout, per key head (a "bundle"): ``in_proj_qkvz`` rows
``[q (Dk) | k (Dk) | v (r*Dv) | z (r*Dv)]`` and ``in_proj_ba`` rows ``[b (r) | a (r)]`` with
r = value heads per key head; conv channels ``[q (Hk*Dk) | k (Hk*Dk) | v (Hv*Dv)]``; value head
``kh*r + j`` belongs to key head kh.  A rank keeps whole bundles, listed in ``bundles``.
The loader regroups the projection rows part by part (``[q | k | v | z]`` over the rank's
bundles, ``[b | a]``), so the projection's output is already in conv-channel order.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from kernels.cpu_fused import l2norm_qkv
from kernels.delta_rule.naive import l2norm_rsqrt
from model_runner.config import ModelConfig
from model_runner.layers.attention import PartialRotary, paged_attention, split_kv, store_kv
from model_runner.layers.linear import (
    ColumnParallelLinear,
    RowParallelLinear,
    attach_loader,
    group_rows,
    new_param,
    rank_slice,
)
from model_runner.layers.norm import GatedRMSNorm, RMSNorm
from model_runner.models.common import (
    DecoderLayer,
    HybridForCausalLM,
    StepContext,
    delta_rule,
    rank_bundles,
    short_conv,
)
from model_runner.parallel import TPGroup


class GatedDeltaNet(nn.Module):
    """The GDN mixer.  Its projections are kept in one layout whatever the checkpoint's:
    ``in_proj_qkvz`` outputs ``[q | k | v | z]`` over this rank's bundles (conv-channel order
    first), ``in_proj_ba`` outputs ``[b | a]``; ``build_projections`` says where those rows
    come from on disk (Qwen3-Next's per-bundle fused rows here, split tensors in the other
    families' subclasses)."""

    def __init__(self, cfg: ModelConfig, tp: TPGroup, dtype: torch.dtype, bundles: list[int],
                 linear_index: int, norm_eps: float | None = None):
        super().__init__()
        self.linear_index = linear_index
        self.beta_scale = cfg.linear_beta_scale  # 2.0: OLMo-Hybrid's negative eigenvalues
        r, dk, dv = cfg.gva_ratio, cfg.linear_key_head_dim, cfg.linear_value_head_dim
        num_k = cfg.linear_num_key_heads
        self.num_k_local, self.num_v_local = len(bundles), len(bundles) * r
        self.r, self.dk, self.dv = r, dk, dv
        v_heads = [b * r + j for b in bundles for j in range(r)]
        # conv channels [q (Hk*Dk) | k (Hk*Dk) | v (Hv*Dv)]: this rank's rows of each
        self.qkv_rows = (group_rows(bundles, dk), num_k * dk + group_rows(bundles, dk),
                         2 * num_k * dk + group_rows(v_heads, dv))
        self.build_projections(cfg, dtype, bundles, v_heads)
        self.conv1d = nn.Module()
        self.conv1d.weight = attach_loader(
            new_param(sum(map(len, self.qkv_rows)), cfg.linear_conv_kernel_dim, dtype=dtype),
            {None: torch.cat(self.qkv_rows)}, transform=lambda w: w.reshape(w.shape[0], -1))
        heads = torch.tensor(v_heads)
        self.A_log = attach_loader(new_param(len(v_heads), dtype=torch.float32), {None: heads})
        self.dt_bias = attach_loader(new_param(len(v_heads), dtype=torch.float32), {None: heads})
        self.norm = GatedRMSNorm(dv, norm_eps or cfg.rms_norm_eps, dtype, gate="silu")
        self.out_proj = RowParallelLinear(group_rows(v_heads, dv), cfg.hidden_size, tp, dtype)

    def build_projections(self, cfg: ModelConfig, dtype: torch.dtype, bundles: list[int],
                          v_heads: list[int]) -> None:
        """Qwen3-Next: per key head, ``in_proj_qkvz`` rows [q | k | v (r*Dv) | z (r*Dv)] and
        ``in_proj_ba`` rows [b (r) | a (r)]; the rows are regrouped part by part."""
        r, dk, dv = self.r, self.dk, self.dv
        size, parts = 2 * dk + 2 * r * dv, [(0, dk), (dk, dk), (2 * dk, r * dv),
                                            (2 * dk + r * dv, r * dv)]  # q, k, v, z
        self.in_proj_qkvz = ColumnParallelLinear(cfg.hidden_size, {None: torch.cat(
            [group_rows(bundles, size, a, n) for a, n in parts])}, dtype)
        self.in_proj_ba = ColumnParallelLinear(cfg.hidden_size, {None: torch.cat(
            [group_rows(bundles, 2 * r, 0, r), group_rows(bundles, 2 * r, r, r)])}, dtype)

    def forward(self, x: torch.Tensor, ctx: StepContext) -> torch.Tensor:
        n, hk, hv = x.shape[0], self.num_k_local, self.num_v_local
        dk, dv = self.dk, self.dv
        mixed, z = self.in_proj_qkvz(x).split([2 * hk * dk + hv * dv, hv * dv], dim=-1)
        b, a = self.in_proj_ba(x).split([hv, hv], dim=-1)
        mixed = short_conv(mixed, self.conv1d.weight, ctx, self.linear_index)
        qkv = l2norm_qkv(mixed, hk, dk)  # one pass in C on a CPU
        if qkv is None:
            q, k, v = mixed.split([hk * dk, hk * dk, hv * dv], dim=-1)
            qkv = (l2norm_rsqrt(q.reshape(n, hk, dk).float()),
                   l2norm_rsqrt(k.reshape(n, hk, dk).float()), v.float())
        q, k, v = qkv
        beta = b.sigmoid() if self.beta_scale == 1.0 else b.sigmoid() * self.beta_scale
        g = -self.A_log.float().exp() * F.softplus(a.float() + self.dt_bias)
        o = delta_rule(q, k, v.reshape(n, hv, dv), g, beta.float(), ctx, self.linear_index,
                       scale=dk**-0.5, operand_dtype=x.dtype)
        o = self.norm.from_fp32(o.reshape(n, hv, dv), z)
        return self.out_proj(o.reshape(n, hv * dv))


class GatedAttention(nn.Module):
    """Full attention with a sigmoid output gate; q_proj rows per head are [query | gate]."""

    def __init__(self, cfg: ModelConfig, tp: TPGroup, dtype: torch.dtype, full_index: int):
        super().__init__()
        self.full_index, d = full_index, cfg.head_dim
        heads = rank_slice(cfg.num_attention_heads, tp)
        group = cfg.num_attention_heads // cfg.num_key_value_heads
        kv_heads = sorted({h // group for h in heads})
        self.num_heads, self.num_kv, self.head_dim = len(heads), len(kv_heads), d
        self.q_proj = ColumnParallelLinear(cfg.hidden_size, {None: group_rows(heads, 2 * d)}, dtype)
        self.k_proj = ColumnParallelLinear(cfg.hidden_size, {None: group_rows(kv_heads, d)}, dtype)
        self.v_proj = ColumnParallelLinear(cfg.hidden_size, {None: group_rows(kv_heads, d)}, dtype)
        self.o_proj = RowParallelLinear(group_rows(heads, d), cfg.hidden_size, tp, dtype)
        self.q_norm = RMSNorm(d, cfg.rms_norm_eps, dtype, unit_offset=True)
        self.k_norm = RMSNorm(d, cfg.rms_norm_eps, dtype, unit_offset=True)
        self.rotary = PartialRotary(d, cfg.partial_rotary_factor, cfg.rope_theta)

    def forward(self, x: torch.Tensor, ctx: StepContext) -> torch.Tensor:
        n, d = x.shape[0], self.head_dim
        q, gate = self.q_proj(x).view(n, self.num_heads, 2 * d).chunk(2, dim=-1)
        q = self.rotary(self.q_norm(q), ctx.batch)
        k = self.rotary(self.k_norm(self.k_proj(x).view(n, self.num_kv, d)), ctx.batch)
        v = self.v_proj(x).view(n, self.num_kv, d)
        cache = ctx.kv.caches[self.full_index]  # [rows, 2, Hkv, D]
        store_kv(ctx.batch, cache, torch.stack([k, v], dim=1))
        o = paged_attention(ctx.batch, q, cache, split_kv, d**-0.5)
        o = o.reshape(n, -1) * torch.sigmoid(gate.reshape(n, -1))
        return self.o_proj(o)

    @staticmethod
    def kv_entry_shape(cfg: ModelConfig, tp: TPGroup) -> tuple[int, ...]:
        group = cfg.num_attention_heads // cfg.num_key_value_heads
        heads = rank_slice(cfg.num_attention_heads, tp)
        return (2, len({h // group for h in heads}), cfg.head_dim)


class Qwen3NextForCausalLM(HybridForCausalLM):
    gdn_class: type[GatedDeltaNet] = GatedDeltaNet
    name_rules = [
        (r"^mtp\.", None, None),
        (r"\.mlp\.experts\.(\d+)\.gate_proj\.weight$", ".mlp.w13", lambda m: (0, int(m[1]))),
        (r"\.mlp\.experts\.(\d+)\.up_proj\.weight$", ".mlp.w13", lambda m: (1, int(m[1]))),
        (r"\.mlp\.experts\.(\d+)\.down_proj\.weight$", ".mlp.w2", lambda m: int(m[1])),
        (r"(\.mlp(?:\.shared_expert)?)\.gate_proj\.weight$", r"\1.gate_up_proj.weight", 0),
        (r"(\.mlp(?:\.shared_expert)?)\.up_proj\.weight$", r"\1.gate_up_proj.weight", 1),
    ]

    def __init__(self, cfg: ModelConfig, tp: TPGroup, dtype: torch.dtype,
                 head_order: list[list[int]] | None = None):
        layers, lin, full = [], 0, 0
        owned = rank_bundles(cfg, tp, head_order)
        for i, kind in enumerate(cfg.layer_types):
            if kind == "linear_attention":
                bundles = owned[lin]
                mixer, name = self.gdn_class(cfg, tp, dtype, bundles, lin), "linear_attn"
                lin += 1
            else:
                mixer, name = GatedAttention(cfg, tp, dtype, full), "self_attn"
                full += 1
            layers.append(DecoderLayer(cfg, tp, dtype, mixer, name, i))
        super().__init__(cfg, tp, dtype, layers)

    @staticmethod
    def kv_entry_shape(cfg: ModelConfig, tp: TPGroup) -> tuple[int, ...]:
        return GatedAttention.kv_entry_shape(cfg, tp)

