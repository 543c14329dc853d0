"""Kimi-Linear: Kimi Delta Attention (per-channel decay) + MLA full attention (no RoPE).

KDA on disk, per head h (a "bundle"): rows ``[h*K, (h+1)*K)`` of q/k/v_proj, of q/k/v_conv1d,
of f_b_proj, g_b_proj and dt_bias; ``A_log[0, 0, h, 0]``; row h of b_proj; columns
``[h*K, (h+1)*K)`` of o_proj.  f_a_proj and g_a_proj (low rank) are replicated.
MLA caches the latent ``[norm(kv_nope) (kv_lora_rank) | k_rot (rope_dim)]`` per token; prefill
expands it with the rank's heads' rows of kv_b_proj, decode (one new token) attends over it
directly with kv_b_proj absorbed into the query and the output (``model_runner.layers.mla``).
"""

from __future__ import annotations

import torch
from torch import nn

from kernels.delta_rule.naive import l2norm_div
from model_runner.config import ModelConfig
from model_runner.layers.attention import (
    causal_attention,
    gather_rows,
    paged_attention,
    store_kv,
)
from model_runner.layers.linear import (
    ColumnParallelLinear,
    ReplicatedLinear,
    RowParallelLinear,
    attach_loader,
    group_rows,
    new_param,
    rank_slice,
)
from model_runner.layers.mla import (
    absorb_query,
    absorbs_chunk,
    key_absorption,
    latent_attention,
    latent_causal_attention,
    up_project_values,
    value_projection,
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


def kda_log_decay(f: torch.Tensor, A_log: torch.Tensor, dt_bias: torch.Tensor) -> torch.Tensor:
    """g = -exp(A_log[h]) * softplus(f + dt_bias[h, k]); f: [N, H, K] -> [N, H, K] FP32."""
    x = f.float() + dt_bias.float().view(1, *f.shape[1:])
    softplus = torch.where(x > 20.0, x, torch.log(1.0 + torch.exp(x)))
    return -A_log.float().exp()[:, None] * softplus


class KimiDeltaAttention(nn.Module):
    def __init__(self, cfg: ModelConfig, tp: TPGroup, dtype: torch.dtype, heads: list[int],
                 linear_index: int):
        super().__init__()
        self.linear_index, self.num_heads = linear_index, len(heads)
        dim, hidden = cfg.linear_key_head_dim, cfg.hidden_size
        self.head_dim = dim
        rows = group_rows(heads, dim)
        self.q_proj = ColumnParallelLinear(hidden, {None: rows}, dtype)
        self.k_proj = ColumnParallelLinear(hidden, {None: rows}, dtype)
        self.v_proj = ColumnParallelLinear(hidden, {None: rows}, dtype)
        self.conv1d = nn.Module()
        self.conv1d.weight = attach_loader(
            new_param(3 * len(rows), cfg.linear_conv_kernel_dim, dtype=dtype),
            {"q": rows, "k": rows, "v": rows}, transform=lambda w: w.reshape(w.shape[0], -1))
        self.f_a_proj = ReplicatedLinear(hidden, dim, dtype)
        self.f_b_proj = ColumnParallelLinear(dim, {None: rows}, dtype)
        self.dt_bias = attach_loader(new_param(len(rows), dtype=torch.float32), {None: rows})
        self.A_log = attach_loader(new_param(len(heads), dtype=torch.float32),
                                   {None: torch.tensor(heads)}, transform=lambda a: a.reshape(-1))
        self.b_proj = ColumnParallelLinear(hidden, {None: torch.tensor(heads)}, dtype)
        self.g_a_proj = ReplicatedLinear(hidden, dim, dtype)
        self.g_b_proj = ColumnParallelLinear(dim, {None: rows}, dtype)
        self.o_norm = GatedRMSNorm(dim, cfg.rms_norm_eps, dtype, gate="sigmoid")
        self.o_proj = RowParallelLinear(rows, hidden, tp, dtype)

    def forward(self, x: torch.Tensor, ctx: StepContext) -> torch.Tensor:
        n, h, d = x.shape[0], self.num_heads, self.head_dim
        mixed = torch.cat([self.q_proj(x), self.k_proj(x), self.v_proj(x)], dim=-1)
        mixed = short_conv(mixed, self.conv1d.weight, ctx, self.linear_index)
        q, k, v = (t.reshape(n, h, d) for t in mixed.split(h * d, dim=-1))
        g = kda_log_decay(self.f_b_proj(self.f_a_proj(x)).view(n, h, d), self.A_log, self.dt_bias)
        beta = torch.sigmoid(self.b_proj(x))
        o = delta_rule(l2norm_div(q.float()), l2norm_div(k.float()), v.float(), g, beta.float(),
                       ctx, self.linear_index, scale=d**-0.5, operand_dtype=x.dtype)
        gate = self.g_b_proj(self.g_a_proj(x)).view(n, h, d)
        return self.o_proj(self.o_norm(o.to(x.dtype), gate).reshape(n, h * d))


class MLAttention(nn.Module):
    def __init__(self, cfg: ModelConfig, tp: TPGroup, dtype: torch.dtype, full_index: int):
        super().__init__()
        self.full_index = full_index
        heads = rank_slice(cfg.num_attention_heads, tp)
        self.num_heads, self.cfg = len(heads), cfg
        qk, hidden = cfg.mla_qk_head_dim, cfg.hidden_size
        q_rows = group_rows(heads, qk)
        if cfg.q_lora_rank is None:
            self.q_proj = ColumnParallelLinear(hidden, {None: q_rows}, dtype)
        else:
            self.q_a_proj = ReplicatedLinear(hidden, cfg.q_lora_rank, dtype)
            self.q_a_layernorm = RMSNorm(cfg.q_lora_rank, 1e-6, dtype, unit_offset=False)
            self.q_b_proj = ColumnParallelLinear(cfg.q_lora_rank, {None: q_rows}, dtype)
        self.kv_a_proj_with_mqa = ReplicatedLinear(hidden, cfg.kv_lora_rank + cfg.qk_rope_head_dim,
                                                   dtype)
        self.kv_a_layernorm = RMSNorm(cfg.kv_lora_rank, 1e-6, dtype, unit_offset=False)
        self.kv_b_proj = ColumnParallelLinear(
            cfg.kv_lora_rank, {None: group_rows(heads, cfg.qk_nope_head_dim + cfg.v_head_dim)},
            dtype)
        self.kv_b_proj.keeps_weight = True  # decode reads it absorbed (``layers.mla``)
        self.o_proj = RowParallelLinear(group_rows(heads, cfg.v_head_dim), hidden, tp, dtype)
        self.scale = qk**-0.5
        self.absorb_decode = True  # False: decode expands the cache too (tests compare)

    def _expand(self, latent: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """latent [L, kv_lora + rope] -> k [L, H, nope + rope], v [L, H, Dv]."""
        cfg = self.cfg
        kv_nope, k_rot = latent.split([cfg.kv_lora_rank, cfg.qk_rope_head_dim], dim=-1)
        kv = self.kv_b_proj(kv_nope).view(latent.shape[0], self.num_heads, -1)
        k_nope, v = kv.split([cfg.qk_nope_head_dim, cfg.v_head_dim], dim=-1)
        k_rot = k_rot[:, None].expand(-1, self.num_heads, -1)
        return torch.cat([k_nope, k_rot], dim=-1), v

    def forward(self, x: torch.Tensor, ctx: StepContext) -> torch.Tensor:
        cfg, n = self.cfg, x.shape[0]
        if cfg.q_lora_rank is None:
            q = self.q_proj(x)
        else:
            q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))
        q = q.view(n, self.num_heads, cfg.mla_qk_head_dim)
        kv_nope, k_rot = self.kv_a_proj_with_mqa(x).split(
            [cfg.kv_lora_rank, cfg.qk_rope_head_dim], dim=-1)
        cache = ctx.kv.caches[self.full_index]  # [rows, kv_lora + rope]
        store_kv(ctx.batch, cache, torch.cat([self.kv_a_layernorm(kv_nope), k_rot], dim=-1))
        return self.o_proj(self._attention(ctx.batch, q, cache).reshape(n, -1))

    def _attention(self, batch, q: torch.Tensor, cache: torch.Tensor) -> torch.Tensor:
        """q [N, H, qk] -> [N, H, Dv]: absorbed for one-token sequences (decode, the static step)
        and for chunks that cost less so (``absorbs_chunk``: a short chunk after a long prefix),
        expanded for the others (prefill of a fresh prompt)."""
        cfg = self.cfg
        cu = batch.cu_seqlens
        if not self.absorb_decode:
            return paged_attention(batch, q, cache, self._expand, self.scale)
        weight, nope = self.kv_b_proj.weight, cfg.qk_nope_head_dim
        w_uk = key_absorption(weight, self.num_heads, nope)
        w_uv_t = value_projection(weight, self.num_heads, nope)
        if batch.is_static:  # one query per sequence over its row table [B, C]
            rows = gather_rows(cache, batch.kv_table)
            o_lat = latent_attention(absorb_query(q, w_uk), rows, cfg.kv_lora_rank, self.scale,
                                     batch.kv_lens)
            return up_project_values(o_lat, w_uv_t)
        out = q.new_empty(q.shape[0], self.num_heads, cfg.v_head_dim)
        singles = batch.single_queries
        if singles is not None:
            q_abs = absorb_query(q[singles.rows], w_uk)  # [S, H, kv_lora + rope]
            if singles.table is not None:  # one padded batch, else one attention per sequence
                o_lat = latent_attention(q_abs, gather_rows(cache, singles.table),
                                         cfg.kv_lora_rank, self.scale, singles.lens)
            else:
                reads = [gather_rows(cache, batch.kv_read_index[i][None]) for i in singles.seqs]
                o_lat = torch.cat([latent_attention(q_abs[j, None], rows, cfg.kv_lora_rank,
                                                    self.scale)
                                   for j, rows in enumerate(reads)])  # [S, H, kv_lora]
            out[singles.rows] = up_project_values(o_lat, w_uv_t)
        for i in range(batch.num_seqs):
            a, b, prefix = cu[i], cu[i + 1], batch.prefix_lens[i]
            if b - a == 1:
                continue
            rows = gather_rows(cache, batch.kv_read_index[i])
            if absorbs_chunk(b - a, prefix, self.num_heads, nope, cfg.qk_rope_head_dim,
                             cfg.v_head_dim, cfg.kv_lora_rank):
                o_lat = latent_causal_attention(absorb_query(q[a:b], w_uk), rows, prefix,
                                                cfg.kv_lora_rank, self.scale)
                out[a:b] = up_project_values(o_lat, w_uv_t)
            else:
                out[a:b] = causal_attention(q[a:b], *self._expand(rows), prefix, self.scale)
        return out


class KimiLinearForCausalLM(HybridForCausalLM):
    name_rules = [
        (r"\.block_sparse_moe\.experts\.(\d+)\.w1\.weight$", ".mlp.w13", lambda m: (0, int(m[1]))),
        (r"\.block_sparse_moe\.experts\.(\d+)\.w3\.weight$", ".mlp.w13", lambda m: (1, int(m[1]))),
        (r"\.block_sparse_moe\.experts\.(\d+)\.w2\.weight$", ".mlp.w2", lambda m: int(m[1])),
        (r"\.(?:block_sparse_moe|mlp)\.gate\.e_score_correction_bias$",
         ".mlp.e_score_correction_bias", None),
        (r"\.(?:block_sparse_moe|mlp)\.shared_experts\.gate_proj\.weight$",
         ".mlp.shared_expert.gate_up_proj.weight", 0),
        (r"\.(?:block_sparse_moe|mlp)\.shared_experts\.up_proj\.weight$",
         ".mlp.shared_expert.gate_up_proj.weight", 1),
        (r"\.(?:block_sparse_moe|mlp)\.shared_experts\.", ".mlp.shared_expert.", None),
        (r"\.(?:block_sparse_moe|mlp)\.gate_proj\.weight$", ".mlp.gate_up_proj.weight", 0),
        (r"\.(?:block_sparse_moe|mlp)\.up_proj\.weight$", ".mlp.gate_up_proj.weight", 1),
        (r"\.block_sparse_moe\.", ".mlp.", None),
        (r"\.self_attn\.([qkv])_conv1d\.weight$", ".self_attn.conv1d.weight", lambda m: m[1]),
    ]

    def __init__(self, cfg: ModelConfig, tp: TPGroup, dtype: torch.dtype,
                 head_order: list[list[int]] | None = None):
        layers, lin, full = [], 0, 0
        owned = rank_bundles(cfg, tp, head_order)
        for i, kind in enumerate(cfg.layer_types):
            if kind == "linear_attention":
                heads = owned[lin]
                mixer, lin = KimiDeltaAttention(cfg, tp, dtype, heads, lin), lin + 1
            else:
                mixer, full = MLAttention(cfg, tp, dtype, full), full + 1
            layers.append(DecoderLayer(cfg, tp, dtype, mixer, "self_attn", i))
        super().__init__(cfg, tp, dtype, layers)

    @staticmethod
    def kv_entry_shape(cfg: ModelConfig, tp: TPGroup) -> tuple[int, ...]:
        return (cfg.kv_lora_rank + cfg.qk_rope_head_dim,)
