"""The experts of a decode step in C (``kernels.moe_decode.moe_decode``) against the torch
routed form (``SparseMoE._routed_experts``):
- bf16: at most one bf16 unit in the last place from the routed form, on under 1 % of the
  values (each product sums its input rows in order, oneDNN's GEMMs in another);
- FP32: equal to rounding;
- AVX-512 and portable forms give the same bits;
- a bf16 CPU layer takes it for a few tokens and not for a prefill chunk; expert ids outside
  the layer raise; what it cannot run it declines (None);
- over the coded copies of the experts' and the shared expert's weights (``code_experts``) it
  gives the same bits, with or without the weights, and a layer with them
  (``SparseMoE.code_weights``) streams them and, with packed bf16 copies too, runs without its
  experts' weights (``release_experts``).
"""

from __future__ import annotations

import pytest
import torch
from support.bf16_checks import assert_bf16_close
from support.moe_layers import moe, run

import model_runner.layers.linear as linear_module
from kernels.gemv import RAW
from kernels.moe_decode import (
    MOE_DECODE_MAX_TOKENS,
    code_experts,
    moe_decode,
    native_library,
    simd_available,
)
from model_runner.cpu_features import cpu_has_native_bf16

pytestmark = pytest.mark.skipif(native_library() is None, reason="no C compiler here")


def _inputs(layer, tokens: int, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, layer.cfg.hidden_size, generator=gen).to(layer.w13.dtype)
    weights, ids = layer.route(x)
    return x, weights, ids


@pytest.mark.parametrize("tokens", [1, 2, 5, MOE_DECODE_MAX_TOKENS])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
@torch.inference_mode()
def test_matches_the_routed_form(dtype, tokens):
    layer = moe("gdn", 8, 2).to(dtype)
    x, weights, ids = _inputs(layer, tokens)
    got = moe_decode(x, ids, weights, layer.w13, layer.w2, simd=simd_available())
    want = run(layer, "routed", x)
    assert got.dtype == dtype and got.shape == want.shape
    if dtype == torch.float32:
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
        return
    assert_bf16_close(got, want)


@pytest.mark.skipif(not simd_available(), reason="no AVX-512 here")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
@torch.inference_mode()
def test_simd_and_portable_forms_give_the_same_bits(dtype):
    layer = moe("gdn", 8, 2).to(dtype)
    x, weights, ids = _inputs(layer, 3, seed=1)
    assert torch.equal(moe_decode(x, ids, weights, layer.w13, layer.w2),
                       moe_decode(x, ids, weights, layer.w13, layer.w2, simd=False))


@torch.inference_mode()
def test_a_bf16_layer_takes_it_for_a_few_tokens(monkeypatch):
    """The layer's forward: a decode step's few tokens go through the kernel (the torch forms
    are never called), a prefill chunk through the torch forms; both equal the routed form
    to the tolerance above."""
    layer = moe("gdn", 8, 2).to(torch.bfloat16)
    few, _, _ = _inputs(layer, 4)
    want = layer.shared_expert(few)
    want = torch.sigmoid(layer.shared_expert_gate(few)) * want + run(layer, "routed", few)
    taken = []
    real = layer._experts
    monkeypatch.setattr(layer, "_experts", lambda *a: (taken.append(len(a[0])), real(*a))[1])
    got = layer(few)
    assert taken == [] and got.dtype == torch.bfloat16
    assert_bf16_close(got, want)
    many, _, _ = _inputs(layer, MOE_DECODE_MAX_TOKENS + 1)
    layer(many)
    assert taken == [MOE_DECODE_MAX_TOKENS + 1]


@torch.inference_mode()
def test_expert_ids_outside_the_layer_raise():
    layer = moe("gdn", 8, 2)
    x, weights, ids = _inputs(layer, 2)
    ids = ids.clone()
    ids[1, 0] = 8
    with pytest.raises(IndexError, match="expert ids"):
        moe_decode(x, ids, weights, layer.w13, layer.w2)


@torch.inference_mode()
def test_declines_what_it_does_not_run():
    layer = moe("gdn", 8, 2)
    x, weights, ids = _inputs(layer, 2)
    assert moe_decode(x.bfloat16(), ids, weights, layer.w13, layer.w2) is None  # dtypes differ
    many, many_w, many_ids = _inputs(layer, MOE_DECODE_MAX_TOKENS + 1)
    assert moe_decode(many, many_ids, many_w, layer.w13, layer.w2) is None
    assert moe_decode(x, ids.int(), weights, layer.w13, layer.w2) is None
    assert moe_decode(x, ids, weights, layer.w13.transpose(1, 2), layer.w2) is None
    with torch.enable_grad():
        assert moe_decode(x, ids, weights, layer.w13, layer.w2) is None


@pytest.mark.parametrize("gated", [True, False], ids=["qwen-gate", "no-gate"])
@torch.inference_mode()
def test_the_shared_expert_is_added_last(gated):
    """The shared expert (stored input-major by ``DenseMLP.input_major``) goes in after the
    routed experts with its gate's weight (1 without a gate): ``round(routed + shared)``, as
    ``SparseMoE.forward`` adds them; the AVX-512 and portable forms agree bit for bit."""
    layer = moe("gdn", 8, 2).to(torch.bfloat16)
    x, weights, ids = _inputs(layer, 3, seed=2)
    gate = torch.sigmoid(layer.shared_expert_gate(x)) if gated else None
    shared = (*layer.shared_expert.input_major(), gate)
    got = moe_decode(x, ids, weights, layer.w13, layer.w2, shared, simd=simd_available())
    dense = layer.shared_expert(x)
    want = run(layer, "routed", x) + (gate * dense if gated else dense)
    assert_bf16_close(got, want)
    if simd_available():
        assert torch.equal(got, moe_decode(x, ids, weights, layer.w13, layer.w2, shared,
                                           simd=False))


def salted(layer) -> None:
    """Expert weights the coding must keep exactly: zeros, subnormals, values too far apart
    for one block's window, an infinity (its outputs NaN or infinite, compared as bits)."""
    for w in (layer.w13, layer.w2):
        flat = w.data.view(-1)
        flat[::89], flat[1::97], flat[2::211] = 0.0, 1e-39, 3e4
    layer.w13.data[5, 7, 3] = float("inf")


@pytest.mark.skipif(not simd_available(), reason="no AVX-512 here")
@pytest.mark.parametrize("tokens", [1, 3, MOE_DECODE_MAX_TOKENS])
@torch.inference_mode()
def test_the_coded_copies_give_the_same_bits(tokens):
    layer = moe("gdn", 8, 2).to(torch.bfloat16)
    salted(layer)
    x, weights, ids = _inputs(layer, tokens, seed=tokens)
    shared_major = layer.shared_expert.input_major()
    shared = (*shared_major, torch.sigmoid(layer.shared_expert_gate(x)))
    coded = code_experts(layer.w13, layer.w2, shared_major)
    assert all(c is not None for c in coded)
    assert any((c.head == RAW).any() for c in coded)  # blocks kept with their high bytes
    want = moe_decode(x, ids, weights, layer.w13, layer.w2, shared).view(torch.int16)
    for simd in (True, False):
        got = moe_decode(x, ids, weights, layer.w13, layer.w2, shared, simd=simd, coded=coded)
        assert torch.equal(got.view(torch.int16), want)
        alone = moe_decode(x, ids, weights, None, None, shared, simd=simd, coded=coded)
        assert torch.equal(alone.view(torch.int16), want)  # the copies without the weights
    with pytest.raises(ValueError, match="coded copies"):
        moe_decode(x, ids, weights, None, None, shared)


@pytest.mark.skipif(not simd_available(), reason="no AVX-512 here")
@torch.inference_mode()
def test_a_layer_with_coded_copies_streams_them():
    """``code_weights`` codes the experts and the shared expert's input-major weights (and so
    not the shared expert's linears): changed after coding, the weights' new values reach
    only a prefill chunk's torch forms."""
    layer = moe("gdn", 8, 2).to(torch.bfloat16)
    x, _, _ = _inputs(layer, 2)
    before = layer(x)
    assert len(layer.code_weights()) == 4
    assert all(p.coded is None for p in (layer.shared_expert.gate_up_proj,
                                         layer.shared_expert.down_proj))
    for w in (layer.w13, layer.w2, *layer.shared_expert.input_major()):
        w.mul_(2)
    assert torch.equal(layer(x), before)


@pytest.mark.skipif(not (simd_available() and cpu_has_native_bf16()),
                    reason="coded copies need AVX-512, packed bf16 ones native bf16")
@torch.inference_mode()
def test_a_layer_runs_from_its_copies_alone(monkeypatch):
    """With packed bf16 copies of every expert (``PACK_MIN_ELEMENTS`` lowered for the tiny
    layer) and coded ones, ``release_experts`` drops the routed experts' weights: a decode
    step's tokens and a prefill chunk's give the same bits as before; a fixed-shape step,
    which reads the weights, is refused."""
    monkeypatch.setattr(linear_module, "PACK_MIN_ELEMENTS", 0)
    layer = moe("gdn", 8, 2).to(torch.bfloat16)
    layer.pack_weights()
    layer.code_weights()
    inputs = [_inputs(layer, n, seed=n)[0] for n in (2, MOE_DECODE_MAX_TOKENS + 9)]
    want = [layer(x) for x in inputs]
    size = layer.w13.nbytes + layer.w2.nbytes
    assert layer.release_experts() == size and layer.w13 is None and layer.w2 is None
    assert all(torch.equal(layer(x), w) for x, w in zip(inputs, want))
    with pytest.raises(RuntimeError, match="fixed-shape"):
        layer(inputs[0], is_static=True)
