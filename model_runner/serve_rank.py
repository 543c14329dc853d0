"""One serving rank: ``python -m model_runner.serve_rank --config JSON ...`` under torchrun (or
alone at TP=1).

The rank builds the runner, the selection plan and the checkpoint pool from the ``ServeConfig``
the launcher built, then executes the ``BatchPlan``s the scheduler sends.  Only rank 0 talks to
the scheduler; it republishes each plan to the other ranks with a torch.distributed broadcast,
so every rank runs the same plans in the same order (SPMD), and it alone samples and replies.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from pathlib import Path

import torch

from kernels import cpu_fused, lm_head, prefill_attention
from kernels.delta_rule import cpu_chunk
from kernels.delta_rule import cpu_decode as delta_decode
from kernels.ragged_state import native as ragged_native
from kernels.short_conv import cpu as conv_native
from model_runner import cpu_affinity
from model_runner.batch import SeqInput
from model_runner.checkpoints.pool import CheckpointFormat
from model_runner.compression.accounting import dense_slot_bytes, report_plan, slots_at_budget
from model_runner.compression.horizons import static_horizons
from model_runner.compression.placement import placement_head_order
from model_runner.compression.plan import ModelIdentity, SelectionPlan, dasc_plan, random_plan
from model_runner.compression.weights import load_decay_params
from model_runner.config import ModelConfig
from model_runner.cpu_features import emulated_bf16_note
from model_runner.grammar import TokenizerCache
from model_runner.host_memory import keep_freed_memory
from model_runner.parallel import TPGroup, init_tp_group, rank_device, shutdown_tp_group
from model_runner.processes import exit_now
from model_runner.rank_args import fp32_weights
from model_runner.runner import ModelRunner, RunnerConfig
from model_runner.sampling import LogitControlTable, Sampled, sample_tokens, target_logprobs
from model_runner.tier_store import TierStore, fingerprint, kv_bytes_per_token
from scheduler.wire import ipc
from scheduler.wire.messages import Shutdown
from scheduler.wire.rank_messages import (
    BatchPlan,
    RankInfo,
    RowTables,
    Sample,
    SeqStep,
    StepResult,
)
from scheduler.wire.serve_config import (
    DEFAULT_CHECKPOINT_SLOTS,
    CheckpointSpec,
    Payload,
    RankConfig,
    Selection,
    ServeConfig,
)


def build_plan(model_dir: str, cfg: ModelConfig, spec: CheckpointSpec) -> SelectionPlan:
    """Needs only the config and the decay weights, so hybrid placement can load the model in
    the permuted head order the plan asks for."""
    params = load_decay_params(model_dir, cfg)
    horizons = static_horizons(cfg, params)
    plan = dasc_plan(ModelIdentity.of(cfg, params), horizons, spec.w_max)
    if spec.selection is Selection.RANDOM and spec.w_max > 0:
        plan = random_plan(plan, horizons, spec.mask_seed)
    return plan


def max_context_len(model_dir: str) -> int:
    raw = json.loads((Path(model_dir) / "config.json").read_text())
    return int(raw.get("max_position_embeddings") or raw.get("model_max_length") or 8192)


def graph_max_bs(ranks: RankConfig, max_running_requests: int, device: torch.device) -> int:
    """CUDA graphs for decode by default on cuda only (0: eager decode)."""
    if device.type != "cuda" or not ranks.cuda_graph:
        return 0
    return min(ranks.cuda_graph_max_bs, max_running_requests)


def checkpoint_slots(ranks: RankConfig, slot_bytes: int) -> int:
    if ranks.checkpoint_slots is not None:
        return ranks.checkpoint_slots
    if ranks.state_budget_bytes is not None:
        return slots_at_budget(ranks.state_budget_bytes, slot_bytes)
    return DEFAULT_CHECKPOINT_SLOTS


def start(config: ServeConfig) -> tuple[ModelRunner, TPGroup, RankInfo]:
    ranks, sched, spec = config.ranks, config.scheduling, config.checkpoints
    cpu_chunk.set_amx(ranks.cpu_amx_delta_rule)  # before the warm-up's and the fingerprint's use
    prefill_attention.set_amx(ranks.cpu_amx_attention)
    device = rank_device(ranks.device)
    tp = init_tp_group(device)
    cfg = ModelConfig.from_dir(config.model)
    rc = RunnerConfig(config.model, dtype=ranks.dtype, device=str(device),
                      num_pages=sched.max_total_tokens, page_size=1,
                      num_state_slots=sched.num_state_slots,
                      cuda_graph_max_bs=graph_max_bs(ranks, sched.max_running_requests, device),
                      cuda_graph_max_context=ranks.cuda_graph_max_context,
                      fp32_weights=fp32_weights(ranks.cpu_fp32_weights),
                      packed_weights=ranks.cpu_packed_weights,
                      huge_pages=ranks.cpu_huge_pages,
                      coded_weights=ranks.cpu_coded_weights,
                      lm_head_screen=ranks.cpu_lm_head_screen.value)
    plan = build_plan(config.model, cfg, spec)
    placement = spec.placement.value  # the compression modules take plain strings
    head_order = placement_head_order(plan, cfg, tp.size, placement)
    runner = ModelRunner(rc, tp, head_order)
    report = report_plan(plan, cfg, tp.size, int8=spec.payload is Payload.INT8,
                         placements=(placement,))
    slot_bytes = report.placements[0].slot_bytes
    num_slots = checkpoint_slots(ranks, slot_bytes)
    if num_slots < 1:
        raise ValueError(f"the state budget holds no checkpoint slot ({slot_bytes} bytes each)")
    runner.attach_checkpoints(plan, num_slots, CheckpointFormat(payload=spec.payload.value,
                                                                placement=placement))
    warm_up(runner, 0 if runner.weight_bytes < WARM_UP_MIN_BYTES else
            min(WARM_UP_TOKENS, sched.max_total_tokens - 1, max_context_len(config.model) - 1))
    info = RankInfo(cfg.architecture, tp.size, cfg.vocab_size, cfg.eos_token_id,
                    max_context_len(config.model), num_slots, slot_bytes,
                    dense_slot_bytes(cfg, tp.size), plan.refresh_window,
                    measure_prefill_rate(runner, min(PROBE_TOKENS, sched.max_total_tokens))
                    if sched.step_target_ms else 0.0, weight_bytes=runner.weight_bytes)
    if config.tier.enabled:
        directory = config.tier.cache_tier_dir
        info.tier_fingerprint = fingerprint(config, runner, tp.size) if directory else "memory"
        info.kv_bytes_per_token = kv_bytes_per_token(runner)
        info.tier_slot_bytes = runner.checkpoints.nbytes_per_slot()
        runner.tier = TierStore(Path(directory) if directory else None, info.tier_fingerprint,
                                runner)
    return runner, tp, info


PROBE_TOKENS = 128
# A start-up prefill this long, then a decode step, so that the first request does not pay for
# first use: the C kernels built or loaded, oneDNN's kernels generated for the step's shapes,
# the activations' memory faulted in.  Without it the first 1,400-token prompt at
# Qwen3.5-0.8B's shape on the 2-core VM took 7.0 s against 2.9 s for the next.
WARM_UP_TOKENS = 2048
# Models smaller than this skip the warm-up forwards (their first use costs little; the
# built-in tiny models' 0.2 s of start-up CPU made timing tests on a busy 2-core machine flaky).
WARM_UP_MIN_BYTES = 64 * 2**20


def warm_up(runner: ModelRunner, num_tokens: int) -> None:
    """The C libraries loaded; then, for ``num_tokens`` > 0, one prefill of ``num_tokens`` and
    one decode step on every rank (SPMD), into KV rows [0, num_tokens] and state slot 1, which
    nothing holds yet; the slot is left zeroed."""
    for library in (cpu_chunk.native_library, delta_decode.native_library,
                    conv_native.native_library, cpu_fused.native_library,
                    ragged_native.native_library, lm_head.native_library,
                    prefill_attention.native_library):
        library()  # built on first use: now, not in the first request
    if num_tokens < 1:
        return
    ids = [i % runner.vocab_size for i in range(num_tokens)]
    runner.forward([SeqInput(ids, 0, list(range(num_tokens)), 1)])
    runner.forward([SeqInput([ids[-1]], num_tokens, list(range(num_tokens + 1)), 1)])
    if runner.device.type == "cuda":
        torch.cuda.synchronize()
    runner.zero_state(1)


def measure_prefill_rate(runner: ModelRunner, num_tokens: int) -> float:
    """Tokens per second of one timed prefill of ``num_tokens`` (after one untimed warm-up), on
    every rank (SPMD); it writes KV rows [0, n) and state slot 1, which nothing holds yet, and
    leaves the slot zeroed."""
    ids = [i % runner.vocab_size for i in range(num_tokens)]
    step = [SeqInput(ids, 0, list(range(num_tokens)), 1)]
    runner.forward(step)
    if runner.device.type == "cuda":
        torch.cuda.synchronize()
    started = time.perf_counter()
    runner.forward(step)
    if runner.device.type == "cuda":
        torch.cuda.synchronize()
    elapsed = time.perf_counter() - started
    runner.zero_state(1)
    return num_tokens / max(elapsed, 1e-9)


def row_tables(runner: ModelRunner) -> RowTables:
    """The rank's copies of the running requests' KV-row tables, as int64 tensors on the
    runner's device, each checked against the KV pool once and uploaded once, when the plan
    that carries it arrives; steps then name only their request, so ``execute`` neither checks
    nor uploads a table per step."""
    return RowTables(lambda table: runner.check_page_table(table).to(runner.device))


def execute(runner: ModelRunner, plan: BatchPlan, tables: RowTables,
            controls: LogitControlTable | None = None) -> tuple[list[int], list[float]]:
    """``execute_plan``'s sampled tokens and their logprobs, without the top logprobs."""
    sampled = execute_plan(runner, plan, tables, controls)
    return sampled.token_ids, sampled.logprobs


def execute_plan(runner: ModelRunner, plan: BatchPlan, tables: RowTables,
                 controls: LogitControlTable | None = None) -> Sampled:
    """Run one plan in the order BatchPlan documents; what rank 0 sampled (empty elsewhere).
    ``tables`` comes from ``row_tables`` (checked on arrival) and the token ids from the
    scheduler, which checks every prompt, and the sampler.  ``controls``: rank 0's logit
    controls, kept across plans like the row tables (None: a fresh table for this plan)."""
    tables.apply(plan)
    controls = LogitControlTable() if controls is None else controls
    controls.release(plan.release)

    def seq(s: SeqStep) -> SeqInput:
        return SeqInput(s.token_ids, s.prefix_len, tables.rows(s.rid), s.state_slot,
                        s.snapshots)

    if plan.stores_before:
        runner.store_checkpoints(*_unzip(plan.stores_before))
    if plan.loads:
        ckpt, active = _unzip(plan.loads)
        runner.load_checkpoints(ckpt, active)
    # dasc-wr replays run inside the step's forward, ahead of its sequences (``batch.Refresh``)
    refresh = (runner.replays([seq(s) for s in plan.refresh], plan.refresh_scratch)
               if plan.refresh else None)
    sampled = Sampled([], [], [], [])
    if plan.seqs or refresh is not None:
        # logits of the sequences that sample only (none for a chunk inside a prompt); echo:
        # every position's, only in steps with a sequence that asks (lm_head over all the
        # step's tokens; rank 0 reads only the rows that asked)
        all_logits = any(s.logprob_targets for s in plan.seqs)
        rows = [i for i, s in enumerate(plan.seqs) if s.sample is not None]
        rids = [plan.seqs[i].rid for i in rows]
        specs = [plan.seqs[i].sample for i in rows]
        screen = (runner.screened_head is not None and bool(rows) and not all_logits
                  and all(_plain_greedy(spec) for spec in specs) and not controls.holds(rids))
        logits = runner.forward([seq(s) for s in plan.seqs], all_logits=all_logits,
                                refresh=refresh, inputs_checked=True, logits_of=rows,
                                head=not screen)
        if screen:  # one rank: ``logits`` are the hidden states the head reads
            tokens = runner.greedy(logits)
            if tokens is not None:
                sampled = Sampled(tokens, [math.nan] * len(tokens), [], [])
                rows = []
            else:
                logits = runner.head_logits(logits)
        if runner.tp.is_first:
            if all_logits:
                logits, sampled = _last_rows(logits, plan.seqs), _targets(logits, plan.seqs)
                logits = logits[rows]  # rows ascend
            if rows:
                got = sample_tokens(logits, specs, controls.for_batch(rids, specs, logits))
                sampled = got._replace(target_logprobs=sampled.target_logprobs,
                                       target_top_ids=sampled.target_top_ids,
                                       target_top_logprobs=sampled.target_top_logprobs)
    if plan.stores_after:
        runner.store_checkpoints(*_unzip(plan.stores_after))
    return sampled


def _plain_greedy(spec: Sample) -> bool:
    """A row whose token is its logits' argmax and which reports nothing else: the screened
    LM head may give it (``ModelRunner.greedy``)."""
    return (spec.temperature <= 0 and not spec.logprob and not spec.num_top_logprobs
            and spec.controls is None)


def _starts(seqs: list[SeqStep]) -> list[int]:
    """Row of each sequence's first token in all-logits order (sequence-major)."""
    starts, row = [], 0
    for s in seqs:
        starts.append(row)
        row += len(s.token_ids)
    return starts


def _last_rows(logits: torch.Tensor, seqs: list[SeqStep]) -> torch.Tensor:
    """[num_tokens, vocab] -> [num_seqs, vocab]: each sequence's last token."""
    last = [start + len(s.token_ids) - 1 for start, s in zip(_starts(seqs), seqs)]
    return logits[torch.tensor(last, dtype=torch.long, device=logits.device)]


def _targets(logits: torch.Tensor, seqs: list[SeqStep]) -> Sampled:
    """Prompt logprobs of the sequences with ``logprob_targets``: row start + i predicts
    target i."""
    lps, top_ids, top_lps = [], [], []
    for start, s in zip(_starts(seqs), seqs):
        if s.logprob_targets:
            n = len(s.logprob_targets)
            got = target_logprobs(logits[start : start + n], s.logprob_targets,
                                  s.num_top_targets)
            lps.append(got[0])
            top_ids.append(got[1])
            top_lps.append(got[2])
    return Sampled([], [], [], [], lps, top_ids, top_lps)


def _unzip(pairs: list[tuple[int, int]]) -> tuple[list[int], list[int]]:
    return [a for a, _ in pairs], [b for _, b in pairs]


def serve(runner: ModelRunner, tp: TPGroup, info: RankInfo, port: int) -> None:
    conn, tables = None, row_tables(runner)
    controls = LogitControlTable(TokenizerCache(runner.rc.model_dir, info.vocab_size,
                                                info.eos_token_id))
    if tp.is_first:
        conn = ipc.connect(port)
        ipc.send(conn, info)
    while True:
        msg = _next_plan(conn) if tp.is_first else None
        msg = tp.broadcast_object(msg)
        if isinstance(msg, Shutdown):
            return
        started, screened = time.perf_counter(), runner.screened_tokens
        tier = runner.tier
        fetch_failed, fetch_s = [], 0.0
        if tier is not None:  # before the plan: its rows and slots may be reused by it
            if msg.tier_free:
                tier.free(msg.tier_free)
            tier.spill(msg.spills)
        sampled = execute_plan(runner, msg, tables, controls)
        if tier is not None and msg.fetches:  # after it: a store may reuse a fetch's slot
            fetch_failed, fetch_s = tier.fetch(msg.fetches)
        written, write_failed = tier.collect(msg.tier_sync) if tier is not None else ([], [])
        if tp.is_first:
            ipc.send(conn, StepResult(msg.step_id, sampled.token_ids,
                                      time.perf_counter() - started, sampled.logprobs,
                                      sampled.top_ids, sampled.top_logprobs,
                                      sampled.target_logprobs, sampled.target_top_ids,
                                      sampled.target_top_logprobs, written, write_failed,
                                      fetch_failed, fetch_s, runner.screened_tokens - screened))


def _next_plan(conn) -> object:
    """The scheduler's next message; its loss stops every rank in step (no rank is left
    waiting in a collective)."""
    try:
        return ipc.recv(conn)
    except (EOFError, OSError):
        return Shutdown()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m model_runner.serve_rank",
                                description="A dasc serving rank (started by dasc-serve).")
    p.add_argument("--scheduler-port", type=int, required=True, help="rank 0 connects here")
    p.add_argument("--config", required=True, help="the ServeConfig, as JSON")
    args = p.parse_args(argv)
    rank = os.environ.get("RANK", "0")
    try:
        config = ServeConfig.from_json(args.config)
    except ValueError as e:
        print(f"error: rank {rank}: {e}", file=sys.stderr, flush=True)
        return 2
    ranks = config.ranks
    if ranks.cpu_bind:  # this rank's own CPUs, before its threads start
        cpu_affinity.bind_rank()
    torch.set_num_threads(ranks.cpu_threads)  # dasc-serve set OMP_NUM_THREADS to it too
    if ranks.device == "cpu":
        keep_freed_memory()
    note = emulated_bf16_note(ranks.device, ranks.dtype, ranks.cpu_fp32_weights)
    if note and rank == "0":
        print(note, file=sys.stderr, flush=True)
    try:
        runner, tp, info = start(config)
        with torch.inference_mode():
            serve(runner, tp, info, args.scheduler_port)
    except (EOFError, ConnectionError):
        return 0  # the scheduler went away: the server is stopping
    except Exception as e:  # noqa: BLE001 - one line naming the rank, then a non-zero exit
        print(f"error: rank {rank}: {type(e).__name__}: {e}", file=sys.stderr, flush=True)
        return 1
    shutdown_tp_group(tp)
    return 0


if __name__ == "__main__":
    exit_now(main())  # the process group is left and the scheduler's socket closed
