"""Chunked CPU delta rule vs token-by-token recurrence vs fla's naive torch references."""

from __future__ import annotations

import importlib.metadata
import importlib.util

import pytest
import torch

from kernels.delta_rule.decode import decode_step
from kernels.delta_rule.naive import (
    FACTOR_LIMIT,
    chunk_delta_rule,
    l2norm_div,
    recurrent_delta_rule,
    recurrent_step,
)
from kernels.short_conv.naive import conv_decode, conv_decode_into, conv_prefill
from model_runner.ops.linear_attention import (
    delta_rule_decode,
    delta_rule_prefill,
    recurrence_in_pool,
)


def _fla_naive(path: str):
    """Load one of fla's naive.py files without importing the fla package (blocked on CPU)."""
    file = importlib.metadata.distribution("fla-core").locate_file(path)
    spec = importlib.util.spec_from_file_location(f"fla_naive_{path.replace('/', '_')}", file)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _inputs(batch, seq_len, heads, k_dim, v_dim, per_channel, seed=0):
    gen = torch.Generator().manual_seed(seed)
    q = l2norm_div(torch.randn(batch, seq_len, heads, k_dim, generator=gen))
    k = l2norm_div(torch.randn(batch, seq_len, heads, k_dim, generator=gen))
    v = torch.randn(batch, seq_len, heads, v_dim, generator=gen)
    g_shape = (batch, seq_len, heads, k_dim) if per_channel else (batch, seq_len, heads)
    # a realistic spread: some units forget within a token, some barely at all
    g = -torch.rand(g_shape, generator=gen).pow(3) * 4
    beta = torch.rand(batch, seq_len, heads, generator=gen)
    h0 = torch.randn(batch, heads, k_dim, v_dim, generator=gen)
    return q, k, v, g, beta, h0


def _close(a, b, tol=2e-5):
    assert (a - b).abs().max().item() <= tol * max(1.0, b.abs().max().item())


@pytest.mark.parametrize("per_channel", [False, True])
@pytest.mark.parametrize("seq_len,chunk", [(1, None), (7, None), (64, None), (77, 16), (130, 32)])
def test_chunked_matches_recurrence(per_channel, seq_len, chunk):
    q, k, v, g, beta, h0 = _inputs(2, seq_len, 3, 16, 8, per_channel)
    o_ref, s_ref = recurrent_delta_rule(q, k, v, g, beta, h0, 16**-0.5)
    o, s = chunk_delta_rule(q, k, v, g, beta, h0, 16**-0.5, chunk_size=chunk)
    _close(o, o_ref)
    _close(s, s_ref)


@pytest.mark.parametrize("gva", [False, True])
@pytest.mark.parametrize("reset", [None, 5, 15])
def test_per_channel_factorised_and_exact_forms(reset, gva):
    """Mild decays take the factorised intra-chunk form; a reset (log-decay -2 * FACTOR_LIMIT
    at one token in three channels of one head) pushes those channels of that chunk past the
    limit, and they alone take the exact form.  Both equal the recurrence, with GVA key heads
    too, and the gradients stay finite (the steep channels' factorised products are clamped)."""
    q, k, v, g, beta, h0 = _inputs(1, 40, 2, 16, 8, per_channel=True, seed=5)
    g = g * 0.05  # total log-decay per 16-token chunk stays far above -FACTOR_LIMIT
    assert (-g.sum(1)).max() < FACTOR_LIMIT
    if reset is not None:
        g[:, reset, 1, :3] = -2 * FACTOR_LIMIT  # value head 1: key head 0 under GVA
    if gva:  # one key head serves both value heads
        q, k = q[:, :, :1], k[:, :, :1]
    qe, ke = (x.expand(-1, -1, 2, -1) for x in (q, k))
    o_ref, s_ref = recurrent_delta_rule(qe, ke, v, g, beta, h0, 0.25)
    v = v.clone().requires_grad_()
    o, s = chunk_delta_rule(q, k, v, g, beta, h0, 0.25)
    _close(o.detach(), o_ref)
    _close(s.detach(), s_ref)
    (o.sum() + s.sum()).backward()
    assert torch.isfinite(v.grad).all()


@pytest.mark.parametrize("per_channel", [False, True])
def test_gva_key_heads_without_expansion(per_channel):
    """Hk key heads serving H = 3 Hk value heads equal the expanded call, chunked and decode."""
    q, k, v, g, beta, h0 = _inputs(2, 37, 6, 16, 8, per_channel, seed=6)
    q, k = q[:, :, :2], k[:, :, :2]
    qe, ke = q.repeat_interleave(3, dim=2), k.repeat_interleave(3, dim=2)
    o_ref, s_ref = recurrent_delta_rule(qe, ke, v, g, beta, h0, 0.25)
    o, s = chunk_delta_rule(q, k, v, g, beta, h0, 0.25, chunk_size=16)
    _close(o, o_ref)
    _close(s, s_ref)
    o1, s1 = decode_step(q[:, 0], k[:, 0], v[:, 0], g[:, 0], beta[:, 0], h0.clone(), 0.25)
    o1_ref, s1_ref = recurrent_step(qe[:, 0], ke[:, 0], v[:, 0], g[:, 0], beta[:, 0], h0, 0.25)
    _close(o1, o1_ref, tol=1e-6)
    _close(s1, s1_ref, tol=1e-6)


def test_kda_matches_fla_naive_references():
    naive = _fla_naive("fla/ops/kda/naive.py")
    # fla's naive chunk form needs T to be a multiple of its chunk size
    q, k, v, g, beta, h0 = _inputs(2, 48, 2, 16, 16, per_channel=True, seed=1)
    o_ref, s_ref = naive.naive_recurrent_kda(q, k, v, g, beta, scale=0.25, initial_state=h0,
                                              output_final_state=True)
    o, s = chunk_delta_rule(q, k, v, g, beta, h0, 0.25)
    _close(o, o_ref)
    _close(s, s_ref)
    o_chunk, s_chunk = naive.naive_chunk_kda(q, k, v, g, beta, scale=0.25, initial_state=h0,
                                             output_final_state=True, chunk_size=16)
    _close(o, o_chunk, tol=1e-4)
    _close(s, s_chunk, tol=1e-4)


def test_gdn_matches_fla_naive_reference():
    naive = _fla_naive("fla/ops/gated_delta_rule/naive.py")
    q, k, v, g, beta, h0 = _inputs(2, 50, 2, 16, 8, per_channel=False, seed=2)
    fn = getattr(naive, "naive_recurrent_gated_delta_rule", None) or naive.naive_recurrent_gdn
    out = fn(q=q, k=k, v=v, g=g, beta=beta, scale=0.25, initial_state=h0,
             output_final_state=True)
    o, s = chunk_delta_rule(q, k, v, g, beta, h0, 0.25)
    _close(o, out[0])
    _close(s, out[1])


def test_varlen_prefill_then_decode_with_gva():
    """The device-dispatched interface: two sequences of different lengths in one flat batch, GVA
    (2 value heads per key head), then one decode step each, against the recurrence."""
    q, k, v, g, beta, _ = _inputs(1, 23, 4, 8, 8, per_channel=False, seed=3)
    q, k = q[:, :, :2], k[:, :, :2]  # 2 key heads serve 4 value heads
    states = torch.randn(2, 4, 8, 8)
    cu = [0, 9, 22]
    o, finals = delta_rule_prefill(q[0, :22], k[0, :22], v[0, :22], g[0, :22], beta[0, :22],
                                   states, cu, 0.3)
    qe, ke = q.repeat_interleave(2, dim=2), k.repeat_interleave(2, dim=2)
    for i in range(2):
        a, b = cu[i], cu[i + 1]
        o_ref, s_ref = recurrent_delta_rule(qe[:, a:b], ke[:, a:b], v[:, a:b], g[:, a:b],
                                            beta[:, a:b], states[i : i + 1], 0.3)
        _close(o[a:b], o_ref[0])
        _close(finals[i : i + 1], s_ref)
    t = 22
    o_dec, new = delta_rule_decode(q[0, [t, t]], k[0, [t, t]], v[0, [t, t]], g[0, [t, t]],
                                   beta[0, [t, t]], finals, 0.3)
    o_ref, s_ref = recurrent_step(qe[0, [t, t]], ke[0, [t, t]], v[0, [t, t]], g[0, [t, t]],
                                  beta[0, [t, t]], finals, 0.3)
    _close(o_dec, o_ref)
    _close(new, s_ref)


@pytest.mark.parametrize("dtype, channels", [(torch.float32, 6), (torch.bfloat16, 8192)])
def test_short_conv_decode_gives_the_prefills_bits(dtype, channels):
    """Token by token, the decode (and its in-slot form) gives the prefill's states bit for bit
    and, at a real GDN layer's 8,192 channels, its outputs too: one arithmetic.  With 6
    channels the outputs agree to 1e-6: torch's SiLU takes its scalar loop for a row shorter
    than a vector and its vectorised exp over the prefill's [11 x 6] block."""
    gen = torch.Generator().manual_seed(4)
    x = torch.randn(11, channels, generator=gen).to(dtype)
    weight = torch.randn(channels, 4, generator=gen).to(dtype)
    state0 = torch.randn(channels, 3, generator=gen).to(dtype)
    out, state = conv_prefill(x, weight, state0)
    s = state0[None]
    pool = torch.randn(4, channels, 3, generator=gen).to(dtype)
    pool[2] = state0
    others = pool[[0, 1, 3]].clone()
    for t in range(11):
        y, s = conv_decode(x[t : t + 1], weight, s)
        y_in_slot = conv_decode_into(x[t : t + 1], weight, pool, torch.tensor([2]))
        for got in (y[0], y_in_slot[0]):
            if channels % 16:
                _close(got, out[t], tol=1e-6)
            else:
                assert torch.equal(got, out[t])
    assert torch.equal(state, s[0]) and torch.equal(state, pool[2])
    assert torch.equal(pool[[0, 1, 3]], others)
    # a short sequence keeps part of the old state: (kernel - 1) positions in all
    _, short = conv_prefill(x[:2], weight, state0)
    assert torch.equal(short, torch.cat([state0[:, 2:], x[:2].t()], dim=1))


@pytest.mark.parametrize("per_channel", [False, True])
@pytest.mark.parametrize("lens", [[1, 1, 1], [1, 9, 1, 5], [9, 5]])
def test_recurrence_in_pool_gives_the_gathered_paths_bits(per_channel, lens):
    """The CPU step's in-pool recurrence (decodes updated in their slots, longer sequences
    gathered) against the gathered states through ``delta_rule_prefill``, which runs the same
    decodes batched: bit for bit in the outputs and the slots, the other slots untouched.
    Decode-only, mixed and prefill-only steps; GVA (2 value heads per key head)."""
    n = sum(lens)
    q, k, v, g, beta, _ = _inputs(1, n, 4, 8, 8, per_channel, seed=7)
    q, k, v, g, beta = (x[0] for x in (q[:, :, :2], k[:, :, :2], v, g, beta))
    pool = torch.randn(6, 4, 8, 8, generator=torch.Generator().manual_seed(8))
    slots = torch.tensor([4, 0, 5, 2][: len(lens)])
    cu = [0]
    for m in lens:
        cu.append(cu[-1] + m)
    with torch.inference_mode():
        o_ref, finals = delta_rule_prefill(q, k, v, g, beta, pool[slots], cu, 0.3)
        expected = pool.clone()
        expected[slots] = finals
        o = recurrence_in_pool(q, k, v, g, beta, pool, slots, cu, 0.3)
    assert torch.equal(o, o_ref)
    assert torch.equal(pool, expected)
