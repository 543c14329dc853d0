"""The grouped-GEMM MoE form (``SparseMoE._grouped_experts``: one device-side sort, one
``torch._grouped_mm`` per projection) equals the routed form, reads only the routed experts,
needs no host sync, and is chosen where ``expert_form`` says.

fp32 tolerance (1e-6 of the output's largest magnitude): both forms compute every (token, slot)
row's products in fp32 from the same operands and add the rows back in the same order; only the
GEMM kernels' summation order can differ (observed: equal).  bf16 (one bf16 step, 2^-8, of the
largest magnitude): both round to bf16 at the same points (after each projection, as ``linear``
does); weights held in fp32 give the very same fp32 products (observed: equal), bf16 weights a
different accumulation order, so a rounding may fall the other way (observed 6.7e-4 of the
largest magnitude); skipping the rounding after the first projection is off by 5.4-6.1e-3.
"""

from __future__ import annotations

import pytest
import torch
from support.moe_layers import moe, run
from torch._subclasses.fake_tensor import (
    DataDependentOutputException,
    DynamicOutputShapeException,
    FakeTensorMode,
)

from model_runner.layers import mlp
from model_runner.layers.linear import hold_fp32
from model_runner.layers.mlp import SparseMoE, expert_form, grouped_mm_runs

BF16_STEP = 2.0**-8


def apply(layer: SparseMoE, form: str, x: torch.Tensor, weights: torch.Tensor,
          ids: torch.Tensor) -> torch.Tensor:
    out = torch.zeros_like(x)
    getattr(layer, f"_{form}_experts")(x, weights, ids, out)
    return out


def skewed_ids(num_tokens: int, num_experts: int, top_k: int, seed: int) -> torch.Tensor:
    """Distinct experts per token, most pairs on a few experts, the first and last unrouted."""
    gen = torch.Generator().manual_seed(seed)
    popularity = torch.rand(num_experts, generator=gen) ** 8
    popularity[[0, num_experts - 1]] = 0.0
    return torch.multinomial(popularity.expand(num_tokens, -1), top_k, generator=gen)


@pytest.mark.parametrize("arch", ["gdn", "kda"])
@pytest.mark.parametrize("num_tokens", [1, 13, 200])
def test_grouped_equals_routed_fp32(arch, num_tokens):
    layer = moe(arch, 64, 2)
    x = torch.randn(num_tokens, layer.cfg.hidden_size, generator=torch.Generator().manual_seed(3))
    assert grouped_mm_runs(x, layer.w13, layer.w2)
    ref = run(layer, "routed", x)
    torch.testing.assert_close(run(layer, "grouped", x), ref, rtol=0,
                               atol=1e-6 * ref.abs().max().item())


def test_uneven_and_empty_groups():
    """64 experts top-4, 100 tokens: group sizes from 0 (the first, the last and 31 others) to
    30 rows."""
    layer = moe("gdn", 64, 4)
    ids = skewed_ids(100, 64, 4, seed=4)
    counts = torch.bincount(ids.reshape(-1), minlength=64)
    assert counts[0] == counts[63] == 0 and (counts == 0).sum() > 8 and counts.max() >= 24
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(100, layer.cfg.hidden_size, generator=gen)
    weights = torch.rand(100, 4, generator=gen)
    ref = apply(layer, "routed", x, weights, ids)
    torch.testing.assert_close(apply(layer, "grouped", x, weights, ids), ref, rtol=0,
                               atol=1e-6 * ref.abs().max().item())


@pytest.mark.parametrize("held_fp32", [False, True])
@pytest.mark.parametrize("arch", ["gdn", "kda"])
def test_grouped_equals_routed_bf16(arch, held_fp32):
    """bf16 activations with bf16 weights, or with the weights held in fp32 (``hold_fp32``:
    fp32 GEMMs rounded to bf16 where ``linear`` rounds)."""
    layer = moe(arch, 64, 2).to(torch.bfloat16)
    if held_fp32:
        assert hold_fp32(layer) > 0 and layer.w13.dtype == torch.float32
    x = torch.randn(48, layer.cfg.hidden_size,
                    generator=torch.Generator().manual_seed(6)).bfloat16()
    assert grouped_mm_runs(x, layer.w13, layer.w2)
    ref = run(layer, "routed", x)
    ours = run(layer, "grouped", x)
    assert ours.dtype == ref.dtype == torch.bfloat16
    torch.testing.assert_close(ours.float(), ref.float(), rtol=0,
                               atol=BF16_STEP * ref.abs().max().item())


def host_read(fn, *args) -> str | None:
    """Run ``fn`` on fake tensors (shapes and dtypes, no data) and name the first op that needs
    tensor data on the host: ``.item()``, ``.tolist()``, ``int()``, ``bool()`` (all
    ``aten._local_scalar_dense``) or an output sized by the data (``bincount``, ``nonzero``),
    each a host sync on a GPU and an error inside a CUDA graph capture; None if there is none."""
    mode = FakeTensorMode(allow_non_fake_inputs=True)  # the layer's parameters: converted
    fake = [mode.from_tensor(a) for a in args]
    try:
        with mode:
            fn(*fake)
    except (DataDependentOutputException, DynamicOutputShapeException) as e:
        return str(e.func)
    return None


def test_host_read_finds_host_syncs():
    x, ids = torch.randn(8), torch.tensor([0, 1, 1, 3])
    scalar = "aten._local_scalar_dense.default"
    assert host_read(lambda t: t * t.sum().item(), x) == scalar
    assert host_read(lambda t: len(t.tolist()), ids) == scalar
    assert host_read(lambda t: t[0] if t[0] > 0 else t[1], x) == scalar
    assert host_read(lambda t: t.nonzero(), x) == "aten.nonzero.default"
    assert host_read(lambda t: torch.bincount(t, minlength=4), ids) == "aten.bincount.default"
    counts = torch.zeros(4, dtype=torch.long)
    assert host_read(lambda t: counts.scatter_add(0, t, torch.ones_like(t)), ids) is None


def test_grouped_form_has_no_host_sync(monkeypatch):
    """No op of the grouped form reads tensor data on the host (in bf16 GEMMs, the CUDA fast
    path's dtype and the only one torch's meta kernel for ``_grouped_mm`` accepts: the CPU's
    upcast for emulated bf16 is off); the routed form, which takes its per-expert counts to the
    host, does."""
    monkeypatch.setattr(mlp, "emulates_bf16", lambda t: False)
    layer = moe("gdn", 64, 2).to(torch.bfloat16)
    x = torch.randn(9, layer.cfg.hidden_size,
                    generator=torch.Generator().manual_seed(8)).bfloat16()
    weights, ids = layer.route(x)
    assert host_read(layer._grouped_experts, x, weights, ids, torch.zeros_like(x)) is None
    assert host_read(layer._routed_experts, x, weights, ids,
                     torch.zeros_like(x)) == "aten.bincount.default"


def test_grouped_mm_conditions():
    layer = moe("gdn", 8, 2)
    x = torch.zeros(3, layer.cfg.hidden_size)
    assert grouped_mm_runs(x, layer.w13, layer.w2)
    assert grouped_mm_runs(x.bfloat16(), layer.w13.bfloat16(), layer.w2.bfloat16())
    assert not grouped_mm_runs(x.half(), layer.w13.half(), layer.w2.half())
    assert not grouped_mm_runs(x, layer.w13, layer.w2.double())
    # rows of I = 34 fp32 values (136 bytes) are not 16-byte aligned
    odd = torch.zeros(8, 34, layer.cfg.hidden_size)
    assert not grouped_mm_runs(x, layer.w13[:, :, :68].contiguous(), odd)


def test_expert_form_choice():
    """Fixed shapes: gathered to the limit, then grouped (all experts where it cannot run).
    Eager: grouped on CUDA at every size; on CPU while pairs <= 2 per expert (64 tokens of 64
    experts top-2, measured) unless the weights would be upcast or have packed bf16 copies;
    else routed."""
    cfg = moe("gdn", 64, 2).cfg
    for device in ("cpu", "cuda"):
        limit = int(mlp.GATHERED_PAIRS_PER_EXPERT[device] * 64 / 2)  # tokens
        assert expert_form(limit, cfg, device, True, True) == "gathered"
        assert expert_form(limit + 1, cfg, device, True, True) == "grouped"
        assert expert_form(limit + 1, cfg, device, True, True, prefers_routed=True) == "grouped"
        assert expert_form(limit + 1, cfg, device, True, False) == "all"
    assert [expert_form(n, cfg, "cuda", False, True) for n in (1, 2048)] == ["grouped"] * 2
    assert [expert_form(n, cfg, "cpu", False, True) for n in (1, 64, 65, 2048)] == \
        ["grouped", "grouped", "routed", "routed"]
    assert expert_form(1, cfg, "cpu", False, True, prefers_routed=True) == "routed"
    assert [expert_form(n, cfg, d, False, False) for n in (1, 2048)
            for d in ("cpu", "cuda")] == ["routed"] * 4


def test_static_layer_takes_grouped_form_past_gathered_limit(monkeypatch):
    """With the gathered form capped, a fixed-shape step takes the grouped form: unrouted
    experts set to NaN leave it finite (the all-experts form would read them) and it equals
    the eager step in the routed form."""
    layer = moe("gdn", 64, 2)
    x = torch.randn(5, layer.cfg.hidden_size, generator=torch.Generator().manual_seed(9))
    monkeypatch.setitem(mlp.GROUPED_PAIRS_PER_EXPERT, "cpu", 0.0)  # eager: routed
    eager = layer(x)
    monkeypatch.setitem(mlp.GATHERED_PAIRS_PER_EXPERT, "cpu", 0.1)
    _, ids = layer.route(x)
    unrouted = torch.ones(64, dtype=torch.bool)
    unrouted[ids.reshape(-1)] = False
    layer.w13.data[unrouted] = float("nan")
    layer.w2.data[unrouted] = float("nan")
    torch.testing.assert_close(layer(x, is_static=True), eager, rtol=0,
                               atol=1e-6 * eager.abs().max().item())


def test_packed_bf16_experts_take_the_routed_form(monkeypatch):
    """On a CPU with native bf16 the experts are packed in bf16, and the routed form's GEMMs
    through those copies beat torch's grouped GEMM over the plain weights at every size
    measured (``SparseMoE.packs_bf16``): an eager step of one token, grouped before packing,
    takes the routed form after it, and the two agree within one bf16 step."""
    from model_runner.layers import linear as linear_mod

    monkeypatch.setattr(linear_mod, "_EMULATED_BF16", False)
    monkeypatch.setattr(linear_mod, "PACK_MIN_ELEMENTS", 1)  # pack this small layer too
    layer = moe("gdn", 8, 2).to(torch.bfloat16)
    x = torch.randn(1, layer.cfg.hidden_size, generator=torch.Generator().manual_seed(4))
    x = x.bfloat16()
    taken = []
    for form in ("grouped", "routed"):
        real = getattr(layer, f"_{form}_experts")
        monkeypatch.setattr(layer, f"_{form}_experts",
                            lambda *a, form=form, real=real: (taken.append(form), real(*a))[1])
    assert not layer.packs_bf16
    grouped = layer(x)
    layer.pack_weights()
    assert layer.packs_bf16
    routed = layer(x)
    assert taken == ["grouped", "routed"]
    torch.testing.assert_close(routed.float(), grouped.float(), rtol=0,
                               atol=BF16_STEP * grouped.abs().max().item())
