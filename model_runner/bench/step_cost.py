"""Per-step cost of a real config on one tensor-parallel rank: weight bytes read and FLOPs per
decode step and per prefill token, eager path vs the fixed-shape (CUDA-graph) path.

    python -m model_runner.bench.step_cost [--config DIR ...] [--tp 1 8] [--batch 1 8 64]
        [--context 4096] [--bytes-per-param 2] [--chunk 2048]

Pure arithmetic from config.json (defaults: Qwen3-Next-80B-A3B and Kimi-Linear-48B-A3B from
``tests/data/configs``), no weights.  Paths, per rank:
- ``eager``: routed experts grouped by a host-side sort; each distinct routed expert is read
  once per step (expected distinct count under uniform routing, E (1 - (1 - k/E)^B)).
- ``graph, all experts``: the fixed-shape form that runs every expert on every token.
- ``graph``: the fixed-shape form now (``model_runner.layers.mlp.uses_gathered_experts`` with
  the CUDA limit): each (token, slot) pair reads its expert's rows, B k expert reads, until the
  batch passes the limit and the all-experts form takes over.
Decode attention: MLA decode is absorbed on both paths now (the latent row is read, never
expanded; ``expanded`` columns show what it cost before); the graph path reads the padded
context bucket.  Linear-attention state (fp32, read and written every step) is reported apart
from weights.  Prefill runs eagerly on both paths: one prompt of ``--context`` tokens in chunks
of ``--chunk``, every expert touched per chunk, MLA rows expanded once per chunk.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from model_runner.config import ModelConfig
from model_runner.cuda_graph import context_bucket
from model_runner.layers.mlp import uses_gathered_experts

CONFIGS = Path(__file__).resolve().parents[2] / "tests" / "data" / "configs"
DEFAULT = [CONFIGS / "qwen3-next-80b-a3b-instruct", CONFIGS / "kimi-linear-48b-a3b-instruct"]


def mixer_params(cfg: ModelConfig, kind: str, tp: int) -> int:
    """Weights of one attention/linear-attention mixer on one rank."""
    h = cfg.hidden_size
    if kind == "linear_attention" and cfg.is_kda:
        inner = cfg.linear_num_value_heads * cfg.linear_value_head_dim // tp
        d = cfg.linear_key_head_dim
        return (3 * h * inner + 3 * inner * cfg.linear_conv_kernel_dim + 2 * (h * d + d * inner)
                + h * cfg.linear_num_value_heads // tp + inner * h)
    if kind == "linear_attention":
        qk = cfg.linear_num_key_heads * cfg.linear_key_head_dim // tp
        v = cfg.linear_num_value_heads * cfg.linear_value_head_dim // tp
        conv = 2 * qk + v
        return (h * (conv + v) + h * 2 * cfg.linear_num_value_heads // tp
                + conv * cfg.linear_conv_kernel_dim + v * h)
    heads = cfg.num_attention_heads // tp
    if cfg.is_kda:  # MLA, no q-LoRA
        return (h * heads * cfg.mla_qk_head_dim + h * (cfg.kv_lora_rank + cfg.qk_rope_head_dim)
                + cfg.kv_lora_rank * heads * (cfg.qk_nope_head_dim + cfg.v_head_dim)
                + heads * cfg.v_head_dim * h)
    kv = kv_heads(cfg, tp)
    return h * heads * 2 * cfg.head_dim + 2 * h * kv * cfg.head_dim + heads * cfg.head_dim * h


def kv_heads(cfg: ModelConfig, tp: int) -> int:
    """Qwen's KV heads per rank: a rank holds the KV heads its query heads use."""
    return max(1, cfg.num_key_value_heads // tp)


def expert_params(cfg: ModelConfig, tp: int) -> int:
    return 3 * cfg.hidden_size * cfg.moe_intermediate_size // tp


def lm_head_params(cfg: ModelConfig, tp: int) -> int:
    return -(-cfg.vocab_size // tp) * cfg.hidden_size


def fixed_params(cfg: ModelConfig, tp: int) -> int:
    """Every weight a decode step reads but the routed experts, one rank: mixers, dense MLPs,
    routers, shared experts, the LM head (the embedding contributes B rows: left out)."""
    h, total = cfg.hidden_size, lm_head_params(cfg, tp)
    for kind, mlp in zip(cfg.layer_types, cfg.mlp_types):
        total += mixer_params(cfg, kind, tp)
        if mlp == "dense":
            total += 3 * h * cfg.intermediate_size // tp
        else:
            total += h * cfg.num_experts + 3 * h * cfg.shared_expert_intermediate_size // tp
    return total


def num_moe_layers(cfg: ModelConfig) -> int:
    return sum(m == "sparse" for m in cfg.mlp_types)


def attention_cost(cfg: ModelConfig, tp: int, ctx: int, bpp: int, absorbed: bool
                   ) -> tuple[float, float]:
    """(cache bytes read, FLOPs) of one decode query at context ``ctx``, all full layers."""
    layers = len(cfg.full_layer_ids)
    heads = cfg.num_attention_heads // tp
    if not cfg.is_kda:
        d = cfg.head_dim
        return (layers * ctx * 2 * kv_heads(cfg, tp) * d * bpp, layers * 4 * heads * ctx * d)
    lora, rope = cfg.kv_lora_rank, cfg.qk_rope_head_dim
    nope, dv = cfg.qk_nope_head_dim, cfg.v_head_dim
    read = ctx * (lora + rope) * bpp
    if absorbed:
        flops = 2 * heads * (nope * lora + ctx * (2 * lora + rope) + lora * dv)
    else:  # every row expanded into K and V, then attention over 192 / 128 wide heads
        flops = 2 * ctx * (lora * heads * (nope + dv) + heads * (nope + rope + dv))
        read += 2 * ctx * heads * (nope + rope + dv) * bpp  # K, V written and read again
    return layers * read, layers * flops


def state_bytes(cfg: ModelConfig, tp: int) -> int:
    """Linear-attention state read + written per decoded token (fp32)."""
    per_layer = (cfg.linear_num_value_heads // tp) * cfg.linear_key_head_dim \
        * cfg.linear_value_head_dim * 4
    return 2 * cfg.num_linear_layers * per_layer


def decode_rows(cfg: ModelConfig, tp: int, batch: int, ctx: int, bpp: int) -> list[list]:
    e, k = cfg.num_experts, cfg.num_experts_per_tok
    fixed, expert, moe = fixed_params(cfg, tp), expert_params(cfg, tp), num_moe_layers(cfg)
    distinct = e * (1 - (1 - k / e) ** batch)
    gathered = uses_gathered_experts(batch, cfg, "cuda")
    graph_reads = batch * k if gathered else e
    att_eager = attention_cost(cfg, tp, ctx, bpp, absorbed=True)
    att_graph = attention_cost(cfg, tp, context_bucket(ctx), bpp, absorbed=True)
    att_old = attention_cost(cfg, tp, context_bucket(ctx), bpp, absorbed=False)
    rows = []
    for path, reads, flops_experts, att in (
            ("eager", distinct, batch * k, att_eager),
            ("graph, all experts (before)", e, batch * e, att_old),
            ("graph" + (" (gathered)" if gathered else " (all experts)"), graph_reads,
             batch * (k if gathered else e), att_graph)):
        weights = (fixed + moe * reads * expert) * bpp
        flops = batch * (2 * fixed + att[1]) + moe * flops_experts * 2 * expert
        rows.append([path, batch, f"{reads:.1f}", gb(weights), gb(moe * reads * expert * bpp),
                     gb(batch * att[0]), gb(batch * state_bytes(cfg, tp)), tflop(flops)])
    return rows


def prefill_row(cfg: ModelConfig, tp: int, ctx: int, chunk: int, bpp: int) -> list:
    """Per prompt token of one ``ctx``-token prompt in chunks of ``chunk``: weights read once
    per chunk (the experts its tokens route to), the LM head on a chunk's last token only;
    attention over a mean context of ctx / 2; MLA expands rows [0, end) for every chunk."""
    e, k, moe = cfg.num_experts, cfg.num_experts_per_tok, num_moe_layers(cfg)
    expert, fixed, head = expert_params(cfg, tp), fixed_params(cfg, tp), lm_head_params(cfg, tp)
    chunk = min(chunk, ctx)
    num_chunks = -(-ctx // chunk)
    touched = e * (1 - (1 - k / e) ** chunk)
    weights = (fixed + moe * touched * expert) * bpp / chunk
    flops = 2 * (fixed - head) + 2 * head / chunk + moe * k * 2 * expert
    heads, full = cfg.num_attention_heads // tp, len(cfg.full_layer_ids)
    if cfg.is_kda:
        nope, rope, dv, lora = (cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim,
                                cfg.kv_lora_rank)
        rows_per_token = (num_chunks + 1) / 2  # chunk i expands i * chunk rows
        flops += full * (rows_per_token * 2 * lora * heads * (nope + dv)
                         + 2 * heads * (ctx / 2) * (nope + rope + dv))
    else:
        flops += full * 4 * heads * (ctx / 2) * cfg.head_dim
    return ["prefill (eager; no graph)", f"per token, chunk {chunk}", f"{touched:.1f}",
            gb(weights), gb(moe * touched * expert * bpp / chunk), "", "", tflop(flops)]


def gb(x: float) -> str:
    return f"{x / 1e9:.3f}"


def tflop(x: float) -> str:
    return f"{x / 1e12:.4f}"


HEADER = ["path", "batch", "experts read / MoE layer", "weights GB", "of which experts GB",
          "KV read GB", "linear state GB", "TFLOP"]


def report(cfg: ModelConfig, name: str, tp: int, batches: list[int], ctx: int, chunk: int,
           bpp: int) -> str:
    lines = [f"### {name}, TP {tp} (one rank, {bpp}-byte weights, context {ctx})", "",
             "| " + " | ".join(HEADER) + " |", "|" + "---|" * len(HEADER)]
    for b in batches:
        lines += ["| " + " | ".join(map(str, r)) + " |" for r in decode_rows(cfg, tp, b, ctx, bpp)]
    lines.append("| " + " | ".join(map(str, prefill_row(cfg, tp, ctx, chunk, bpp))) + " |")
    return "\n".join(lines) + "\n"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--config", type=Path, nargs="+", default=DEFAULT)
    p.add_argument("--tp", type=int, nargs="+", default=[1, 8])
    p.add_argument("--batch", type=int, nargs="+", default=[1, 8, 64])
    p.add_argument("--context", type=int, default=4096)
    p.add_argument("--chunk", type=int, default=2048)
    p.add_argument("--bytes-per-param", type=int, default=2)
    a = p.parse_args()
    for path in a.config:
        cfg = ModelConfig.from_dir(path)
        for tp in a.tp:
            print(report(cfg, path.name, tp, a.batch, a.context, a.chunk, a.bytes_per_param))


if __name__ == "__main__":
    main()
