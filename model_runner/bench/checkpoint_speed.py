"""Checkpoint store/load bandwidth next to a plain torch copy of the same number of bytes.

    OMP_NUM_THREADS=1 python -m model_runner.bench.checkpoint_speed [--model DIR] [--batch 32]
    OMP_NUM_THREADS=1 torchrun --standalone --nproc-per-node 2 \
        -m model_runner.bench.checkpoint_speed \
        --placements off storage hybrid

One CheckpointPool per (W_max, format) on the model's real decay weights; every call moves
`--batch` slots (random, distinct active and checkpoint slot ids). GB/s = stored bytes moved
(bytes per slot on this rank x batch) / median seconds per call; `copy` is `dst.copy_(src)` of
a same-sized fp32 buffer; `load/slot copy` compares a load with a copy of the whole active
slots it writes (retained units, zeros for omitted ones, conv state). Rank 0 prints one JSON
line per row, then a markdown table.
On CPU the pool runs the one-pass C kernels (kernels/ragged_state/native.py);
DASC_NATIVE_KERNELS=0 measures the torch flat-row fallback instead.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from kernels.ragged_state.native import native_library
from model_runner.checkpoints.pool import CheckpointFormat, CheckpointPool
from model_runner.compression.horizons import static_horizons
from model_runner.compression.placement import head_permutation
from model_runner.compression.plan import ModelIdentity, dasc_plan
from model_runner.compression.weights import load_decay_params
from model_runner.config import DEFAULT_MODEL, ModelConfig
from model_runner.parallel import init_tp_group, rank_device, shutdown_tp_group

FORMATS = (("ragged", "fp32"), ("padded", "fp32"), ("ragged", "int8"))


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def median_seconds(fn, repeats: int, barrier) -> float:
    fn()  # warm-up
    times = []
    for _ in range(repeats):
        barrier()
        sync()
        start = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def copy_gbps(num_bytes: int, repeats: int, device: torch.device) -> float:
    src = torch.randn(max(num_bytes // 4, 1), device=device)
    dst = torch.empty_like(src)
    return num_bytes / median_seconds(lambda: dst.copy_(src), repeats, lambda: None) / 1e9


def bench_one(cfg, plan, fmt, tp, args, gen) -> dict:
    order = head_permutation(plan, cfg, tp.size) if fmt.placement == "hybrid" else None
    heads = cfg.linear_num_value_heads // tp.size
    num_active = args.batch + 1
    temporal = torch.randn(cfg.num_linear_layers, num_active, heads, cfg.linear_key_head_dim,
                           cfg.linear_value_head_dim, generator=gen).to(args.device)
    conv = torch.randn(cfg.num_linear_layers, num_active, cfg.linear_conv_dim // tp.size,
                       cfg.linear_conv_kernel_dim - 1, generator=gen).to(args.device)
    pool = CheckpointPool(cfg, plan, args.ckpt_slots, fmt, tp_rank=tp.rank, tp_size=tp.size,
                          head_order=order, conv_dtype=conv.dtype, device=args.device)
    active = torch.randperm(num_active, generator=gen)[: args.batch]
    ckpt = torch.randperm(args.ckpt_slots, generator=gen)[: args.batch]
    out, out_conv = torch.zeros_like(temporal), torch.zeros_like(conv)
    barrier = tp.barrier
    store_s = median_seconds(lambda: pool.store(temporal, conv, active, ckpt), args.repeats,
                             barrier)
    load_s = median_seconds(lambda: pool.load(out, out_conv, ckpt, active), args.repeats,
                            barrier)
    num_bytes = pool.nbytes_per_slot() * args.batch
    copy = copy_gbps(num_bytes, args.repeats, args.device)
    store, load = num_bytes / store_s / 1e9, num_bytes / load_s / 1e9
    # A load writes whole active slots (omitted units as zeros), fp32 even from INT8 payloads:
    # its floor is a copy of those bytes, not of the stored ones.
    slot_bytes = (temporal[:, 0].nbytes + conv[:, 0].nbytes) * args.batch
    slot_copy = copy_gbps(slot_bytes, args.repeats, args.device)
    return dict(tp_size=tp.size, device=str(args.device), w_max=plan.w_max, layout=fmt.layout,
                payload=fmt.payload, placement=fmt.placement, bytes_per_slot=pool.nbytes_per_slot(),
                store_ms=1e3 * store_s, load_ms=1e3 * load_s, store_gbps=store, load_gbps=load,
                copy_gbps=copy, store_vs_copy=store / copy, load_vs_copy=load / copy,
                load_vs_slot_copy=slot_bytes / load_s / 1e9 / slot_copy)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--model", default=str(DEFAULT_MODEL))
    p.add_argument("--wmax", type=float, nargs="+", default=[0, 16, 128, 512])
    p.add_argument("--placements", nargs="+", default=["off"],
                   choices=["off", "storage", "hybrid"])
    p.add_argument("--batch", type=int, default=32, help="slots per store/load call")
    p.add_argument("--ckpt-slots", type=int, default=64)
    p.add_argument("--repeats", type=int, default=30)
    p.add_argument("--device", default="cpu", help="cpu or cuda (one GPU per rank)")
    args = p.parse_args()
    args.device = rank_device(args.device)
    tp = init_tp_group(args.device)
    cfg = ModelConfig.from_dir(args.model)
    params = load_decay_params(args.model, cfg)
    identity, horizons = ModelIdentity.of(cfg, params), static_horizons(cfg, params)
    gen = torch.Generator().manual_seed(tp.rank)
    rows = []
    for w_max in args.wmax:
        plan = dasc_plan(identity, horizons, w_max)
        for placement in args.placements:
            for layout, payload in FORMATS:
                row = bench_one(cfg, plan, CheckpointFormat(layout, payload, placement), tp,
                                args, gen)
                rows.append(row)
                if tp.is_first:
                    print(json.dumps({k: round(v, 4) if isinstance(v, float) else v
                                      for k, v in row.items()}), flush=True)
    if tp.is_first:
        print_table(rows)
    shutdown_tp_group(tp)


def print_table(rows: list[dict]) -> None:
    cpu_path = "C runs" if native_library() is not None else "torch flat rows"
    print(f"\nTP={rows[0]['tp_size']}, device={rows[0]['device']}, "
          f"threads={torch.get_num_threads()}, CPU path: {cpu_path}\n")
    print("| W_max | format | placement | bytes/slot | store GB/s | load GB/s | copy GB/s "
          "| store/copy | load/copy | load/slot copy |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['w_max']:g} | {r['layout']} {r['payload']} | {r['placement']} "
              f"| {r['bytes_per_slot']:,} | {r['store_gbps']:.2f} | {r['load_gbps']:.2f} "
              f"| {r['copy_gbps']:.2f} | {r['store_vs_copy']:.2f} | {r['load_vs_copy']:.2f} "
              f"| {r['load_vs_slot_copy']:.2f} |")


if __name__ == "__main__":
    main()
