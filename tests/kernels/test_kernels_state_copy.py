"""The one-pass CPU checkpoint kernels (`kernels/ragged_state/native.py` over `native.c`): runs
against the torch references bit for bit (fp32 and INT8, ragged and padded, partial, empty and
full layers), slot checking, and the build's fallbacks."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
from support.paths import ROOT

from kernels.int8_quant.naive import dequantize_int8_ref, quantize_int8_ref
from kernels.ragged_state import build_unit_index
from kernels.ragged_state.naive import gather_units_ref, scatter_units_ref
from kernels.ragged_state.native import (
    StateRuns,
    check_slots,
    copy_runs,
    dequantize_runs,
    native_library,
    quantize_runs,
)
from model_runner.checkpoints.pool import CheckpointPool
from model_runner.compression.plan import ModelIdentity, dense_plan
from model_runner.config import ModelConfig

NUM_SLOTS, NUM_CKPT = 7, 5
SRC, DST = torch.tensor([5, 1, 3]), torch.tensor([4, 0, 2])  # unsorted, not contiguous

pytestmark = pytest.mark.skipif(native_library() is None, reason="no C compiler here")


def masks(num_units: int, pattern: str, seed: int) -> list[torch.Tensor]:
    """Four layers: none retained, all retained, and two random partial ones (or all / none)."""
    gen = torch.Generator().manual_seed(seed)
    if pattern in ("all", "none"):
        return [torch.full((num_units,), pattern == "all") for _ in range(4)]
    some = [torch.rand(num_units, generator=gen) < 0.4 for _ in range(2)]
    some[0][0], some[0][-1] = True, False
    some[1][0], some[1][-1] = False, True
    return [torch.zeros(num_units, dtype=torch.bool), torch.ones(num_units, dtype=torch.bool),
            *some]


# (name, U, rows per unit, V): GDN units are whole heads [K, V], KDA units one V row
SHAPES = [("kda", 24, 1, 8), ("kda_odd_v", 15, 1, 3), ("gdn", 3, 4, 6)]
CASES = [(name, units, rpu, v, layout, pattern)
         for name, units, rpu, v in SHAPES
         for layout in ("ragged", "padded") for pattern in ("mixed", "all", "none")]


def pool_values(num_units: int, dim: int, value_dim: int) -> torch.Tensor:
    """[L, S, U, D] with rows of very different magnitudes, exact zeros, rows below the
    1e-8 scale floor and rows whose quotients land on .5 (round half to even shows)."""
    gen = torch.Generator().manual_seed(dim)
    x = torch.randn(4, NUM_SLOTS, num_units, dim, generator=gen) * 3.0
    rows = x.view(4, NUM_SLOTS, -1, value_dim)
    rows[:, :, 1::5] *= 1e4
    rows[:, :, 2::5] = 0.0
    rows[:, :, 3::5] *= 1e-10
    halves = torch.randint(-254, 255, rows[:, :, 4::5].shape, generator=gen).float() / 2
    halves[..., 0] = 127.0  # amax 127: the scale is exactly 1
    rows[:, :, 4::5] = halves
    return x


@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join(map(str, c)))
def test_runs_match_references(case):
    _, num_units, rpu, v, layout, pattern = case
    dim = rpu * v
    index = build_unit_index(masks(num_units, pattern, seed=num_units), layout)
    runs = StateRuns.of(index, dim)
    pool = pool_values(num_units, dim, v)
    pool_bytes, ckpt_shape = pool.stride(1) * 4, (NUM_CKPT, index.num_rows, dim)
    if pattern == "all" and layout == "ragged":
        assert len(runs.store) == len(runs.load) == 4  # a dense slot: one run per layer

    # fp32 store / load: the C runs write exactly what the references write, garbage elsewhere
    ckpt = torch.full(ckpt_shape, 7.0)
    copy_runs(pool, ckpt, SRC, DST, pool_bytes, ckpt.stride(0) * 4, runs.fp32(NUM_SLOTS)[0])
    want = gather_units_ref(pool, SRC, index.unit_layer, index.unit_index,
                            torch.full(ckpt_shape, 7.0), DST)
    assert torch.equal(ckpt, want)
    out = torch.full_like(pool, -3.0)
    copy_runs(want, out, DST, SRC, ckpt.stride(0) * 4, pool_bytes, runs.fp32(NUM_SLOTS)[1])
    assert torch.equal(out, scatter_units_ref(want, DST, index.unit_pos,
                                              torch.full_like(pool, -3.0), SRC))

    # INT8: quantise on store, dequantise on load, the same bits as the torch reference
    q = torch.full(ckpt_shape, 99, dtype=torch.int8)
    scale = torch.full((NUM_CKPT, index.num_rows, rpu), 5.0)
    quantize_runs(pool, q, scale, SRC, DST, pool.stride(1), runs.int8(NUM_SLOTS)[0], rpu, v)
    packed = gather_units_ref(pool, torch.arange(NUM_SLOTS), index.unit_layer,
                              index.unit_index, torch.empty(NUM_SLOTS, *ckpt_shape[1:]),
                              torch.arange(NUM_SLOTS))[SRC]  # [B, R, D], padding rows zero
    want_q, want_s = quantize_int8_ref(packed.view(len(SRC), index.num_rows, rpu, v))
    assert torch.equal(q[DST].view(want_q.shape), want_q)
    assert torch.equal(scale[DST], want_s)
    untouched = torch.ones(NUM_CKPT, dtype=torch.bool)
    untouched[DST] = False
    assert (q[untouched] == 99).all() and (scale[untouched] == 5.0).all()
    out = torch.full_like(pool, -3.0)
    dequantize_runs(q, scale, out, DST, SRC, pool.stride(1), runs.int8(NUM_SLOTS)[1], rpu, v)
    x_hat = dequantize_int8_ref(q.view(NUM_CKPT, index.num_rows, rpu, v), scale)
    assert torch.equal(out, scatter_units_ref(x_hat.view(ckpt_shape), DST, index.unit_pos,
                                              torch.full_like(pool, -3.0), SRC))


def test_rounding_ties_and_tiny_rows_exactly():
    rows = torch.tensor([[127.0, 0.5, 1.5, 2.5, -0.5, -1.5, -2.5, 126.5],
                         [3e-9, -1e-9, 0.0, 2e-9, 0.0, 0.0, 0.0, 0.0],
                         [0.0] * 8])
    pool = rows.view(1, 3, 1, 8)  # three slots of one unit
    index = build_unit_index([torch.ones(1, dtype=torch.bool)])
    q = torch.empty(3, 1, 8, dtype=torch.int8)
    scale = torch.empty(3, 1, 1)
    slots = torch.arange(3)
    quantize_runs(pool, q, scale, slots, slots, 8, StateRuns.of(index, 8).int8(3)[0], 1, 8)
    assert q[0, 0].tolist() == [127, 0, 2, 2, 0, -2, -2, 126]
    want_q, want_s = quantize_int8_ref(rows)
    assert torch.equal(q.view(3, 8), want_q) and torch.equal(scale.view(3), want_s)


def test_checkpoint_pool_rejects_bad_slots_before_writing():
    cfg = ModelConfig.from_dir(ROOT / "tests" / "data" / "compression" / "tiny-kda")
    pool = CheckpointPool(cfg, dense_plan(ModelIdentity.of(cfg)), 2, conv_dtype=torch.float32)
    temporal = torch.randn(cfg.num_linear_layers, 3, cfg.linear_num_value_heads,
                           cfg.linear_key_head_dim, cfg.linear_value_head_dim)
    conv = torch.randn(cfg.num_linear_layers, 3, cfg.linear_conv_dim, 3)
    before = (pool.temporal.clone(), temporal.clone())
    with pytest.raises(IndexError, match=r"checkpoint slot ids \[0, 2\] outside \[0, 2\)"):
        pool.store(temporal, conv, torch.tensor([1, 2]), torch.tensor([0, 2]))
    with pytest.raises(IndexError, match=r"active slot ids \[-1\] outside \[0, 3\)"):
        pool.load(temporal, conv, torch.tensor([1]), torch.tensor([-1]))
    with pytest.raises(ValueError, match=r"both be \[B\], got \(3,\) and \(1,\)"):
        pool.store(temporal, conv, torch.tensor([0, 1, 2]), torch.tensor([1]))
    with pytest.raises(ValueError, match="active conv state must be"):  # fewer conv slots
        pool.load(temporal, conv[:, :1].contiguous(), torch.tensor([1]), torch.tensor([2]))
    assert torch.equal(pool.temporal, before[0]) and torch.equal(temporal, before[1])
    assert check_slots(torch.tensor([2, 0], dtype=torch.int32), 3, "x").dtype == torch.long


def test_non_finite_rows_give_torch_scales_and_defined_codes():
    rows = torch.tensor([[float("nan"), 1.0, -2.0, 0.5], [float("inf"), 1.0, 0.0, 3.0],
                         [1.0, 2.0, 3.0, 4.0]])
    pool = rows.view(1, 3, 1, 4)
    index = build_unit_index([torch.ones(1, dtype=torch.bool)])
    q, scale = torch.empty(3, 1, 4, dtype=torch.int8), torch.empty(3, 1, 1)
    slots = torch.arange(3)
    quantize_runs(pool, q, scale, slots, slots, 4, StateRuns.of(index, 4).int8(3)[0], 1, 4)
    want_q, want_s = quantize_int8_ref(rows)
    torch.testing.assert_close(scale.view(3), want_s, equal_nan=True)  # NaN and inf as torch
    assert torch.equal(q[2, 0], want_q[2]) and (q[:2] == 0).all()  # NaN quotients: 0


def _library_in_child(env: dict[str, str]) -> subprocess.CompletedProcess:
    code = ("import warnings; warnings.simplefilter('always');"
            "from kernels.ragged_state.native import native_library;"
            "print(native_library() is None)")
    return subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True,
                          text=True, timeout=120, env={**os.environ, **env})


def test_library_builds_into_its_cache_and_falls_back(tmp_path):
    built = _library_in_child({"DASC_CACHE_DIR": str(tmp_path / "ok")})
    assert built.stdout.strip() == "False", built.stderr
    assert len(list((tmp_path / "ok").glob("ragged_state-*.so"))) == 1
    off = _library_in_child({"DASC_NATIVE_KERNELS": "0"})
    assert off.stdout.strip() == "True" and "not built" not in off.stderr
    broken = _library_in_child({"DASC_CACHE_DIR": str(tmp_path / "bad"), "CC": "false"})
    assert broken.stdout.strip() == "True" and "using torch" in broken.stderr
    (tmp_path / "a-file").write_text("")  # an unusable cache dir: built in the temp dir
    elsewhere = _library_in_child({"DASC_CACHE_DIR": str(tmp_path / "a-file" / "dasc")})
    assert elsewhere.stdout.strip() == "False" and "using torch" not in elsewhere.stderr
