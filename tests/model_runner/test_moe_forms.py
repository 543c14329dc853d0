"""The three forms of the routed experts agree, and the graph-safe gathered form reads only the
routed experts.

``_routed_experts`` (eager: host-side sort, one GEMM pair per used expert), ``_gathered_experts``
(fixed shapes: each (token, slot) pair sums its expert's weight rows with embedding_bag) and
``_all_experts`` (fixed shapes: every expert on every token) must give the same output in FP32
for both routers, and the fixed-shape step must pick the gathered form for small decode batches.
"""

from __future__ import annotations

import pytest
import torch
from support.moe_layers import moe, run

from model_runner.layers.mlp import uses_gathered_experts


@pytest.mark.parametrize("arch", ["gdn", "kda"])
@pytest.mark.parametrize("num_tokens", [1, 4, 13])
def test_forms_agree(arch, num_tokens):
    layer = moe(arch, 64, 2)
    x = torch.randn(num_tokens, layer.cfg.hidden_size, generator=torch.Generator().manual_seed(1))
    ref = run(layer, "routed", x)
    for form in ("gathered", "all"):
        torch.testing.assert_close(run(layer, form, x), ref, rtol=0,
                                   atol=1e-6 * ref.abs().max().item())
    # the whole layer's static path equals its eager path
    torch.testing.assert_close(layer(x, is_static=True), layer(x), rtol=0,
                               atol=1e-6 * ref.abs().max().item())


@pytest.mark.parametrize("form, tokens", [("gathered", 4), ("grouped", 6)])
def test_fixed_shape_forms_read_only_routed_experts(form, tokens):
    layer = moe("gdn", 64, 2)
    x = torch.randn(tokens, layer.cfg.hidden_size, generator=torch.Generator().manual_seed(2))
    ref = run(layer, form, x)
    _, ids = layer.route(x)
    unrouted = torch.ones(64, dtype=torch.bool)
    unrouted[ids.reshape(-1)] = False
    assert unrouted.sum() >= 64 - 2 * tokens
    layer.w13.data[unrouted] = float("nan")  # any read of these would poison the output
    layer.w2.data[unrouted] = float("nan")
    assert torch.equal(run(layer, form, x), ref)
    assert run(layer, "all", x).isnan().all()  # the dense form reads every expert


def test_static_form_choice():
    """Gathered up to 8 pairs per expert on CPU (the largest measured, still faster), half a pair
    per expert on CUDA."""
    cfg = moe("gdn", 64, 2).cfg
    assert [uses_gathered_experts(n, cfg) for n in (1, 4, 256, 257)] == [True] * 3 + [False]
    assert [uses_gathered_experts(n, cfg, "cuda") for n in (16, 17)] == [True, False]
