"""The CPU step's packed forms against each sequence alone: the delta rule of all sequences in
one pass (``varlen_chunk_delta_rule``, one-token sequences by the decode update), the short
convolution of all sequences in one buffer (``conv_varlen``), and attention of a step's
one-token sequences over one padded row table (``batch.single_queries``)."""

from __future__ import annotations

import pytest
import torch

from kernels.delta_rule.naive import (
    chunk_delta_rule,
    l2norm_div,
    recurrent_delta_rule,
    varlen_chunk_delta_rule,
)
from kernels.short_conv.naive import conv_prefill, conv_varlen
from model_runner.batch import SeqInput, SingleQueries, build_batch
from model_runner.layers.attention import causal_attention, per_sequence
from model_runner.ops.linear_attention import delta_rule_prefill

# one-token sequences (the decodes of a mixed step), a whole chunk, chunks and a tail, ...
LENS = [1, 37, 16, 1, 64, 130, 5, 2]


def _cu(lens: list[int]) -> list[int]:
    cu = [0]
    for n in lens:
        cu.append(cu[-1] + n)
    return cu


def _operands(lens, per_channel, seed=0, heads=4, key_heads=2, k_dim=16, v_dim=8):
    gen = torch.Generator().manual_seed(seed)
    n = sum(lens)
    q = l2norm_div(torch.randn(n, key_heads, k_dim, generator=gen))
    k = l2norm_div(torch.randn(n, key_heads, k_dim, generator=gen))
    v = torch.randn(n, heads, v_dim, generator=gen)
    g_shape = (n, heads, k_dim) if per_channel else (n, heads)
    g = -torch.rand(g_shape, generator=gen).pow(3) * 4
    beta = torch.rand(n, heads, generator=gen)
    states = torch.randn(len(lens), heads, k_dim, v_dim, generator=gen)
    return q, k, v, g, beta, states


def _alone(q, k, v, g, beta, states, cu, i, scale):
    """Sequence i by the token-by-token recurrence (GVA key heads repeated)."""
    a, b = cu[i], cu[i + 1]
    ratio = v.shape[1] // k.shape[1]
    qe, ke = (x[a:b].repeat_interleave(ratio, dim=1)[None] for x in (q, k))
    o, s = recurrent_delta_rule(qe, ke, v[None, a:b], g[None, a:b], beta[None, a:b],
                                states[i : i + 1], scale)
    return o[0], s[0]


def _close(a, b, tol=2e-5):
    assert (a - b).abs().max().item() <= tol * max(1.0, b.abs().max().item())


@pytest.mark.parametrize("per_channel", [False, True], ids=["gdn", "kda"])
@pytest.mark.parametrize("lens", [LENS, [130, 1, 1], [3, 70]], ids=str)
def test_packed_delta_rule_equals_each_sequence_alone(per_channel, lens):
    """Through the CPU dispatch (mixed lengths, GVA, rounds of falling chunk counts) and, for
    the one-token sequences, the batched decode update beside the chunks."""
    q, k, v, g, beta, states = _operands(lens, per_channel)
    cu = _cu(lens)
    before = states.clone()
    o, finals = delta_rule_prefill(q, k, v, g, beta, states, cu, 0.3)
    assert torch.equal(states, before)  # the pool's gathered copy is not written
    for i in range(len(lens)):
        o_ref, s_ref = _alone(q, k, v, g, beta, states, cu, i, 0.3)
        _close(o[cu[i] : cu[i + 1]], o_ref)
        _close(finals[i], s_ref)


def test_packed_delta_rule_is_differentiable():
    """Under autograd the packed hand-off advances its states out of place, so gradients of the
    packed pass equal those of each sequence through ``chunk_delta_rule``."""
    lens = [5, 20, 1]
    cu = _cu(lens)
    q, k, v, g, beta, states = _operands(lens, per_channel=True, seed=4)
    q, v = q.clone().requires_grad_(), v.clone().requires_grad_()
    o, finals = delta_rule_prefill(q, k, v, g, beta, states, cu, 0.3)
    (o.square().sum() + finals.sum()).backward()
    for i in range(len(lens)):
        a, b = cu[i], cu[i + 1]
        q_i, v_i = (x.detach()[a:b].clone().requires_grad_() for x in (q, v))
        o_i, s_i = chunk_delta_rule(q_i[None], k[None, a:b], v_i[None], g[None, a:b],
                                    beta[None, a:b], states[i : i + 1], 0.3)
        (o_i.square().sum() + s_i.sum()).backward()
        _close(q.grad[a:b], q_i.grad)
        _close(v.grad[a:b], v_i.grad)


@pytest.mark.parametrize("chunk", [4, 16])
def test_varlen_chunks_with_one_token_sequences_inside(chunk):
    """One-token sequences padded into chunks of their own (the varlen form called directly)."""
    lens = [1, 9, 1, 4, 12]
    q, k, v, g, beta, states = _operands(lens, per_channel=True, seed=1)
    cu = _cu(lens)
    o, finals = varlen_chunk_delta_rule(q, k, v, g, beta, states, cu, 0.25, chunk)
    for i in range(len(lens)):
        o_ref, s_ref = _alone(q, k, v, g, beta, states, cu, i, 0.25)
        _close(o[cu[i] : cu[i + 1]], o_ref)
        _close(finals[i], s_ref)


def test_packed_conv_equals_each_sequence_alone():
    gen = torch.Generator().manual_seed(2)
    lens, channels, width = [1, 5, 2, 17, 1], 32, 3
    cu = _cu(lens)
    x = torch.randn(cu[-1], channels, generator=gen)
    weight = torch.randn(channels, width + 1, generator=gen)
    states = torch.randn(len(lens), channels, width, generator=gen)
    cuts = [(1, 2), (3, 1), (3, 16), (1, 4)]
    out, finals, at_cuts = conv_varlen(x, weight, states, cu, cuts)
    for i in range(len(lens)):
        o_ref, s_ref = conv_prefill(x[cu[i] : cu[i + 1]], weight, states[i])
        torch.testing.assert_close(out[cu[i] : cu[i + 1]], o_ref, rtol=0, atol=1e-6)
        assert torch.equal(finals[i], s_ref)
    for (i, n), state in zip(cuts, at_cuts):  # a cut's state is a copy of rows: bit for bit
        assert torch.equal(state, conv_prefill(x[cu[i] : cu[i] + n], weight, states[i])[1])


def _step(contexts: list[int], new: list[int], seed: int = 3, kv_heads: int = 2):
    """A step whose sequence i has contexts[i] cached positions and brings new[i] tokens, over
    a random [K | V] cache; returns (batch, q, cache)."""
    gen = torch.Generator().manual_seed(seed)
    total = sum(c + n for c, n in zip(contexts, new))
    rows = torch.randperm(total, generator=gen).tolist()  # scattered pages of size 1
    seqs, start = [], 0
    for i, (c, n) in enumerate(zip(contexts, new)):
        seqs.append(SeqInput([1] * n, c, rows[start : start + c + n], i))
        start += c + n
    batch = build_batch(seqs, 1, torch.device("cpu"))
    cache = torch.randn(total, 2, kv_heads, 8, generator=gen)
    q = torch.randn(sum(new), 4, 8, generator=gen)
    return batch, q, cache


def _each_alone(batch, q, cache):
    outs = []
    for i, rows in enumerate(batch.kv_read_index):
        a, b = batch.cu_seqlens[i], batch.cu_seqlens[i + 1]
        kv = cache[rows]
        outs.append(causal_attention(q[a:b], kv[:, 0], kv[:, 1], batch.prefix_lens[i], 0.4))
    return torch.cat(outs)


@pytest.mark.parametrize("contexts,new,padded", [
    ([20, 13, 30, 7], [1, 6, 1, 1], True),  # decodes and a chunk: the singles share a table
    ([3, 40, 2], [1, 1, 1], False),  # one long context among short ones: padding refused
], ids=["table", "too-much-padding"])
def test_single_queries_attend_as_each_alone(contexts, new, padded):
    batch, q, cache = _step(contexts, new)
    singles = batch.single_queries
    assert singles.seqs == [i for i, n in enumerate(new) if n == 1]
    assert (singles.table is not None) == padded
    if padded:
        assert singles.table.shape[1] * len(singles.seqs) <= SingleQueries.MAX_PADDING * sum(
            c + 1 for c, n in zip(contexts, new) if n == 1)
    got = per_sequence(batch, q, cache, lambda kv: (kv[:, 0], kv[:, 1]), 0.4)
    torch.testing.assert_close(got, _each_alone(batch, q, cache), rtol=0, atol=1e-5)
