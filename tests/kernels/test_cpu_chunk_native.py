"""The C kernel of CPU prefill (``kernels/delta_rule/cpu_chunk``): the chunked gated delta rule
with one decay per head, each state advanced in its pool slot.
- Its AVX-512 and portable forms give the same bits, and so do one and two OpenMP workers.
- It agrees with the torch chunked form and the token-by-token reference to FP32 rounding
  (its sums run in another order: forward substitution instead of an explicit inverse, decay
  products chained instead of exponentials of differences), at real and odd shapes, with GVA,
  several sequences, partial chunks, one-token sequences and steep decays.
- Only the named slots change; bad slots raise before anything is written; it declines
  (None) what it does not run, and the runner's entry points then take the torch form.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kernels import native_build
from kernels.delta_rule import cpu_chunk
from kernels.delta_rule.cpu_chunk import chunk_in_pool, native_library, simd_available
from kernels.delta_rule.naive import recurrent_delta_rule, varlen_chunk_delta_rule
from model_runner.ops.linear_attention import delta_rule_prefill, recurrence_in_pool

pytestmark = pytest.mark.skipif(native_library() is None, reason="no C compiler here")
needs_simd = pytest.mark.skipif(not simd_available(), reason="no AVX-512 here")

SHAPES = {  # (key heads, heads, K, V)
    "qwen3.5": (4, 4, 128, 128),  # Qwen3.5's head shape, fewer heads
    "qwen3-next": (2, 4, 128, 128),  # GVA 2
    "odd": (3, 6, 24, 40),  # V not a multiple of the vector width: the portable loops
}


def _inputs(total, key_heads, heads, k_dim, v_dim, seed, steep=False):
    gen = torch.Generator().manual_seed(seed)
    q = F.normalize(torch.randn(total, key_heads, k_dim, generator=gen), dim=-1)
    k = F.normalize(torch.randn(total, key_heads, k_dim, generator=gen), dim=-1)
    v = torch.randn(total, heads, v_dim, generator=gen)
    g = -torch.rand(total, heads, generator=gen)
    if steep:  # a state reset inside a chunk: its products underflow to zero
        g[total // 3, 0] = -90.0
        g[:, -1] = -30.0
    beta = torch.rand(total, heads, generator=gen)
    return q, k, v, g, beta


def _run(shape, cu, chunk, simd=None, steep=False, seed=0):
    """The kernel on fresh inputs: its AVX-512 form where the CPU has it, else (``simd``
    None) the portable one."""
    simd = simd_available() if simd is None else simd
    key_heads, heads, k_dim, v_dim = SHAPES[shape]
    q, k, v, g, beta = _inputs(cu[-1], key_heads, heads, k_dim, v_dim, seed, steep)
    pool = torch.randn(len(cu) + 2, heads, k_dim, v_dim,
                       generator=torch.Generator().manual_seed(seed + 1)) * 0.1
    slots = list(range(len(cu) + 1, 1, -1))[: len(cu) - 1]  # reversed, slots 0 and 1 unused
    before = pool.clone()
    o = chunk_in_pool(q, k, v, g, beta, pool, slots, cu, k_dim**-0.5, chunk, simd=simd)
    return (q, k, v, g, beta), before, pool, slots, o


@needs_simd
@pytest.mark.parametrize("shape", list(SHAPES))
@torch.inference_mode()
def test_simd_and_portable_forms_give_the_same_bits(shape):
    cu = [0, 37, 38, 100]
    *_, pool, _, o = _run(shape, cu, 16, simd=True)
    *_, pool_portable, _, o_portable = _run(shape, cu, 16, simd=False)
    assert torch.equal(o, o_portable) and torch.equal(pool, pool_portable)


@torch.inference_mode()
def test_workers_do_not_change_the_bits():
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        *_, pool_one, _, o_one = _run("qwen3-next", [0, 50, 90, 91, 160], 16)
        torch.set_num_threads(2)
        *_, pool_two, _, o_two = _run("qwen3-next", [0, 50, 90, 91, 160], 16)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(o_one, o_two) and torch.equal(pool_one, pool_two)


@pytest.mark.parametrize("steep", [False, True])
@pytest.mark.parametrize("chunk", [16, 32])
@pytest.mark.parametrize("shape", list(SHAPES))
@torch.inference_mode()
def test_agrees_with_the_torch_forms(shape, chunk, steep):
    cu = [0, 1, 70, 200]  # a one-token sequence, partial chunks, several chunks
    (q, k, v, g, beta), before, pool, slots, o = _run(shape, cu, chunk, steep=steep)
    scale = q.shape[-1] ** -0.5
    want_o, want_states = varlen_chunk_delta_rule(q, k, v, g, beta, before[slots], cu, scale, 32)
    assert torch.allclose(o, want_o, rtol=0, atol=2e-6 * want_o.abs().max())
    assert torch.allclose(pool[slots], want_states, rtol=0,
                          atol=2e-6 * want_states.abs().max())
    ratio = v.shape[1] // q.shape[1]
    q_v, k_v = (x.repeat_interleave(ratio, dim=1) for x in (q, k))  # per value head
    for i, slot in enumerate(slots):  # the token-by-token reference
        rows = slice(cu[i], cu[i + 1])
        ref_o, ref_state = recurrent_delta_rule(
            *(x[rows][None] for x in (q_v, k_v, v, g, beta)), before[slot][None], scale)
        assert torch.allclose(o[rows], ref_o[0], rtol=0, atol=1e-5 * ref_o.abs().max())
        assert torch.allclose(pool[slot], ref_state[0], rtol=0,
                              atol=1e-5 * ref_state.abs().max())
    unused = [s for s in range(len(pool)) if s not in slots]
    assert torch.equal(pool[unused], before[unused])


@torch.inference_mode()
def test_bad_slots_raise_before_writing():
    key_heads, heads, k_dim, v_dim = SHAPES["odd"]
    q, k, v, g, beta = _inputs(20, key_heads, heads, k_dim, v_dim, 0)
    pool = torch.zeros(2, heads, k_dim, v_dim)
    with pytest.raises(IndexError, match="outside"):
        chunk_in_pool(q, k, v, g, beta, pool, [0, 2], [0, 10, 20], 0.2, 16)
    assert not pool.any()


def test_declines_what_it_does_not_run():
    key_heads, heads, k_dim, v_dim = SHAPES["odd"]
    q, k, v, g, beta = _inputs(20, key_heads, heads, k_dim, v_dim, 0)
    pool = torch.zeros(1, heads, k_dim, v_dim)
    args = ([0], [0, 20], 0.2, 16)
    assert chunk_in_pool(q, k, v, g, beta, pool, *args) is None  # autograd on
    with torch.inference_mode():
        per_channel = g[..., None].expand(-1, -1, k_dim).contiguous()
        assert chunk_in_pool(q, k, v, per_channel, beta, pool, *args) is None
        assert chunk_in_pool(q.double(), k, v, g, beta, pool, *args) is None
        native_build.set_enabled(False)
        try:
            assert chunk_in_pool(q, k, v, g, beta, pool, *args) is None
        finally:
            native_build.set_enabled(True)
        assert (chunk_in_pool(q, k, v, g, beta, pool, *args) is not None) == simd_available()
        assert chunk_in_pool(q, k, v, g, beta, pool, *args, simd=False) is not None


def test_declines_on_a_cpu_without_avx512(monkeypatch):
    """Its portable form is a reference, slower than the torch form: an AVX2-only CPU takes
    torch."""
    monkeypatch.setattr(cpu_chunk, "simd_available", lambda: False)
    key_heads, heads, k_dim, v_dim = SHAPES["qwen3.5"]
    q, k, v, g, beta = _inputs(20, key_heads, heads, k_dim, v_dim, 0)
    with torch.inference_mode():
        pool = torch.zeros(1, heads, k_dim, v_dim)
        assert chunk_in_pool(q, k, v, g, beta, pool, [0], [0, 20], 0.2, 16) is None
        o_prefill, _ = delta_rule_prefill(q, k, v, g, beta, pool, [0, 20], 0.2)
        o_torch, _ = varlen_chunk_delta_rule(q, k, v, g, beta, pool, [0, 20], 0.2, 32)
    assert torch.equal(o_prefill, o_torch)


@needs_simd
@torch.inference_mode()
def test_the_runner_entry_points_take_it_and_agree_with_each_other():
    """``recurrence_in_pool`` (in place) and ``delta_rule_prefill`` (on gathered states) both
    run the kernel: the same bits, and the torch form's values within FP32 rounding."""
    cu = [0, 1, 40, 41, 130]
    key_heads, heads, k_dim, v_dim = SHAPES["qwen3-next"]
    q, k, v, g, beta = _inputs(cu[-1], key_heads, heads, k_dim, v_dim, 3)
    pool = torch.randn(6, heads, k_dim, v_dim) * 0.1
    slots = torch.tensor([5, 1, 3, 0])
    o_ref, finals = delta_rule_prefill(q, k, v, g, beta, pool[slots], cu, 0.3)
    o = recurrence_in_pool(q, k, v, g, beta, pool, slots, cu, 0.3)
    assert torch.equal(o, o_ref) and torch.equal(pool[slots], finals)
    native_build.set_enabled(False)
    try:
        o_torch, _ = delta_rule_prefill(q, k, v, g, beta, pool[slots], cu, 0.3)
    finally:
        native_build.set_enabled(True)
    o_native, _ = delta_rule_prefill(q, k, v, g, beta, pool[slots], cu, 0.3)
    assert not torch.equal(o_torch, o_native)  # the two forms really differ in rounding
    assert torch.allclose(o_native, o_torch, rtol=0, atol=2e-6 * o_torch.abs().max())
