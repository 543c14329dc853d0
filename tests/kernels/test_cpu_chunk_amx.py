"""The C kernel's AMX form (``kernels/delta_rule/cpu_chunk``, ``bf16=True``): a bf16 model's
chunk products on AMX tiles from bf16-rounded operands, FP32 accumulation.
- It computes what its header says: a float64 emulation of the same chunk algorithm, rounding
  the same operands to bf16 at the same points, agrees with it far closer than the FP32 form
  does (so the bf16 rounding, the pair layouts and the padding are where the header puts them).
- Each (sequence, head) runs alone: a sequence gets the same bits alone and in a batch, with
  one or two OpenMP workers.
- The runner's entry point takes it for a bf16 model only (and not when switched off:
  ``--cpu-amx-delta-rule off``), and its results stay within bf16 rounding of the FP32 form.
Skipped where the CPU has no AMX.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kernels.delta_rule.cpu_chunk import amx_available, chunk_in_pool, native_library, set_amx
from model_runner.ops.linear_attention import AMX_CHUNK, NATIVE_CHUNK, recurrence_in_pool

pytestmark = pytest.mark.skipif(native_library() is None or not amx_available(),
                                reason="no C compiler or no AMX here")

SHAPES = {  # (key heads, heads, K, V)
    "qwen3.5": (2, 2, 128, 128),
    "gva": (1, 2, 64, 32),  # GVA 2, the smallest tiles
}


def _inputs(total, key_heads, heads, k_dim, v_dim, seed):
    gen = torch.Generator().manual_seed(seed)
    q = F.normalize(torch.randn(total, key_heads, k_dim, generator=gen), dim=-1)
    k = F.normalize(torch.randn(total, key_heads, k_dim, generator=gen), dim=-1)
    v = torch.randn(total, heads, v_dim, generator=gen)
    g = -torch.rand(total, heads, generator=gen) * 0.2
    beta = torch.rand(total, heads, generator=gen)
    pool = torch.randn(4, heads, k_dim, v_dim, generator=gen) * 0.1
    return (q, k, v, g, beta), pool


def _bf16(x: torch.Tensor) -> torch.Tensor:
    """x rounded to bf16 (nearest even) through FP32, back in float64."""
    return x.float().bfloat16().double()


def _emulate(q, k, v, g, beta, state, scale, chunk, rounded=True):
    """One sequence, one head (q, k [T, K], v [T, V], g, beta [T], state [K, V]) by the kernel's
    chunk algorithm in float64, with its bf16 roundings where ``rounded``."""
    r = _bf16 if rounded else (lambda x: x.double())
    q, k, v, g, beta, s = (x.double() for x in (q, k, v, g, beta, state))
    out = []
    for c0 in range(0, len(k), chunk):
        kc, qc, vc = k[c0 : c0 + chunk], q[c0 : c0 + chunk], v[c0 : c0 + chunk]
        gc, bc = g[c0 : c0 + chunk], beta[c0 : c0 + chunk]
        kb, qb, sb = r(kc), r(qc), r(s)
        kk, qk, p, qs = kb @ kb.T, qb @ kb.T, kb @ sb, qb @ sb
        cum = torch.cumsum(gc, 0)
        e = cum.exp()
        d = (cum[:, None] - cum[None, :]).exp().tril()  # D[i][j] = a_{j+1} ... a_i
        n = (vc - e[:, None] * p) * bc[:, None]
        coef = -(bc[:, None] * d * kk).tril(-1)
        for i in range(len(kc)):  # forward substitution
            n[i] = n[i] + coef[i, :i] @ n[:i]
        w = scale * d * qk
        out.append(scale * e[:, None] * qs + r(w.tril()) @ r(n))
        s = s * e[-1] + r(kc).T @ r(d[-1][:, None] * n)
    return torch.cat(out), s


def _rel(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got - want).norm() / want.norm())


@pytest.mark.parametrize("shape", list(SHAPES))
@torch.inference_mode()
def test_it_computes_the_bf16_operand_algorithm(shape):
    key_heads, heads, k_dim, v_dim = SHAPES[shape]
    cu = [0, 150, 170]  # full chunks, a partial one, a sequence shorter than a chunk
    (q, k, v, g, beta), pool = _inputs(cu[-1], key_heads, heads, k_dim, v_dim, 1)
    before, slots, scale = pool.clone(), [2, 0], k_dim**-0.5
    o = chunk_in_pool(q, k, v, g, beta, pool, slots, cu, scale, AMX_CHUNK, bf16=True)
    o_fp32 = chunk_in_pool(q, k, v, g, beta, before.clone(), slots, cu, scale, AMX_CHUNK)
    ratio = heads // key_heads
    for b, slot in enumerate(slots):
        rows = slice(cu[b], cu[b + 1])
        for h in range(heads):
            operands = (q[rows, h // ratio], k[rows, h // ratio], v[rows, h], g[rows, h],
                        beta[rows, h], before[slot, h], scale, AMX_CHUNK)
            want_o, want_s = _emulate(*operands)
            plain_o, _ = _emulate(*operands, rounded=False)
            got = o[rows, h].double()
            # relative RMS: where a value sits on a bf16 rounding boundary the emulation's
            # float64 rounds it the other way now and then, one element in thousands
            err, plain_err = _rel(got, want_o), _rel(got, plain_o)
            assert err < 1e-4 and plain_err > 1e-3, (err, plain_err)
            assert _rel(o_fp32[rows, h].double(), plain_o) < 1e-5  # the FP32 form: unrounded
            assert _rel(pool[slot, h].double(), want_s) < 1e-5
    untouched = [i for i in range(len(pool)) if i not in slots]
    assert torch.equal(pool[untouched], before[untouched])


@pytest.mark.parametrize("threads", [1, 2])
@torch.inference_mode()
def test_a_sequence_gets_the_same_bits_alone_and_in_a_batch(threads):
    key_heads, heads, k_dim, v_dim = SHAPES["qwen3.5"]
    cu = [0, 70, 71, 200]
    (q, k, v, g, beta), pool = _inputs(cu[-1], key_heads, heads, k_dim, v_dim, 2)
    batch_pool, alone_pool = pool.clone(), pool.clone()
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        o = chunk_in_pool(q, k, v, g, beta, batch_pool, [1, 3, 0], cu, 0.1, AMX_CHUNK,
                          bf16=True)
        rows = slice(cu[2], cu[3])
        alone = chunk_in_pool(*(x[rows] for x in (q, k, v, g, beta)), alone_pool, [0],
                              [0, cu[3] - cu[2]], 0.1, AMX_CHUNK, bf16=True)
    finally:
        torch.set_num_threads(before)
    assert torch.equal(o[rows], alone) and torch.equal(batch_pool[0], alone_pool[0])


@torch.inference_mode()
def test_the_runner_takes_it_for_bf16_models_only():
    key_heads, heads, k_dim, v_dim = SHAPES["qwen3.5"]
    cu = [0, 90, 300]
    (q, k, v, g, beta), pool = _inputs(cu[-1], key_heads, heads, k_dim, v_dim, 3)
    slots = torch.tensor([3, 1])
    runs = {}
    for bf16 in (False, True):
        runs[bf16] = (recurrence_in_pool(q, k, v, g, beta, served := pool.clone(), slots, cu,
                                         0.2, bf16=bf16), served)
    want = {bf16: (chunk_in_pool(q, k, v, g, beta, direct := pool.clone(), slots.tolist(), cu,
                                 0.2, AMX_CHUNK if bf16 else NATIVE_CHUNK, bf16=bf16), direct)
            for bf16 in (False, True)}
    for bf16 in (False, True):
        assert torch.equal(runs[bf16][0], want[bf16][0])
        assert torch.equal(runs[bf16][1], want[bf16][1])
    (o32, s32), (o16, s16) = runs[False], runs[True]
    set_amx(False)  # --cpu-amx-delta-rule off: FP32 for a bf16 model too
    try:
        off = recurrence_in_pool(q, k, v, g, beta, served := pool.clone(), slots, cu, 0.2,
                                 bf16=True)
    finally:
        set_amx(True)
    assert torch.equal(off, o32) and torch.equal(served, s32)
    assert not torch.equal(o16, o32)
    assert (o16 - o32).abs().max() < 2e-2 * o32.abs().max()
    assert (s16 - s32).abs().max() < 2e-2 * s32.abs().max()
