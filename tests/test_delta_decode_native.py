"""The C kernel of the delta rule's one-token update (``kernels/delta_decode``) gives the torch
form's bits (``delta_rule_decode._update``: an ``embedding_bag`` projection, ``mul_`` and
``addcmul_``), in its AVX-512 form (V = 128) and its portable loop, per head and per channel,
with GVA, at Qwen3-Next's and Kimi-Linear's state shapes; the decode entry points take it at
inference and fall back to torch where it cannot run.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from kernels import delta_decode
from kernels.delta_decode import decode_in_place, native_library
from model_runner.ops.delta_rule_decode import _operands, _update, decode_into, decode_step

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.skipif(native_library() is None, reason="no C compiler here")


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
    got = decode_in_place(pool, slots, *rows, simd=simd).view(len(slots), heads, v_dim)
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
    real = delta_decode.native_library()

    class Spy:
        def dasc_delta_decode(self, *args):
            calls.append(args[3])  # the number of sequences
            real.dasc_delta_decode(*args)

    q, k, v, g, beta = _step(2, 16, 32, 128, 128, per_channel, seed=3)
    pool = torch.randn(3, 32, 128, 128, generator=torch.Generator().manual_seed(4))
    monkeypatch.setattr(delta_decode, "native_library", lambda: None)
    want_pool = pool.clone()
    want = decode_into(want_pool, [2, 1], q, k, v, g, beta, 0.09)
    want_batch = pool[[2, 1]].clone()
    want_step, _ = decode_step(q, k, v, g, beta, want_batch, 0.09)
    assert not calls
    monkeypatch.setattr(delta_decode, "native_library", Spy)
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
        assert decode_in_place(pool.bfloat16(), [1], *rows) is None  # not an FP32 state
        assert decode_in_place(pool.transpose(2, 3), [1], *rows) is None  # not a row-major one
        with pytest.raises(IndexError, match="outside"):
            decode_in_place(pool, [2], *rows)
    assert decode_in_place(pool, [1], *rows) is None  # autograd: the torch form's graph
    # and under autograd decode_step stays differentiable, as training needs
    state = pool[1:].clone().requires_grad_()
    o, new = decode_step(q, k, v, g, beta, state, 0.5)
    (o.sum() + new.sum()).backward()
    assert state.grad is not None and torch.isfinite(state.grad).all()


def test_the_library_builds_into_its_cache_and_can_be_switched_off(tmp_path):
    code = ("from kernels.delta_decode import native_library;"
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
