"""The ranks' flags, declared without importing torch (so ``dasc-serve --help`` is instant)."""

from __future__ import annotations

import argparse


def add_rank_args(p: argparse.ArgumentParser) -> None:
    """Flags the ranks need; ``dasc-serve`` declares the same ones and passes them through."""
    g = p.add_argument_group("model and checkpoints (ranks)")
    g.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"],
                   help="weights and activations (bfloat16 is emulated, so slower, on CPUs "
                        "without native bf16)")
    g.add_argument("--device", default="cpu", help="cpu or cuda (one GPU per rank)")
    g.add_argument("--cpu-fp32-weights", choices=["auto", "on", "off"], default="auto",
                   help="hold a bf16 model's GEMM weights in fp32 (2x their memory; activations, "
                        "KV and states stay bf16): each GEMM is then one fp32 GEMM rounded to "
                        "bf16 and no step upcasts weights; auto: on a CPU that only emulates bf16 "
                        "(default: auto)")
    g.add_argument("--cpu-packed-weights", choices=["on", "off"], default="on",
                   help="give large linear weights a oneDNN-packed fp32 copy for GEMMs of two "
                        "or more rows (prefill chunks, batched decode), 1.2-2.5x faster than "
                        "torch's GEMM on this class of CPU, at the weight's size in fp32 of "
                        "extra memory (default: on)")
    g.add_argument("--disable-cuda-graph", action="store_true",
                   help="on cuda, run decode steps eagerly instead of replaying CUDA graphs")
    g.add_argument("--cuda-graph-max-bs", type=int, default=32,
                   help="largest decode batch replayed as a CUDA graph (capped at "
                        "--max-running-requests); larger steps and prefill run eagerly "
                        "(default: 32)")
    g.add_argument("--cuda-graph-max-context", type=int, default=4096,
                   help="longest decode context replayed as a CUDA graph; graphs for every "
                        "context bucket (powers of two from 256) up to it are captured at "
                        "start-up, longer contexts decode eagerly (default: 4096)")
    g.add_argument("--wmax", type=float, default=0.0,
                   help="W_max of the selection plan (0: dense checkpoints)")
    g.add_argument("--load-policy", choices=["nr", "wr"], default="nr",
                   help="on a hit: zero-fill omitted units (nr) or refresh them by replaying "
                        "the last W_wr cached tokens (wr)")
    g.add_argument("--placement", choices=["off", "storage", "hybrid"], default="off",
                   help="TP-balanced placement of the stored units")
    g.add_argument("--int8-checkpoints", action="store_true", help="INT8 checkpoint payload")
    g.add_argument("--selection", choices=["dasc", "random"], default="dasc",
                   help="decay-aware selection, or the count-matched random control")
    g.add_argument("--mask-seed", type=int, default=1234, help="seed of --selection random")
    size = g.add_mutually_exclusive_group()
    size.add_argument("--state-budget-bytes", type=int, default=None,
                      help="checkpoint memory per rank; slots = floor(B / worst-rank bytes per "
                           "slot) - 1 (paper eq. 8) (default: --checkpoint-slots)")
    size.add_argument("--checkpoint-slots", type=int, default=None,
                      help="number of checkpoint slots (default: 64)")


def fp32_weights(choice: str) -> bool | None:
    """``--cpu-fp32-weights`` as ``RunnerConfig.fp32_weights`` (None: auto)."""
    return {"auto": None, "on": True, "off": False}[choice]
