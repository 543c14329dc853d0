"""Gated delta rule (GDN: one log-decay per head; KDA: one per head and key channel) in torch.

State layout everywhere in dasc: ``[..., H, K, V]`` FP32 (key channel k of head h is the row
``state[h, k, :]``, a d_v vector: the KDA "unit").  Per token t, with log-decay g_t:

    M_t = Diag(exp(g_t)) M_{t-1};  M_t += k_t (beta_t (v_t - k_t^T M_t))^T;  o_t = M_t^T q_t * scale

``chunk_delta_rule`` evaluates this for a whole sequence chunk by chunk (WY form, one triangular
solve per chunk, all chunks at once); only the inter-chunk state hand-off is a loop over chunks.
``recurrent_step`` is the one-token update used for decode; looping it is the reference.
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

    q, k: [B, T, H, K] (normalised, GVA already expanded); v: [B, T, H, V];
    g: [B, T, H] (per head) or [B, T, H, K] (per channel); beta: [B, T, H];
    initial_state: [B, H, K, V] or None.  Returns (o [B, T, H, V] FP32, final state FP32).
    """
    per_channel = g.dim() == 4
    if chunk_size is None:
        chunk_size = 16 if per_channel else 64
    batch, seq_len, num_heads, k_dim = k.shape
    v_dim = v.shape[-1]
    pad = (-seq_len) % chunk_size
    # Padding at the end with k = v = 0, beta = 0, g = 0 leaves the state untouched.
    q, k, v, beta = (F.pad(x.float(), (0, 0) * (x.dim() - 2) + (0, pad)) for x in (q, k, v, beta))
    g = F.pad(g.float(), (0, 0) * (g.dim() - 2) + (0, pad))
    num_chunks = (seq_len + pad) // chunk_size

    def chunked(x: torch.Tensor) -> torch.Tensor:  # [B, T, H, ...] -> [B, H, N, C, ...]
        x = x.reshape(batch, num_chunks, chunk_size, num_heads, *x.shape[3:])
        return x.movedim(3, 1)

    q, k, v, beta, g = chunked(q) * scale, chunked(k), chunked(v), chunked(beta), chunked(g)
    k_beta = k * beta[..., None]
    v_beta = v * beta[..., None]
    g_cum = g.cumsum(dim=3)  # [B, H, N, C(, K)]

    idx = torch.arange(chunk_size, device=q.device)
    causal = idx[:, None] >= idx[None, :]  # [C, C], i attends j <= i
    if per_channel:
        # decay[i, j, c] = exp(G_i - G_j) for j <= i; masked before exp so nothing overflows
        diff = g_cum[..., :, None, :] - g_cum[..., None, :, :]
        decay = diff.masked_fill(~causal[..., None], float("-inf")).exp()  # [B,H,N,C,C,K]
        kk = torch.einsum("...ic,...jc,...ijc->...ij", k_beta, k, decay)
        qk = torch.einsum("...ic,...jc,...ijc->...ij", q, k, decay)
        k_decayed = k_beta * g_cum.exp()
        q_decayed = q * g_cum.exp()
    else:
        diff = g_cum[..., :, None] - g_cum[..., None, :]
        decay = diff.masked_fill(~causal, float("-inf")).exp()  # [B,H,N,C,C]
        kk = (k_beta @ k.transpose(-1, -2)) * decay
        qk = (q @ k.transpose(-1, -2)) * decay
        k_decayed = k_beta * g_cum.exp()[..., None]
        q_decayed = q * g_cum.exp()[..., None]

    eye = torch.eye(chunk_size, device=q.device, dtype=q.dtype)
    strict = ~causal | eye.bool()  # entries masked out of the strictly lower part
    lower = eye + kk.masked_fill(strict, 0.0)  # I + strictly-lower(kβ k^T ⊙ decay)
    # T = lower^{-1}; u = T v_beta, w = T (k_beta ⊙ exp(G))
    u = torch.linalg.solve_triangular(lower, v_beta, upper=False, unitriangular=True)
    w = torch.linalg.solve_triangular(lower, k_decayed, upper=False, unitriangular=True)
    qk = qk.masked_fill(~causal, 0.0)

    state = (
        initial_state.float()
        if initial_state is not None
        else q.new_zeros(batch, num_heads, k_dim, v_dim)
    )
    outs = []
    for n in range(num_chunks):
        g_last = g_cum[:, :, n, -1]  # [B, H(, K)]
        v_new = u[:, :, n] - w[:, :, n] @ state  # [B, H, C, V]
        outs.append(q_decayed[:, :, n] @ state + qk[:, :, n] @ v_new)
        if per_channel:
            k_tail = k[:, :, n] * (g_last[..., None, :] - g_cum[:, :, n]).exp()
            state = state * g_last.exp()[..., None]
        else:
            k_tail = k[:, :, n] * (g_last[..., None] - g_cum[:, :, n]).exp()[..., None]
            state = state * g_last.exp()[..., None, None]
        state = state + k_tail.transpose(-1, -2) @ v_new
    o = torch.stack(outs, dim=2)  # [B, H, N, C, V]
    o = o.reshape(batch, num_heads, num_chunks * chunk_size, v_dim)[:, :, :seq_len]
    return o.transpose(1, 2), state
