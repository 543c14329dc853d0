"""Absorbed MLA decode (``model_runner.layers.mla``) against the expanded form.

Decode attends over the cached latent rows with kv_b_proj folded into the query and the output;
prefill expands every row into K and V.  In FP32 the two differ only in summation order: a score
is one 576-term dot product either way (absorbed: ``(W_uk^T q) . latent``; expanded:
``q . (W_uk latent)``, 128 terms of 512-term sums), and an output is one 512-term sum of
weighted latents projected once instead of a weighted sum of projected rows.  Each order has a
relative rounding error of a few FP32 ulps times the depth of the sums (~1e-6 here), which
softmax and the following layers carry through unamplified at these magnitudes; the limits
below are 1e-5 of the reference's largest magnitude, 7-15x the observed 0.7e-6 - 1.5e-6.
Greedy tokens must be equal.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from support.decode_schedule import PROMPT_LENS, assert_near, new_runner, run_schedule
from support.random_checkpoints import make_model
from support.runner_scenarios import Pages

from model_runner.batch import SeqInput
from model_runner.layers import mla
from model_runner.layers.attention import causal_attention
from model_runner.layers.mla import (
    absorb_query,
    absorbs_chunk,
    key_absorption,
    latent_attention,
    latent_causal_attention,
    split_kv_b,
    up_project_values,
    value_projection,
)
from model_runner.models.kimi_linear import MLAttention


def expanded_decode(q, rows, w_kv_b, num_heads, nope, kv_lora, scale):
    """The reference: expand every cached row, then ordinary attention (one query)."""
    latent, k_rot = rows[:, :kv_lora], rows[:, kv_lora:]
    kv = F.linear(latent, w_kv_b).view(rows.shape[0], num_heads, -1)
    k = torch.cat([kv[..., :nope], k_rot[:, None].expand(-1, num_heads, -1)], dim=-1)
    return causal_attention(q, k, kv[..., nope:], rows.shape[0] - 1, scale)


@pytest.mark.parametrize("context", [1, 300])
def test_latent_attention_at_kimi_shapes(context):
    """Kimi-Linear-48B's MLA: 32 heads, kv_lora 512, nope 128 + rope 64, v 128."""
    heads, nope, rope, dv, kv_lora = 32, 128, 64, 128, 512
    gen = torch.Generator().manual_seed(context)
    w_kv_b = torch.randn(heads * (nope + dv), kv_lora, generator=gen) * kv_lora**-0.5
    rows = torch.randn(context, kv_lora + rope, generator=gen)
    q = torch.randn(1, heads, nope + rope, generator=gen)
    scale = (nope + rope) ** -0.5
    ref = expanded_decode(q, rows, w_kv_b, heads, nope, kv_lora, scale)
    w_uk, w_uv_t = split_kv_b(w_kv_b, heads, nope)[0], value_projection(w_kv_b, heads, nope)
    o_lat = latent_attention(absorb_query(q, w_uk), rows[None], kv_lora, scale)
    assert_near(up_project_values(o_lat, w_uv_t), ref)
    # the padded table form: columns past the length are masked
    padded = torch.cat([rows, torch.randn(7, kv_lora + rope, generator=gen) * 50])[None]
    o_pad = latent_attention(absorb_query(q, w_uk), padded, kv_lora, scale,
                             torch.tensor([context]))
    assert_near(up_project_values(o_pad, w_uv_t), ref)


def test_value_projection_is_kept_gives_the_views_bits_and_follows_the_weight():
    """The CPU keeps W_uv^T as a contiguous copy on kv_b_proj's weight: the up-projection
    through it has the bits of the transposed view's, the copy is made once, and an in-place
    change of the weight makes it again."""
    heads, nope, dv, kv_lora = 32, 128, 128, 512
    gen = torch.Generator().manual_seed(3)
    weight = torch.randn(heads * (nope + dv), kv_lora, generator=gen).bfloat16()
    o_lat = torch.randn(2, heads, kv_lora, generator=gen).bfloat16()
    kept = value_projection(weight, heads, nope)
    assert kept.is_contiguous() and value_projection(weight, heads, nope) is kept
    view = split_kv_b(weight, heads, nope)[1].transpose(1, 2)
    assert torch.equal(up_project_values(o_lat, kept), up_project_values(o_lat, view))
    weight.mul_(2)
    again = value_projection(weight, heads, nope)
    assert again is not kept and torch.equal(again, 2 * kept)


def test_key_absorption_is_kept_gives_the_views_bits_and_follows_the_weight():
    """W_uk likewise: ``absorb_query`` through the kept copy has the strided view's bits."""
    heads, nope, dv, kv_lora = 32, 128, 128, 512
    gen = torch.Generator().manual_seed(4)
    weight = torch.randn(heads * (nope + dv), kv_lora, generator=gen).bfloat16()
    q = torch.randn(3, heads, nope + 64, generator=gen).bfloat16()
    kept = key_absorption(weight, heads, nope)
    assert kept.is_contiguous() and key_absorption(weight, heads, nope) is kept
    view = split_kv_b(weight, heads, nope)[0]
    assert not view.is_contiguous()
    assert torch.equal(absorb_query(q, kept), absorb_query(q, view))
    weight.mul_(2)
    again = key_absorption(weight, heads, nope)
    assert again is not kept and torch.equal(again, 2 * kept)


def set_absorbed(runner, on: bool) -> int:
    layers = [m for m in runner.model.modules() if isinstance(m, MLAttention)]
    for m in layers:
        m.absorb_decode = on
    return len(layers)


@pytest.mark.parametrize("name,overrides", [
    ("kda", {}),
    ("kda-qlora-5heads", {"q_lora_rank": 24, "num_attention_heads": 5, "num_key_value_heads": 5}),
])
@pytest.mark.parametrize("max_bs", [0, 8])  # eager decode, the fixed-shape (graph) step
def test_absorbed_decode_equals_expanded(name, overrides, max_bs, tmp_path):
    make_model("kda", tmp_path, seed=11, **overrides)
    absorbed, expanded = new_runner(tmp_path, "cpu", max_bs), new_runner(tmp_path, "cpu", max_bs)
    assert set_absorbed(absorbed, True) == set_absorbed(expanded, False) == 2
    ref, steps = run_schedule(expanded)
    ours, _ = run_schedule(absorbed, ref)
    for a, b in zip(ours, ref):
        assert a.argmax(-1).tolist() == b.argmax(-1).tolist()
        assert_near(a, b)
    # a mixed step: two decodes beside a prefill chunk over a cached prefix (expanded)
    pages = Pages(160)
    for n in (*PROMPT_LENS, -4):  # the pages decode_schedule took
        pages.take(n + 12)
    prompt = SeqInput(list(range(3, 30)), 0, pages.take(40), 5)
    for runner in (absorbed, expanded):
        runner.forward([SeqInput(prompt.token_ids[:10], 0, prompt.page_table, 5)])
    decodes = steps[-1][:2]
    for s in decodes:
        s.prefix_len += 1
        s.token_ids = [7]
    mixed = [*decodes, SeqInput(prompt.token_ids[10:], 10, prompt.page_table, 5)]
    assert_near(absorbed.forward(mixed), expanded.forward(mixed))


def test_latent_causal_attention_at_kimi_shapes(monkeypatch):
    """A chunk of 5 queries after 40 cached rows, absorbed, against the expanded reference with
    the same lower-right causal mask (query i sees rows [0, 40 + i]); FP32.  Then with the
    scores held two queries at a time (``MAX_SCORES``)."""
    heads, nope, rope, dv, kv_lora, prefix, num = 32, 128, 64, 128, 512, 40, 5
    gen = torch.Generator().manual_seed(9)
    w_kv_b = torch.randn(heads * (nope + dv), kv_lora, generator=gen) * kv_lora**-0.5
    rows = torch.randn(prefix + num, kv_lora + rope, generator=gen)
    q = torch.randn(num, heads, nope + rope, generator=gen)
    scale = (nope + rope) ** -0.5
    latent, k_rot = rows[:, :kv_lora], rows[:, kv_lora:]
    kv = F.linear(latent, w_kv_b).view(rows.shape[0], heads, -1)
    k = torch.cat([kv[..., :nope], k_rot[:, None].expand(-1, heads, -1)], dim=-1)
    ref = causal_attention(q, k, kv[..., nope:], prefix, scale)
    w_uk = split_kv_b(w_kv_b, heads, nope)[0]
    o_lat = latent_causal_attention(absorb_query(q, w_uk), rows, prefix, kv_lora, scale)
    assert_near(up_project_values(o_lat, value_projection(w_kv_b, heads, nope)), ref)
    assert not torch.allclose(ref[0], ref[-1])  # the mask matters
    monkeypatch.setattr(mla, "MAX_SCORES", 2 * heads * rows.shape[0])
    blocked = latent_causal_attention(absorb_query(q, w_uk), rows, prefix, kv_lora, scale)
    assert_near(blocked, o_lat)


def test_absorbs_a_short_chunk_after_a_long_prefix_only():
    kimi = dict(num_heads=32, nope=128, rope=64, v_dim=128, kv_lora=512)
    assert absorbs_chunk(50, 2000, **kimi) and absorbs_chunk(2, 10, **kimi)
    assert not absorbs_chunk(128, 0, **kimi)  # a fresh prompt: its rows are its queries
    assert not absorbs_chunk(400, 100_000, **kimi)  # past ~170 queries expanding wins


def test_absorbed_chunk_after_a_prefix_equals_expanded(tmp_path):
    """Through the model: a 4-token chunk after a 40-token prefix takes the absorbed form (and
    the prefix's own prefill the expanded one); the logits equal the expanded runner's."""
    make_model("kda", tmp_path, seed=12)
    absorbed, expanded = new_runner(tmp_path, "cpu", 0), new_runner(tmp_path, "cpu", 0)
    assert set_absorbed(absorbed, True) == set_absorbed(expanded, False) == 2
    attn = next(m for m in absorbed.model.modules() if isinstance(m, MLAttention))
    cfg = attn.cfg
    dims = (attn.num_heads, cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim,
            cfg.kv_lora_rank)
    assert absorbs_chunk(4, 40, *dims) and not absorbs_chunk(40, 0, *dims)
    table = Pages(160).take(60)
    tokens = list(range(3, 47))
    for runner in (absorbed, expanded):
        runner.forward([SeqInput(tokens[:40], 0, table, 3)])
    got = absorbed.forward([SeqInput(tokens[40:], 40, table, 3)], all_logits=True)
    want = expanded.forward([SeqInput(tokens[40:], 40, table, 3)], all_logits=True)
    assert got.argmax(-1).tolist() == want.argmax(-1).tolist()
    assert_near(got, want)
