"""One TP rank of the multi-rank checkpoint tests; run by
tests/model_runner/test_compression_dist.py as
`torchrun --standalone --nproc-per-node T tests/support/compression_dist_worker.py OUT_DIR`.

Every rank builds the same global state, takes its own shard (following the head order),
stores and loads through `CheckpointPool` over gloo, and asserts exactness itself. Rank r writes
OUT_DIR/rank{r}.json with the checks it ran; any failure raises, so torchrun exits non-zero.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from model_runner.checkpoints.pool import CheckpointFormat, CheckpointPool
from model_runner.checkpoints.redistribute import from_storage, to_storage
from model_runner.compression.balance import balance_storage
from model_runner.compression.horizons import random_decay_params, static_horizons
from model_runner.compression.placement import (
    local_units,
    local_value_heads,
    placement_head_order,
    rank_row_counts,
)
from model_runner.compression.plan import (
    ModelIdentity,
    SelectionPlan,
    dasc_plan,
    dense_plan,
    random_plan,
)
from model_runner.config import ModelConfig

DATA = Path(__file__).parents[1] / "data" / "compression"
NUM_ACTIVE, NUM_CKPT = 5, 4


def check_raw_exchange(rank: int, world: int, counts: list[int], dtype: torch.dtype) -> None:
    """to_storage against an independent reference of where every row must land."""
    bal = balance_storage(counts)

    def tagged(s: int) -> torch.Tensor:  # rank s's packed rows [2, U_s, 3], random content
        gen = torch.Generator().manual_seed(100 + s)
        if dtype == torch.uint8:
            return torch.randint(0, 256, (2, counts[s], 3), generator=gen, dtype=torch.uint8)
        return torch.randn(2, counts[s], 3, generator=gen, dtype=dtype)

    mine = tagged(rank)  # [2, U_rank, 3]
    stored = to_storage(bal, rank, mine)  # [2, C, 3]
    assert stored.shape == (2, bal.width, 3)
    # Reference: donor excess rows in (rank, row) order fill receiver gaps in (rank, row) order.
    excess = [(s, i) for s in range(world) for i in range(bal.width, counts[s])]
    gaps = [(d, j) for d in range(world) for j in range(counts[d], bal.width)]
    expect = torch.zeros(2, bal.width, 3, dtype=dtype)
    expect[:, : min(counts[rank], bal.width)] = mine[:, : bal.width]
    for (s, i), (d, j) in zip(excess, gaps, strict=False):
        if d == rank:
            expect[:, j] = tagged(s)[:, i]
    assert torch.equal(stored, expect), (rank, counts, stored, expect)
    assert torch.equal(from_storage(bal, rank, stored), mine)


def shard(cfg: ModelConfig, order, rank: int, world: int, full: torch.Tensor) -> torch.Tensor:
    """Local temporal [L, S, H_loc, K, V] of the global [L, S, H, K, V] under head order."""
    heads = local_value_heads(cfg, order, rank, world)
    return torch.stack([full[l][:, h] for l, h in enumerate(heads)]).contiguous()


def expected_after_load(cfg, plan, order, rank, world, local: torch.Tensor) -> torch.Tensor:
    """Retained local units as they were, omitted ones zero."""
    mask = plan.mask()
    units = local_units(cfg, order, rank, world)
    keep = torch.stack([mask[l, torch.tensor(u)] for l, u in enumerate(units)])  # [L, U_loc]
    num_layers, slots, heads_loc, k, v = local.shape
    keep = keep.view(num_layers, 1, heads_loc, -1, 1)  # KDA: per k; GDN: per head
    return torch.where(keep, local, torch.zeros(()))


def strided(t: torch.Tensor) -> torch.Tensor:
    """The same values with every other slot of a twice larger buffer (not contiguous)."""
    view = torch.zeros((t.shape[0], 2 * t.shape[1], *t.shape[2:]), dtype=t.dtype)[:, ::2]
    return view.copy_(t)


def check_pool(cfg: ModelConfig, plan: SelectionPlan, fmt: CheckpointFormat, rank: int,
               world: int, conv_dtype: torch.dtype) -> dict:
    order = placement_head_order(plan, cfg, world, fmt.placement)
    gen = torch.Generator().manual_seed(1234)  # same global state on every rank
    heads, k, v = cfg.linear_num_value_heads, cfg.linear_key_head_dim, cfg.linear_value_head_dim
    full = torch.randn(cfg.num_linear_layers, NUM_ACTIVE, heads, k, v, generator=gen)
    full[:, :, :, 0] *= 1000.0  # rows of very different scales
    temporal = shard(cfg, order, rank, world, full)
    conv = torch.randn(cfg.num_linear_layers, NUM_ACTIVE, cfg.linear_conv_dim // world, 3,
                       generator=gen).to(conv_dtype)
    counts = rank_row_counts(plan, cfg, order, world, fmt.layout)
    want_rows = balance_storage(counts).width if fmt.is_balanced else counts[rank]
    src, dst = torch.tensor([4, 1, 2]), torch.tensor([3, 0, 2])
    results = []
    for is_flat in (True, False):  # contiguous state: CPU flat path; strided: kernel path
        pool = CheckpointPool(cfg, plan, NUM_CKPT, fmt, tp_rank=rank, tp_size=world,
                              head_order=order, conv_dtype=conv_dtype)
        assert pool.num_rows == want_rows, (pool.num_rows, want_rows)
        restored = torch.full_like(temporal, float("nan"))
        restored_conv = torch.zeros_like(conv)
        views = (temporal, conv, restored, restored_conv)
        views = views if is_flat else tuple(map(strided, views))
        pool.store(views[0], views[1], src, dst)
        pool.load(views[2], views[3], torch.tensor([0, 2, 3]), torch.tensor([0, 3, 4]))
        results.append((pool, views[2], views[3]))
    (pool, restored, restored_conv), (other, *other_out) = results
    assert torch.allclose(restored, other_out[0], rtol=0, atol=0, equal_nan=True), fmt
    assert torch.equal(restored_conv, other_out[1]), fmt
    for attr in ("temporal", "scale", "conv"):
        a, b = getattr(pool, attr), getattr(other, attr)
        assert (a is None and b is None) or torch.equal(a, b), (fmt, attr)
    # active 1 -> ckpt 0 -> active 0; active 2 -> ckpt 2 -> active 3; 4 -> 3 -> 4
    got = restored[:, [0, 3, 4]]
    want = expected_after_load(cfg, plan, order, rank, world, temporal)[:, [1, 2, 4]]
    assert torch.equal(restored_conv[:, [0, 3, 4]], conv[:, [1, 2, 4]])
    assert bool(restored[:, [1, 2]].isnan().all()), "load touched slots it was not asked to"
    moved = pool.balance.moved_rows if pool.balance is not None else 0
    if fmt.payload == "fp32":
        assert torch.equal(got, want), (fmt, (got - want).abs().max())
        return {"moved": moved, "max_err": 0.0}
    scale = want.abs().amax(dim=-1, keepdim=True).clamp_min(1e-8) / 127  # per (l, h, k) over V
    err = (got - want).abs()
    assert bool((err <= scale / 2 * (1 + 1e-6)).all()), (fmt, float((err / scale).max()))
    return {"moved": moved, "max_err_over_scale": float((err / scale).max())}


def main() -> None:
    out = Path(sys.argv[1])
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    checks: list[str] = []
    wide = [9 * world + 3] + [0] * (world - 2) + [1]  # one rank far above C
    for counts in ([3, 0] + [5] * (world - 2), wide, [2] * world, [0] * world):
        for dtype in (torch.float32, torch.uint8):
            check_raw_exchange(rank, world, counts, dtype)
            checks.append(f"exchange {counts} {dtype}")
    for name in ("tiny-gdn", "tiny-kda"):
        cfg = ModelConfig.from_dir(DATA / name)
        params = random_decay_params(cfg, seed=7)
        ident = ModelIdentity.of(cfg, params)
        horizons = static_horizons(cfg, params)
        w = float(horizons.median())
        dasc = dasc_plan(ident, horizons, w)
        # Everything retained sits in bundle 0 of layer 0: rank 0 holds a head wider than C.
        n = ident.num_units
        per_bundle = n // cfg.linear_num_key_heads
        lopsided = SelectionPlan(ident, "dasc", w, ((tuple(range(per_bundle)),)
                                 + ((),) * (cfg.num_linear_layers - 1)), 4)
        plans = [dense_plan(ident), dasc, random_plan(dasc, horizons, seed=3), lopsided]
        for plan in plans:
            for layout in ("ragged", "padded"):
                for payload in ("fp32", "int8"):
                    for placement in ("off", "storage", "hybrid"):
                        fmt = CheckpointFormat(layout, payload, placement)
                        conv_dtype = torch.bfloat16 if payload == "int8" else torch.float32
                        res = check_pool(cfg, plan, fmt, rank, world, conv_dtype)
                        checks.append(f"{name} {plan.selector} w={plan.w_max:g} {fmt} {res}")
    dist.barrier()
    (out / f"rank{rank}.json").write_text(json.dumps({"rank": rank, "checks": checks}))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
