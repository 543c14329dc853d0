"""dasc-serve's flags, parsed once: ``serve_config`` turns them into the frozen ``ServeConfig``
the launcher hands to the scheduler and the ranks, and the front end's ``FrontEndOptions`` (the
API key, the body and queue limits); the launcher keeps the rest (HTTP, torchrun, timeouts) for
itself.  Declaring the flags imports no torch, so ``--help`` is
instant; ``validate`` checks what it can before any process starts.
"""

from __future__ import annotations

import argparse
import os
import sys
from dataclasses import dataclass
from enum import StrEnum
from pathlib import Path

from client.cli_help import DefaultsHelpFormatter
from model_runner.config import DEFAULT_MODEL
from model_runner.model_files import resolve_dtype
from scheduler.wire.serve_config import (
    DEFAULT_CHECKPOINT_SLOTS,
    DEFAULT_CHUNKED_PREFILL,
    CacheTierConfig,
    CheckpointAdmission,
    CheckpointEviction,
    CheckpointSpec,
    DecodeFirst,
    Device,
    Dtype,
    Fp32Weights,
    LmHeadScreen,
    LoadPolicy,
    Payload,
    Placement,
    RankConfig,
    SchedulePolicyName,
    SchedulingConfig,
    Selection,
    ServeConfig,
    TierEviction,
)


@dataclass(frozen=True, slots=True, kw_only=True)
class FrontEndOptions:
    """The front end's own settings (``dasc_server.app.create_app``)."""

    api_key: str | None = None  # --api-key, else $DASC_API_KEY
    max_request_bytes: int = 16 * 1024 * 1024
    max_queued_requests: int = 256


# the defaults: every flag that sets a config field reads its default from the dataclass
FRONT = FrontEndOptions()
RANKS = RankConfig(dtype=Dtype.BFLOAT16)
SCHED = SchedulingConfig()
CKPT = CheckpointSpec()
TIER = CacheTierConfig()


def values(kind: type[StrEnum]) -> list[str]:
    return [member.value for member in kind]


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="dasc-serve", formatter_class=DefaultsHelpFormatter,
        description="Serve a hybrid linear-attention checkpoint (Qwen3.5, Qwen3-Next, "
                    "OLMo-Hybrid, Kimi-Linear) with an OpenAI-compatible API and a prefix "
                    "cache of compressed (dasc) recurrent-state checkpoints.")
    p.add_argument("--model", default=str(DEFAULT_MODEL),
                   help="folder with config.json and *.safetensors (default: the built-in tiny "
                        "Kimi-Linear model, %(default)s)")
    p.add_argument("--served-model-name", default=None,
                   help="the model name clients use (default: the folder name)")
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel ranks")
    p.add_argument("--host", default="127.0.0.1",
                   help="bind address (default: %(default)s, loopback only)")
    p.add_argument("--port", type=int, default=8000,
                   help="HTTP port (0: a free one, named in the ready line)")
    p.add_argument("--startup-timeout", type=float, default=300.0,
                   help="seconds to wait for the ranks to load the model")
    p.add_argument("--shutdown-timeout", type=float, default=30.0,
                   help="on SIGTERM/SIGINT, seconds to let in-flight requests finish")
    p.add_argument("--api-key", default=None,
                   help="require 'Authorization: Bearer KEY' on every route but /health "
                        "(default: $DASC_API_KEY if set, else no key)")
    p.add_argument("--max-request-bytes", type=int, default=FRONT.max_request_bytes,
                   help="larger request bodies get 413")
    p.add_argument("--max-queued-requests", type=int, default=FRONT.max_queued_requests,
                   help="requests waiting beyond --max-running-requests; more get 503")
    g = p.add_argument_group("multi-node (passed to torchrun; node 0 runs the front end and "
                             "the scheduler, other nodes only their ranks)")
    g.add_argument("--nnodes", type=int, default=1, help="nodes the ranks span")
    g.add_argument("--node-rank", type=int, default=0, help="this node's index")
    g.add_argument("--master-addr", default="127.0.0.1", help="node 0's address for torchrun")
    g.add_argument("--master-port", type=int, default=29500, help="node 0's torchrun port")
    add_rank_flags(p)
    add_scheduling_flags(p)
    add_tier_flags(p)
    return p


def on_off(group, flag: str, on: bool, help: str) -> None:
    """A switch whose value is "on" or "off", defaulting to ``on``'s."""
    group.add_argument(flag, choices=["on", "off"], default="on" if on else "off", help=help)


def threads_flag(text: str) -> str:
    if text != "auto" and not (text.isdigit() and int(text) >= 1):
        raise argparse.ArgumentTypeError(f"expected a thread count of at least 1 or auto, "
                                         f"got {text!r}")
    return text


def resolve_threads(args: argparse.Namespace) -> int:
    """``--cpu-threads``' count for this node's ranks."""
    if args.cpu_threads != "auto":
        return int(args.cpu_threads)
    env = os.environ.get("OMP_NUM_THREADS", "").split(",")[0].strip()
    if env.isdigit() and int(env) >= 1:
        return int(env)
    if args.device != "cpu":
        return 1
    return max(1, len(os.sched_getaffinity(0)) // (args.tp // args.nnodes))


def add_rank_flags(p: argparse.ArgumentParser) -> None:
    """``ServeConfig.ranks`` and ``ServeConfig.checkpoints``."""
    g = p.add_argument_group("model and checkpoints (ranks)")
    g.add_argument("--dtype", default="auto", choices=["auto", *values(Dtype)],
                   help="weights and activations; auto: the checkpoint's bfloat16 where this "
                        "device computes bf16 natively (CUDA, a CPU with AVX512-BF16 or AMX), "
                        "else float32 (bfloat16 is emulated, so slower, on other CPUs)")
    g.add_argument("--device", default=RANKS.device.value, choices=values(Device),
                   help="cuda: one GPU per rank")
    g.add_argument("--cpu-fp32-weights", choices=values(Fp32Weights),
                   default=RANKS.cpu_fp32_weights.value,
                   help="hold a bf16 model's GEMM weights in fp32 (2x their memory; activations, "
                        "KV and states stay bf16): each GEMM is then one fp32 GEMM rounded to "
                        "bf16 and no step upcasts weights; auto: on a CPU that only emulates bf16")
    on_off(g, "--cpu-packed-weights", RANKS.cpu_packed_weights,
           "give large linear weights a oneDNN-packed copy: bf16 on a CPU with AVX512-BF16 or "
           "AMX, for every GEMM (1.1-4x faster than torch's there), else fp32, for GEMMs of "
           "2-256 rows (1.2-2.5x faster on AVX2); extra memory: the weight again in that dtype, "
           "except where --cpu-coded-weights lets a bf16 linear drop the weight as loaded")
    on_off(g, "--cpu-huge-pages", RANKS.cpu_huge_pages,
           "copy the weights a decode step streams into transparent huge pages at start-up: "
           "decode steps took ~0.92x the time on the 2-core VM measured, for ~1-10 s more "
           "start-up per GB where the kernel first compacts memory")
    on_off(g, "--cpu-coded-weights", RANKS.cpu_coded_weights,
           "give bf16 linear weights a coded copy that a decode step's GEMV streams instead, "
           "where the CPU has AVX-512: the same values in 12 bits an element, so the same bits "
           "out, in ~0.7-0.85x the GEMV's time at 1-2 rows, about the same at 4; where the CPU "
           "has AVX512-BF16 or AMX a linear then drops its weight, which neither its packed nor "
           "its coded copy needs (0.1-0.24 GiB less at Qwen3.5-0.8B than off), elsewhere each "
           "copy costs ~0.77x its weight; ~1.5 s more start-up there")
    on_off(g, "--cpu-amx-delta-rule", RANKS.cpu_amx_delta_rule,
           "a bf16 model's chunked delta rule (GDN prefill) with its products on AMX tiles from "
           "bf16 operands, FP32 accumulation, as fla's GPU kernels read them, where the CPU has "
           "AMX (the kernel ~0.6x the FP32 form's time, a whole prefill ~0.9x at the bench "
           "shapes; within bf16 rounding of it); off: FP32 throughout")
    on_off(g, "--cpu-amx-attention", RANKS.cpu_amx_attention,
           "a bf16 model's prefill attention (a prompt chunk's queries over its cached and new "
           "keys) in C on AMX tiles, reading the KV rows where they lie in the pool, where the "
           "CPU has AMX (a step of cache hits after a long prefix ~0.8x the time, a fresh "
           "prompt ~0.95-1x, at the bench shapes; within bf16 rounding of torch's); off: "
           "torch's SDPA")
    g.add_argument("--cpu-threads", type=threads_flag, default="auto", metavar="N",
                   help="threads each rank computes on, its own and its C kernels' (OpenMP); "
                        "auto: OMP_NUM_THREADS where set, else on a CPU device the CPUs this "
                        "process may use, shared among this node's ranks (at least 1), on cuda "
                        "1. On the 2-core VM measured, 2 threads instead of 1 served the "
                        "multi-turn load at ~0.6x the TTFT and TPOT, the scheduler and front end "
                        "beside them")
    on_off(g, "--cpu-bind", RANKS.cpu_bind,
           "bind each CPU rank of this node to --cpu-threads CPUs of its own (the first ones "
           "this process may use, by rank) and the scheduler and front end to the rest, as "
           "vLLM-CPU binds its worker; refused where the ranks' threads outnumber the CPUs. "
           "With one thread on the 2-core VM measured, the multi-turn load's TTFT was ~0.96x "
           "and its TPOT ~0.94x. "
           "Off by default: two servers on one machine would bind to the same CPUs")
    g.add_argument("--cpu-lm-head-screen", choices=values(LmHeadScreen),
                   default=RANKS.cpu_lm_head_screen.value,
                   help="greedy rows that report no logprobs take an int8 copy of the LM head "
                        "and compute exactly only the rows that can win (the same tokens); one "
                        "rank, bf16, AVX-512 VNNI; auto: heads of 16M weights or more (extra "
                        "memory: 1 byte per weight)")
    g.add_argument("--disable-cuda-graph", action="store_true",
                   help="on cuda, run decode steps eagerly instead of replaying CUDA graphs")
    g.add_argument("--cuda-graph-max-bs", type=int, default=RANKS.cuda_graph_max_bs,
                   help="largest decode batch replayed as a CUDA graph (capped at "
                        "--max-running-requests); larger steps and prefill run eagerly")
    g.add_argument("--cuda-graph-max-context", type=int,
                   default=RANKS.cuda_graph_max_context,
                   help="longest decode context replayed as a CUDA graph; graphs for every "
                        "context bucket (powers of two from 256) up to it are captured at "
                        "start-up, longer contexts decode eagerly")
    g.add_argument("--wmax", type=float, default=CKPT.w_max,
                   help="W_max of the selection plan (0: dense checkpoints)")
    g.add_argument("--load-policy", choices=values(LoadPolicy), default=CKPT.load_policy.value,
                   help="on a hit: zero-fill omitted units (nr) or refresh them by replaying "
                        "the last W_wr cached tokens (wr)")
    g.add_argument("--placement", choices=values(Placement), default=CKPT.placement.value,
                   help="TP-balanced placement of the stored units")
    g.add_argument("--int8-checkpoints", action="store_true", help="INT8 checkpoint payload")
    g.add_argument("--selection", choices=values(Selection), default=CKPT.selection.value,
                   help="decay-aware selection, or the count-matched random control")
    g.add_argument("--mask-seed", type=int, default=CKPT.mask_seed,
                   help="seed of --selection random")
    size = g.add_mutually_exclusive_group()
    size.add_argument("--state-budget-bytes", type=int, default=None,
                      help="checkpoint memory per rank; slots = floor(B / worst-rank bytes per "
                           "slot) - 1 (paper eq. 8) (default: --checkpoint-slots)")
    size.add_argument("--checkpoint-slots", type=int, default=None,
                      help=f"number of checkpoint slots (default: {DEFAULT_CHECKPOINT_SLOTS})")
    g.add_argument("--target-slots", type=int, default=None, metavar="N",
                   help="with --state-budget-bytes: choose W_max as the smallest whose "
                        "worst-rank slot fits N slots in that budget (dasc-plan --target-slots; "
                        "prints the capacity and the omitted fraction) (default: off, --wmax)")


def add_scheduling_flags(p: argparse.ArgumentParser) -> None:
    """``ServeConfig.scheduling``."""
    g = p.add_argument_group("scheduling and prefix cache")
    g.add_argument("--max-total-tokens", type=int, default=SCHED.max_total_tokens,
                   help="KV pool size in tokens (page size 1)")
    g.add_argument("--max-running-requests", type=int, default=SCHED.max_running_requests,
                   help="requests decoded together (active state slots)")
    g.add_argument("--chunked-prefill-size", type=int, default=None,
                   help=f"new tokens per step, decodes included (default: "
                        f"{DEFAULT_CHUNKED_PREFILL}, or derived with --step-target-ms)")
    g.add_argument("--step-target-ms", type=float, default=None,
                   help="derive --chunked-prefill-size from the prefill rate the ranks measure "
                        "at start-up: the tokens a step prefills in this time (64 to 8192), so "
                        "decodes never wait behind a whole long prompt (default: off)")
    g.add_argument("--checkpoint-interval", type=int, default=SCHED.checkpoint_interval,
                   help="store a checkpoint every N prompt tokens (0: at the prompt end only)")
    g.add_argument("--schedule-policy", choices=values(SchedulePolicyName),
                   default=SCHED.schedule_policy.value,
                   help="which prefill a step takes first: fcfs (arrival order) or lpm (shortest "
                        "remaining prefill after the cached prefix first, so hits do not wait "
                        "behind misses)")
    g.add_argument("--schedule-max-passes", type=int, default=SCHED.schedule_max_passes,
                   help="lpm's fairness bound: a request overtaken by this many later arrivals "
                        "goes first")
    g.add_argument("--prefill-mix-ratio", type=float, default=SCHED.prefill_mix_ratio,
                   help="lpm: a step holding prefill chunks defers a chunk more than this many "
                        "times longer than its longest one to the next step (0: never defer)")
    g.add_argument("--decode-interleave", type=int, default=SCHED.decode_interleave, metavar="N",
                   help="while requests decode, a step carries prefill only after N "
                        "decode-only steps, so a decode waits behind one prefill step in N + 1 "
                        "at most, and a prompt waits N decode steps at most (0: every step may "
                        "carry prefill)")
    g.add_argument("--batch-wait-ms", type=float, default=SCHED.batch_wait_ms, metavar="MS",
                   help="a step that would only start prompts (nothing decoding) waits up to "
                        "this long for more prompts: from the end of the step before when it "
                        "finished requests, else from the first prompt; prompts that arrive "
                        "together (clients sending their next turn at once) then prefill in one "
                        "step and decode in the same steps (0: never wait)")
    g.add_argument("--decode-first", choices=values(DecodeFirst),
                   default=SCHED.decode_first.value,
                   help="cost: while requests decode, a step defers prefill when the running "
                        "decodes, finished first, would delay the waiting prompts less than the "
                        "prefill would delay the decodes, by the ranks' measured step times; a "
                        "prompt waits less than its own prefill takes (off: never defer)")
    g.add_argument("--checkpoint-eviction", choices=values(CheckpointEviction),
                   default=SCHED.checkpoint_eviction.value,
                   help="which checkpoint a full pool drops: lru (least recently hit) or reuse "
                        "(recency plus the prefill a hit there saves over its nearest cached "
                        "ancestor)")
    g.add_argument("--checkpoint-admission", choices=values(CheckpointAdmission),
                   default=SCHED.checkpoint_admission.value,
                   help="where a prefill stores checkpoints: branch (every "
                        "--checkpoint-interval tokens, the prompt end and the point where the "
                        "prompt branches off a cached one, so a shared prefix of any length is "
                        "hit from its third sharer on, from its second when they are in flight "
                        "together), all (the interval and the prompt end) or "
                        "reuse (the prompt end and the branch point; the interval plays no part)")
    g.add_argument("--step-log", metavar="FILE", default=None,
                   help="append a line per step to FILE: when it started (Unix seconds), its "
                        "wall and rank-0 seconds, its id, each sequence as "
                        "rid:start+tokens (s: it samples; cN: N cuts inside it), and its "
                        "checkpoint loads and stores (default: off)")
    g.add_argument("--no-prefix-cache", action="store_true", help="never match nor store")
    g.add_argument("--no-cache-finished", action="store_true",
                   help="do not cache prompt + output when a request finishes")
    g.add_argument("--no-park-finished", action="store_true",
                   help="free a finished request's active state slot at once; by default it "
                        "stays in the prefix tree, exact, until an admission needs a slot, and "
                        "the conversation's next turn adopts it: no checkpoint load and no "
                        "dasc-wr refresh")


def byte_size(text: str) -> int:
    """An argparse type: bytes, with an optional binary suffix (K, M, G, T): "512M", "16G"."""
    units = {"": 1, "K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40}
    raw = text.strip().upper().removesuffix("IB").removesuffix("B")
    unit = raw[-1:] if raw[-1:] in units else ""
    try:
        value = float(raw[: len(raw) - len(unit)]) * units[unit]
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a byte size: {text!r} (e.g. 512M, 16G)") from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"a byte size must be positive, got {text!r}")
    return int(value)


def add_tier_flags(p: argparse.ArgumentParser) -> None:
    """``ServeConfig.tier``."""
    g = p.add_argument_group("second cache tier (a file-backed store behind the checkpoint pool)")
    g.add_argument("--cache-tier-dir", default=None, metavar="DIR",
                   help="keep prefixes evicted from the checkpoint pool (their KV rows and "
                        "checkpoint, in the server's checkpoint format) as files here, load them "
                        "back on a hit, and find them again after a restart with the same model "
                        "and settings (default: off)")
    g.add_argument("--cache-tier-bytes", type=byte_size,
                   default=f"{TIER.cache_tier_bytes >> 30}G", metavar="B",
                   help="the tier's size on disk, every rank's files together; bytes or a "
                        "suffixed size: 512M, 16G (default: %(default)s)")
    g.add_argument("--host-tier-bytes", type=byte_size, default=None, metavar="B",
                   help="keep the tier in host memory instead of files (pinned on CUDA), every "
                        "rank's entries together: faster loads, nothing kept across a restart; "
                        "not with --cache-tier-dir (default: off)")
    g.add_argument("--cache-tier-eviction", choices=values(TierEviction),
                   default=TIER.cache_tier_eviction.value,
                   help="which entry a full tier drops: lru (least recently used) or reuse "
                        "(recency plus the prefill a hit there saves per byte, over the longest "
                        "entry below it)")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    args = build_parser().parse_args(argv)
    # absolute from here on: /server_info and /get_model_info report it, and a client started
    # elsewhere (the SGLang gateway loading the tokenizer) must find the folder
    args.model = str(Path(args.model).resolve())
    if args.api_key is None:  # read here, so that --help never prints the key
        args.api_key = os.environ.get("DASC_API_KEY")
    return args


def serve_config(args: argparse.Namespace) -> ServeConfig:
    """The part of the flags that every process runs from (after ``validate``); W_max is
    --wmax, or the one --target-slots chooses."""
    a = args
    # every config checks its own values before --target-slots' plan search runs
    ranks = RankConfig(
        dtype=resolve_dtype(a.dtype, a.model, a.device), device=a.device,
        cpu_fp32_weights=a.cpu_fp32_weights, cpu_packed_weights=a.cpu_packed_weights == "on",
        cpu_huge_pages=a.cpu_huge_pages == "on", cpu_coded_weights=a.cpu_coded_weights == "on",
        cpu_lm_head_screen=a.cpu_lm_head_screen,
        cpu_amx_delta_rule=a.cpu_amx_delta_rule == "on",
        cpu_amx_attention=a.cpu_amx_attention == "on", cpu_threads=resolve_threads(a),
        cpu_bind=a.cpu_bind == "on",
        cuda_graph=not a.disable_cuda_graph, cuda_graph_max_bs=a.cuda_graph_max_bs,
        cuda_graph_max_context=a.cuda_graph_max_context,
        state_budget_bytes=a.state_budget_bytes, checkpoint_slots=a.checkpoint_slots)
    scheduling = SchedulingConfig(
        max_total_tokens=a.max_total_tokens, max_running_requests=a.max_running_requests,
        chunked_prefill_size=a.chunked_prefill_size, step_target_ms=a.step_target_ms,
        checkpoint_interval=a.checkpoint_interval, schedule_policy=a.schedule_policy,
        schedule_max_passes=a.schedule_max_passes, prefill_mix_ratio=a.prefill_mix_ratio,
        decode_interleave=a.decode_interleave, checkpoint_eviction=a.checkpoint_eviction,
        checkpoint_admission=a.checkpoint_admission, prefix_cache=not a.no_prefix_cache,
        cache_finished=not a.no_cache_finished, park_finished=not a.no_park_finished,
        decode_first=a.decode_first, batch_wait_ms=a.batch_wait_ms,
        step_log=str(Path(a.step_log).resolve()) if a.step_log else None)
    tier = CacheTierConfig(
        cache_tier_dir=str(Path(a.cache_tier_dir).resolve()) if a.cache_tier_dir else None,
        cache_tier_bytes=a.cache_tier_bytes, cache_tier_eviction=a.cache_tier_eviction,
        host_tier_bytes=a.host_tier_bytes)
    w_max = choose_w_max(a) if a.target_slots is not None else a.wmax
    checkpoints = CheckpointSpec(
        w_max=w_max, selection=a.selection, mask_seed=a.mask_seed, placement=a.placement,
        payload=Payload.INT8 if a.int8_checkpoints else Payload.FP32, load_policy=a.load_policy)
    return ServeConfig(model=a.model, ranks=ranks, scheduling=scheduling,
                       checkpoints=checkpoints, tier=tier)


def validate(args: argparse.Namespace) -> None:
    """What can be checked before any process starts and beyond one config's own values
    (the configs check those when ``serve_config`` builds them); raises with a one-line
    message."""
    from model_runner.config import ModelConfig
    from model_runner.model_files import check_tp, check_weight_files

    if args.tp < 1:
        raise ValueError(f"--tp must be at least 1 (got {args.tp})")
    model_dir = Path(args.model)
    cfg = ModelConfig.from_dir(model_dir)
    check_tp(cfg, args.tp, str(model_dir / "config.json"))
    check_weight_files(model_dir)
    for flag, port, low in (("--port", args.port, 0), ("--master-port", args.master_port, 1)):
        if not low <= port <= 65535:
            raise ValueError(f"{flag} must lie in [{low}, 65535] (got {port})")
    check_device(args)
    if args.target_slots is not None:
        if args.state_budget_bytes is None:
            raise ValueError("--target-slots needs --state-budget-bytes, the budget the slots "
                             "share")
        if args.wmax != 0 or args.selection != Selection.DASC.value:
            raise ValueError("--target-slots chooses W_max for dasc's selection: drop --wmax "
                             "and --selection")
    if args.step_log:
        folder = Path(args.step_log).resolve().parent
        if not folder.is_dir() or not os.access(folder, os.W_OK):
            raise ValueError(f"--step-log {args.step_log}: its folder does not exist or is "
                             "not writable")
    if args.tp % args.nnodes or not 0 <= args.node_rank < args.nnodes:
        raise ValueError(f"--tp {args.tp} must split evenly over --nnodes {args.nnodes}, and "
                         f"--node-rank must lie in [0, {args.nnodes})")
    if args.cpu_bind == "on":
        from model_runner.cpu_affinity import split_cpus

        if args.device != Device.CPU:
            raise ValueError("--cpu-bind on binds CPU ranks; with --device cuda leave it off")
        split_cpus(sorted(os.sched_getaffinity(0)), args.tp // args.nnodes,
                   resolve_threads(args))


def choose_w_max(args: argparse.Namespace) -> float:
    """--target-slots (checked by ``validate``): the W_max whose plan fits that many slots in
    --state-budget-bytes; raises ``PlanError`` (a ValueError) where none does."""
    from model_runner.compression.horizons import static_horizons
    from model_runner.compression.plan import ModelIdentity
    from model_runner.compression.target import plan_for_slots
    from model_runner.compression.weights import load_decay_params
    from model_runner.config import ModelConfig

    cfg = ModelConfig.from_dir(args.model)
    params = load_decay_params(args.model, cfg)
    fit = plan_for_slots(ModelIdentity.of(cfg, params), static_horizons(cfg, params), cfg,
                         args.tp, args.target_slots, args.state_budget_bytes,
                         int8=args.int8_checkpoints, placement=args.placement)
    print(f"dasc-serve: --target-slots {args.target_slots}: W_max {fit.plan.w_max:.9g}, "
          f"{fit.slots} slots of {fit.report.placements[0].slot_bytes:,} bytes per rank, "
          f"{fit.capacity:.2f}x the dense slots, {fit.omitted_fraction:.1%} of units omitted",
          file=sys.stderr, flush=True)
    return fit.plan.w_max


def check_device(args: argparse.Namespace) -> None:
    if args.device == Device.CPU:
        return
    import torch

    need, have = args.tp // args.nnodes, torch.cuda.device_count()
    if have < need:
        raise ValueError(f"--device cuda needs {need} CUDA device(s) on this node, "
                         f"{have} visible")
