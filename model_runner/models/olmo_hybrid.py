"""OLMo-Hybrid: Gated DeltaNet with negative eigenvalues + OLMo's post-norm full attention.

Linear layers are pre-norm blocks around a GDN whose q, k, v, gate (``g_proj``, Qwen's z), b
and a projections are separate tensors, as are its three depthwise convs (``q_conv1d``,
``k_conv1d``, ``v_conv1d``, channels ``Hk*Dk``, ``Hk*Dk``, ``Hv*Dv``); beta is scaled by 2
(``linear_allow_neg_eigval``) and the gated output norm uses eps 1e-5.  Full-attention layers
are post-norm: ``x + norm(attn(x))`` then ``x + norm(mlp(x))``, with no output gate, q/k norms
over the whole projection (all heads: an all-reduce of the squares under TP) and full-width
rotary, or none (NoPE).  Norms multiply in FP32 before casting.

On disk the linear layers' norms are ``attention_layer_norm`` / ``feedforward_layer_norm``;
transformers reads ``feedforward_layer_norm`` as ``post_attention_layernorm`` wherever it
appears, and so does this loader.
"""

from __future__ import annotations

import torch
from torch import nn

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
from model_runner.layers.norm import RMSNorm, _normalize
from model_runner.models.common import (
    DecoderLayer,
    HybridForCausalLM,
    StepContext,
    rank_bundles,
)
from model_runner.models.qwen3_next import GatedDeltaNet
from model_runner.parallel import TPGroup

GATED_NORM_EPS = 1e-5  # the GDN output norm's, fixed in transformers' module


class OlmoGDN(GatedDeltaNet):
    def build_projections(self, cfg: ModelConfig, dtype: torch.dtype, bundles: list[int],
                          v_heads: list[int]) -> None:
        dk, dv, heads = self.dk, self.dv, torch.tensor(v_heads)
        self.in_proj_qkvz = ColumnParallelLinear(cfg.hidden_size, {
            "q": group_rows(bundles, dk), "k": group_rows(bundles, dk),
            "v": group_rows(v_heads, dv), "z": group_rows(v_heads, dv)}, dtype)
        self.in_proj_ba = ColumnParallelLinear(cfg.hidden_size, {"b": heads, "a": heads}, dtype)

    def __init__(self, cfg: ModelConfig, tp: TPGroup, dtype: torch.dtype, bundles: list[int],
                 linear_index: int):
        super().__init__(cfg, tp, dtype, bundles, linear_index, norm_eps=GATED_NORM_EPS)
        # the conv's [q | k | v] rows come in three tensors, in one of two splits: as published
        # (Hk*Dk, Hk*Dk and Hv*Dv rows) or as transformers 5.24 saves them (``torch.chunk(3)``
        # of the whole); ``_load_conv_part`` tells them apart by size
        key, total = cfg.linear_num_key_heads * self.dk, cfg.linear_conv_dim
        third = -(-total // 3)
        self.conv_splits = ({"q": (0, key), "k": (key, key), "v": (2 * key, total - 2 * key)},
                            {p: (i * third, min(third, total - i * third))
                             for i, p in enumerate("qkv")})
        self.conv1d.weight.weight_loader = self._load_conv_part
        self.conv1d.weight.shard_ids = set("qkv")

    def _load_conv_part(self, p: nn.Parameter, loaded: torch.Tensor, part: str) -> None:
        rows = torch.cat(self.qkv_rows)  # this rank's rows of the whole conv, in order
        loaded = loaded.reshape(loaded.shape[0], -1)
        for split in self.conv_splits:
            start, length = split[part]
            if loaded.shape == (length, p.shape[1]):
                mine = (rows >= start) & (rows < start + length)
                p.data[mine] = loaded[rows[mine] - start].to(p.dtype)
                return
        total = sum(self.conv_splits[0]["v"])  # the v part's start plus its length
        raise ValueError(f"shape {tuple(loaded.shape)} is not the {part} part of a "
                         f"{total}-channel conv")


class WholeRMSNorm(nn.Module):
    """RMSNorm over a projection whose heads are split across TP ranks (each rank holds a
    disjoint share, ``rows`` of the weight): the squares are summed over the ranks."""

    def __init__(self, rows: torch.Tensor, full_dim: int, eps: float, dtype: torch.dtype,
                 tp: TPGroup):
        super().__init__()
        self.eps, self.full_dim, self.tp = eps, full_dim, tp
        self.weight = attach_loader(new_param(len(rows), dtype=dtype), {None: rows})

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.tp.size == 1:
            return (self.weight * _normalize(x, self.eps)).to(x.dtype)
        xf = x.float()
        squares = self.tp.all_reduce(xf.pow(2).sum(-1, keepdim=True))
        return (self.weight * (xf * torch.rsqrt(squares / self.full_dim + self.eps))).to(x.dtype)


class OlmoAttention(nn.Module):
    def __init__(self, cfg: ModelConfig, tp: TPGroup, dtype: torch.dtype, full_index: int):
        super().__init__()
        self.full_index, d = full_index, cfg.head_dim
        heads = rank_slice(cfg.num_attention_heads, tp)
        kv_heads = rank_slice(cfg.num_key_value_heads, tp)
        self.num_heads, self.num_kv, self.head_dim = len(heads), len(kv_heads), d
        q_rows, kv_rows = group_rows(heads, d), group_rows(kv_heads, d)
        self.q_proj = ColumnParallelLinear(cfg.hidden_size, {None: q_rows}, dtype)
        self.k_proj = ColumnParallelLinear(cfg.hidden_size, {None: kv_rows}, dtype)
        self.v_proj = ColumnParallelLinear(cfg.hidden_size, {None: kv_rows}, dtype)
        self.o_proj = RowParallelLinear(q_rows, cfg.hidden_size, tp, dtype)
        eps = cfg.rms_norm_eps
        self.q_norm = WholeRMSNorm(q_rows, cfg.num_attention_heads * d, eps, dtype, tp)
        self.k_norm = WholeRMSNorm(kv_rows, cfg.num_key_value_heads * d, eps, dtype, tp)
        self.rotary = PartialRotary(d, cfg.partial_rotary_factor, cfg.rope_theta) \
            if cfg.use_rope else None

    def forward(self, x: torch.Tensor, ctx: StepContext) -> torch.Tensor:
        n, d = x.shape[0], self.head_dim
        q = self.q_norm(self.q_proj(x)).view(n, self.num_heads, d)
        k = self.k_norm(self.k_proj(x)).view(n, self.num_kv, d)
        if self.rotary is not None:
            q, k = self.rotary(q, ctx.batch), self.rotary(k, ctx.batch)
        v = self.v_proj(x).view(n, self.num_kv, d)
        cache = ctx.kv.caches[self.full_index]  # [rows, 2, Hkv, D]
        store_kv(ctx.batch, cache, torch.stack([k, v], dim=1))
        o = paged_attention(ctx.batch, q, cache, split_kv, d**-0.5)
        return self.o_proj(o.reshape(n, -1))

    @staticmethod
    def kv_entry_shape(cfg: ModelConfig, tp: TPGroup) -> tuple[int, ...]:
        return (2, cfg.num_key_value_heads // tp.size, cfg.head_dim)


class PostNormDecoderLayer(DecoderLayer):
    """``x + norm(attn(x))``, then ``x + norm(mlp(x))``."""

    def __init__(self, cfg: ModelConfig, tp: TPGroup, dtype: torch.dtype, mixer: nn.Module,
                 layer_id: int, norm):
        super().__init__(cfg, tp, dtype, mixer, "self_attn", layer_id, norm)
        del self.input_layernorm
        self.post_feedforward_layernorm = norm(cfg.hidden_size)

    def mix(self, x: torch.Tensor, ctx: StepContext) -> torch.Tensor:
        return x + self.post_attention_layernorm(self.self_attn(x, ctx))

    def feed_forward(self, x: torch.Tensor, ctx: StepContext) -> torch.Tensor:
        return x + self.post_feedforward_layernorm(self.mlp(x, ctx.batch.is_static))


class OlmoHybridForCausalLM(HybridForCausalLM):
    name_rules = [
        (r"\.attention_layer_norm\.", ".input_layernorm.", None),
        (r"\.feedforward_layer_norm\.", ".post_attention_layernorm.", None),
        (r"\.linear_attn\.([qkv])_proj\.weight$", r".linear_attn.in_proj_qkvz.weight",
         lambda m: m[1]),
        (r"\.linear_attn\.g_proj\.weight$", ".linear_attn.in_proj_qkvz.weight", "z"),
        (r"\.linear_attn\.([ab])_proj\.weight$", ".linear_attn.in_proj_ba.weight",
         lambda m: m[1]),
        (r"\.linear_attn\.([qkv])_conv1d\.weight$", ".linear_attn.conv1d.weight",
         lambda m: m[1]),
        (r"\.linear_attn\.o_norm\.", ".linear_attn.norm.", None),
        (r"\.linear_attn\.o_proj\.", ".linear_attn.out_proj.", None),
        (r"\.mlp\.gate_proj\.weight$", ".mlp.gate_up_proj.weight", 0),
        (r"\.mlp\.up_proj\.weight$", ".mlp.gate_up_proj.weight", 1),
    ]

    def __init__(self, cfg: ModelConfig, tp: TPGroup, dtype: torch.dtype,
                 head_order: list[list[int]] | None = None):
        def norm(dim: int) -> nn.Module:
            return RMSNorm(dim, cfg.rms_norm_eps, dtype, unit_offset=False, fp32_product=True)

        layers, lin, full = [], 0, 0
        owned = rank_bundles(cfg, tp, head_order)
        for i, kind in enumerate(cfg.layer_types):
            if kind == "linear_attention":
                gdn = OlmoGDN(cfg, tp, dtype, owned[lin], lin)
                layers.append(DecoderLayer(cfg, tp, dtype, gdn, "linear_attn", i, norm))
                lin += 1
            else:
                attn = OlmoAttention(cfg, tp, dtype, full)
                layers.append(PostNormDecoderLayer(cfg, tp, dtype, attn, i, norm))
                full += 1
        super().__init__(cfg, tp, dtype, layers, norm)

    @staticmethod
    def kv_entry_shape(cfg: ModelConfig, tp: TPGroup) -> tuple[int, ...]:
        return OlmoAttention.kv_entry_shape(cfg, tp)

