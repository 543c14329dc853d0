"""The prefill attention on AMX tiles (``kernels/prefill_attention``) against torch's flash
attention (``causal_attention``) and a float64 reference: as accurate as torch's; a query's
output has the same bits whatever chunk it arrives in (a prompt prefilled at once or after a
cached prefix); the attention layers take it; it declines what it does not run.  Skipped where
the CPU has no AMX."""

from __future__ import annotations

import pytest
import torch

from kernels import native_build, prefill_attention
from kernels.prefill_attention import amx_available, attention_prefill
from model_runner.layers import attention as attention_layers
from model_runner.layers.attention import causal_attention, gather_rows, split_kv

pytestmark = pytest.mark.skipif(not amx_available(), reason="no AMX here")


def _case(n, prefix, heads, kv_heads, dim, seed=0, pool_rows=4096):
    """q [n, H, D] bf16, a pool [R, 2, Hkv, D] bf16, the rows of positions [0, prefix + n) in
    a shuffled order of the pool."""
    gen = torch.Generator().manual_seed(seed)
    cache = torch.randn(pool_rows, 2, kv_heads, dim, generator=gen).bfloat16()
    rows = torch.randperm(pool_rows, generator=gen)[: prefix + n]
    q = torch.randn(n, heads, dim, generator=gen).bfloat16()
    return q, cache, rows


def _reference(q, cache, rows, prefix, scale) -> torch.Tensor:
    """Causal attention in float64 from the same bf16 operands."""
    k, v = (t.double() for t in split_kv(gather_rows(cache, rows)))
    n, heads, _ = q.shape
    ratio = heads // k.shape[1]
    k, v = (t.repeat_interleave(ratio, dim=1) for t in (k, v))
    scores = torch.einsum("nhd,lhd->hnl", q.double(), k) * scale
    keys = torch.arange(prefix + n)
    scores = scores.masked_fill(keys[None, None] > (prefix + torch.arange(n))[None, :, None],
                                float("-inf"))
    return torch.einsum("hnl,lhd->nhd", scores.softmax(-1), v)


@pytest.mark.parametrize("n, prefix, heads, kv_heads, dim", [
    (300, 0, 8, 2, 256),    # Qwen3.5-0.8B's heads, a fresh prompt
    (101, 700, 8, 2, 256),  # a hit's suffix
    (77, 129, 16, 2, 256),  # Qwen3-Next's heads
    (45, 20, 3, 1, 128),    # an odd number of query heads per KV head
    (33, 0, 4, 4, 64),
])
@torch.inference_mode()
def test_as_accurate_as_torch_flash_attention(n, prefix, heads, kv_heads, dim):
    q, cache, rows = _case(n, prefix, heads, kv_heads, dim)
    scale = dim**-0.5
    got = attention_prefill(q, cache, rows, prefix, scale)
    k, v = split_kv(gather_rows(cache, rows))
    torch_out = causal_attention(q, k, v, prefix, scale)
    ref = _reference(q, cache, rows, prefix, scale)
    assert got is not None and got.dtype == torch.bfloat16 and got.shape == q.shape
    ours, theirs = ((x.double() - ref).abs().max().item() for x in (got, torch_out))
    assert ours <= 2 * theirs + 1e-4, (ours, theirs)
    assert (got.double() - torch_out.double()).abs().max().item() <= 2 * 2**-8 * ref.abs().max()


@pytest.mark.parametrize("cuts", [[37], [16, 64], [1, 2, 130, 200], [63, 64, 65]])
@torch.inference_mode()
def test_a_query_gets_the_same_bits_in_any_chunk(cuts):
    """A prompt in one chunk, and the same prompt in chunks after its cached prefix: equal."""
    q, cache, rows = _case(230, 0, 8, 2, 256, seed=1)
    scale = 256**-0.5
    whole = attention_prefill(q, cache, rows, 0, scale)
    bounds = [0, *cuts, len(q)]
    parts = [attention_prefill(q[a:b], cache, rows[:b], a, scale)
             for a, b in zip(bounds, bounds[1:])]
    assert torch.equal(torch.cat(parts), whole)


@torch.inference_mode()
def test_declines_what_it_does_not_run():
    q, cache, rows = _case(20, 4, 4, 2, 64)
    assert attention_prefill(q.float(), cache.float(), rows, 4, 0.125) is None
    assert attention_prefill(q[..., :32], cache[..., :32], rows, 4, 0.125) is None  # D = 32
    assert attention_prefill(q, cache, rows[:-1], 4, 0.125) is None  # rows short of the chunk
    with pytest.raises(IndexError):
        attention_prefill(q, cache, torch.cat([rows[:-1], torch.tensor([len(cache)])]), 4,
                          0.125)
    prefill_attention.set_amx(False)  # --cpu-amx-attention off
    try:
        assert attention_prefill(q, cache, rows, 4, 0.125) is None
    finally:
        prefill_attention.set_amx(True)
    native_build.set_enabled(False)  # DASC_NATIVE_KERNELS=0
    try:
        assert attention_prefill(q, cache, rows, 4, 0.125) is None
    finally:
        native_build.set_enabled(True)
    assert attention_prefill(q, cache, rows, 4, 0.125) is not None


@torch.inference_mode()
def test_the_attention_layers_take_it(monkeypatch):
    """``paged_attention`` of a step with a prefill chunk and a decode row: the chunk goes to
    the kernel, over its rows in the pool; with the kernel off it takes torch's."""
    from model_runner.batch import SeqInput, build_batch

    _, cache, _ = _case(1, 0, 8, 2, 256, seed=2)
    seqs = [SeqInput(list(range(50)), 30, list(range(100, 200)), 1),
            SeqInput([5], 40, list(range(300, 400)), 2)]
    batch = build_batch(seqs, page_size=1, device=torch.device("cpu"))
    q = torch.randn(51, 8, 256).bfloat16()
    calls = []
    real = attention_layers.attention_prefill

    def spy(*args):
        out = real(*args)
        calls.append(out is not None)
        return out

    monkeypatch.setattr(attention_layers, "attention_prefill", spy)
    got = attention_layers.paged_attention(batch, q, cache, split_kv, 256**-0.5)
    assert calls == [True]
    prefill_attention.set_amx(False)
    try:
        want = attention_layers.paged_attention(batch, q, cache, split_kv, 256**-0.5)
    finally:
        prefill_attention.set_amx(True)
    assert torch.equal(got[50:], want[50:])  # the decode row: the decode kernel either way
    ref = _reference(q[:50], cache, batch.kv_read_index[0], 30, 256**-0.5)
    assert (got[:50].double() - ref).abs().max() <= 2 * (want[:50].double() - ref).abs().max()
