"""Dense gated MLP and sparse MoE, both sharded over the intermediate dimension.

Every rank holds every expert's slice [rank*I/T, (rank+1)*I/T) of the intermediate features, so
routing (replicated, identical on all ranks) needs no communication and the routed experts plus
the shared expert cost one all-reduce together.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from kernels.cpu_fused import silu_mul
from kernels.derived import derived
from kernels.gemv import CodedWeight
from kernels.moe_decode import MOE_DECODE_MAX_TOKENS, code_experts, moe_decode
from kernels.moe_decode import simd_available as moe_simd_available
from model_runner.config import ModelConfig
from model_runner.layers.linear import (
    ColumnParallelLinear,
    ReplicatedLinear,
    RowParallelLinear,
    attach_loader,
    emulates_bf16,
    linear,
    new_param,
    pack_weight,
    packed_bytes,
    rank_slice,
)
from model_runner.parallel import TPGroup


def _intermediate_index(size: int, tp: TPGroup, field: str) -> torch.Tensor:
    if size % tp.size:
        raise ValueError(f"{field}={size} is not divisible by tp={tp.size}")
    return torch.tensor(rank_slice(size, tp))


# The fixed-shape MoE takes the gathered form (only the routed experts' weights are read) while
# pairs (tokens * top_k) <= GATHERED_PAIRS_PER_EXPERT * experts, else the grouped form where it
# runs (``grouped_mm_runs``), else the all-experts form (each expert read once, but computed
# for every token).  CPU, measured on 64 experts of [1024 x 512] top-2
# (model_runner/bench/moe_forms.py,
# docs/results/runner.md, step-cost.md): gathered is faster than all-experts at every size
# tried, up to 512 pairs (8 per expert), by 2-18x; past it, at 640 pairs, grouped 184 / 220 ms
# against all-experts 1,376 / 1,086 ms (fp32 / bf16).  CUDA: not measured; the all-experts
# form reads E experts, the gathered one `pairs` of them, so 1 by bytes, halved for
# embedding_bag's bandwidth; the grouped form past it by construction (unmeasured on a GPU).
GATHERED_PAIRS_PER_EXPERT = {"cpu": 8.0, "cuda": 0.5}
# Eager steps take the grouped form while pairs <= GROUPED_PAIRS_PER_EXPERT * experts, where it
# runs on the weights as held (``emulates_bf16`` weights are upcast whole on every call), else
# the routed form.  CPU, one thread (model_runner/bench/moe_forms.py,
# docs/results/step-cost.md): fp32
# grouped is 1.2-1.8x faster up to 2 pairs per expert on the Qwen-shape (8 experts), Kimi-shape
# (16) and 64-expert models, 0.8-1.1x from 4 to 256 (the routed form's packed GEMMs), 0.85-1.3x
# beyond (mixed: kept routed); bf16 weights 0.06-1.04x.  Experts with packed bf16 copies (a
# CPU with native bf16) take the routed form at every size (``SparseMoE.packs_bf16``).
# CUDA: unmeasured; by construction at
# every size (one grouped GEMM per projection and no host sync, against a GEMM pair per used
# expert after a sync).
GROUPED_PAIRS_PER_EXPERT = {"cpu": 2.0, "cuda": float("inf")}


def uses_gathered_experts(num_tokens: int, cfg: ModelConfig, device_type: str = "cpu") -> bool:
    """Whether a fixed-shape step of ``num_tokens`` takes the gathered-experts form."""
    limit = GATHERED_PAIRS_PER_EXPERT.get(device_type, GATHERED_PAIRS_PER_EXPERT["cuda"])
    return num_tokens * cfg.num_experts_per_tok <= limit * cfg.num_experts


def expert_form(num_tokens: int, cfg: ModelConfig, device_type: str, is_static: bool,
                can_group: bool, prefers_routed: bool = False) -> str:
    """The ``SparseMoE`` form (``_{form}_experts``) of a step of ``num_tokens``: fixed-shape
    steps gathered, then grouped where ``can_group`` (``grouped_mm_runs``), else all experts;
    eager steps grouped while ``GROUPED_PAIRS_PER_EXPERT`` allows, unless ``prefers_routed``
    (the grouped GEMMs would upcast the weights, or the routed form has packed bf16 copies),
    else routed."""
    if is_static:
        if uses_gathered_experts(num_tokens, cfg, device_type):
            return "gathered"
        return "grouped" if can_group else "all"
    limit = GROUPED_PAIRS_PER_EXPERT.get(device_type, GROUPED_PAIRS_PER_EXPERT["cuda"])
    pairs = num_tokens * cfg.num_experts_per_tok
    return "grouped" if can_group and not prefers_routed and pairs <= limit * cfg.num_experts \
        else "routed"


def grouped_mm_runs(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor) -> bool:
    """Whether ``torch._grouped_mm`` runs the grouped form's GEMMs here with no host sync (read
    from torch's sources, aten/src/ATen/native/GroupedMMUtils.h and cuda/GroupedBlas.cpp):
    - operands of one dtype (x is cast to the weights' dtype, as ``linear`` does), every row
      stride a multiple of 16 bytes (hidden, 2I and I here; checked on every device);
    - CPU: fp32 or bf16 (torch loops over the groups, one ``mm`` each, on the host anyway);
    - CUDA: bf16 on compute capability 9.x or 10.x only, the CUTLASS grouped GEMM reading the
      group ends on the device.  Any other CUDA dtype or device takes torch's fallback, which
      copies the offsets to the host (a sync, not capturable in a graph); ROCm is not claimed.
    Not run on a GPU here."""
    dtype = w13.dtype
    if not hasattr(torch, "_grouped_mm") or w2.dtype != dtype:
        return False
    if x.device.type == "cpu":
        fits = dtype in (torch.float32, torch.bfloat16)
    elif x.device.type == "cuda" and torch.version.hip is None:
        fits = (x.dtype == dtype == torch.bfloat16
                and torch.cuda.get_device_capability(x.device)[0] in (9, 10))
    else:
        return False
    align = 16 // dtype.itemsize
    return fits and all(n % align == 0 for n in (*w13.shape[1:], w2.shape[1]))


def _silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up of [.., gate | up]: one pass in C on a CPU, else torch's two."""
    act = silu_mul(gate_up)
    if act is None:
        gate, up = gate_up.chunk(2, dim=-1)
        act = F.silu(gate) * up
    return act


class DenseMLP(nn.Module):
    """down(silu(gate(x)) * up(x)); ``reduce=False`` leaves the partial sum for the caller."""

    def __init__(self, hidden: int, intermediate: int, tp: TPGroup, dtype: torch.dtype,
                 reduce: bool = True, field: str = "intermediate_size"):
        super().__init__()
        index = _intermediate_index(intermediate, tp, field)
        self.gate_up_proj = ColumnParallelLinear(hidden, {0: index, 1: index}, dtype)
        self.down_proj = RowParallelLinear(index, hidden, tp, dtype, reduce=reduce)

    def input_major(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The weights stored input-major ([H, 2I] gate | up, [I, H]) as ``SparseMoE``'s experts
        are, for ``moe_decode``'s shared expert; copies made once and kept while the weights
        are unchanged."""
        return (derived(self.gate_up_proj.weight, "_input_major", lambda w: w.t().contiguous()),
                derived(self.down_proj.weight, "_input_major", lambda w: w.t().contiguous()))

    def forward(self, x: torch.Tensor, is_static: bool = False) -> torch.Tensor:
        """``is_static`` is accepted for symmetry with ``SparseMoE`` (this path is always
        graph-safe)."""
        return self.down_proj(_silu_mul(self.gate_up_proj(x)))


class SparseMoE(nn.Module):
    """Top-k routed experts plus shared expert(s).

    Qwen3-Next: softmax router, optional renormalisation, sigmoid-gated shared expert.
    Kimi-Linear: sigmoid router with score-correction bias, grouped top-k, routed scaling.
    """

    GEMM_WEIGHTS = ("w13", "w2")
    CODED_WEIGHTS = ("w13", "w2")  # what ``coded`` stands in for at decode
    packed_experts: list[tuple[torch.Tensor | None, torch.Tensor | None]] = []  # pack_weights
    coded: tuple[CodedWeight | None, ...] | None = None  # code_weights

    def __init__(self, cfg: ModelConfig, tp: TPGroup, dtype: torch.dtype):
        super().__init__()
        self.cfg, self.tp = cfg, tp
        num_experts, hidden = cfg.num_experts, cfg.hidden_size
        index = _intermediate_index(cfg.moe_intermediate_size, tp, "moe_intermediate_size")
        local = len(index)
        router_dtype = torch.float32 if cfg.is_kda else dtype
        self.gate = ReplicatedLinear(hidden, num_experts, router_dtype)
        self.gate.keeps_weight = cfg.is_kda  # ``route`` reads its weight in FP32
        # Stored input-major, [E, in, out] (the transpose of nn.Linear's weight), so that one
        # expert's weight is H contiguous rows of its output features: the rows the gathered
        # form's embedding_bag sums.  ``gate_up(e)`` / ``down(e)`` are the [out, in] views.
        self.w13 = new_param(num_experts, hidden, 2 * local, dtype=dtype)  # [E, hidden, gate|up]
        self.w2 = new_param(num_experts, local, hidden, dtype=dtype)  # [E, I, hidden]
        self.w13.weight_loader = self._expert_loader(index, dim=0)
        self.w2.weight_loader = self._expert_loader(index, dim=1)
        self.w13.shard_ids = {(half, e) for half in (0, 1) for e in range(num_experts)}
        self.w2.shard_ids = set(range(num_experts))
        self.w13.whole_shard = self.w2.whole_shard = "fused"  # one tensor holding every expert
        self.shared_expert = DenseMLP(hidden, cfg.shared_expert_intermediate_size, tp, dtype,
                                      reduce=False, field="shared_expert_intermediate_size")
        for part in (self.shared_expert.gate_up_proj, self.shared_expert.down_proj):
            part.keeps_weight = True  # read input-major by ``moe_decode``
        if cfg.is_kda:
            bias = new_param(num_experts, dtype=torch.float32)
            self.e_score_correction_bias = attach_loader(bias, {None: None})
            self.shared_expert_gate = None
        else:
            self.shared_expert_gate = ReplicatedLinear(hidden, 1, dtype)

    @staticmethod
    def _expert_loader(index: torch.Tensor, dim: int):
        def load(p: nn.Parameter, loaded: torch.Tensor, shard_id: tuple[int, int] | int | str
                 ) -> None:
            if shard_id == "fused":  # every expert at once: [E, 2I, H] (gate | up) or [E, H, I]
                if loaded.dim() != 3 or loaded.shape[0] != p.shape[0]:
                    raise ValueError(f"shape {tuple(loaded.shape)} does not hold "
                                     f"{p.shape[0]} experts")
                if dim == 0:
                    inter = loaded.shape[1] // 2
                    for half in (0, 1):
                        for e in range(p.shape[0]):
                            load(p, loaded[e, half * inter:(half + 1) * inter], (half, e))
                else:
                    for e in range(p.shape[0]):
                        load(p, loaded[e], e)
                return
            if isinstance(shard_id, tuple):  # (0 gate | 1 up, expert)
                half, expert = shard_id
                dst = p.data[expert].t().narrow(0, half * len(index), len(index))
            else:
                dst = p.data[shard_id].t()
            other = 1 - dim  # the unsharded dim must match exactly
            if loaded.dim() != 2 or loaded.shape[other] != dst.shape[other] or \
                    int(index.max()) >= loaded.shape[dim]:
                raise ValueError(f"shape {tuple(loaded.shape)} does not fit expert "
                                 f"{tuple(dst.shape)}")
            dst.copy_(loaded.index_select(dim, index))

        return load

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Returns (weights [N, k], expert ids [N, k])."""
        cfg = self.cfg
        if not cfg.is_kda:
            logits = self.gate(x)
            probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
            weights, ids = torch.topk(probs, cfg.num_experts_per_tok, dim=-1)
            if cfg.norm_topk_prob:
                weights = weights / weights.sum(dim=-1, keepdim=True)
            return weights.to(logits.dtype), ids
        scores = F.linear(x.float(), self.gate.weight.float()).sigmoid()
        choice = scores + self.e_score_correction_bias
        groups, per_group = cfg.num_expert_group, cfg.num_experts // cfg.num_expert_group
        group_scores = choice.view(-1, groups, per_group).topk(2, dim=-1)[0].sum(dim=-1)
        top_groups = torch.topk(group_scores, k=cfg.topk_group, dim=-1, sorted=False)[1]
        group_mask = torch.zeros_like(group_scores).scatter_(1, top_groups, 1.0)
        expert_mask = group_mask.unsqueeze(-1).expand(-1, groups, per_group).reshape(x.shape[0], -1)
        choice = choice.masked_fill(~expert_mask.bool(), float("-inf"))
        ids = torch.topk(choice, k=cfg.num_experts_per_tok, dim=-1, sorted=False)[1]
        weights = scores.gather(1, ids)
        if cfg.norm_topk_prob:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        return weights * cfg.routed_scaling_factor, ids

    def forward(self, x: torch.Tensor, is_static: bool = False) -> torch.Tensor:  # x: [N, hidden]
        """A bf16 CPU step of a few tokens (decode) takes ``kernels.moe_decode.moe_decode``, the
        shared expert included: the torch forms' roundings, each used expert's weights streamed
        once, no per-expert calls.
        ``is_static``: a graph-safe form for fixed-shape decode (fixed shapes, no host sync):
        each token gathers its routed experts' weights while few tokens route
        (``uses_gathered_experts``), else one grouped GEMM per projection (every expert on
        every token where that cannot run); otherwise the routed form (grouped by a host-side
        sort) or the grouped one, as ``expert_form`` chooses."""
        weights, ids = self.route(x)
        gate = (torch.sigmoid(self.shared_expert_gate(x)) if self.shared_expert_gate is not None
                else None)  # the shared expert's weight
        if (not is_static and x.shape[0] <= MOE_DECODE_MAX_TOKENS
                and x.dtype == torch.bfloat16 and x.device.type == "cpu"
                and moe_simd_available()):  # its input-major copies only where it runs
            both = moe_decode(x, ids, weights, self.w13, self.w2,
                              (*self.shared_expert.input_major(), gate), coded=self.coded)
            if both is not None:  # a decode step's few tokens
                return self.tp.all_reduce(both)
        out = torch.zeros_like(x)
        self._experts(x, weights, ids, out, is_static)
        shared = self.shared_expert(x)
        return self.tp.all_reduce(out + (gate * shared if gate is not None else shared))

    def _experts(self, x, weights, ids, out, is_static: bool) -> None:
        """The routed experts' weighted sum into ``out``, in the form ``expert_form`` picks."""
        if self.w13 is None and is_static:
            raise RuntimeError("the fixed-shape expert forms read the experts' weights, which "
                               "this layer dropped for its copies")
        form = expert_form(x.shape[0], self.cfg, x.device.type, is_static,
                           self.w13 is not None and grouped_mm_runs(x, self.w13, self.w2),
                           self.packs_bf16 or emulates_bf16(self.w13))
        getattr(self, f"_{form}_experts")(x, weights, ids, out)

    def code_weights(self) -> list[CodedWeight]:
        """``code_gemms``: the coded copies ``moe_decode`` streams, of the experts and of the
        shared expert's input-major weights; returns them."""
        self.coded = code_experts(self.w13, self.w2, self.shared_expert.input_major())
        if self.coded is not None:  # moe_decode runs the shared expert: not its linears
            for part in (self.shared_expert.gate_up_proj, self.shared_expert.down_proj):
                part.decode_gemv, part.coded = False, None
        return [c for c in self.coded or () if c is not None]

    def release_experts(self) -> int:
        """Drop the routed experts' weights where their copies run every eager step: coded
        ones a decode step's few tokens (``moe_decode``), packed bf16 ones the routed form's
        GEMMs.  Not where fixed-shape decode runs (its forms read the weights: the caller
        knows).  Returns the bytes freed."""
        coded, pairs = self.coded, self.packed_experts
        if (self.w13 is None or coded is None or coded[0] is None or coded[1] is None
                or not self.packs_bf16 or any(p is None for pair in pairs for p in pair)):
            return 0
        freed = self.w13.nbytes + self.w2.nbytes
        self.w13 = self.w2 = None
        return freed

    def pack_weights(self) -> int:
        """``pack_gemms``: packed copies of each expert's [out, in] views, for its GEMMs of two
        or more rows in the routed form (the graph-safe forms read ``w13``/``w2`` directly)."""
        self.packed_experts = [(pack_weight(self.gate_up(e)), pack_weight(self.down(e)))
                               for e in range(self.cfg.num_experts)]
        sizes = (packed_bytes(self.w13[0]), packed_bytes(self.w2[0]))
        return sum(size for pair in self.packed_experts
                   for size, p in zip(sizes, pair) if p is not None)

    @property
    def packs_bf16(self) -> bool:
        """The experts hold packed bf16 copies (``pack_weight`` on a CPU with native bf16).
        The routed form's GEMMs through them beat torch's grouped GEMM over the plain weights
        at every size measured: a Kimi-shape decode step (16 experts) took 131-136 against
        198-209 ms at batch 1 and 155-164 against 217-230 ms at batch 4 (one core)."""
        first = self.packed_experts[0][0] if self.packed_experts else None
        return first is not None and first.dtype == torch.bfloat16

    def gate_up(self, expert: int) -> torch.Tensor | None:  # None: dropped (release_experts)
        return None if self.w13 is None else self.w13[expert].t()  # [2I, hidden]

    def down(self, expert: int) -> torch.Tensor | None:
        return None if self.w2 is None else self.w2[expert].t()  # [hidden, I]

    def _routed_experts(self, x, weights, ids, out) -> None:
        """Tokens grouped by expert with one sort: per used expert one contiguous GEMM pair over
        its rows of the gathered batch, then one weighted scatter-add back."""
        order = ids.reshape(-1).argsort(stable=True)  # (token, slot) pairs by expert
        counts = torch.bincount(ids.reshape(-1), minlength=self.cfg.num_experts).tolist()
        token = order // ids.shape[1]
        gathered = x[token]  # [N * k, hidden]
        h = torch.empty_like(gathered)
        start = 0
        for expert, count in enumerate(counts):  # host sync: the per-expert counts
            if count:
                rows = slice(start, start + count)
                packed_gate_up, packed_down = (self.packed_experts[expert]
                                               if self.packed_experts else (None, None))
                gate_up = linear(gathered[rows], self.gate_up(expert), packed_gate_up)
                h[rows] = linear(_silu_mul(gate_up), self.down(expert), packed_down)
                start += count
        out.index_add_(0, token, (h * weights.reshape(-1)[order, None]).to(out.dtype))

    def _grouped_experts(self, x, weights, ids, out) -> None:
        """The routed form with fixed shapes and no host sync (``grouped_mm_runs`` must hold):
        the pairs sorted by expert on the device, one gather, each expert's row end in the
        sorted batch by ``searchsorted``, one grouped GEMM per projection over all experts
        (``torch._grouped_mm``; empty groups cost nothing), one weighted scatter-add back.
        Rounded to x's dtype where ``linear`` rounds, so it equals the routed form."""
        num_experts, w13, w2 = self.cfg.num_experts, self.w13, self.w2
        if emulates_bf16(w13):  # as ``linear`` does for a transposed bf16 weight: fp32 GEMMs
            w13, w2 = w13.float(), w2.float()  # (an emulated bf16 one is 10-70x slower here)
        dtype = w13.dtype
        expert, order = ids.reshape(-1).sort(stable=True)  # [N * k] pairs by expert
        experts = torch.arange(num_experts, device=x.device, dtype=expert.dtype)
        ends = torch.searchsorted(expert, experts, right=True, out_int32=True)  # [E]
        token = order // ids.shape[1]
        gathered = x[token].to(dtype)  # [N * k, hidden], rows [ends[e-1], ends[e]) expert e
        gate, up = torch._grouped_mm(gathered, w13, offs=ends).to(x.dtype).chunk(2, dim=-1)
        h = torch._grouped_mm((F.silu(gate) * up).to(dtype), w2, offs=ends).to(x.dtype)
        out.index_add_(0, token, (h * weights.reshape(-1)[order, None]).to(out.dtype))

    def _gathered_experts(self, x, weights, ids, out) -> None:
        """Fixed shapes, reading only the routed experts, copying no weights: the GEMV of
        (token, slot) pair p with expert e is a weighted sum of e's H input rows, one bag of
        ``F.embedding_bag`` over the [E * H, 2I] table (weights x[p]), and likewise for w2."""
        num_tokens, top_k = ids.shape
        hidden, inter = x.shape[1], self.w2.shape[1]
        pairs = ids.reshape(-1, 1)  # [N * k, 1], token-major
        xs = x.repeat_interleave(top_k, dim=0).to(self.w13.dtype)  # [N * k, hidden]
        rows = pairs * hidden + torch.arange(hidden, device=x.device)  # [N * k, hidden]
        # rounded to x's dtype where ``linear`` rounds: the weights may be held in fp32
        gate, up = F.embedding_bag(rows, self.w13.view(-1, 2 * inter), per_sample_weights=xs,
                                   mode="sum").to(x.dtype).chunk(2, dim=-1)  # [N * k, I] each
        rows = pairs * inter + torch.arange(inter, device=x.device)  # [N * k, I]
        h = F.embedding_bag(rows, self.w2.view(-1, hidden),
                            per_sample_weights=(F.silu(gate) * up).to(self.w2.dtype),
                            mode="sum").to(x.dtype)  # [N * k, hidden]
        routed = h.view(num_tokens, top_k, -1) * weights[:, :, None]
        out.add_(routed.sum(dim=1).to(out.dtype))

    def _all_experts(self, x, weights, ids, out) -> None:
        """Fixed shapes: a dense routing matrix [N, E] (0 where not routed) weighs every
        expert's output; reads every expert once, cheaper than gathering once the batch routes
        more pairs than ``uses_gathered_experts`` allows."""
        dense = torch.zeros(x.shape[0], self.cfg.num_experts, dtype=weights.dtype,
                            device=x.device).scatter_(1, ids, weights)  # [N, E]
        for expert in range(self.cfg.num_experts):
            gate, up = linear(x, self.gate_up(expert)).chunk(2, dim=-1)
            h = linear(F.silu(gate) * up, self.down(expert))
            out.add_((h * dense[:, expert, None]).to(out.dtype))
