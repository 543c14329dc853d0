"""The one-token gated delta rule as batched matrix products (``naive.recurrent_step``'s
update, which the tests loop as the reference).

At decode the state is most of the bytes a linear layer moves (2 MiB a sequence at Qwen3-Next's
shapes), so each row's state [K, V] is read three times and written twice: one pass projects
it on the decayed key and query together (``k^T (D S) = (d k)^T S``), then ``D S + k delta^T``
is written in two in-place passes.  The output reads the old state's projection:
``q^T S' = (d q)^T S + (q . k) delta``.

``decode_step`` updates a batch of states (a caller's gathered copy); ``decode_into`` updates
each sequence's slot of a state pool in place, one sequence at a time, with the same operations
on the same rows, so both give the same bits.  At inference on a CPU both run the update as
the C kernel (``cpu_decode.py`` beside this file) where it is built: one pass over each state,
the same bits as these torch operations (3-6x faster at Qwen3-Next's shapes).
"""

from __future__ import annotations

from functools import lru_cache

import torch
import torch.nn.functional as F

from kernels.delta_rule.cpu_decode import delta_rule_in_place


def decode_step(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """q, k: [B, Hk, K] (normalised; Hk = H / r key heads, GVA); v: [B, H, V]; g: [B, H] or
    [B, H, K]; beta: [B, H]; state: [B, H, K, V] FP32, updated in place (out of place under
    autograd).  Returns (o [B, H, V], new state)."""
    batch, num_heads, k_dim, v_dim = state.shape
    rows = _operands(q, k, v, g, beta, num_heads, scale)
    flat = state.view(batch * num_heads, k_dim, v_dim)
    if torch.is_grad_enabled():
        o, new = _update(flat, *rows, in_place=False)
        return o.view(batch, num_heads, v_dim), new.view(state.shape)
    o = delta_rule_in_place(state, list(range(batch)), *rows)
    if o is None:
        o, _ = _update(flat, *rows)
    return o.view(batch, num_heads, v_dim), state


def decode_into(pool: torch.Tensor, slots: list[int], q, k, v, g, beta, scale: float
                ) -> torch.Tensor:
    """``decode_step`` of sequence i from and into ``pool[slots[i]]`` (pool [S, H, K, V] FP32),
    in place, without autograd.  Returns o [B, H, V].

    One sequence at a time: its state is updated while the product has just brought it into
    cache, and nothing is gathered or written back.  At Qwen3-Next's shapes, 15 sequences, one
    core, that is 0.5x the time of gathering, ``decode_step`` and ``index_copy_``."""
    num_heads, k_dim, v_dim = pool.shape[1:]
    rows = _operands(q, k, v, g, beta, num_heads, scale)
    o = delta_rule_in_place(pool, slots, *rows)
    if o is not None:
        return o.view(len(slots), num_heads, v_dim)
    o = torch.empty(len(slots) * num_heads, 1, v_dim, dtype=torch.float32, device=pool.device)
    for i, slot in enumerate(slots):
        at = slice(i * num_heads, (i + 1) * num_heads)
        o[at] = _update(pool[slot].view(num_heads, k_dim, v_dim), *(x[at] for x in rows))[0]
    return o.view(len(slots), num_heads, v_dim)


def _operands(q, k, v, g, beta, num_heads: int, scale: float) -> tuple[torch.Tensor, ...]:
    """Per (sequence, head) row, FP32: (the decayed [k | q]^T [BH, 2, K], q . k [BH, 1, 1],
    v [BH, 1, V], beta [BH, 1, 1], the decay [BH, 1 or K, 1], k [BH, K, 1])."""
    batch, k_dim = q.shape[0], q.shape[-1]
    ratio = num_heads // k.shape[1]
    if ratio > 1:
        q, k = (x.unsqueeze(2).expand(-1, -1, ratio, -1).reshape(batch, num_heads, k_dim)
                for x in (q, k))
    rows = batch * num_heads
    decay = g.float().exp().reshape(rows, -1, 1)  # [BH, 1, 1] (GDN) or [BH, K, 1] (KDA)
    k_f = k.float().reshape(rows, k_dim, 1)
    q_f = q.float().reshape(rows, k_dim, 1) * scale
    kq = torch.stack([k_f * decay, q_f * decay], dim=1).view(rows, 2, k_dim)  # contiguous
    qk = (q_f * k_f).sum(dim=1, keepdim=True)
    return (kq, qk, v.float().reshape(rows, 1, -1), beta.float().reshape(rows, 1, 1), decay,
            k_f)


def _update(flat: torch.Tensor, kq, qk, v, beta, decay, k_f, in_place: bool = True
            ) -> tuple[torch.Tensor, torch.Tensor]:
    """The rows' states ``flat`` [BH, K, V] advanced by one token: (o [BH, 1, V], new states,
    ``flat`` itself when ``in_place``)."""
    proj = _project(kq, flat)  # [BH, 2, V]: (d k)^T S, (d q)^T S
    delta = (v - proj[:, :1]) * beta
    o = proj[:, 1:] + qk * delta
    if in_place:
        return o, flat.mul_(decay).addcmul_(k_f, delta)
    return o, torch.addcmul(flat * decay, k_f, delta)


def _project(kq: torch.Tensor, flat: torch.Tensor) -> torch.Tensor:
    """``bmm(kq, flat)`` ([BH, 2, K] x [BH, K, V]) as two weighted sums of each state's K rows,
    one ``embedding_bag`` bag per product: torch's bmm runs a GEMM per head, which at M = 2
    spends its time on call overhead (Qwen3-Next's 32 heads of 128, one core: 0.35 against
    0.14 ms, the state read once in 0.09 ms).  The sum runs over k in order, in FP32."""
    rows, k_dim, v_dim = flat.shape
    bags = kq.shape[1]
    index = _bag_rows(rows, bags, k_dim, flat.device)
    out = F.embedding_bag(index, flat.reshape(rows * k_dim, v_dim),
                          per_sample_weights=kq.reshape(rows * bags, k_dim), mode="sum")
    return out.view(rows, bags, v_dim)


@lru_cache(maxsize=32)
def _bag_rows(rows: int, bags: int, k_dim: int, device: torch.device) -> torch.Tensor:
    """Bag j of row r sums rows [r*K, (r+1)*K) of the flattened states: [rows * bags, K].
    Made outside inference mode, so that autograd may save it after an inference call."""
    with torch.inference_mode(False):
        start = torch.arange(rows, device=device).repeat_interleave(bags) * k_dim
        return start[:, None] + torch.arange(k_dim, device=device)
