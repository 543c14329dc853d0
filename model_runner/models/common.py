"""Parts shared by the hybrid architectures: step context, the recurrent-state plumbing of a
linear-attention layer, the decoder layer, and the causal-LM shell with its name mapping."""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from kernels.delta_rule.cpu_chunk import chunk_runs
from kernels.short_conv.naive import conv_decode_into, conv_varlen
from model_runner.batch import ForwardBatch, Snapshots
from model_runner.compression.placement import check_head_order, owned_bundles
from model_runner.config import ModelConfig
from model_runner.layers.linear import ParallelLMHead, VocabParallelEmbedding
from model_runner.layers.mlp import DenseMLP, SparseMoE
from model_runner.layers.norm import RMSNorm
from model_runner.ops.linear_attention import (
    delta_rule_decode,
    delta_rule_prefill,
    recurrence_in_pool,
)
from model_runner.parallel import TPGroup
from model_runner.rank_memory import KVPool, StatePool


@dataclass(slots=True)
class StepContext:
    """Everything a layer reads besides its input: the batch and this rank's pools."""

    batch: ForwardBatch
    kv: KVPool
    state: StatePool
    capture: dict | None = None  # when a dict: layers record analysis tensors into it


def short_conv(mixed: torch.Tensor, weight: torch.Tensor, ctx: StepContext, layer: int
               ) -> torch.Tensor:
    """Causal conv over [N, C] channels, carrying each sequence's conv state in its slot (and
    the states at its cuts into their snapshot slots, ``ForwardBatch.snapshots``)."""
    batch, pool = ctx.batch, ctx.state.conv[layer]
    slots = batch.state_slots
    if batch.is_decode:
        return conv_decode_into(mixed, weight, pool, slots)
    snap, r = batch.snapshots, batch.num_replays  # replays lead the batch and have no cuts
    cuts = [(r + i, cut, slot) for i, pairs in enumerate(snap.cuts) for cut, slot in pairs
            ] if snap is not None else []
    out, pool[slots], at_cuts = conv_varlen(mixed, weight, pool[slots], batch.cu_seqlens,
                                            [(i, cut) for i, cut, _ in cuts])
    if cuts:  # after the slots: a snapshot may go into a replay's scratch slot
        pool[[slot for _, _, slot in cuts]] = at_cuts
    return out


def delta_rule(q, k, v, g, beta, ctx: StepContext, layer: int, scale: float,
               operand_dtype: torch.dtype) -> torch.Tensor:
    """Gated delta rule from / into each sequence's temporal state; returns o [N, Hv, V] FP32.
    ``operand_dtype``: the model's dtype, which fla's kernels read q, k, v and beta in.
    A step with dasc-wr replays runs them first, merges the omitted units into the hits' slots
    (``Refresh.merge``), then runs its own sequences from the merged states (so a snapshot
    written into a replay's scratch slot comes after the merge read it)."""
    batch, pool = ctx.batch, ctx.state.temporal[layer]
    args = (scale, operand_dtype)
    if batch.num_replays:
        r, t = batch.num_replays, batch.replay_tokens
        cu, slots = batch.cu_seqlens, batch.state_slots
        replayed = _recurrence(pool, slots[:r], cu[: r + 1], *args, q[:t], k[:t], v[:t], g[:t],
                               beta[:t])
        batch.refresh.merge(layer)
        rest = _snapshot_recurrence(pool, slots[r:], [c - t for c in cu[r:]], batch.snapshots,
                                    *args, q[t:], k[t:], v[t:], g[t:], beta[t:])
        o = torch.cat([replayed, rest])
    else:
        o = _snapshot_recurrence(pool, batch.state_slots, batch.cu_seqlens, batch.snapshots,
                                 *args, q, k, v, g, beta)
    if ctx.capture is not None:
        ctx.capture.setdefault("g", {})[layer] = g.detach().clone()
        ctx.capture.setdefault("q", {})[layer] = q.detach().clone()
    return o


def _snapshot_recurrence(pool: torch.Tensor, slots: torch.Tensor, cu_seqlens: list[int],
                         snap: Snapshots | None, scale: float, operand_dtype: torch.dtype,
                         q, k, v, g, beta) -> torch.Tensor:
    """``_recurrence`` of the step's own sequences, with each snapshot's state copied into its
    slot: the sequences run in rounds, segment by segment between their cuts, and after each
    round the states of the sequences cut there are copied out (``Snapshots``).  A segment's
    operands are row slices of the step's (views, no copies): a round of one segment runs on
    them, and so does each segment of a round wherever the C kernel runs (GDN on the CPU):
    it runs every (sequence, head) alone, so a segment gets the bits of their batch; any other
    round gathers its rows (the torch form batches its sequences' chunks)."""
    if snap is None:
        return _recurrence(pool, slots, cu_seqlens, scale, operand_dtype, q, k, v, g, beta)
    operands = (q, k, v, g, beta)
    alone = chunk_runs(*operands)
    o = v.new_empty(v.shape, dtype=torch.float32)
    for rnd in snap.rounds:
        if len(rnd.spans) == 1 or alone:
            for i, (a, b) in zip(rnd.seqs.tolist(), rnd.spans):
                o[a:b] = _recurrence(pool, slots[i : i + 1], [0, b - a], scale, operand_dtype,
                                     *(x[a:b] for x in operands))
        else:
            rows = rnd.rows
            o[rows] = _recurrence(pool, slots[rnd.seqs], rnd.cu_seqlens, scale, operand_dtype,
                                  *(x[rows] for x in operands))
        if len(rnd.copy_seqs):
            pool[rnd.copy_slots] = pool[slots[rnd.copy_seqs]]
    return o


def _recurrence(pool: torch.Tensor, slots: torch.Tensor, cu_seqlens: list[int], scale: float,
                operand_dtype: torch.dtype, q, k, v, g, beta) -> torch.Tensor:
    """The sequences of ``cu_seqlens`` from and into ``pool[slots]``: one-token sequences take
    the decode kernel, anything longer the chunked prefill."""
    if len(slots) == 0:
        return v.new_empty(v.shape, dtype=torch.float32)
    if not pool.is_cuda and not torch.is_grad_enabled():
        return recurrence_in_pool(q, k, v, g, beta, pool, slots, cu_seqlens, scale,
                                  operand_dtype == torch.bfloat16)
    # index_select, not pool[slots]: torch's advanced-indexing gather took 2x as long for
    # states of 2 MB a sequence (real shapes); the decode updates the gathered copy in place
    states = pool.index_select(0, slots)
    if len(cu_seqlens) - 1 == cu_seqlens[-1]:  # one token each
        o, states = delta_rule_decode(q, k, v, g, beta, states, scale, operand_dtype,
                                      in_place=True)
    else:
        o, states = delta_rule_prefill(q, k, v, g, beta, states, cu_seqlens, scale,
                                       operand_dtype)
    pool.index_copy_(0, slots, states)
    return o


def rank_bundles(cfg: ModelConfig, tp: TPGroup, head_order: list[list[int]] | None
                 ) -> list[list[int]]:
    """Per linear layer, the head bundles this rank keeps: ``order[r*nb/T : (r+1)*nb/T]`` of the
    layer's (validated) bundle order, identity by default."""
    return owned_bundles(check_head_order(cfg, head_order), tp.rank, tp.size)


def default_norm(cfg: ModelConfig, dtype: torch.dtype) -> Callable[[int], nn.Module]:
    """The family's hidden-state RMSNorm: Qwen's (1 + w) for GDN models, Llama's for KDA."""
    return lambda dim: RMSNorm(dim, cfg.rms_norm_eps, dtype, unit_offset=not cfg.is_kda)


class DecoderLayer(nn.Module):
    """Pre-norm block: ``x + mixer(norm(x))``, then ``x + mlp(norm(x))``."""

    def __init__(self, cfg: ModelConfig, tp: TPGroup, dtype: torch.dtype, mixer: nn.Module,
                 mixer_name: str, layer_id: int, norm: Callable[[int], nn.Module] | None = None):
        super().__init__()
        norm = norm or default_norm(cfg, dtype)
        self.input_layernorm = norm(cfg.hidden_size)
        self.post_attention_layernorm = norm(cfg.hidden_size)
        self.mixer_name = mixer_name
        self.add_module(mixer_name, mixer)
        if cfg.mlp_types[layer_id] == "sparse":
            self.mlp = SparseMoE(cfg, tp, dtype)
        else:
            self.mlp = DenseMLP(cfg.hidden_size, cfg.intermediate_size, tp, dtype)

    def forward(self, x: torch.Tensor, ctx: StepContext) -> torch.Tensor:
        return self.feed_forward(self.mix(x, ctx), ctx)

    def mix(self, x: torch.Tensor, ctx: StepContext) -> torch.Tensor:
        return x + getattr(self, self.mixer_name)(self.input_layernorm(x), ctx)

    def feed_forward(self, x: torch.Tensor, ctx: StepContext) -> torch.Tensor:
        return x + self.mlp(self.post_attention_layernorm(x), ctx.batch.is_static)


class Backbone(nn.Module):
    def __init__(self, cfg: ModelConfig, tp: TPGroup, dtype: torch.dtype, layers: list[nn.Module],
                 norm: Callable[[int], nn.Module]):
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size, tp, dtype)
        self.layers = nn.ModuleList(layers)
        self.norm = norm(cfg.hidden_size)


class HybridForCausalLM(nn.Module):
    """``model.embed_tokens``, ``model.layers.{i}``, ``model.norm``, ``lm_head`` as on disk."""

    # (on-disk pattern, parameter name, shard id); the first match wins; None drops the tensor
    name_rules: list[tuple[str, str | None, object]] = []

    def __init__(self, cfg: ModelConfig, tp: TPGroup, dtype: torch.dtype, layers: list[nn.Module],
                 norm: Callable[[int], nn.Module] | None = None):
        super().__init__()
        self.cfg, self.tp = cfg, tp
        self.last_linear = max(cfg.linear_layer_ids, default=-1)  # where replays leave
        self.model = Backbone(cfg, tp, dtype, layers, norm or default_norm(cfg, dtype))
        self.lm_head = ParallelLMHead(cfg.vocab_size, cfg.hidden_size, tp, dtype)

    def forward(self, ctx: StepContext, all_logits: bool = False,
                logits_of: list[int] | None = None, head: bool = True) -> torch.Tensor:
        """Logits of the step's sequences (of those listed in ``logits_of``, in its order: a
        prefill chunk nobody samples from needs none, and at a large vocabulary the LM head
        reads as much as the rest of a decode step: 0.5 GB at Qwen3.5's 248k tokens); without
        ``head``, the normed hidden states the LM head would read (``ModelRunner.greedy``).
        dasc-wr replays (``batch.Refresh``) leave the batch after the last linear layer's
        mixer: past it nothing reads them, so they skip its MLP and every later layer."""
        x = self.model.embed_tokens(ctx.batch.token_ids)
        for i, layer in enumerate(self.model.layers):
            if i != self.last_linear or not ctx.batch.num_replays:
                x = layer(x, ctx)
                continue
            x = layer.mix(x, ctx)
            x, ctx.batch = x[ctx.batch.replay_tokens :], ctx.batch.without_replays()
            if x.shape[0] == 0:  # replays alone (the same on every rank)
                return x.new_empty(0, self.cfg.vocab_size, dtype=torch.float32)
            x = layer.feed_forward(x, ctx)
        if not all_logits and logits_of is not None:
            if not logits_of:  # nobody samples: no LM head
                return x.new_empty(0, self.cfg.vocab_size, dtype=torch.float32)
            rows = ctx.batch.last_token_index[torch.tensor(logits_of, dtype=torch.long)]
            x = x[rows.to(x.device)]
        elif not all_logits and not ctx.batch.is_decode:  # decode: every token is a last token
            x = x[ctx.batch.last_token_index.to(x.device)]
        x = self.model.norm(x)
        return self.lm_head(x).float() if head else x

    @classmethod
    def map_name(cls, name: str) -> tuple[str | None, object]:
        """On-disk tensor name -> (parameter name or None to skip, shard id)."""
        for pattern, target, shard in cls.name_rules:
            m = re.search(pattern, name)
            if m is None:
                continue
            if target is None:
                return None, None
            shard_id = shard(m) if callable(shard) else shard
            return name[: m.start()] + m.expand(target) + name[m.end() :], shard_id
        return name, None
