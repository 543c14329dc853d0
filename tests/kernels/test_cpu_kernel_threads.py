"""The C kernels that split their work among the OpenMP threads (``dasc-serve --cpu-threads``):
each output is computed by one thread in the same order whatever their number, so every
kernel gives the same bits on 1, 2 or 3 threads (3 splits the work unevenly), at sizes past
``PARALLEL_MIN`` with ragged tails.  The AVX-512 forms only: the portable ones run on one
thread."""

from __future__ import annotations

import pytest
import torch

from kernels import cpu_fused, decode_attention, gemv, lm_head, moe_decode, prefill_attention
from kernels.delta_rule import cpu_decode as delta_decode
from kernels.short_conv import cpu as short_conv

THREADS = (1, 2, 3)


@pytest.fixture
def threads():
    """Runs a kernel at each thread count (the calling thread's OpenMP count, as a rank sets
    it) and returns the outputs; restores the count after."""
    before = torch.get_num_threads()

    def run(kernel):
        outs = []
        for n in THREADS:
            torch.set_num_threads(n)
            out = kernel()
            if out is None:
                pytest.skip("the kernel does not run here")
            outs.append(out if isinstance(out, tuple) else (out,))
        return outs

    yield run
    torch.set_num_threads(before)


def same(outs) -> bool:
    return all(all(torch.equal(a, b) for a, b in zip(outs[0], o)) for o in outs[1:])


def gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


@torch.inference_mode()
def test_the_decode_gemv(threads):
    w = (torch.randn(4103, 256, generator=gen(0)) * 0.05).bfloat16()  # 4103: a ragged tail
    for rows in (1, 3):
        x = torch.randn(rows, 256, generator=gen(rows)).bfloat16()
        assert same(threads(lambda x=x: gemv.gemv(x, w)))


@torch.inference_mode()
def test_the_decode_gemv_over_a_coded_weight(threads):
    w = (torch.randn(4103, 256, generator=gen(3)) * 0.05).bfloat16()
    coded = gemv.code_weight(w)
    for rows in (1, 3):
        x = torch.randn(rows, 256, generator=gen(rows)).bfloat16()
        assert same(threads(lambda x=x: gemv.gemv(x, w, coded=coded) if coded else None))


@torch.inference_mode()
def test_the_lm_head_screen(threads):
    wq = torch.randint(-127, 128, (4099, 128), generator=gen(1), dtype=torch.int8)
    xu = torch.randint(0, 256, (2, 128), generator=gen(2), dtype=torch.uint8)
    assert same(threads(lambda: lm_head.screen_dots(xu, wq)))


def moe_operands(inter: int, hidden: int = 256, experts: int = 4):
    w13 = (torch.randn(experts, hidden, 2 * inter, generator=gen(3)) * 0.05).bfloat16()
    w2 = (torch.randn(experts, inter, hidden, generator=gen(4)) * 0.05).bfloat16()
    shared = ((torch.randn(hidden, 2 * inter, generator=gen(5)) * 0.05).bfloat16(),
              (torch.randn(inter, hidden, generator=gen(6)) * 0.05).bfloat16())
    x = torch.randn(2, hidden, generator=gen(7)).bfloat16()
    ids = torch.tensor([[0, 3], [3, 1]])
    weights = torch.rand(2, 2, generator=gen(8)).bfloat16()
    return x, ids, weights, w13, w2, shared


@torch.inference_mode()
def test_the_moe_decode(threads):
    x, ids, weights, w13, w2, shared = moe_operands(304)  # 2I = 608: 38 runs of 16, 3 threads
    assert same(threads(lambda: moe_decode.moe_decode(x, ids, weights, w13, w2,
                                                      (*shared, None))))


@torch.inference_mode()
def test_the_moe_decode_over_coded_weights(threads):
    x, ids, weights, w13, w2, shared = moe_operands(352)  # 2I = 704: 11 blocks of 64
    coded = moe_decode.code_experts(w13, w2, shared)
    assert same(threads(lambda: moe_decode.moe_decode(x, ids, weights, w13, w2, (*shared, None),
                                                      coded=coded) if coded else None))


@torch.inference_mode()
def test_the_fused_passes(threads):
    n, heads, dim = 301, 4, 128
    x = torch.randn(n, 2 * 512, generator=gen(9)).bfloat16()
    assert same(threads(lambda: cpu_fused.silu_mul(x)))
    w = torch.rand(512, generator=gen(10)) + 0.5
    assert same(threads(lambda: cpu_fused.rmsnorm(x[:, :512], w, 1e-6, True)))
    o = torch.randn(n, heads, dim, generator=gen(11))
    z = torch.randn(n, heads * dim, generator=gen(12)).bfloat16()
    g = torch.rand(dim, generator=gen(13)) + 0.5
    assert same(threads(lambda: cpu_fused.gated_rmsnorm(o, z, g, 1e-6)))
    qkv = torch.randn(n, 2 * heads * dim + 384, generator=gen(14)).bfloat16()
    assert same(threads(lambda: cpu_fused.l2norm_qkv(qkv, heads, dim)))


@torch.inference_mode()
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_the_conv_prefill_sums(threads, dtype):
    channels, width = 512, 3
    x = torch.randn(700, channels, generator=gen(15)).to(dtype)
    columns = torch.randn(width + 1, channels, generator=gen(16))
    states = torch.randn(2, channels, width, generator=gen(17)).to(dtype)
    cu = [0, 2, 700]  # a sequence shorter than the window, then a long one
    assert same(threads(lambda: short_conv.conv_window_sums(x, columns, states, cu, dtype)))


@torch.inference_mode()
def test_the_decode_attention(threads):
    heads, kv_heads, dim, rows = 8, 2, 128, 900
    cache = torch.randn(rows, 2, kv_heads, dim, generator=gen(18)).bfloat16()
    q = torch.randn(3, heads, dim, generator=gen(19)).bfloat16()
    index = torch.randperm(rows, generator=gen(20))
    starts, lens = torch.tensor([0, 300, 301]), torch.tensor([300, 1, 599])
    assert same(threads(lambda: decode_attention.attention_decode(q, cache, index, starts, lens,
                                                                  dim ** -0.5)))


@torch.inference_mode()
def test_the_delta_rule_decode(threads):
    seqs, heads, k_dim, v_dim = 3, 5, 128, 128
    pool = torch.randn(5, heads, k_dim, v_dim, generator=gen(21))
    rows = seqs * heads
    wkq = torch.randn(rows, 2, k_dim, generator=gen(22))
    qk, beta = torch.randn(rows, generator=gen(23)), torch.rand(rows, generator=gen(24))
    v = torch.randn(rows, 1, v_dim, generator=gen(25))
    decay = torch.rand(rows, k_dim, 1, generator=gen(26))  # per key dim (KDA's form)
    k = torch.randn(rows, k_dim, 1, generator=gen(27))
    slots = [4, 1, 2]

    def step():  # the state advances in place: each thread count starts from the same one
        state = pool.clone()
        o = delta_decode.delta_rule_in_place(state, slots, wkq, qk, v, beta, decay, k)
        return None if o is None else (o, state)

    assert same(threads(step))


@pytest.mark.parametrize("heads, kv_heads, dim, prefix, n", [
    (8, 2, 256, 40, 300),  # Qwen3.5's heads: three groups of eight query tiles a KV head
    (16, 2, 128, 0, 77),  # Qwen3-Next's eight query heads a KV head: groups of four tiles
    (3, 1, 64, 5, 50),  # an odd number of query heads a KV head: one at a time
])
@torch.inference_mode()
def test_the_prefill_attention(threads, heads, kv_heads, dim, prefix, n):
    cache = torch.randn(prefix + n + 9, 2, kv_heads, dim, generator=gen(30)).bfloat16()
    rows = torch.randperm(len(cache), generator=gen(31))[: prefix + n]
    q = torch.randn(n, heads, dim, generator=gen(32)).bfloat16()
    assert same(threads(lambda: prefill_attention.attention_prefill(q, cache, rows, prefix,
                                                                    dim ** -0.5)))
