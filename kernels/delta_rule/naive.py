"""Gated delta rule (GDN: one log-decay per head; KDA: one per head and key channel) in torch.

State layout everywhere in dasc: ``[..., H, K, V]`` FP32 (key channel k of head h is the row
``state[h, k, :]``, a d_v vector: the KDA "unit").  Per token t, with log-decay g_t:

    M_t = Diag(exp(g_t)) M_{t-1};  M_t += k_t (beta_t (v_t - k_t^T M_t))^T;  o_t = M_t^T q_t * scale

``chunk_delta_rule`` evaluates this for a whole sequence chunk by chunk (WY form, one triangular
solve per chunk, all chunks at once); only the inter-chunk state hand-off is a loop over chunks.
``recurrent_step`` is the one-token update; looping it is the reference
(``decode.decode_step`` is the same update as batched products, used for decode).
Both are differentiable, so the training script uses them too.
"""

from __future__ import annotations

from functools import lru_cache

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


# Per-channel decay is factorised within a chunk, exp(G_i - G_j) = exp(G_i) * exp(-G_j), which
# needs exp(-G_j) finite: a chunk's total log-decay must stay above -FACTOR_LIMIT (e^60 ~ 1e26).
# The channels beyond it in a chunk (a state reset, fast-forgetting units) take the exact form,
# each on its own: a chunk's other channels keep the factorised products.
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

    Everything but the state hand-off is batched over heads and chunks (``_chunk_factors``);
    the hand-off writes into a preallocated output and updates one state in place.
    """
    chunk_size = chunk_size or default_chunk_size(g.dim() == 4)
    batch, seq_len = k.shape[:2]
    num_heads, k_dim, v_dim = v.shape[2], k.shape[3], v.shape[3]
    pad = (-seq_len) % chunk_size
    num_chunks = (seq_len + pad) // chunk_size

    def chunked(x: torch.Tensor) -> torch.Tensor:  # [B, T, H, ...] -> [B, N, C, H, ...] FP32
        x = x.float()
        if pad:  # k = v = 0, beta = 0, g = 0 at the end leave the state untouched
            x = F.pad(x, (0, 0) * (x.dim() - 2) + (0, pad))
        return x.reshape(batch, num_chunks, chunk_size, *x.shape[2:])

    factors = _chunk_factors(*(chunked(x) for x in (q, k, v, g, beta)), scale)
    state = (initial_state.float().clone() if initial_state is not None
             else q.new_zeros(batch, num_heads, k_dim, v_dim, dtype=torch.float32))
    o = q.new_empty(num_chunks, batch * num_heads, chunk_size, v_dim, dtype=torch.float32)
    flat = state.view(batch * num_heads, k_dim, v_dim)
    # training differentiates through this: the state then advances out of place
    in_place = not (torch.is_grad_enabled() and any(
        x.requires_grad for x in (*factors, flat)))
    for n in range(num_chunks):  # chunk n of [B, H, N, ...] as [B*H, ...]
        o[n], flat = _hand_off(flat, [x[:, :, n].reshape(batch * num_heads, *x.shape[3:])
                                      for x in factors], in_place)
    state = flat.view(batch, num_heads, k_dim, v_dim)
    o = o.view(num_chunks, batch, num_heads, chunk_size, v_dim).permute(1, 0, 3, 2, 4)
    return o.reshape(batch, num_chunks * chunk_size, num_heads, v_dim)[:, :seq_len], state


def default_chunk_size(per_channel: bool) -> int:
    """Tokens per chunk: 16 for a per-channel (KDA) log-decay (the per-channel form holds
    [C, C, K]-sized decay products), 32 for a per-head (GDN) one.  A chunk's own products (the
    triangular inverse and its two applications, q k^T, k k^T) cost C per token, the state
    hand-off does not, so halving C halves them at the price of twice the hand-off calls: at
    Qwen3-Next's GDN shape, 1,024 tokens, one core, 113-131 ms a layer at C = 32 against
    145-164 ms at 64 (three alternating pairs; the outputs ~5e-8 apart)."""
    return 16 if per_channel else 32


def varlen_chunk_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    states: torch.Tensor,
    cu_seqlens: list[int],
    scale: float,
    chunk_size: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``chunk_delta_rule`` of packed sequences of any lengths, all in one pass.

    q, k: [N, Hk, K]; v: [N, H, V]; g: [N, H(, K)]; beta: [N, H]; states: [B, H, K, V];
    sequence i holds rows [cu_seqlens[i], cu_seqlens[i + 1]).  Returns (o [N, H, V] FP32,
    final states [B, H, K, V] FP32).

    Each sequence is cut into zero-padded chunks and every chunk of every sequence gets its
    factors in one batch.  The hand-off then runs in rounds: round j advances every sequence
    that has a j-th chunk.  Chunks are laid out round by round, sequences by falling chunk count
    within a round, so round j's chunks and states are leading slices: views, no gathers.
    """
    if len(cu_seqlens) == 2:  # one sequence: its natural layout, without the packing copies
        o, final = chunk_delta_rule(q[None], k[None], v[None], g[None], beta[None], states,
                                    scale, chunk_size)
        return o[0], final
    order, active, offsets, dest = _packing(tuple(cu_seqlens), chunk_size)
    num_chunks, num_heads, k_dim, v_dim = offsets[-1], v.shape[1], k.shape[2], v.shape[2]
    dest = dest.to(q.device)

    def packed(x: torch.Tensor) -> torch.Tensor:  # [N, H, ...] -> [M, 1, C, H, ...] FP32
        out = x.new_zeros(num_chunks * chunk_size, *x.shape[1:], dtype=torch.float32)
        out[dest] = x.float()  # zero padding leaves the state untouched (as chunk_delta_rule)
        return out.view(num_chunks, 1, chunk_size, *x.shape[1:])

    factors = [x.reshape(num_chunks * num_heads, *x.shape[3:])
               for x in _chunk_factors(*(packed(x) for x in (q, k, v, g, beta)), scale)]
    state = states.float()[order].contiguous()
    flat = state.view(-1, k_dim, v_dim)
    o = q.new_empty(num_chunks * num_heads, chunk_size, v_dim, dtype=torch.float32)
    # under autograd the states advance out of place, as in chunk_delta_rule
    in_place = not (torch.is_grad_enabled() and any(
        x.requires_grad for x in (*factors, flat)))
    for j, count in enumerate(active):
        rows, n = slice(offsets[j] * num_heads, (offsets[j] + count) * num_heads), count * num_heads
        o[rows], ahead = _hand_off(flat[:n], [x[rows] for x in factors], in_place)
        if not in_place:
            flat = torch.cat([ahead, flat[n:]])
    finals = torch.empty_like(state)
    finals[order] = flat.view_as(state)
    o = o.view(num_chunks, num_heads, chunk_size, v_dim)
    return o[dest // chunk_size, :, dest % chunk_size], finals  # one gather, [N, H, V]


@lru_cache(maxsize=16)
def _packing(cu_seqlens: tuple[int, ...], chunk_size: int
             ) -> tuple[list[int], list[int], list[int], torch.Tensor]:
    """``varlen_chunk_delta_rule``'s layout, the same in every linear layer of a step: (the
    sequences by falling chunk count, how many take part in each round, where each round's
    chunks start (and the total at the end), the packed row of every token)."""
    lens = [b - a for a, b in zip(cu_seqlens, cu_seqlens[1:])]
    counts = [-(-n // chunk_size) for n in lens]
    order = sorted(range(len(lens)), key=lambda i: -counts[i])  # stable: ties keep their order
    active = [sum(1 for c in counts if c > j) for j in range(max(counts))]
    offsets = [0]
    for a in active:
        offsets.append(offsets[-1] + a)
    rank = torch.empty(len(lens), dtype=torch.long)
    rank[order] = torch.arange(len(lens))
    seq = torch.repeat_interleave(torch.arange(len(lens)), torch.tensor(lens))
    pos = torch.arange(cu_seqlens[-1]) - torch.tensor(cu_seqlens[:-1])[seq]
    chunk = torch.tensor(offsets[:-1])[pos // chunk_size] + rank[seq]
    return order, active, offsets, chunk * chunk_size + pos % chunk_size


def _add_steep_channels(kk, qk, steep, g_cum, q, k, beta, ratio: int, causal) -> None:
    """Add the exact-form terms sum over channels c of ``exp(G_ic - G_jc)`` k_ic (k_jc or q_jc)
    of the steep (chunk, head, channel) triples to kk and qk [B, H, N, C, C]: one [C, C] decay
    per triple, so the cost follows the few fast-forgetting channels, not whole chunks."""
    b, h, n, c = steep[..., 0, :].nonzero(as_tuple=True)  # [P] each
    g_p = g_cum[b, h, n, :, c]  # [P, C]
    decay = (g_p[:, :, None] - g_p[:, None, :]).masked_fill(~causal, float("-inf")).exp()
    k_p, q_p = k[b, h // ratio, n, :, c], q[b, h // ratio, n, :, c]  # [P, C]
    k_j = k_p[:, None, :] * decay  # [P, C (i), C (j)]
    index = (b * kk.shape[1] + h) * kk.shape[2] + n
    kk.view(-1, *kk.shape[3:]).index_add_(0, index, (k_p * beta[b, h, n])[:, :, None] * k_j)
    qk.view(-1, *qk.shape[3:]).index_add_(0, index, q_p[:, :, None] * k_j)


def _hand_off(flat: torch.Tensor, factors: list[torch.Tensor], in_place: bool
              ) -> tuple[torch.Tensor, torch.Tensor]:
    """One chunk of each state in ``flat`` [BH, K, V]: (its output [BH, C, V], the state
    after it, ``flat`` itself when ``in_place``)."""
    u, w, qk, q_decayed, k_tail_t, state_decay = factors
    v_new = torch.baddbmm(u, w, flat, alpha=-1.0)  # u - w S  [BH, C, V]
    o = torch.baddbmm(torch.bmm(q_decayed, flat), qk, v_new)
    if in_place:
        return o, flat.mul_(state_decay).baddbmm_(k_tail_t, v_new)
    return o, torch.baddbmm(flat * state_decay, k_tail_t, v_new)


def _chunk_factors(q, k, v, g, beta, scale: float) -> tuple[torch.Tensor, ...]:
    """What the hand-off needs of each chunk, every chunk at once.  Inputs [B, N, C, H, ...]
    FP32 (q, k with Hk key heads); returns (u, w, qk, q_decayed, k_tail^T, state_decay), each
    [B, H, N, ...]: with S the state entering the chunk, v_new = u - w S, the chunk's output
    q_decayed S + qk v_new, and the state after it S * state_decay + k_tail^T v_new."""
    per_channel = g.dim() == 5
    batch, num_chunks, chunk_size, num_k_heads = k.shape[:4]
    num_heads = v.shape[3]
    ratio = num_heads // num_k_heads
    q, k, v, g, beta = (x.movedim(3, 1).contiguous() for x in (q, k, v, g, beta))
    g_cum = g.cumsum(dim=3)  # [B, H, N, C(, K)]
    idx = torch.arange(chunk_size, device=q.device)
    causal = idx[:, None] >= idx[None, :]  # [C, C], i attends j <= i

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
        # steep channels (a chunk's log-decay past -FACTOR_LIMIT) leave the factorised products
        # (exp(-G) clamped so they stay finite, gradients too, then zeroed) for the exact form
        steep = -g_cum[..., -1:, :] > FACTOR_LIMIT  # [B, H, N, 1, K]
        k_inv = heads(kg * (-g_cum_r).clamp(max=FACTOR_LIMIT).exp()).masked_fill(steep, 0.0)
        kk = k_decayed @ k_inv.transpose(-1, -2)
        qk = q_decayed @ k_inv.transpose(-1, -2)
        if steep.any():
            _add_steep_channels(kk, qk, steep, g_cum, q * scale, k, beta, ratio, causal)
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
    # T = lower^{-1}; u = T v_beta, w = T (k_beta ⊙ exp(G)).  T is formed explicitly, as fla's
    # kernels do, and applied by two products: solving for the [C, C] identity and multiplying
    # cost 0.6x the two solves for the [C, V] and [C, K] right-hand sides (GDN at Qwen3-Next's
    # shapes, 1,024 tokens, one core: 36 against 57 ms), and differ from them by ~2e-7 of
    # their scale
    eye = torch.eye(chunk_size, dtype=lower.dtype, device=q.device).expand_as(lower)
    inverse = torch.linalg.solve_triangular(lower, eye, upper=False, unitriangular=True)
    u, w = inverse @ v_beta, inverse @ k_decayed
    qk = qk.masked_fill_(~causal, 0.0)
    k_tail_t = k_tail.transpose(-1, -2)

    return u, w, qk, q_decayed, k_tail_t, state_decay
