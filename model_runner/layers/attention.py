"""Full-attention helpers: partial rotary embedding and causal attention over paged KV.

Attention runs per sequence over the rows its page table maps (``batch.kv_read_index``): query i
of a sequence sits at position prefix_len + i and sees keys [0, prefix_len + i].  A static decode
batch instead attends over its padded row table in one masked batch (fixed shapes, no host sync).

Prefill runs through ``F.scaled_dot_product_attention`` on every device (torch picks the fused
kernel the shapes and mask allow, flash attention on CPU too; GQA through ``enable_gqa``): at
real shapes the explicit softmax was 2.8x slower in fp32 and 100x slower in bf16 on CPU.  A
bf16 CPU prefill over ``split_kv`` caches takes ``kernels.prefill_attention`` where the CPU has
AMX: the same flash arithmetic on AMX tiles, over the rows where they lie.  A CPU
decode query (one token) keeps the explicit softmax: in C over the rows where they lie
(``split_kv`` caches, ``kernels.decode_attention.attention_decode``), else in torch over gathered
copies; CUDA takes SDPA there as well.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kernels.decode_attention import attention_decode
from kernels.prefill_attention import attention_prefill
from model_runner.batch import ForwardBatch
from model_runner.layers.linear import emulates_bf16


class PartialRotary:
    """RoPE on the first ``rotary_dim`` features of each head (rotate-half convention)."""

    def __init__(self, head_dim: int, partial_factor: float, theta: float):
        self.rotary_dim = int(head_dim * partial_factor)
        exponents = torch.arange(0, self.rotary_dim, 2, dtype=torch.float32) / self.rotary_dim
        self.inv_freq = 1.0 / (theta**exponents)
        self._settings = (self.rotary_dim, float(theta))

    def __call__(self, x: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        """x: [N, H, D], the batch's tokens at ``batch.positions``."""
        cos, sin = batch.rotary_angles((*self._settings, x.dtype),
                                       lambda positions: self._cos_sin(positions, x))
        rot, rest = x[..., : self.rotary_dim], x[..., self.rotary_dim :]
        half = self.rotary_dim // 2
        rotated = torch.cat([-rot[..., half:], rot[..., :half]], dim=-1)
        return torch.cat([rot * cos + rotated * sin, rest], dim=-1)

    def _cos_sin(self, positions: torch.Tensor, x: torch.Tensor
                 ) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin [N, 1, rd] of the positions' angles in x's dtype."""
        if self.inv_freq.device != x.device:  # moved once: a host copy cannot be graph-captured
            self.inv_freq = self.inv_freq.to(x.device)
        freqs = positions.float()[:, None] * self.inv_freq[None]  # [N, rd/2]
        emb = torch.cat([freqs, freqs], dim=-1)
        return emb.cos().to(x.dtype)[:, None], emb.sin().to(x.dtype)[:, None]


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, prefix_len: int,
                     scale: float) -> torch.Tensor:
    """One sequence. q: [n, H, D]; k: [L, Hkv, D]; v: [L, Hkv, Dv]; L = prefix_len + n."""
    if q.is_cuda or q.shape[0] > 1:
        return _sdpa_causal(q, k, v, prefix_len, scale)
    # one query sees every key: the table form with one row
    lens = torch.full((1,), k.shape[0], dtype=torch.long, device=q.device)
    return _grouped_decode(q, k[None], v[None], lens, scale)


def _work_dtype(q: torch.Tensor) -> torch.dtype:
    """fp32 for bf16 on a CPU that emulates bf16 (``emulates_bf16``), else q's dtype."""
    return torch.float32 if emulates_bf16(q) else q.dtype


def _lower_right_causal(n: int, total: int, device: torch.device):
    """Query i of n sees keys [0, total - n + i]: on CUDA torch's lower-right causal bias, which
    SDPA hands to flash attention (GQA included) where a boolean mask would take the math
    backend; elsewhere the boolean mask that bias materialises (the same bits, and importing
    ``torch.nn.attention.bias`` pulls in dynamo: ~1.7 s of every CPU rank's start)."""
    if device.type == "cuda":
        from torch.nn.attention.bias import causal_lower_right

        return causal_lower_right(n, total)
    return torch.ones(n, total, dtype=torch.bool, device=device).tril(total - n)


def _sdpa_causal(q, k, v, prefix_len: int, scale: float) -> torch.Tensor:
    """Decode (n = 1) sees every key; a fresh prompt is plain causal; after a cached prefix,
    query i sees keys [0, prefix + i]: causal aligned to the lower right."""
    n, total = q.shape[0], k.shape[0]
    mask = _lower_right_causal(n, total, q.device) if n > 1 and prefix_len > 0 else None
    q, k, v = (x.transpose(0, 1)[None] for x in (q, k, v))  # [1, H, L, D]
    dv = v.shape[-1]
    if not q.is_cuda:
        # Head-major copies: torch's CPU flash attention took 1.1-1.2x as long over the
        # token-major views, copies included (Qwen3-Next's 16 / 2 heads of 256, 1,024 queries,
        # bf16), and gives the same bits.
        # CPU flash attention needs one head size: with MLA's values (128) narrower than its
        # keys (192) SDPA fell back to its math form, 513 against 217 ms a layer for
        # Kimi-Linear's 32 heads and 1,024 queries (bf16, one core).  Zero value columns add
        # nothing to the kept ones; the padded copy is head-major too.
        q, k = q.contiguous(), k.contiguous()
        v = F.pad(v, (0, q.shape[-1] - dv)) if dv < q.shape[-1] else v.contiguous()
    out = F.scaled_dot_product_attention(
        q, k, v, attn_mask=mask, is_causal=n > 1 and prefix_len == 0, scale=scale,
        enable_gqa=q.shape[1] != k.shape[1])  # [1, H, n, Dv]
    return out[0, ..., :dv].transpose(0, 1)


def gather_rows(cache: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """``cache[index]`` for pool rows ``index`` (any shape), as one ``index_select`` over the
    flattened rows: the same copy, 3-4x faster on a CPU at real shapes (4,096 rows of Qwen3-Next
    KV, [2, 2, 256] bf16: 1.2 against 4.1 ms; as many of Kimi-Linear's 576-wide latent rows
    0.46 against 2.1 ms), where advanced indexing walks the trailing dims element by element."""
    rows = cache.flatten(1).index_select(0, index.reshape(-1))
    return rows.view(*index.shape, *cache.shape[1:])


def split_kv(entries: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``expand`` of a cache whose rows are [2, Hkv, D] = [K | V]; decode over such a cache
    takes ``kernels.decode_attention.attention_decode`` on a CPU, which reads the rows where
    they lie in the pool (no gathered copy) and gives each sequence the bits it gets alone."""
    return entries[:, 0], entries[:, 1]


def store_kv(batch: ForwardBatch, cache: torch.Tensor, entries: torch.Tensor) -> None:
    """Write the new tokens' KV entries [N, ...] into their pool rows; replays write none."""
    cache[batch.kv_write_index] = entries[batch.replay_tokens :]


def paged_attention(batch: ForwardBatch, q: torch.Tensor, cache: torch.Tensor, expand,
                    scale: float) -> torch.Tensor:
    """Attention of the step's queries q [N, H, D] over the paged ``cache``; ``expand(entries)
    -> (k, v)`` turns cache entries [L, ...] into keys [L, Hkv, D] and values [L, Hkv, Dv]."""
    if batch.is_static:
        return table_decode_attention(batch.kv_table, batch.kv_lens, q, cache, expand, scale)
    return per_sequence(batch, q, cache, expand, scale)


def table_decode_attention(table: torch.Tensor, lens: torch.Tensor, q: torch.Tensor,
                           cache: torch.Tensor, expand, scale: float) -> torch.Tensor:
    """One query per sequence over its row table: table [B, C] (columns [len, C) are padding and
    masked), lens [B], q [B, H, D] -> [B, H, Dv]."""
    num_seqs, width = table.shape
    if expand is split_kv and not q.is_cuda:
        starts = torch.arange(0, num_seqs * width, width, device=q.device)
        out = attention_decode(q, cache, table.reshape(-1), starts, lens, scale)
        if out is not None:
            return out
    k, v = expand(gather_rows(cache, table.reshape(-1)))  # [B*C, Hkv, D], [B*C, Hkv, Dv]
    num_kv = k.shape[1]
    k = k.view(num_seqs, width, num_kv, -1)
    v = v.view(num_seqs, width, num_kv, -1)
    if q.is_cuda:
        return _sdpa_table(q, k, v, lens, scale)
    return _grouped_decode(q, k, v, lens, scale)


# A CPU decode over a row table at least this wide runs one product pair per sequence and KV
# head on the rows as they lie (``_decode_each``), below it one batched pair over head-major
# copies.  torch.mm reads a strided [len, D] view in place, where the batched products need the
# copies (over the views themselves they took 4x as long); the per-pair calls cost ~80 us each.
# Qwen3-Next's 16 / 2 heads of 256, bf16, one core: equal at 2 x 512 rows, 1.4 against 1.2 ms
# at 2 x 1,024, 9.4 against 30.9 ms at 16 x 1,024, 4.1 against 6.8 ms at 1 x 8,192; 4.3
# against 2.2 ms at 15 x 300.  Both give the same bits for a sequence that fills the table.
EACH_MIN_ROWS = 512


def _grouped_decode(q, k, v, lens: torch.Tensor, scale: float) -> torch.Tensor:
    """CPU: q [B, H, D] over k [B, C, Hkv, D], v [B, C, Hkv, Dv], keys [lens, C) masked ->
    [B, H, Dv].  The r = H / Hkv query heads of a KV head attend as one [r, D] block against
    its keys, so the keys and values are never repeated r times (at Qwen3-Next's 16 / 2 heads
    the repeat, and the copies that laid it out for the products, cost more than the
    products).  Short tables: the keys and values are copied head-major first (torch's CPU
    matmul over the token-major views took 4x as long, copies included, with the same bits);
    wide ones go to ``_decode_each`` (``EACH_MIN_ROWS``).  Rounded to q's dtype where a dtype
    product would round (``_work_dtype``)."""
    if k.shape[1] >= EACH_MIN_ROWS:
        return _decode_each(q, k, v, lens, scale)
    num_seqs, width, num_kv = k.shape[:3]
    dtype, work = q.dtype, _work_dtype(q)
    queries = q.to(work).view(num_seqs, num_kv, -1, q.shape[-1])  # [B, Hkv, r, D]
    keys = k.transpose(1, 2).to(work).contiguous()  # [B, Hkv, C, D]
    scores = torch.matmul(queries, keys.transpose(-1, -2)).to(dtype) * scale
    padding = torch.arange(width, device=q.device)[None] >= lens[:, None]  # [B, C]
    scores = scores.masked_fill(padding[:, None, None], float("-inf"))  # [B, Hkv, r, C]
    probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(dtype)
    values = v.transpose(1, 2).to(work).contiguous()  # [B, Hkv, C, Dv]
    out = torch.matmul(probs.to(work), values)  # [B, Hkv, r, Dv]
    return out.to(dtype).reshape(num_seqs, q.shape[1], -1)


def _decode_each(q, k, v, lens: torch.Tensor, scale: float) -> torch.Tensor:
    """``_grouped_decode`` one sequence and KV head at a time, over its first ``lens`` rows as
    they lie in the gathered table (no copies, no padding: a sequence gets the bits it gets
    alone)."""
    num_seqs, _, num_kv = k.shape[:3]
    dtype, work = q.dtype, _work_dtype(q)
    queries = q.to(work).view(num_seqs, num_kv, -1, q.shape[-1])  # [B, Hkv, r, D]
    out = q.new_empty(num_seqs, num_kv, queries.shape[2], v.shape[-1])
    for b, n in enumerate(lens.tolist()):
        for h in range(num_kv):
            scores = torch.mm(queries[b, h], k[b, :n, h].to(work).t()).to(dtype) * scale
            probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(dtype)
            out[b, h] = torch.mm(probs.to(work), v[b, :n, h].to(work))
    return out.reshape(num_seqs, q.shape[1], -1)


def _sdpa_table(q, k, v, lens: torch.Tensor, scale: float) -> torch.Tensor:
    """q [B, H, D], k [B, C, Hkv, D], v [B, C, Hkv, Dv], keys [lens, C) masked -> [B, H, Dv]."""
    keep = torch.arange(k.shape[1], device=q.device)[None] < lens[:, None]  # [B, C]
    out = F.scaled_dot_product_attention(
        q[:, :, None], k.transpose(1, 2), v.transpose(1, 2), attn_mask=keep[:, None, None],
        scale=scale, enable_gqa=q.shape[1] != k.shape[2])  # [B, H, 1, Dv]
    return out[:, :, 0]


def per_sequence(batch: ForwardBatch, q: torch.Tensor, cache: torch.Tensor, expand, scale: float
                 ) -> torch.Tensor:
    """``causal_attention`` for each sequence; ``expand(rows) -> (k, v)`` reads its cache.  The
    one-token sequences attend together over a padded row table (``batch.single_queries``)."""
    singles = batch.single_queries
    longer = range(batch.num_seqs)
    parts = []
    if singles is not None:
        single = None
        if expand is split_kv and not q.is_cuda:
            single = attention_decode(q[singles.rows], cache, *singles.flat_rows(),
                                      singles.lens, scale)
        if single is None and singles.table is not None:
            single = table_decode_attention(singles.table, singles.lens, q[singles.rows],
                                            cache, expand, scale)
        if single is not None:
            parts.append((singles.rows, single))
            longer = sorted(set(longer) - set(singles.seqs))
    for i in longer:
        a, b = batch.cu_seqlens[i], batch.cu_seqlens[i + 1]
        read, prefix = batch.kv_read_index[i], batch.prefix_lens[i]
        part = attention_prefill(q[a:b], cache, read, prefix, scale) \
            if expand is split_kv and not q.is_cuda else None
        if part is None:
            k, v = expand(gather_rows(cache, read))
            part = causal_attention(q[a:b], k, v, prefix, scale)
        parts.append((slice(a, b), part))
    out = q.new_empty(*q.shape[:2], parts[0][1].shape[-1])
    for rows, part in parts:
        out[rows] = part
    return out
