"""The CUDA attention formulation (`F.scaled_dot_product_attention`, GQA by `enable_gqa`,
an explicit mask for prefixed prefill and padded row tables) against the explicit softmax the
CPU path runs: the same function of the same inputs, on CPU tensors here, on a GPU in
tests/test_cuda_path.py through the whole model."""

from __future__ import annotations

import pytest
import torch

from model_runner.layers.attention import (
    _sdpa_causal,
    _sdpa_table,
    causal_attention,
    table_decode_attention,
)

# (new tokens n, prefix, query heads, KV heads, key dim, value dim): prefill with and without
# a cached prefix, decode, GQA, MLA-like value dims
SHAPES = [(5, 7, 4, 2, 16, 16), (1, 9, 4, 4, 8, 8), (6, 0, 4, 1, 8, 12), (3, 4, 2, 2, 24, 16),
          (1, 0, 2, 1, 8, 8)]


@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_sdpa_prefill_and_decode_equal_the_explicit_softmax(shape):
    n, prefix, heads, kv_heads, dim, v_dim = shape
    gen = torch.Generator().manual_seed(n * 31 + prefix)
    q = torch.randn(n, heads, dim, generator=gen)
    k = torch.randn(prefix + n, kv_heads, dim, generator=gen)
    v = torch.randn(prefix + n, kv_heads, v_dim, generator=gen)
    want = causal_attention(q, k, v, prefix, 0.3)
    torch.testing.assert_close(_sdpa_causal(q, k, v, prefix, 0.3), want, rtol=0, atol=1e-5)
    if n > 1:  # the mask matters: the last query sees more than the first
        assert not torch.allclose(want[0], want[-1])


@pytest.mark.parametrize("kv_heads", [1, 2, 4])
def test_sdpa_row_table_equals_the_explicit_softmax(kv_heads):
    gen = torch.Generator().manual_seed(kv_heads)
    cache = torch.randn(50, 2, kv_heads, 8, generator=gen)  # rows [K | V]
    table = torch.randint(0, 50, (3, 16), generator=gen)
    lens = torch.tensor([5, 16, 1])
    q = torch.randn(3, 4, 8, generator=gen)

    def expand(kv):
        return kv[:, 0], kv[:, 1]

    want = table_decode_attention(table, lens, q, cache, expand, 0.5)
    k, v = expand(cache[table.reshape(-1)])
    got = _sdpa_table(q, k.view(3, 16, kv_heads, 8), v.view(3, 16, kv_heads, 8), lens, 0.5)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-5)
    # a padded column never leaks in: changing it changes nothing
    table[0, 5:] = (table[0, 5:] + 1) % 50
    torch.testing.assert_close(table_decode_attention(table, lens, q, cache, expand, 0.5), want)


def test_cpu_decode_over_head_major_copies_gives_the_token_major_views_bits():
    """The CPU decode copies keys and values head-major before its products (4x faster at
    Qwen3-Next's shapes); the products over the token-major views the table gathers gave the
    same bits.  bf16, 16 query heads over 2 KV heads of 256, two sequences, one padded."""
    gen = torch.Generator().manual_seed(5)
    cache = torch.randn(700, 2, 2, 256, generator=gen).bfloat16()
    table = torch.randperm(700, generator=gen)[:600].view(2, 300)
    lens = torch.tensor([300, 211])
    q = torch.randn(2, 16, 256, generator=gen).bfloat16()
    rows = cache[table.reshape(-1)]
    k, v = rows[:, 0].view(2, 300, 2, 256), rows[:, 1].view(2, 300, 2, 256)
    queries = q.view(2, 2, 8, 256)
    scores = torch.matmul(queries, k.permute(0, 2, 3, 1)) * 256**-0.5
    scores = scores.masked_fill((torch.arange(300)[None] >= lens[:, None])[:, None, None],
                                float("-inf"))
    probs = torch.softmax(scores, dim=-1, dtype=torch.float32).bfloat16()
    want = torch.matmul(probs, v.transpose(1, 2)).reshape(2, 16, 256)
    got = table_decode_attention(table, lens, q, cache, lambda kv: (kv[:, 0], kv[:, 1]),
                                 256**-0.5)
    assert torch.equal(got, want)
