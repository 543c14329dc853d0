"""Gated delta rule (GDN: one log-decay per head; KDA: one per head and key channel) in torch.

State layout everywhere in dasc: ``[..., H, K, V]`` FP32 (key channel k of head h is the row
``state[h, k, :]``, a d_v vector: the KDA "unit").  Per token t, with log-decay g_t:

    M_t = Diag(exp(g_t)) M_{t-1};  M_t += k_t (beta_t (v_t - k_t^T M_t))^T;  o_t = M_t^T q_t * scale

``chunk_delta_rule`` evaluates this for a whole sequence chunk by chunk (WY form, one triangular
solve per chunk, all chunks at once); only the inter-chunk state hand-off is a loop over chunks.
``recurrent_step`` is the one-token update; looping it is the reference.  ``decode_step`` is
the same update as batched products in place, used for decode.
Both are differentiable, so the training script uses them too.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def l2norm_rsqrt(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """Qwen3-Next's form: x * rsqrt(sum(x^2) + eps)."""
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + eps)


def l2norm_div(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """Kimi-Linear's form: x / sqrt(sum(x^2) + eps)."""
    return x / torch.sqrt((x * x).sum(dim=-1, keepdim=True) + eps)


def recurrent_step(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One token for a batch of sequences.

    q, k: [B, H, K] (normalised); v: [B, H, V]; g: [B, H] or [B, H, K]; beta: [B, H];
    state: [B, H, K, V] FP32.  Returns (o [B, H, V] FP32, new state).
    """
    q, k, v, g, beta = (x.float() for x in (q, k, v, g, beta))
    decay = g.exp()[..., None, None] if g.dim() == 2 else g.exp()[..., None]
    state = state * decay
    kv_mem = (state * k[..., None]).sum(dim=-2)  # [B, H, V]
    delta = (v - kv_mem) * beta[..., None]
    state = state + k[..., None] * delta[..., None, :]
    o = (state * (q * scale)[..., None]).sum(dim=-2)
    return o, state


def decode_step(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``recurrent_step`` as batched matrix products, updating ``state`` in place (the caller's
    gathered copy); q, k may have Hk = H / r key heads (GVA).  Returns (o [B, H, V], state)."""
    batch, num_heads, k_dim, v_dim = state.shape
    ratio = num_heads // k.shape[1]
    if ratio > 1:
        q, k = (x.unsqueeze(2).expand(-1, -1, ratio, -1).reshape(batch, num_heads, k_dim)
                for x in (q, k))
    flat = state.view(batch * num_heads, k_dim, v_dim)
    decay = g.float().exp()  # [B, H] or [B, H, K]
    flat.mul_(decay.reshape(batch * num_heads, -1, 1))
    k_col = k.float().reshape(batch * num_heads, k_dim, 1)
    kv_mem = torch.bmm(k_col.transpose(1, 2), flat)  # [BH, 1, V]
    delta = (v.float().reshape(batch * num_heads, 1, v_dim) - kv_mem)
    delta.mul_(beta.float().reshape(batch * num_heads, 1, 1))
    flat.baddbmm_(k_col, delta)
    o = torch.bmm(q.float().reshape(batch * num_heads, 1, k_dim) * scale, flat)
    return o.view(batch, num_heads, v_dim), state


def recurrent_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    initial_state: torch.Tensor | None,
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Token-by-token reference. q, k: [B, T, H, K]; v: [B, T, H, V]; g: [B, T, H(, K)]."""
    batch, seq_len, num_heads, k_dim = k.shape
    state = (
        initial_state.float()
        if initial_state is not None
        else k.new_zeros(batch, num_heads, k_dim, v.shape[-1], dtype=torch.float32)
    )
    outs = []
    for t in range(seq_len):
        o, state = recurrent_step(q[:, t], k[:, t], v[:, t], g[:, t], beta[:, t], state, scale)
        outs.append(o)
    return torch.stack(outs, dim=1), state


# Per-channel decay is factorised within a chunk, exp(G_i - G_j) = exp(G_i) * exp(-G_j), which
# needs exp(-G_j) finite: a chunk's total log-decay must stay above -FACTOR_LIMIT (e^60 ~ 1e26).
# Chunks beyond it (a state reset, extreme gates) take the exact [C, C, K] decay form.
FACTOR_LIMIT = 60.0


def chunk_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    initial_state: torch.Tensor | None,
    scale: float,
    chunk_size: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Chunked evaluation for equal-length sequences.

    q, k: [B, T, Hk, K] (normalised; Hk divides H: GVA key heads are shared, not copied);
    v: [B, T, H, V];
    g: [B, T, H] (per head) or [B, T, H, K] (per channel); beta: [B, T, H];
    initial_state: [B, H, K, V] or None.  Returns (o [B, T, H, V] FP32, final state FP32).

    Everything but the state hand-off is batched over heads and chunks; the hand-off writes
    into a preallocated output and updates one state in place.
    """
    per_channel = g.dim() == 4
    if chunk_size is None:
        chunk_size = 16 if per_channel else 64
    batch, seq_len, num_k_heads, k_dim = k.shape
    num_heads, v_dim = v.shape[2], v.shape[3]
    ratio = num_heads // num_k_heads
    pad = (-seq_len) % chunk_size
    num_chunks = (seq_len + pad) // chunk_size

    def chunked(x: torch.Tensor) -> torch.Tensor:  # [B, T, H, ...] -> [B, H, N, C, ...] FP32
        x = x.float()
        if pad:  # k = v = 0, beta = 0, g = 0 at the end leave the state untouched
            x = F.pad(x, (0, 0) * (x.dim() - 2) + (0, pad))
        x = x.reshape(batch, num_chunks, chunk_size, x.shape[2], *x.shape[3:])
        return x.movedim(3, 1).contiguous()

    q, k, v, beta, g = chunked(q), chunked(k), chunked(v), chunked(beta), chunked(g)
    g_cum = g.cumsum(dim=3)  # [B, H, N, C(, K)]
    idx = torch.arange(chunk_size, device=q.device)
    causal = idx[:, None] >= idx[None, :]  # [C, C], i attends j <= i
    state = (initial_state.float().clone() if initial_state is not None
             else q.new_zeros(batch, num_heads, k_dim, v_dim))

    def heads(x: torch.Tensor) -> torch.Tensor:  # [B, Hk, r, ...] -> [B, H, ...]
        return x.reshape(batch, num_heads, *x.shape[3:])

    # GVA: key-head tensors enter per value head as broadcast views [B, Hk, 1, ...]
    qg, kg = q.unsqueeze(2) * scale, k.unsqueeze(2)
    split = (batch, num_k_heads, ratio)
    if per_channel:
        g_cum_r = g_cum.view(*split, *g_cum.shape[2:])
        e_g = g_cum_r.exp()
        beta_r = beta.view(*split, *beta.shape[2:])[..., None]
        q_decayed = heads(qg * e_g)
        k_decayed = heads(kg * beta_r * e_g)  # k_beta * exp(G)
        k_tail = heads(kg * (g_cum_r[..., -1:, :] - g_cum_r).exp())  # k * exp(G_last - G)
        if -g_cum[..., -1, :].min().item() <= FACTOR_LIMIT:
            k_inv = heads(kg * (-g_cum_r).exp())
            kk = k_decayed @ k_inv.transpose(-1, -2)
            qk = q_decayed @ k_inv.transpose(-1, -2)
        else:
            diff = g_cum[..., :, None, :] - g_cum[..., None, :, :]
            decay = diff.masked_fill(~causal[..., None], float("-inf")).exp()  # [B,H,N,C,C,K]
            k_full, q_full = (heads(x.expand(*split, -1, -1, -1)) for x in (kg, qg))
            kk = torch.einsum("...ic,...jc,...ijc->...ij", k_full * beta[..., None], k_full, decay)
            qk = torch.einsum("...ic,...jc,...ijc->...ij", q_full, k_full, decay)
        state_decay = g_cum[:, :, :, -1].exp()[..., None]  # [B, H, N, K, 1]
    else:
        diff = g_cum[..., :, None] - g_cum[..., None, :]
        decay = diff.masked_fill(~causal, float("-inf")).exp()  # [B, H, N, C, C]
        decay_r = decay.view(*split, *decay.shape[2:])
        kk_raw = k @ k.transpose(-1, -2)  # [B, Hk, N, C, C], shared by a key head's value heads
        qk_raw = q @ k.transpose(-1, -2) * scale
        kk = heads(kk_raw.unsqueeze(2) * decay_r) * beta[..., None]
        qk = heads(qk_raw.unsqueeze(2) * decay_r)
        e_g = g_cum.exp().view(*split, *g_cum.shape[2:], 1)
        beta_r = beta.view(*split, *beta.shape[2:], 1)
        q_decayed = heads(qg * e_g)
        k_decayed = heads(kg * (beta_r * e_g))
        tail = (g_cum[..., -1:] - g_cum).exp().view(*split, *g_cum.shape[2:], 1)
        k_tail = heads(kg * tail)
        state_decay = g_cum[:, :, :, -1].exp()[..., None, None]  # [B, H, N, 1, 1]
    v_beta = v * beta[..., None]

    strict = ~causal | torch.eye(chunk_size, dtype=torch.bool, device=q.device)
    lower = kk.masked_fill_(strict, 0.0)
    lower.diagonal(dim1=-2, dim2=-1).fill_(1.0)  # I + strictly-lower(k_beta k^T ⊙ decay)
    # T = lower^{-1}; u = T v_beta, w = T (k_beta ⊙ exp(G))
    u = torch.linalg.solve_triangular(lower, v_beta, upper=False, unitriangular=True)
    w = torch.linalg.solve_triangular(lower, k_decayed, upper=False, unitriangular=True)
    qk = qk.masked_fill_(~causal, 0.0)
    k_tail_t = k_tail.transpose(-1, -2)

    o = q.new_empty(num_chunks, batch * num_heads, chunk_size, v_dim)  # chunk-major
    flat = state.view(batch * num_heads, k_dim, v_dim)

    def at(x: torch.Tensor, n: int) -> torch.Tensor:  # chunk n of [B, H, N, ...] as [B*H, ...]
        return x[:, :, n].reshape(batch * num_heads, *x.shape[3:])

    # training differentiates through this: the state then advances out of place
    in_place = not (torch.is_grad_enabled() and any(
        x.requires_grad for x in (u, w, qk, q_decayed, k_tail_t, state_decay, flat)))
    for n in range(num_chunks):
        v_new = torch.baddbmm(at(u, n), at(w, n), flat, alpha=-1.0)  # u - w S  [BH, C, V]
        o[n] = torch.baddbmm(torch.bmm(at(q_decayed, n), flat), at(qk, n), v_new)
        if in_place:
            flat.mul_(at(state_decay, n)).baddbmm_(at(k_tail_t, n), v_new)
        else:
            flat = torch.baddbmm(flat * at(state_decay, n), at(k_tail_t, n), v_new)
    state = flat.view(batch, num_heads, k_dim, v_dim)
    o = o.view(num_chunks, batch, num_heads, chunk_size, v_dim).permute(1, 0, 3, 2, 4)
    return o.reshape(batch, num_chunks * chunk_size, num_heads, v_dim)[:, :seq_len], state
