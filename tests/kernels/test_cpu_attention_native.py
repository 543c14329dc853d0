"""Decode attention in C (``kernels.decode_attention.attention_decode``) against its torch form
(``layers/attention.py``'s ``_decode_each`` over the gathered rows):
- bf16: at most one bf16 unit in the last place from torch's result, on under 1 % of the values
  (its dot products, exponential and softmax sum run in another order);
- FP32: equal to rounding;
- AVX-512 and portable forms give the same bits, and a sequence's bits do not depend on the
  sequences beside it;
- rows outside the pool raise; what it cannot run it declines (None);
- a served model's decode takes it (the gathered copy is never made).
"""

from __future__ import annotations

import pytest
import torch
from support.bf16_checks import assert_bf16_close

from kernels.decode_attention import attention_decode, native_library, simd_available
from model_runner.layers import attention
from model_runner.layers.attention import _decode_each, split_kv, table_decode_attention

pytestmark = pytest.mark.skipif(native_library() is None, reason="no C compiler here")

LENS = [1, 5, 33, 700]  # below, at and past 16-row blocks, and a long context


def _case(dtype, heads, kv_heads, dim, lens=LENS, seed=0):
    """A pool of 2,000 rows [2, kv_heads, dim] and sequences reading pages of 16 rows."""
    gen = torch.Generator().manual_seed(seed)
    cache = torch.randn(2000, 2, kv_heads, dim, generator=gen).to(dtype)
    pages = torch.randperm(125, generator=gen)
    rows = (pages[:, None] * 16 + torch.arange(16)).reshape(-1)
    lens_t = torch.tensor(lens)
    starts = lens_t.cumsum(0) - lens_t
    index = rows[: int(lens_t.sum())]
    q = torch.randn(len(lens), heads, dim, generator=gen).to(dtype)
    return q, cache, index, starts, lens_t


def _torch_form(q, cache, index, starts, lens, scale):
    outs = []
    for b in range(len(lens)):
        kv = cache[index[starts[b] : starts[b] + lens[b]]]
        outs.append(_decode_each(q[b : b + 1], kv[None, :, 0], kv[None, :, 1], lens[b : b + 1],
                                 scale))
    return torch.cat(outs)


@pytest.mark.parametrize("shape", [(16, 2, 256), (8, 2, 256), (4, 4, 32), (6, 2, 48)], ids=str)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
@torch.inference_mode()
def test_matches_the_torch_form(dtype, shape):
    heads, kv_heads, dim = shape
    q, cache, index, starts, lens = _case(dtype, heads, kv_heads, dim)
    got = attention_decode(q, cache, index, starts, lens, dim**-0.5,
                           simd=simd_available())
    want = _torch_form(q, cache, index, starts, lens, dim**-0.5)
    assert got.dtype == dtype and got.shape == want.shape
    if dtype == torch.float32:
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
        return
    assert_bf16_close(got, want)


@pytest.mark.skipif(not simd_available(), reason="no AVX-512 here")
@pytest.mark.parametrize("shape", [(16, 2, 256), (8, 2, 256), (3, 1, 32), (6, 2, 48)], ids=str)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
@torch.inference_mode()
def test_simd_and_portable_forms_give_the_same_bits(dtype, shape):
    heads, kv_heads, dim = shape
    q, cache, index, starts, lens = _case(dtype, heads, kv_heads, dim, seed=1)
    fast = attention_decode(q, cache, index, starts, lens, 0.3)
    portable = attention_decode(q, cache, index, starts, lens, 0.3, simd=False)
    assert torch.equal(fast, portable)


@torch.inference_mode()
def test_a_sequence_gets_the_bits_it_gets_alone():
    q, cache, index, starts, lens = _case(torch.bfloat16, 16, 2, 256)
    batch = attention_decode(q, cache, index, starts, lens, 0.0625)
    for b in range(len(lens)):
        rows = index[starts[b] : starts[b] + lens[b]]
        alone = attention_decode(q[b : b + 1], cache, rows, torch.tensor([0]), lens[b : b + 1],
                                 0.0625)
        assert torch.equal(batch[b : b + 1], alone)
    # the padded row table of a static decode: columns past a sequence's length are not read
    width = max(LENS)
    table = torch.zeros(len(LENS), width, dtype=torch.long)
    for b, n in enumerate(LENS):
        table[b, :n] = index[starts[b] : starts[b] + n]
        table[b, n:] = 1999 - b  # rows no sequence owns
    got = table_decode_attention(table, lens, q, cache, split_kv, 0.0625)
    assert torch.equal(got, batch)


@torch.inference_mode()
def test_rows_outside_the_pool_raise():
    q, cache, index, starts, lens = _case(torch.float32, 4, 2, 32)
    index = index.clone()
    index[3] = cache.shape[0]
    with pytest.raises(IndexError, match="outside"):
        attention_decode(q, cache, index, starts, lens, 0.5)


@torch.inference_mode()
def test_declines_what_it_does_not_run():
    q, cache, index, starts, lens = _case(torch.float32, 4, 2, 32)
    assert attention_decode(q.double(), cache.double(), index, starts, lens, 0.5) is None
    assert attention_decode(q, cache[:, :1], index, starts, lens, 0.5) is None  # not [K | V]
    assert attention_decode(q[:, :3], cache, index, starts, lens, 0.5) is None  # 3 heads, 2 KV
    assert attention_decode(q, cache, index, starts, lens.clamp(max=0), 0.5) is None
    with torch.enable_grad():
        assert attention_decode(q, cache, index, starts, lens, 0.5) is None


@torch.inference_mode()
def test_served_decode_reads_the_pool_in_place(monkeypatch):
    """Through the model's path (``paged_attention`` with ``split_kv``): the one-token
    sequences of a step take the kernel, and the gathered copy is never made."""
    from model_runner.batch import ForwardBatch

    q, cache, index, starts, lens = _case(torch.bfloat16, 8, 2, 64)
    reads = [index[starts[b] : starts[b] + lens[b]] for b in range(len(LENS))]
    n = len(LENS)
    batch = ForwardBatch(torch.zeros(n, dtype=torch.long), lens - 1, [1] * n,
                         [x - 1 for x in LENS], list(range(n + 1)),
                         torch.arange(n), torch.zeros(n, dtype=torch.long), reads,
                         is_decode=True)

    def no_gather(*args):
        raise AssertionError("gathered the KV rows")

    monkeypatch.setattr(attention, "gather_rows", no_gather)
    got = attention.paged_attention(batch, q, cache, split_kv, 0.125)
    assert torch.equal(got, attention_decode(q, cache, index, starts, lens, 0.125))
