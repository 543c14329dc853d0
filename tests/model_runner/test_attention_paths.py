"""The CUDA attention formulation (`F.scaled_dot_product_attention`, GQA by `enable_gqa`,
an explicit mask for prefixed prefill and padded row tables) against the explicit softmax the
CPU path runs: the same function of the same inputs, on CPU tensors here, on a GPU in
tests/model_runner/test_cuda_path.py through the whole model."""

from __future__ import annotations

import pytest
import torch

from model_runner.layers.attention import (
    EACH_MIN_ROWS,
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


def _token_major_decode(q, k, v, lens, scale):
    """The CPU decode as it was: products over the token-major views of the gathered rows."""
    num_seqs, width, num_kv = k.shape[:3]
    queries = q.view(num_seqs, num_kv, -1, q.shape[-1])
    scores = torch.matmul(queries, k.permute(0, 2, 3, 1)) * scale
    scores = scores.masked_fill((torch.arange(width)[None] >= lens[:, None])[:, None, None],
                                float("-inf"))
    probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
    return torch.matmul(probs, v.transpose(1, 2)).reshape(num_seqs, q.shape[1], -1)


@pytest.mark.parametrize("width", [300, 600], ids=["head-major-copies", "each-sequence"])
def test_cpu_decode_forms_give_the_token_major_views_bits(width):
    """Both CPU decode forms against the products over the token-major views: bf16, 16 query
    heads over 2 KV heads of 256.  Below ``EACH_MIN_ROWS`` rows the batched form over
    head-major copies gives their bits, padded sequences included; from it on each sequence
    and KV head runs alone over its own rows, with the bits of its table alone (no padding)."""
    assert (width >= EACH_MIN_ROWS) == (width == 600)
    gen = torch.Generator().manual_seed(width)
    cache = torch.randn(1300, 2, 2, 256, generator=gen).bfloat16()
    table = torch.randperm(1300, generator=gen)[: 2 * width].view(2, width)
    lens = torch.tensor([width, width - 89])
    q = torch.randn(2, 16, 256, generator=gen).bfloat16()

    def expand(kv):
        return kv[:, 0], kv[:, 1]

    def views(tab):
        k, v = expand(cache[tab.reshape(-1)])
        return k.view(*tab.shape, 2, 256), v.view(*tab.shape, 2, 256)

    got = table_decode_attention(table, lens, q, cache, expand, 256**-0.5)
    if width < EACH_MIN_ROWS:
        assert torch.equal(got, _token_major_decode(q, *views(table), lens, 256**-0.5))
        return
    for i in range(2):
        alone = table[i : i + 1, : lens[i]]
        want = _token_major_decode(q[i : i + 1], *views(alone), lens[i : i + 1], 256**-0.5)
        assert torch.equal(got[i : i + 1], want)


@pytest.mark.parametrize("prefix", [0, 9])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_cpu_prefill_with_narrower_values_runs_flash_attention(prefix, dtype):
    """MLA's values are narrower than its keys (128 against 192): on a CPU the prefill pads
    them to the key width so that torch's flash kernel runs (it wants one head size; SDPA fell
    back to its 2.4x slower math form).  Only the flash backend is allowed here, so without the
    padding this raises; the result equals the explicit softmax in float64."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    n, heads, dim, v_dim = 40, 4, 24, 16
    gen = torch.Generator().manual_seed(prefix)
    q = torch.randn(n, heads, dim, generator=gen).to(dtype)
    k = torch.randn(prefix + n, heads, dim, generator=gen).to(dtype)
    v = torch.randn(prefix + n, heads, v_dim, generator=gen).to(dtype)
    with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
        got = causal_attention(q, k, v, prefix, dim**-0.5)
    scores = torch.einsum("qhd,khd->hqk", q.double(), k.double()) * dim**-0.5
    seen = torch.ones(n, prefix + n, dtype=torch.bool).tril(prefix)
    want = torch.einsum("hqk,khd->qhd", scores.masked_fill(~seen, float("-inf")).softmax(-1),
                        v.double())
    assert got.shape == (n, heads, v_dim) and got.dtype == dtype
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got.double(), want, atol=tol, rtol=tol)


@torch.inference_mode()
def test_a_steps_rotary_angles_are_made_once_per_setting_and_follow_its_positions():
    """The batch keeps each rotary setting's cos and sin for its step: the same for every layer
    of that setting and dtype, its own for another setting or dtype, and a new step (new
    positions) gets new ones."""
    from model_runner.batch import SeqInput, build_batch
    from model_runner.layers.attention import PartialRotary

    def fresh(rotary, x, positions):  # the rotation computed from scratch
        freqs = positions.float()[:, None] * rotary.inv_freq[None]
        emb = torch.cat([freqs, freqs], dim=-1)
        cos, sin = emb.cos().to(x.dtype)[:, None], emb.sin().to(x.dtype)[:, None]
        half, rd = rotary.rotary_dim // 2, rotary.rotary_dim
        rot = x[..., :rd]
        rotated = torch.cat([-rot[..., half:], rot[..., :half]], dim=-1)
        return torch.cat([rot * cos + rotated * sin, x[..., rd:]], dim=-1)

    def step(prefix):  # three tokens of one sequence after ``prefix`` cached
        return build_batch([SeqInput([5, 6, 7], prefix, list(range(prefix + 3)), 1)],
                           page_size=1, device=torch.device("cpu"))

    a, b, a_again = (PartialRotary(64, 0.25, 1e7), PartialRotary(64, 0.5, 1e4),
                     PartialRotary(64, 0.25, 1e7))  # a_again: another layer of a's settings
    x = torch.randn(3, 2, 64, generator=torch.Generator().manual_seed(0)).bfloat16()
    for batch in (step(0), step(900)):
        for rotary, inp in [(a, x), (b, x), (a, x.float()), (a_again, x)]:
            assert torch.equal(rotary(inp, batch), fresh(rotary, inp, batch.positions))
        assert len(batch._rotary) == 3  # a's twice (bf16, fp32) and b's; a_again shared a's
