"""The C kernels of CPU decode (``kernels/delta_rule/cpu_decode``, ``kernels/short_conv/cpu``)
give the torch forms' bits:
- the delta rule's one-token update (``kernels.delta_rule.decode._update``: an ``embedding_bag``
  projection, ``mul_`` and ``addcmul_``), in its AVX-512 form (V = 128) and its portable loop,
  per head and per channel, with GVA, at Qwen3-Next's and Kimi-Linear's state shapes;
- the short conv's window sum and state shift (``short_conv.conv_decode``), and a prefill
  chunk's window sums (``short_conv.conv_varlen``), bf16 and FP32.
The decode entry points take them at inference and fall back to torch where they cannot run.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F
from support.paths import ROOT

from kernels import native_build
from kernels.delta_rule import cpu_decode as delta_native
from kernels.delta_rule.cpu_decode import delta_rule_in_place
from kernels.delta_rule.decode import _operands, _update, decode_into, decode_step
from kernels.short_conv import cpu as conv_native
from kernels.short_conv import naive as short_conv
from kernels.short_conv.cpu import conv_in_place
from kernels.short_conv.naive import _columns, conv_decode, conv_decode_into, conv_varlen

pytestmark = pytest.mark.skipif(delta_native.native_library() is None
                                or conv_native.native_library() is None,
                                reason="no C compiler here")


def _step(batch, key_heads, heads, k_dim, v_dim, per_channel, seed):
    gen = torch.Generator().manual_seed(seed)
    q = F.normalize(torch.randn(batch, key_heads, k_dim, generator=gen), dim=-1)
    k = F.normalize(torch.randn(batch, key_heads, k_dim, generator=gen), dim=-1)
    v = torch.randn(batch, heads, v_dim, generator=gen)
    g = -torch.rand(batch, heads, *([k_dim] if per_channel else []), generator=gen) * 2
    beta = torch.rand(batch, heads, generator=gen)
    return q, k, v, g, beta


def _torch_form(pool, slots, q, k, v, g, beta, scale):
    """The torch operations, one slot at a time, as ``decode_into`` ran them before the kernel."""
    heads, k_dim, v_dim = pool.shape[1:]
    rows = _operands(q, k, v, g, beta, heads, scale)
    out = []
    for i, slot in enumerate(slots):
        at = slice(i * heads, (i + 1) * heads)
        out.append(_update(pool[slot].view(heads, k_dim, v_dim), *(x[at] for x in rows))[0])
    return torch.cat(out).view(len(slots), heads, v_dim)


SHAPES = {  # (key heads, heads, K, V)
    "qwen3-next": (16, 32, 128, 128),  # GVA 2
    "kimi-linear": (32, 32, 128, 128),
    "odd": (3, 6, 24, 40),  # V not a multiple of the vector width: the portable loop
}


@pytest.mark.parametrize("simd", [True, False])
@pytest.mark.parametrize("per_channel", [False, True])
@pytest.mark.parametrize("shape", list(SHAPES))
@torch.inference_mode()
def test_the_kernel_gives_the_torch_forms_bits(shape, per_channel, simd):
    key_heads, heads, k_dim, v_dim = SHAPES[shape]
    slots = [3, 0, 4]  # not in order, and not every slot
    q, k, v, g, beta = _step(len(slots), key_heads, heads, k_dim, v_dim, per_channel, seed=1)
    layers = torch.randn(2, 5, heads, k_dim, v_dim, generator=torch.Generator().manual_seed(2))
    pool = layers[1]  # a layer's view of the pool of every layer, as the runner holds it
    want_pool = pool.clone()
    want = _torch_form(want_pool, slots, q, k, v, g, beta, 0.09)
    rows = _operands(q, k, v, g, beta, heads, 0.09)
    got = delta_rule_in_place(pool, slots, *rows, simd=simd).view(len(slots), heads, v_dim)
    assert torch.equal(got, want)
    assert torch.equal(pool, want_pool)  # updated slots, and untouched ones
    assert torch.equal(layers[0], torch.randn(5, heads, k_dim, v_dim,
                                              generator=torch.Generator().manual_seed(2)))


@pytest.mark.parametrize("per_channel", [False, True])
@torch.inference_mode()
def test_decode_entry_points_take_the_kernel(monkeypatch, per_channel):
    """``decode_into`` (a pool's slots) and ``decode_step`` (a gathered batch) run the kernel at
    inference and give the bits of the torch form they run without it."""
    calls = []
    real = delta_native.native_library()

    class Spy:
        def dasc_delta_decode(self, *args):
            calls.append(args[3])  # the number of sequences
            real.dasc_delta_decode(*args)

    q, k, v, g, beta = _step(2, 16, 32, 128, 128, per_channel, seed=3)
    pool = torch.randn(3, 32, 128, 128, generator=torch.Generator().manual_seed(4))
    monkeypatch.setattr(delta_native, "native_library", lambda: None)
    want_pool = pool.clone()
    want = decode_into(want_pool, [2, 1], q, k, v, g, beta, 0.09)
    want_batch = pool[[2, 1]].clone()
    want_step, _ = decode_step(q, k, v, g, beta, want_batch, 0.09)
    assert not calls
    monkeypatch.setattr(delta_native, "native_library", Spy)
    batch = pool[[2, 1]].clone()
    got_step, new = decode_step(q, k, v, g, beta, batch, 0.09)
    assert torch.equal(got_step, want_step) and new is batch and torch.equal(batch, want_batch)
    got = decode_into(pool, [2, 1], q, k, v, g, beta, 0.09)
    assert torch.equal(got, want) and torch.equal(pool, want_pool)
    assert calls == [2, 2]
    # the gathered and in-slot forms agree with each other too
    assert torch.equal(got_step, got) and torch.equal(batch, pool[[2, 1]])


def test_where_the_kernel_does_not_run():
    q, k, v, g, beta = _step(1, 2, 2, 8, 8, False, seed=5)
    pool = torch.randn(2, 2, 8, 8)
    rows = _operands(q, k, v, g, beta, 2, 0.5)
    with torch.inference_mode():
        assert delta_rule_in_place(pool.bfloat16(), [1], *rows) is None  # not an FP32 state
        assert delta_rule_in_place(pool.transpose(2, 3), [1], *rows) is None  # not a row-major one
        with pytest.raises(IndexError, match="outside"):
            delta_rule_in_place(pool, [2], *rows)
        native_build.set_enabled(False)  # runner_speed --native-kernels off / alternate
        try:
            assert delta_rule_in_place(pool, [1], *rows) is None
            assert conv_in_place(pool[0, 0], torch.zeros(9, 8), pool[:, 0], [1]) is None
        finally:
            native_build.set_enabled(True)
        assert delta_rule_in_place(pool, [1], *rows) is not None
    assert delta_rule_in_place(pool, [1], *rows) is None  # autograd: the torch form's graph
    # and under autograd decode_step stays differentiable, as training needs
    state = pool[1:].clone().requires_grad_()
    o, new = decode_step(q, k, v, g, beta, state, 0.5)
    (o.sum() + new.sum()).backward()
    assert state.grad is not None and torch.isfinite(state.grad).all()


def test_the_library_builds_into_its_cache_and_can_be_switched_off(tmp_path):
    code = ("from kernels.delta_rule.cpu_decode import native_library;"
            "print(native_library() is None)")

    def child(env):
        return subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True,
                              text=True, timeout=120, env={**os.environ, **env})

    built = child({"DASC_CACHE_DIR": str(tmp_path)})
    assert built.stdout.strip() == "False", built.stderr
    assert len(list(tmp_path.glob("delta_decode-*.so"))) == 1
    assert child({"DASC_NATIVE_KERNELS": "0"}).stdout.strip() == "True"
    broken = child({"DASC_CACHE_DIR": str(tmp_path / "b"), "CC": "false"})
    assert broken.stdout.strip() == "True" and "using torch" in broken.stderr


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("channels, kernel", [(8192, 4), (40, 3)])
@torch.inference_mode()
def test_the_conv_kernel_gives_the_torch_forms_bits(channels, kernel, dtype):
    """``conv_in_place`` against ``conv_decode`` on gathered states: the outputs and the shifted
    states, slots out of order, x a strided view of a wider projection (as the runner's)."""
    gen = torch.Generator().manual_seed(7)
    slots = [2, 0, 3]
    pool = torch.randn(4, channels, kernel - 1, generator=gen).to(dtype)
    weight = torch.randn(channels, kernel, generator=gen).to(dtype)
    x = torch.randn(len(slots), channels + 24, generator=gen).to(dtype)[:, :channels]
    want, want_states = conv_decode(x, weight, pool[slots])
    want_pool = pool.clone()
    want_pool[slots] = want_states
    sums = conv_in_place(x, _columns(weight), pool, slots)
    assert torch.equal(F.silu(sums.to(weight.dtype)).to(x.dtype), want)
    assert torch.equal(pool, want_pool)


@torch.inference_mode()
def test_conv_decode_into_takes_the_kernel(monkeypatch):
    gen = torch.Generator().manual_seed(8)
    pool = torch.randn(3, 64, 3, generator=gen).bfloat16()
    weight = torch.randn(64, 4, generator=gen).bfloat16()
    x = torch.randn(2, 64, generator=gen).bfloat16()
    slots = torch.tensor([2, 1])
    monkeypatch.setattr(conv_native, "native_library", lambda: None)
    want_pool = pool.clone()
    want = conv_decode_into(x, weight, want_pool, slots)
    monkeypatch.undo()
    calls = []
    real = conv_native.conv_in_place
    def spy(*args):
        sums = real(*args)
        calls.append((len(args[3]), sums is not None))  # the kernel ran, for 2 sequences
        return sums

    monkeypatch.setattr(short_conv, "conv_in_place", spy)
    got = conv_decode_into(x, weight, pool, slots)
    assert calls == [(2, True)] and torch.equal(got, want) and torch.equal(pool, want_pool)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("channels", [8192, 40])
@torch.inference_mode()
def test_the_prefill_conv_kernel_gives_the_torch_forms_bits(channels, dtype):
    """``conv_varlen`` with the window sums in C against the torch form: outputs, final
    states and the states at cuts, for sequences longer and shorter than the kernel (1 and 2
    tokens: their sums read the state), x a strided view."""
    gen = torch.Generator().manual_seed(9)
    cu = [0, 7, 8, 10, 30]
    x = torch.randn(cu[-1], channels + 8, generator=gen).to(dtype)[:, :channels]
    weight = torch.randn(channels, 4, generator=gen).to(dtype)
    states = torch.randn(len(cu) - 1, channels, 3, generator=gen).to(dtype)
    cuts = [(0, 2), (0, 5), (3, 19)]
    native_build.set_enabled(False)
    try:
        want = conv_varlen(x, weight, states, cu, cuts)
    finally:
        native_build.set_enabled(True)
    calls = []
    real = conv_native.conv_window_sums
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(short_conv, "conv_window_sums",
                   lambda *a: (calls.append(real(*a)), calls[-1])[1])
        got = conv_varlen(x, weight, states, cu, cuts)
    assert len(calls) == 1 and calls[0] is not None  # the kernel ran
    for g, w in zip(got, want):
        assert g.dtype == w.dtype and torch.equal(g, w)
