"""Ragged gather / scatter of state units: index builders, torch reference, Triton kernels, and
the CPU flat-row path (`kernels/ragged_state/flat_rows.py`) against the reference.

The Triton kernels run under the Triton interpreter in a child process (`run_interpreted`), so
`TRITON_INTERPRET` never leaks into this test process.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import pytest
import torch

from kernels.interpreted import run_interpreted
from kernels.ragged_state import build_unit_index, gather_units, layer_offsets, scatter_units
from kernels.ragged_state.flat_rows import (
    FlatIndex,
    Scratch,
    load_rows,
    put_rows,
    put_units,
    stage_units,
    take_rows,
)
from kernels.ragged_state.naive import gather_units_ref, scatter_units_ref

NUM_SLOTS, NUM_CKPT = 7, 5
SRC_SLOTS = [5, 1, 3]  # active slots, not contiguous, not sorted
DST_SLOTS = [4, 0, 2]  # checkpoint slots


@dataclass(frozen=True, slots=True)
class Case:
    name: str
    num_units: int  # U: units per layer
    dim: int  # D: GDN K*V, KDA V
    layout: str
    pattern: str  # "mixed": r_l = 0, all, some, some; "none": nothing retained; CPU path:
    # "all": everything; "pairs": aligned unit pairs; "sparse": about one unit in eight

    def masks(self) -> list[torch.Tensor]:  # L x [U] bool
        gen = torch.Generator().manual_seed(self.num_units * 131 + self.dim)
        if self.pattern in ("none", "all"):
            full = self.pattern == "all"
            return [torch.full((self.num_units,), full) for _ in range(3)]
        if self.pattern == "pairs":
            pairs = [torch.rand(self.num_units // 2, generator=gen) < 0.5 for _ in range(3)]
            pairs[0][:] = True  # r_l: all, and two partial layers
            return [p.repeat_interleave(2) for p in pairs]
        if self.pattern == "sparse":
            return [torch.rand(self.num_units, generator=gen) < 0.125 for _ in range(3)]
        some = [torch.rand(self.num_units, generator=gen) < 0.5 for _ in range(2)]
        some[0][0], some[0][-1] = True, False  # both partial: neither empty nor full
        some[1][0], some[1][-1] = False, True
        return [torch.zeros(self.num_units, dtype=torch.bool), torch.ones_like(some[0]), *some]

    def pool(self) -> torch.Tensor:  # [L, S, U, D]
        gen = torch.Generator().manual_seed(self.dim)
        shape = (len(self.masks()), NUM_SLOTS, self.num_units, self.dim)
        return torch.randn(shape, generator=gen)


SHAPES = [
    ("gdn", 3, 4 * 6),  # 3 heads, K=4, V=6: D is not a power of two
    ("gdn_wide", 2, 12 * 128),  # D=1536 spans two column blocks with a tail
    ("kda", 2 * 8, 8),  # 2 heads x K=8 channels, V=8
    ("kda_odd", 3 * 5, 3),  # 3 heads x K=5, V=3
]
CASES = [
    Case(f"{name}-{layout}", units, dim, layout, "mixed")
    for name, units, dim in SHAPES
    for layout in ("ragged", "padded")
] + [Case("kda-none", 16, 8, "ragged", "none")]


def _slots(values: list[int]) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int32)


def _fresh_ckpt(case: Case, num_rows: int) -> torch.Tensor:  # [C, R, D], garbage
    return torch.full((NUM_CKPT, num_rows, case.dim), 7.0)


def _fresh_pool(case: Case) -> torch.Tensor:  # [L, S, U, D], garbage
    return torch.full_like(case.pool(), -3.0)


# ---------------------------------------------------------------- index builders


def test_layer_offsets_ragged_and_padded():
    assert layer_offsets([0, 4, 2, 3], "ragged") == ([0, 0, 4, 6], 9)
    assert layer_offsets([0, 4, 2, 3], "padded") == ([0, 4, 8, 12], 16)
    with pytest.raises(ValueError):
        layer_offsets([1], "dense")


@pytest.mark.parametrize("layout", ["ragged", "padded"])
def test_build_unit_index_is_consistent(layout):
    masks = Case("x", 6, 2, layout, "mixed").masks()
    idx = build_unit_index(masks, layout)
    counts = [int(m.sum()) for m in masks]
    assert (idx.offsets, idx.num_rows) == layer_offsets(counts, layout)
    assert idx.unit_layer.dtype == idx.unit_index.dtype == idx.unit_pos.dtype == torch.int32
    assert idx.unit_pos.shape == (len(masks), 6)
    assert int((idx.unit_layer >= 0).sum()) == sum(counts)
    for layer, mask in enumerate(masks):
        units = torch.nonzero(mask).flatten()
        rows = idx.unit_pos[layer, units].long()
        start = idx.offsets[layer]
        assert rows.tolist() == list(range(start, start + len(units)))  # ascending, packed
        assert (idx.unit_layer[rows] == layer).all() and (idx.unit_index[rows] == units).all()
        assert (idx.unit_pos[layer, ~mask] == -1).all()
    padding = idx.unit_layer < 0
    assert (idx.unit_index[padding] == -1).all()
    assert padding.any() == (layout == "padded")


def test_rejects_mismatched_shapes():
    case = CASES[0]
    idx = build_unit_index(case.masks(), case.layout)
    with pytest.raises(ValueError):  # ckpt has fewer rows than the index describes
        gather_units(case.pool(), _slots(SRC_SLOTS), idx.unit_layer, idx.unit_index,
                     _fresh_ckpt(case, idx.num_rows - 1), _slots(DST_SLOTS))  # fmt: skip
    with pytest.raises(ValueError):  # unit_pos of another pool shape
        scatter_units(_fresh_ckpt(case, idx.num_rows), _slots(DST_SLOTS), idx.unit_pos[:, :-1],
                      _fresh_pool(case), _slots(SRC_SLOTS))  # fmt: skip
    with pytest.raises(ValueError):  # ckpt dtype differs from the pool
        gather_units(case.pool(), _slots(SRC_SLOTS), idx.unit_layer, idx.unit_index,
                     _fresh_ckpt(case, idx.num_rows).double(), _slots(DST_SLOTS))  # fmt: skip


# ---------------------------------------------------------------- reference semantics


@pytest.mark.parametrize("case", CASES[:2] + CASES[-1:], ids=lambda c: c.name)
def test_gather_reference_matches_definition(case):
    pool, idx = case.pool(), build_unit_index(case.masks(), case.layout)
    ckpt = gather_units_ref(pool, _slots(SRC_SLOTS), idx.unit_layer, idx.unit_index,
                            _fresh_ckpt(case, idx.num_rows), _slots(DST_SLOTS))  # fmt: skip
    expected = _fresh_ckpt(case, idx.num_rows)
    for src, dst in zip(SRC_SLOTS, DST_SLOTS, strict=True):
        for r in range(idx.num_rows):
            layer, unit = int(idx.unit_layer[r]), int(idx.unit_index[r])
            expected[dst, r] = pool[layer, src, unit] if layer >= 0 else 0.0
    assert torch.equal(ckpt, expected)


@pytest.mark.parametrize("case", CASES[:2] + CASES[-1:], ids=lambda c: c.name)
def test_scatter_reference_matches_definition(case):
    idx = build_unit_index(case.masks(), case.layout)
    gen = torch.Generator().manual_seed(1)
    ckpt = torch.randn(NUM_CKPT, idx.num_rows, case.dim, generator=gen)
    pool = scatter_units_ref(ckpt, _slots(DST_SLOTS), idx.unit_pos, _fresh_pool(case),
                             _slots(SRC_SLOTS))  # fmt: skip
    expected = _fresh_pool(case)
    for src, dst in zip(DST_SLOTS, SRC_SLOTS, strict=True):
        for layer, unit in torch.cartesian_prod(*map(torch.arange, idx.unit_pos.shape)).tolist():
            row = int(idx.unit_pos[layer, unit])
            expected[layer, dst, unit] = ckpt[src, row] if row >= 0 else 0.0
    assert torch.equal(pool, expected)


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_round_trip_restores_retained_and_zero_fills_omitted(case):
    pool, masks = case.pool(), case.masks()
    idx = build_unit_index(masks, case.layout)
    ckpt = gather_units(pool, _slots(SRC_SLOTS), idx.unit_layer, idx.unit_index,
                        _fresh_ckpt(case, idx.num_rows), _slots(DST_SLOTS))  # fmt: skip
    restored = scatter_units(ckpt, _slots(DST_SLOTS), idx.unit_pos, _fresh_pool(case),
                             _slots(SRC_SLOTS))  # fmt: skip
    kept = torch.stack(masks)[:, None, :, None]  # [L, 1, U, 1]
    touched = restored[:, SRC_SLOTS]
    assert torch.equal(touched, torch.where(kept, pool[:, SRC_SLOTS], 0.0))
    untouched = [s for s in range(NUM_SLOTS) if s not in SRC_SLOTS]
    assert (restored[:, untouched] == -3.0).all()
    other_ckpt = [c for c in range(NUM_CKPT) if c not in DST_SLOTS]
    assert (ckpt[other_ckpt] == 7.0).all()


# ---------------------------------------------------------------- Triton vs reference


def _inputs(case: Case) -> tuple[tuple, tuple]:
    idx = build_unit_index(case.masks(), case.layout)
    gather_args = (case.pool(), _slots(SRC_SLOTS), idx.unit_layer, idx.unit_index,
                   _fresh_ckpt(case, idx.num_rows), _slots(DST_SLOTS))  # fmt: skip
    gen = torch.Generator().manual_seed(2)
    ckpt = torch.randn(NUM_CKPT, idx.num_rows, case.dim, generator=gen)
    slots = _slots(DST_SLOTS).long(), _slots(SRC_SLOTS).long()  # int64 slots work as well
    scatter_args = (ckpt, slots[0], idx.unit_pos, _fresh_pool(case), slots[1])
    return gather_args, scatter_args


@pytest.fixture(scope="module")
def triton_results() -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    calls = []
    for case in CASES:
        gather_args, scatter_args = _inputs(case)
        calls += [("gather_units_triton", gather_args), ("scatter_units_triton", scatter_args)]
    out = run_interpreted("kernels.ragged_state.triton", calls)
    return {case.name: (out[2 * i], out[2 * i + 1]) for i, case in enumerate(CASES)}


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_triton_matches_reference_exactly(case, triton_results):
    gather_args, scatter_args = _inputs(case)
    ckpt_triton, pool_triton = triton_results[case.name]
    assert torch.equal(ckpt_triton, gather_units_ref(*gather_args))
    assert torch.equal(pool_triton, scatter_units_ref(*scatter_args))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("layout", ["ragged", "padded"])
def test_cuda_dispatch_matches_reference(layout):
    # GDN at TP8-like sizes: 4 heads of K = V = 128 per rank.
    case = Case(f"cuda-{layout}", 4, 128 * 128, layout, "mixed")
    gather_args, scatter_args = _inputs(case)
    cuda = [tuple(a.cuda() for a in args) for args in (gather_args, scatter_args)]
    assert torch.equal(gather_units(*cuda[0]).cpu(), gather_units_ref(*gather_args))
    assert torch.equal(scatter_units(*cuda[1]).cpu(), scatter_units_ref(*scatter_args))


# ---------------------------------------------------------------- CPU flat path vs reference

CPU_CASES = CASES + [
    Case("kda-all-padded", 16, 8, "padded", "all"),  # g = U: one row per (layer, slot)
    Case("gdn-pairs-padded", 6, 24, "padded", "pairs"),  # g = 2 with padding runs
    Case("kda-pairs", 16, 8, "ragged", "pairs"),
    Case("kda-sparse", 16, 8, "ragged", "sparse"),
    Case("gdn-sparse-padded", 8, 12, "padded", "sparse"),
]


@pytest.mark.parametrize("case", CPU_CASES, ids=lambda c: c.name)
def test_cpu_flat_path_matches_reference(case):
    pool, idx = case.pool(), build_unit_index(case.masks(), case.layout)
    flat = FlatIndex.of(idx)
    if case.pattern in ("all", "pairs"):
        assert flat.group == (case.num_units if case.pattern == "all" else 2)
    src, dst = _slots(SRC_SLOTS), _slots(DST_SLOTS)
    ckpt = _fresh_ckpt(case, idx.num_rows)
    put_rows(ckpt.view(NUM_CKPT, -1), dst.long(), stage_units(pool, src, flat).flatten(1))
    want = gather_units_ref(pool, src, idx.unit_layer, idx.unit_index,
                            _fresh_ckpt(case, idx.num_rows), dst)  # fmt: skip
    assert torch.equal(ckpt, want)
    # Load: checkpoint rows behind g zero rows, gathered and written by both strategies.
    gen = torch.Generator().manual_seed(3)
    rows = torch.cat([torch.zeros(flat.group, case.dim),
                      torch.randn(NUM_CKPT * idx.num_rows, case.dim, generator=gen)])
    want = scatter_units_ref(rows[flat.group :].view(NUM_CKPT, idx.num_rows, case.dim), dst,
                             idx.unit_pos, _fresh_pool(case), src)  # fmt: skip
    for is_sparse in (False, True):
        how = replace(flat, is_sparse=is_sparse, _active={})
        staged = take_rows(rows.view(-1, flat.group * case.dim), load_rows(how, dst))
        assert torch.equal(put_units(_fresh_pool(case), src, staged, how), want), is_sparse


@pytest.mark.parametrize(("dtype", "width", "offset"), [
    (torch.float32, 8, 0), (torch.float32, 3, 1), (torch.int8, 5, 3), (torch.bfloat16, 8, 1),
    (torch.uint8, 48, 16),
])
def test_put_rows_and_take_rows_any_width(dtype, width, offset):
    gen = torch.Generator().manual_seed(width)
    base = torch.randint(-100, 100, (offset + 7 * width,), generator=gen).to(dtype)
    dst = base[offset:].view(7, width)  # a storage offset that may forbid wide views
    src = torch.randint(-100, 100, (3, width), generator=gen).to(dtype)
    index = torch.tensor([5, 0, 3])
    want = dst.clone()
    want[index] = src
    assert torch.equal(put_rows(dst, index, src), want)
    rows = torch.tensor([6, 2, 2, 0])
    assert torch.equal(take_rows(dst, rows), dst[rows])
    assert torch.equal(take_rows(dst[:, :1].contiguous(), rows), dst[rows, :1])


def test_scratch_reuses_and_grows():
    scratch = Scratch(torch.device("cpu"))
    a = scratch.get("x", (4, 3), torch.float32)
    b = scratch.get("x", (2, 5), torch.float32)
    assert a.data_ptr() == b.data_ptr() and b.shape == (2, 5)
    assert scratch.get("x", (5, 5), torch.float32).numel() == 25
    assert scratch.get("x", (2,), torch.int8).dtype == torch.int8
