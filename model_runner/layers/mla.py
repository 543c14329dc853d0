"""Absorbed MLA decode: attention over the cached latent rows, never expanded into K and V.

An MLA cache row is ``c = [latent (kv_lora) | k_rot (rope)]``.  Head h's key is
``[W_uk[h] latent | k_rot]`` and its value ``W_uv[h] latent``, with ``kv_b_proj.weight`` =
``[H, W_uk (nope) | W_uv (Dv), kv_lora]``.  So

    q[h] . k[h]   = (W_uk[h]^T q_nope[h]) . latent + q_rot[h] . k_rot = q_abs[h] . c
    sum_t p_t v_t = W_uv[h] (sum_t p_t latent_t)

with ``q_abs[h] = [W_uk[h]^T q_nope[h] | q_rot[h]]`` (kv_lora + rope wide): one query
projection and one output projection per token instead of expanding every cached row of the
context (``L * H * (nope + Dv) * kv_lora`` multiply-adds per step).  All heads share the one
latent row, as multi-query attention.  Prefill keeps the expanded form: there each expanded
row serves many queries, and attention over 192-wide keys beats 576-wide latent rows.
"""

from __future__ import annotations

import torch

from kernels.derived import derived
from model_runner.layers.linear import emulates_bf16


def split_kv_b(weight: torch.Tensor, num_heads: int, nope_dim: int
               ) -> tuple[torch.Tensor, torch.Tensor]:
    """kv_b_proj.weight [H * (nope + Dv), kv_lora] -> views W_uk [H, nope, kv_lora],
    W_uv [H, Dv, kv_lora]."""
    w = weight.view(num_heads, -1, weight.shape[-1])
    return w[:, :nope_dim], w[:, nope_dim:]


def absorb_query(q: torch.Tensor, w_uk: torch.Tensor) -> torch.Tensor:
    """q [N, H, nope + rope] -> q_abs [N, H, kv_lora + rope]."""
    nope = w_uk.shape[1]
    q_nope, q_rot = q[..., :nope], q[..., nope:]
    q_lat = torch.bmm(q_nope.transpose(0, 1).to(w_uk.dtype), w_uk)  # [H, N, kv_lora]
    q_lat = q_lat.transpose(0, 1).to(q.dtype)
    return torch.cat([q_lat, q_rot], dim=-1)


def latent_attention(q_abs: torch.Tensor, rows: torch.Tensor, kv_lora: int, scale: float,
                     lens: torch.Tensor | None = None) -> torch.Tensor:
    """q_abs [B, H, D] over cache rows [B, C, D] (D = kv_lora + rope) -> [B, H, kv_lora];
    with ``lens`` [B], columns [lens, C) are padding and masked."""
    hidden = None
    if lens is not None:
        hidden = torch.arange(rows.shape[1], device=rows.device)[None] >= lens[:, None]
        hidden = hidden[:, None]  # [B, 1, C]
    return _attend(q_abs, rows, hidden, kv_lora, scale)


# ``latent_causal_attention`` holds the scores of at most this many (query head, row) pairs at
# once (64 MB in FP32): 170 queries of 32 heads over 65,536 rows would otherwise take 1.4 GB.
MAX_SCORES = 1 << 24


def latent_causal_attention(q_abs: torch.Tensor, rows: torch.Tensor, prefix_len: int,
                            kv_lora: int, scale: float) -> torch.Tensor:
    """One sequence's chunk of n queries q_abs [n, H, D] over its cache rows [prefix + n, D],
    query i seeing rows [0, prefix + i] -> [n, H, kv_lora]: ``latent_attention`` with a causal
    mask, each product one GEMM over a block of the chunk's query heads (``MAX_SCORES``)."""
    num, heads = q_abs.shape[:2]
    hidden = torch.ones(num, rows.shape[0], dtype=torch.bool, device=rows.device).triu(
        prefix_len + 1)[:, None]  # [n, 1, L]: query i, the rows past prefix + i
    out = q_abs.new_empty(num, heads, kv_lora)
    step = max(1, MAX_SCORES // (heads * rows.shape[0]))  # queries whose scores are held at once
    for a in range(0, num, step):
        out[a : a + step] = _attend(q_abs[a : a + step], rows, hidden[a : a + step], kv_lora,
                                    scale)
    return out


def _attend(q_abs: torch.Tensor, rows: torch.Tensor, hidden: torch.Tensor | None, kv_lora: int,
            scale: float) -> torch.Tensor:
    """q_abs [..., H, D] over rows [..., C, D] -> [..., H, kv_lora], the scores' entries where
    ``hidden`` (broadcast to [..., H, C]) masked.  A 2-D ``rows`` is shared by every leading
    index of q_abs, and each product is one GEMM over all of them."""
    dtype = q_abs.dtype  # products in fp32 where the CPU emulates bf16, rounded as bf16 rounds
    work = torch.float32 if emulates_bf16(q_abs) else dtype
    rows = rows.to(work)
    scores = torch.matmul(q_abs.to(work), rows.transpose(-1, -2)).to(dtype) * scale
    if hidden is not None:
        scores = scores.masked_fill(hidden, float("-inf"))
    probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(dtype)
    return torch.matmul(probs.to(work), rows[..., :kv_lora]).to(dtype)


def absorbs_chunk(num_queries: int, prefix_len: int, num_heads: int, nope: int, rope: int,
                  v_dim: int, kv_lora: int) -> bool:
    """Whether a chunk of ``num_queries`` after ``prefix_len`` cached rows costs fewer
    multiply-adds absorbed than expanded.  Expanded: every row through kv_b_proj, then attention
    over the [nope + rope]-wide keys and Dv-wide values.  Absorbed: each query through W_uk,
    attention over the [kv_lora + rope]-wide rows, each output through W_uv.  A short chunk
    after a long prefix (the next turn of a conversation, a cache hit's suffix) reads far fewer:
    at Kimi-Linear's shapes (32 heads) 50 queries after 2,000 rows took 51 against 291 ms a
    layer (bf16, one core); past ~170 queries expanding wins at any prefix."""
    rows = prefix_len + num_queries
    expanded = rows * kv_lora * num_heads * (nope + v_dim) + \
        num_queries * rows * num_heads * (nope + rope + v_dim)
    absorbed = num_queries * num_heads * (
        nope * kv_lora + rows * (2 * kv_lora + rope) + kv_lora * v_dim)
    return absorbed < expanded


def key_absorption(weight: torch.Tensor, num_heads: int, nope_dim: int) -> torch.Tensor:
    """kv_b_proj.weight -> W_uk [H, nope, kv_lora], ``absorb_query``'s operand.  On a CPU a
    contiguous copy kept on the weight (``derived``), as ``value_projection`` keeps W_uv^T:
    torch's CPU bmm copied the strided view (its heads lie nope + Dv rows apart) on every call,
    0.41 ms a layer a step at Kimi-Linear's shapes, and the copy gives the same bits.
    Elsewhere the view."""
    def keys(w: torch.Tensor) -> torch.Tensor:
        return split_kv_b(w, num_heads, nope_dim)[0]

    if weight.device.type != "cpu":
        return keys(weight)
    return derived(weight, "_mla_w_uk", lambda w: keys(w).contiguous())


def value_projection(weight: torch.Tensor, num_heads: int, nope_dim: int) -> torch.Tensor:
    """kv_b_proj.weight -> W_uv^T [H, kv_lora, Dv], ``up_project_values``' operand.  On a CPU a
    contiguous copy kept on the weight (``derived``): torch's CPU bmm copied the transposed
    view on every call, 2.2 of the 2.3 ms an up-projection took at Kimi-Linear's shapes (32
    heads, one token, bf16); it now takes 0.18 ms, with the same bits.  Elsewhere the view
    (cuBLAS reads a transposed operand in place, and nothing is made during a graph capture)."""
    def transposed(w: torch.Tensor) -> torch.Tensor:
        return split_kv_b(w, num_heads, nope_dim)[1].transpose(1, 2)

    if weight.device.type != "cpu":
        return transposed(weight)
    return derived(weight, "_mla_w_uv_t", lambda w: transposed(w).contiguous())


def up_project_values(o_lat: torch.Tensor, w_uv_t: torch.Tensor) -> torch.Tensor:
    """o_lat [N, H, kv_lora] and W_uv^T [H, kv_lora, Dv] (``value_projection``) -> per-head
    outputs [N, H, Dv]."""
    o = torch.bmm(o_lat.transpose(0, 1).to(w_uv_t.dtype), w_uv_t)
    return o.transpose(0, 1).to(o_lat.dtype)
