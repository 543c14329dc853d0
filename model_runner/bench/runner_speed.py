"""Prefill throughput and decode step time of the runner (run as one rank or under torchrun).

    python -m model_runner.bench.runner_speed [--model DIR] [--prompt-len 1024] [--decode-batch 1 8]
        [--dtype float32|bfloat16] [--cuda-graph] [--mixed-chunks 64 --mixed-decodes 16]
        [--profile 20]
    torchrun --standalone --nproc-per-node 2 -m model_runner.bench.runner_speed ...

Rank 0 prints one JSON line for the machine (torch's CPU capability, whether the CPU has native
bf16 dot products), then one per measurement (median of --repeats).  ``--kernel-times`` adds
to each prefill and decode line the milliseconds spent inside each CPU kernel (``KERNELS``)
per forward, the median over the timed forwards.  ``--profile N`` adds the
torch profiler's top N operators by self time over one more prefill (with ``--mixed-chunks``,
over one more step of the first mixed chunk instead).  Real-shape models come from
``python -m model_runner.bench.real_shape_models``.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import statistics
import time
from collections import defaultdict

import torch

from kernels import native_build, prefill_attention
from kernels.delta_rule import cpu_chunk
from model_runner.batch import SeqInput
from model_runner.config import DEFAULT_MODEL
from model_runner.cpu_features import cpu_has_native_bf16
from model_runner.parallel import init_tp_group, rank_device, shutdown_tp_group
from model_runner.rank_args import fp32_weights
from model_runner.runner import ModelRunner, RunnerConfig

# The CPU kernels --kernel-times clocks, each where the model looks it up: (module, name).
KERNELS = {
    "delta_rule_chunk": ("model_runner.ops.linear_attention", "chunk_in_pool"),
    "delta_rule_decode": ("kernels.delta_rule.decode", "delta_rule_in_place"),
    "conv_prefill_sums": ("kernels.short_conv.naive", "conv_window_sums"),
    "conv_decode": ("kernels.short_conv.naive", "conv_in_place"),
    "attention_decode": ("model_runner.layers.attention", "attention_decode"),
    "attention_prefill": ("model_runner.layers.attention", "attention_prefill"),
    "moe_decode": ("model_runner.layers.mlp", "moe_decode"),
    "silu_mul": ("model_runner.layers.mlp", "silu_mul"),
    "gemv": ("model_runner.layers.linear", "gemv"),
}


class KernelClock:
    """Seconds inside each of ``KERNELS`` since the last ``take()``: each name in its module is
    replaced by a wrapper that times the call (this process only; off unless installed)."""

    def __init__(self) -> None:
        self.spent: dict[str, float] = defaultdict(float)
        for label, (module, name) in KERNELS.items():
            mod = importlib.import_module(module)
            setattr(mod, name, self._timed(label, getattr(mod, name)))

    def _timed(self, label: str, fn):
        def timed(*args, **kwargs):
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.spent[label] += time.perf_counter() - start
        return timed

    def take(self) -> dict[str, float]:
        spent, self.spent = self.spent, defaultdict(float)
        return spent


def kernel_ms(samples: list[dict[str, float]]) -> dict[str, float]:
    """Median milliseconds per forward of each kernel that ran."""
    labels = sorted({k for s in samples for k in s})
    return {k: round(1000 * statistics.median(s.get(k, 0.0) for s in samples), 3) for k in labels}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--model", default=str(DEFAULT_MODEL))
    p.add_argument("--prompt-len", type=int, default=1024)
    p.add_argument("--decode-batch", type=int, nargs="+", default=[1, 8])
    p.add_argument("--decode-steps", type=int, default=32)
    p.add_argument("--decode-context", type=int, default=64, metavar="N",
                   help="tokens each decoding sequence holds before its first timed step "
                        "(at most --prompt-len; default 64)")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--dtype", default="float32")
    p.add_argument("--device", default="cpu", help="cpu or cuda (one GPU per rank)")
    p.add_argument("--cpu-fp32-weights", choices=["auto", "on", "off"], default="auto",
                   help="as dasc-serve's flag: bf16 GEMM weights held in fp32")
    p.add_argument("--cpu-huge-pages", choices=["on", "off"], default="on",
                   help="as dasc-serve's flag: the weights a decode step streams in huge pages")
    p.add_argument("--cpu-lm-head-screen", choices=["auto", "on", "off"], default="auto",
                   help="as dasc-serve's flag: each decode step ends in its greedy tokens, from "
                        "the screened LM head where one is built, else from the full head's "
                        "logits (decode lines name which: lm_head)")
    p.add_argument("--cpu-packed-weights", choices=["on", "off"], default="on",
                   help="as dasc-serve's flag: oneDNN-packed copies of large linear weights "
                        "(bf16 on a CPU with native bf16, else fp32)")
    p.add_argument("--cpu-coded-weights", choices=["on", "off"], default="on",
                   help="as dasc-serve's flag: the decode GEMV streams coded copies of the "
                        "bf16 linear weights")
    p.add_argument("--native-kernels", choices=["on", "off", "alternate"], default="on",
                   help="the CPU decode C kernels (kernels/delta_rule, kernels/short_conv); "
                        "alternate: decode steps alternate off and on in this process, and "
                        "each decode line reports both (step_ms on, step_ms_off) (default: on)")
    p.add_argument("--delta-rule-amx", choices=["on", "off", "alternate"], default="on",
                   help="a bf16 model's chunked delta rule with its products on AMX where the "
                        "CPU has it (kernels/delta_rule/cpu_chunk.c), or in FP32; alternate: "
                        "the prefills alternate off and on, and the prefill line reports both "
                        "(seconds on, seconds_amx_off) (default: on)")
    p.add_argument("--attention-amx", choices=["on", "off", "alternate"], default="on",
                   help="a bf16 model's prefill attention in C on AMX where the CPU has it "
                        "(kernels/prefill_attention), or torch's; alternate as "
                        "--delta-rule-amx's (one of the two may alternate) (default: on)")
    p.add_argument("--mixed-chunks", type=int, nargs="*", default=[], metavar="C",
                   help="also time steps of one decode (batch 1) plus a C-token prefill chunk "
                        "of another sequence, as a serving step that mixes them")
    p.add_argument("--mixed-decodes", type=int, default=1, metavar="B",
                   help="decoding sequences beside each --mixed-chunks prefill chunk")
    p.add_argument("--kernel-times", action="store_true",
                   help="report the time inside each CPU kernel per prefill and decode step")
    p.add_argument("--profile", type=int, default=0, metavar="N",
                   help="print the top N operators of one prefill, or of one step of the "
                        "first --mixed-chunks size (torch profiler)")
    p.add_argument("--cuda-graph", action="store_true",
                   help="decode through model_runner.cuda_graph: replayed CUDA graphs on cuda, "
                        "the same fixed-shape step eagerly on cpu")
    args = p.parse_args()
    device = rank_device(args.device)
    tp = init_tp_group(device)
    page = 16
    if args.delta_rule_amx == args.attention_amx == "alternate":
        p.error("only one of --delta-rule-amx and --attention-amx may alternate")
    if any(not 0 < c <= args.prompt_len for c in args.mixed_chunks):
        p.error("--mixed-chunks must be in [1, --prompt-len]")
    if args.mixed_decodes < 1:
        p.error("--mixed-decodes must be at least 1")
    if not 0 < args.decode_context <= args.prompt_len:
        p.error("--decode-context must be in [1, --prompt-len]")
    max_batch = max(*args.decode_batch, args.mixed_decodes + 1 if args.mixed_chunks else 1)
    num_steps = args.decode_steps * (2 if args.native_kernels == "alternate" else 1)
    per_seq = -(-(args.prompt_len + num_steps + 1) // page)
    rc = RunnerConfig(args.model, dtype=args.dtype, device=str(device),
                      num_pages=per_seq * max_batch, page_size=page, num_state_slots=max_batch + 1,
                      cuda_graph_max_bs=max_batch if args.cuda_graph else 0,
                      fp32_weights=fp32_weights(args.cpu_fp32_weights),
                      packed_weights=args.cpu_packed_weights == "on",
                      huge_pages=args.cpu_huge_pages == "on",
                      coded_weights=args.cpu_coded_weights == "on",
                      lm_head_screen=args.cpu_lm_head_screen)
    runner = ModelRunner(rc, tp)
    decode_path = "eager"
    if args.cuda_graph:
        decode_path = "cuda-graph" if device.type == "cuda" else "fixed-shape eager"
    gen = torch.Generator().manual_seed(0)
    prompt = torch.randint(0, runner.vocab_size, (args.prompt_len,), generator=gen).tolist()
    tables = [list(range(i * per_seq, (i + 1) * per_seq)) for i in range(max_batch)]

    report(tp, kind="machine", cpu=torch.cpu.get_capabilities().get("cpu_name"),
           cpu_capability=torch.backends.cpu.get_cpu_capability(),
           native_bf16=cpu_has_native_bf16(), threads=torch.get_num_threads(),
           model=os.path.basename(os.path.normpath(args.model)), dtype=args.dtype,
           gemm_weight_bytes=runner.gemm_weight_bytes)
    clock = KernelClock() if args.kernel_times else None
    times, spent, times_off = [], [], []
    # the AMX form that alternates (at most one): its prefills off, then on
    alternate = "alternate" in (args.delta_rule_amx, args.attention_amx)
    modes = [False, True] if alternate else [True]
    for _ in range(args.repeats):
        for amx in modes:
            set_amx_forms(args, amx)
            tp.barrier()
            if clock:
                clock.take()
            start = time.perf_counter()
            runner.forward([SeqInput(prompt, 0, tables[0], 1)])
            sync(device)
            (times_off if alternate and not amx else times).append(time.perf_counter() - start)
            if clock and not (alternate and not amx):
                spent.append(clock.take())
    set_amx_forms(args, True)
    report(tp, kind="prefill", tp_size=tp.size, device=str(device), tokens=args.prompt_len,
           seconds=statistics.median(times),
           tokens_per_s=args.prompt_len / statistics.median(times),
           **({"seconds_amx_off": statistics.median(times_off)} if times_off else {}),
           **({"kernel_ms": kernel_ms(spent)} if clock else {}))

    if args.profile and tp.is_first and not args.mixed_chunks:
        from torch.profiler import profile

        with profile() as prof:
            runner.forward([SeqInput(prompt, 0, tables[0], 1)])
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=args.profile),
              flush=True)

    short = prompt[: args.decode_context]
    native_build.set_enabled(args.native_kernels != "off")
    for batch in args.decode_batch:
        seqs = [SeqInput(short, 0, tables[i], i + 1) for i in range(batch)]
        runner.forward(seqs)
        steps: dict[bool, list[float]] = {True: [], False: []}
        spent = []  # the kernels' times of the steps with the kernels on
        for i in range(num_steps):
            native = args.native_kernels == "on" or (args.native_kernels == "alternate"
                                                     and i % 2 == 1)
            native_build.set_enabled(native)
            for s in seqs:
                s.prefix_len += len(s.token_ids)
                s.token_ids = [7]
            tp.barrier()
            if clock:
                clock.take()
            start = time.perf_counter()
            greedy_step(runner, seqs)
            sync(device)
            steps[native].append(time.perf_counter() - start)
            if clock and native:
                spent.append(clock.take())
        timed = {f"step_ms{'' if native else '_off'}": 1000 * statistics.median(ts)
                 for native, ts in steps.items() if ts}
        if clock:
            timed["kernel_ms"] = kernel_ms(spent)
        report(tp, kind="decode", tp_size=tp.size, device=str(device), batch=batch,
               context=args.decode_context, decode_path=decode_path,
               lm_head="screened" if runner.screened_head is not None else "full", **timed)
    native_build.set_enabled(args.native_kernels != "off")
    for chunk in args.mixed_chunks:
        # B sequences decode at their contexts; another (its own slot) prefills `chunk` tokens
        decodes = [SeqInput([7], len(short) + num_steps, tables[i], i + 1)
                   for i in range(args.mixed_decodes)]
        b = args.mixed_decodes
        step = [*decodes, SeqInput(prompt[:chunk], 0, tables[b], b + 1)]
        if b > max(args.decode_batch):  # contexts the decode phase did not write
            runner.forward([SeqInput(short, 0, tables[i], i + 1) for i in range(b)])
        steps = []
        for _ in range(args.repeats):
            tp.barrier()
            start = time.perf_counter()
            runner.forward(step)
            sync(device)
            steps.append(time.perf_counter() - start)
        report(tp, kind="mixed", tp_size=tp.size, device=str(device), chunk=chunk,
               decodes=b, step_ms=1000 * statistics.median(steps))
        if args.profile and tp.is_first and chunk == args.mixed_chunks[0]:
            from torch.profiler import profile

            with profile() as prof:
                runner.forward(step)
            print(prof.key_averages().table(sort_by="self_cpu_time_total",
                                            row_limit=args.profile), flush=True)
    shutdown_tp_group(tp)


def set_amx_forms(args: argparse.Namespace, alternated: bool) -> None:
    """The delta rule's and the prefill attention's AMX forms as their flags say; the one
    that alternates ``alternated``."""
    for flag, set_amx in ((args.delta_rule_amx, cpu_chunk.set_amx),
                          (args.attention_amx, prefill_attention.set_amx)):
        set_amx(alternated if flag == "alternate" else flag == "on")


def greedy_step(runner: ModelRunner, seqs: list[SeqInput]) -> list[int]:
    """One decode step to its greedy tokens, as a serving rank takes them for greedy rows: the
    screened LM head where the runner has one (and it answers), else the full head's argmax."""
    if runner.screened_head is None:
        return runner.forward(seqs).max(dim=-1).indices.tolist()
    hidden = runner.forward(seqs, head=False)
    tokens = runner.greedy(hidden)
    return tokens if tokens is not None else \
        runner.head_logits(hidden).max(dim=-1).indices.tolist()


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def report(tp, **fields) -> None:
    if tp.is_first:
        print(json.dumps(fields), flush=True)


if __name__ == "__main__":
    main()
