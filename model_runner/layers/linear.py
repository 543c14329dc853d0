"""Tensor-parallel linears and embeddings with per-parameter weight loaders.

Every shard is described by *index lists into the on-disk tensor*, not by (rank, size) arithmetic:
a column-parallel weight keeps rows ``index`` of the full weight, a row-parallel one keeps columns
``index``.  Contiguous TP slices, GVA head bundles and the load-time head permutation of
TP-balanced placement are then all the same mechanism.

A parameter's ``weight_loader(param, loaded, shard_id)`` copies the selected part of an on-disk
tensor into its place; merged parameters (gate|up, q|k|v conv) place each ``shard_id`` at its own
offset along the sharded dim, in declaration order.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from kernels.gemv import GEMV_MAX_ROWS, CodedWeight, code_weight, coded_rows, gemv
from model_runner.cpu_features import cpu_has_native_bf16
from model_runner.parallel import TPGroup

Index = torch.Tensor | None  # None: the whole on-disk extent

# A bf16 GEMM with at least this many rows runs in fp32 on a CPU that only emulates bf16.
# Measured on an idle AVX2 core (docs/results/runner.md): [M, 1024] x [1024, 4096] emulated bf16
# costs ~1.1 ms per row; upcasting both operands ~4 ms once, so fp32 wins from M ~ 12.  A
# transposed bf16 weight (the routed experts are stored input-major) takes a far slower
# emulated kernel (32 ms at M = 1), so it is upcast at any M.
UPCAST_MIN_ROWS = 16
_EMULATED_BF16 = not cpu_has_native_bf16()

# oneDNN's prepacked GEMM, the op inductor emits for a frozen CPU linear.
# - fp32 (fp32 models; bf16 ones on a CPU that emulates bf16).  MKL's sgemm is slow at few rows
#   on this class of CPU (AVX2, one thread): a [12288, 1024] weight costs 5 ms at M = 1,
#   11-13 ms at M = 2 and 35 ms at M = 17; the packed weight 8 / 16 ms at M = 2 / 17.  Over the
#   real-shape models' weights the packed form is 1.4-2.7x faster at M = 4, 1.0-2.2x at M = 64,
#   but 0.77-1.2x at M = 1,024 and 0.6-1.0x at M = 1 (model_runner/bench/gemm_forms.py,
#   docs/results/runner.md), so it takes 2 <= M <= PACK_MAX_ROWS; M = 1 keeps torch's GEMV and
#   large prefill chunks torch's GEMM.
# - bf16 on a CPU with AVX512-BF16 or AMX: the packed copy stays bf16, and it is the fastest
#   form at every row count measured (one AVX512-BF16 core, [12288, 1024]: 1.1 against torch's
#   2.9 ms at M = 1, 2.6 against 4.6 ms at M = 16, 121 against 129 ms at M = 1,024; an expert's
#   transposed [1024, 1024] 0.06 against 0.15 ms at M = 1), so it takes every row count.  The
#   fp32 packed form would be 2x slower than the bf16 GEMM from M = 16 on there.
# Only weights of at least PACK_MIN_ELEMENTS are packed (on small ones the call overhead wins).
# The packed copy is extra memory: the weight again, in fp32 or bf16 as above.
PACK_MAX_ROWS = 256
PACK_MIN_ELEMENTS = 1 << 19
# A decode step's few rows (at most GEMV_MAX_ROWS) of a bf16 weight take kernels/gemv's C GEMV
# where it runs (AVX-512): it streams the weight at ~13-15 GB/s against oneDNN's 10-13 here.
# Elsewhere (a CPU without AVX-512, a routed expert's transposed weight) oneDNN's packed bf16
# GEMM of 1-3 rows is slower than of 4: on one AVX512-BF16 core, cold weights, [12288, 1024]
# takes 1.40 / 1.76 / 1.24 ms at M = 1 / 2 / 3 and 1.19 ms at M = 4 ([1024, 4096]: 0.53 / 0.61 /
# 0.45 against 0.41 ms; a Qwen-shape expert's transposed [1024, 1024]: 0.14 / 0.17 against 0.12
# ms).  So fewer rows are padded with zero rows to 4.  Either way a row's bits do not depend on
# how many rows share its step, up to 4.  With ``--cpu-coded-weights`` the GEMV streams the
# weight's coded copy (``kernels.gemv.CodedWeight``: the same values in 3/4 of the bytes) and
# gives the same bits: over Qwen3-Next's projections, one core, ~0.7-0.8x the time at one row,
# ~0.75-0.85x at two, about the same at four, where decoding makes it compute-bound
# (docs/benchmarks.md, "Coded weights for the decode GEMV").
PAD_ROWS = 4
_HAS_ONEDNN = torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn,
                                                                 "_linear_pointwise")


def emulates_bf16(x: torch.Tensor) -> bool:
    """A bf16 CPU tensor on a CPU that only emulates bf16: its products are better computed in
    fp32 and rounded where the bf16 product would round (emulated bf16 matmuls accumulate in
    fp32 too, so only the summation order changes, and a strided emulated bmm is ~25x slower:
    26 ms for one decode query over 1,025 cached keys of 16 heads of 256)."""
    return _EMULATED_BF16 and x.dtype == torch.bfloat16 and x.device.type == "cpu"


def pack_weight(weight: torch.Tensor) -> torch.Tensor | None:
    """The oneDNN-packed copy of an [out, in] CPU weight (bf16 for a bf16 weight on a CPU with
    native bf16, else fp32), or None where packing does not pay (small weights, non-CPU
    tensors, a torch without oneDNN).  A transposed weight (a routed expert's view of its
    input-major storage) is packed for one row, the layout that runs decode's one row per
    expert fastest (fp32: 1.1 vs 2.2-3.0 ms on [2048, 2304]), at 1.1-1.4x the default layout's
    cost for 2-4 rows; a contiguous one is packed for many rows, since its one row keeps
    torch's GEMV in fp32."""
    if (not _HAS_ONEDNN or weight.device.type != "cpu" or weight.dim() != 2
            or weight.numel() < PACK_MIN_ELEMENTS):
        return None
    rows_hint = None if weight.is_contiguous() else 1
    dtype = torch.bfloat16 if _packs_bf16(weight.dtype) else torch.float32
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach().to(dtype), rows_hint)


def _packs_bf16(dtype: torch.dtype) -> bool:
    return dtype == torch.bfloat16 and not _EMULATED_BF16


def packed_bytes(weight: torch.Tensor) -> int:
    """Memory of ``pack_weight(weight)``'s copy."""
    return weight.numel() * (2 if _packs_bf16(weight.dtype) else 4)


def packed_linear(x: torch.Tensor, packed: torch.Tensor) -> torch.Tensor:
    """``x W^T`` through the packed weight, in ``x``'s dtype: a bf16 weight packed in bf16
    accumulates in fp32 and rounds once, as torch's bf16 GEMM does; bf16 through an fp32 packed
    weight is rounded once too."""
    flat = x.reshape(-1, x.shape[-1]).to(packed.dtype).contiguous()
    y = torch.ops.mkldnn._linear_pointwise(flat, packed, None, "none", [], "")
    return y.view(*x.shape[:-1], y.shape[-1]).to(x.dtype)


def linear(x: torch.Tensor, weight: torch.Tensor | None, packed: torch.Tensor | None = None,
           coded: CodedWeight | None = None) -> torch.Tensor:
    """``x W^T`` in ``x``'s dtype.  With ``packed`` (``pack_weight(weight)``): a bf16 packed
    copy takes every row count; an fp32 one 2 to ``PACK_MAX_ROWS`` rows, and one row of a
    transposed weight (in bf16 it would otherwise be upcast whole).  A weight held in fp32 for
    a bf16 model (``hold_fp32``) takes an fp32 GEMM rounded once to bf16.  Otherwise, on a CPU
    without native bf16, a bf16 GEMM of many rows (a prefill chunk) is computed the same way
    after upcasting the weight: the products of bf16 operands are exact in fp32 and the
    emulated bf16 GEMM accumulates in fp32 too, so only the summation order differs, at 4-6x
    the speed.  Without a packed copy, small row counts (decode) keep the bf16 GEMM on a
    contiguous weight, which reads half the bytes.  Up to ``GEMV_MAX_ROWS`` rows of a bf16
    weight take the C GEMV (``kernels.gemv``) where it runs, from ``coded`` (``code_weight``'s
    copy of ``weight``) where given; a bf16 packed GEMM of fewer than ``PAD_ROWS`` rows runs
    padded to ``PAD_ROWS``.  ``weight`` is None where the module released it for its copies
    (``PackedGemm.release_weight``, ``SparseMoE.release_experts``)."""
    rows = x.numel() // x.shape[-1]
    if (rows <= GEMV_MAX_ROWS and x.dtype == torch.bfloat16
            and (coded is not None if weight is None else weight.dtype == torch.bfloat16)):
        y = gemv(x, weight, coded=coded)  # decode's few rows: the weight streamed once, in C
        if y is not None:
            return y
    if packed is not None and (packed.dtype == x.dtype == torch.bfloat16
                               or 2 <= rows <= PACK_MAX_ROWS
                               or (rows == 1 and weight is not None
                                   and not weight.is_contiguous())):
        if rows < PAD_ROWS and packed.dtype == torch.bfloat16:
            padded = F.pad(x.reshape(rows, x.shape[-1]), (0, 0, 0, PAD_ROWS - rows))
            return packed_linear(padded, packed)[:rows].view(*x.shape[:-1], -1)
        return packed_linear(x, packed)  # and one row of a transposed (expert) weight
    if weight is None:
        raise RuntimeError(f"a linear whose weight its bf16 copies stand in for takes bf16 "
                           f"input, not {x.dtype}")
    if weight.dtype != x.dtype:
        return F.linear(x.to(weight.dtype), weight).to(x.dtype)
    if (_EMULATED_BF16 and weight.dtype == torch.bfloat16 and x.device.type == "cpu"
            and (rows >= UPCAST_MIN_ROWS or not weight.is_contiguous())):
        return F.linear(x.float(), weight.float()).to(x.dtype)
    return F.linear(x, weight)


def should_hold_fp32(dtype: torch.dtype, device: torch.device) -> bool:
    """``--cpu-fp32-weights auto``: a bf16 model on a CPU that only emulates bf16."""
    return _EMULATED_BF16 and dtype == torch.bfloat16 and device.type == "cpu"


def hold_fp32(model: nn.Module) -> int:
    """Convert the bf16 GEMM weights (the parameters each module lists in ``GEMM_WEIGHTS``)
    to fp32 in place, exactly (every bf16 value is an fp32 value); returns the bytes added.
    Modules that ``pack_gemms`` gave packed copies keep their bf16 weights, so with packing on
    this holds only the small GEMM weights (all of them with ``--cpu-packed-weights off``).
    Activations, KV and states stay bf16; each GEMM is one fp32 GEMM rounded once, the
    numerics ``linear`` gives prefill chunks, with no per-call upcast.  Costs 2x the memory
    of the weights it holds."""
    added = 0
    for module in model.modules():
        if getattr(module, "packed", None) is not None or getattr(module, "packed_experts", None):
            continue  # pack_gemms gave it packed copies (fp32 ones: one row keeps the bf16 GEMV)
        for name in getattr(module, "GEMM_WEIGHTS", ()):
            param = getattr(module, name)
            if param.dtype == torch.bfloat16:  # a new parameter: a tied embedding keeps bf16
                setattr(module, name, nn.Parameter(param.data.float(), requires_grad=False))
                added += param.numel() * 2
    return added


def pack_gemms(model: nn.Module) -> int:
    """Let every module with ``pack_weights`` (the linears, the routed experts) take the
    oneDNN-packed copies of its weights where that pays; returns the bytes they take."""
    return sum(m.pack_weights() for m in model.modules() if hasattr(m, "pack_weights"))


def release_weights(model: nn.Module, fixed_shapes: bool = False) -> int:
    """Let every linear whose packed bf16 and coded copies stand in for its weight drop it
    (``PackedGemm.release_weight``), and, unless ``fixed_shapes`` decode runs (its expert
    forms read them), every MoE layer its routed experts' (``release_experts``); returns the
    bytes freed.  A tied LM head's weight is the input embedding's tensor: where the head
    drops it, the embedding reads its rows from the head's coded copy.  An untied embedding
    with a coded copy of its own (``code_gemms``) drops its weight for it (the bytes freed
    net of the copy).  Run after ``pack_gemms`` and ``code_gemms``."""
    embedding, head = _embedding_and_head(model)
    tied = head.weight is embedding.weight
    freed = sum(m.release_weight() for m in model.modules() if isinstance(m, PackedGemm))
    if not fixed_shapes:
        freed += sum(m.release_experts() for m in model.modules()
                     if hasattr(m, "release_experts"))
    if tied and head.weight is None:
        embedding.coded, embedding.weight = head.coded, None
    elif not tied and embedding.coded is not None:
        freed += embedding.weight.nbytes - embedding.coded.nbytes
        embedding.weight = None
    return freed


def _embedding_and_head(model: nn.Module) -> tuple[nn.Module, nn.Module]:
    return model.model.embed_tokens, model.lm_head  # models/common.py's layout


def code_gemms(model: nn.Module) -> list[CodedWeight]:
    """Let every module with ``code_weights`` (the linears, the MoE layers) take the coded
    copies of its bf16 weights that a decode step streams (``kernels.gemv.code_weight``),
    where those kernels run; returns the copies.  An untied input embedding takes one too,
    which a step reads a few rows of (not returned: it is not streamed)."""
    copies = [c for m in model.modules() if hasattr(m, "code_weights") for c in m.code_weights()]
    embedding, head = _embedding_and_head(model)
    if head.weight is not embedding.weight:
        embedding.coded = code_weight(embedding.weight)
    return copies


class PackedGemm:
    """A linear module whose ``packed`` is ``weight``'s packed copy once ``pack_gemms`` ran, and
    whose ``coded`` is its coded copy once ``code_gemms`` ran."""

    CODED_WEIGHTS = ("weight",)  # what ``coded`` stands in for at decode
    decode_gemv = True  # whether decode steps run its GEMV: only then is it coded
    # whether anything but ``linear`` reads ``weight`` (an input-major copy, an fp32 router,
    # MLA's absorbed projections): then its copies never stand in for it (a tied embedding
    # reads the head's coded copy instead: ``release_weights``)
    keeps_weight = False
    packed: torch.Tensor | None = None
    coded: CodedWeight | None = None

    def code_weights(self) -> list[CodedWeight]:
        self.coded = code_weight(self.weight) if self.decode_gemv else None
        return [self.coded] if self.coded is not None else []

    def pack_weights(self) -> int:
        self.packed = pack_weight(self.weight)
        return 0 if self.packed is None else packed_bytes(self.weight)

    def release_weight(self) -> int:
        """Drop ``weight`` where its copies run every row count: the coded one decode's few
        rows (the C GEMV), a packed bf16 one the others.  A CPU with AVX512-BF16 would
        otherwise hold a linear's weight three times, once read by neither path (1.5 GB at
        Qwen3.5-0.8B, its tied LM head's 0.5 included).  ``weight`` is None after, so a
        reader not listed in ``keeps_weight`` fails instead of reading a stale copy.  Returns
        the bytes freed."""
        weight = self.weight
        if (self.keeps_weight or weight is None or self.coded is None or self.packed is None
                or self.packed.dtype != torch.bfloat16):
            return 0
        self.weight = None
        return weight.nbytes


def group_rows(groups: Sequence[int], group_size: int, start: int = 0,
               length: int | None = None) -> torch.Tensor:
    """Row indices of the listed groups of ``group_size`` consecutive rows, in listed order;
    with ``start``/``length``, only rows [start, start + length) of each group."""
    g = torch.as_tensor(list(groups), dtype=torch.long)
    length = group_size - start if length is None else length
    return (g[:, None] * group_size + start + torch.arange(length)).reshape(-1)


def rank_slice(num: int, tp: TPGroup) -> list[int]:
    """This rank's contiguous share of ``num`` items (``num`` must divide evenly)."""
    per = num // tp.size
    return list(range(tp.rank * per, (tp.rank + 1) * per))


def attach_loader(
    param: nn.Parameter,
    parts: dict[object, Index],
    dim: int = 0,
    transform: Callable[[torch.Tensor], torch.Tensor] | None = None,
) -> nn.Parameter:
    """Give ``param`` a loader: part ``shard_id`` takes ``loaded.index_select(dim, index)``."""
    offsets, lengths, off = {}, {}, 0
    for shard_id, index in parts.items():
        offsets[shard_id] = off
        lengths[shard_id] = len(index) if index is not None else param.shape[dim] - off
        off += lengths[shard_id]

    def weight_loader(p: nn.Parameter, loaded: torch.Tensor, shard_id: object = None) -> None:
        if transform is not None:
            loaded = transform(loaded)
        index = parts[shard_id]
        dst = p.data.narrow(dim, offsets[shard_id], lengths[shard_id])
        fits = loaded.dim() == dst.dim() and all(
            loaded.shape[d] == dst.shape[d] for d in range(dst.dim()) if d != dim)
        if index is None:
            fits = fits and loaded.shape[dim] == lengths[shard_id]
        elif fits:
            fits = int(index.max()) < loaded.shape[dim]
        if not fits:
            raise ValueError(f"shape {tuple(loaded.shape)} does not fit {tuple(dst.shape)}")
        dst.copy_(loaded if index is None else loaded.index_select(dim, index))

    param.weight_loader = weight_loader
    param.shard_ids = set(parts)  # every part must come from the checkpoint
    return param


def new_param(*shape: int, dtype: torch.dtype) -> nn.Parameter:
    return nn.Parameter(torch.empty(*shape, dtype=dtype), requires_grad=False)


class ColumnParallelLinear(PackedGemm, nn.Module):
    """y = x W^T keeping the output rows listed in ``parts`` (merged when several)."""

    GEMM_WEIGHTS = ("weight",)

    def __init__(self, in_features: int, parts: dict[object, torch.Tensor], dtype: torch.dtype):
        super().__init__()
        out_features = sum(len(index) for index in parts.values())
        self.weight = attach_loader(new_param(out_features, in_features, dtype=dtype), parts)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.packed, self.coded)


class ReplicatedLinear(ColumnParallelLinear):
    def __init__(self, in_features: int, out_features: int, dtype: torch.dtype):
        super().__init__(in_features, {None: torch.arange(out_features)}, dtype)


class RowParallelLinear(PackedGemm, nn.Module):
    """y = all_reduce(x_local W_local^T) keeping the input columns listed in ``index``."""

    GEMM_WEIGHTS = ("weight",)

    def __init__(self, index: torch.Tensor, out_features: int, tp: TPGroup, dtype: torch.dtype,
                 reduce: bool = True):
        super().__init__()
        self.tp, self.reduce = tp, reduce
        self.weight = attach_loader(new_param(out_features, len(index), dtype=dtype),
                                    {None: index}, dim=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = linear(x, self.weight, self.packed, self.coded)
        return self.tp.all_reduce(y) if self.reduce else y


class VocabParallelEmbedding(nn.Module):
    """Vocabulary rows [rank*V_p, (rank+1)*V_p), V_p = ceil(vocab / tp); padding rows are 0.
    Where ``weight`` is None its rows come from ``coded``: its own coded copy, or its tied LM
    head's (``code_gemms``, ``release_weights``)."""

    coded: CodedWeight | None = None

    def __init__(self, vocab_size: int, hidden_size: int, tp: TPGroup, dtype: torch.dtype):
        super().__init__()
        self.tp, self.vocab_size = tp, vocab_size
        self.per_rank = -(-vocab_size // tp.size)
        self.start = tp.rank * self.per_rank
        self.weight = new_param(self.per_rank, hidden_size, dtype=dtype)
        self.weight.data.zero_()
        self.weight.weight_loader = self._load
        self.weight.shard_ids = {None}

    def _load(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: object = None) -> None:
        if tuple(loaded.shape) != (self.vocab_size, param.shape[1]):
            raise ValueError(f"shape {tuple(loaded.shape)} does not fit "
                             f"({self.vocab_size}, {param.shape[1]})")
        rows = loaded[self.start : self.start + self.per_rank]
        param.data[: rows.shape[0]].copy_(rows)

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        """This rank's rows ``ids`` of the weight, exactly, from its coded copy where the
        weight was released."""
        if self.weight is None:
            return coded_rows(self.coded, ids)
        return F.embedding(ids, self.weight)

    def forward(self, token_ids: torch.Tensor) -> torch.Tensor:
        if self.tp.size == 1:
            return self.rows(token_ids)
        local = token_ids - self.start
        is_mine = (local >= 0) & (local < self.per_rank)
        out = self.rows(local.clamp(0, self.per_rank - 1))
        out = out * is_mine[:, None].to(out.dtype)
        return self.tp.all_reduce(out)


class ParallelLMHead(PackedGemm, VocabParallelEmbedding):
    """Vocab-sharded output projection; every rank gets the full [N, vocab] logits."""

    GEMM_WEIGHTS = ("weight",)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = linear(hidden, self.weight, self.packed, self.coded)
        return self.tp.all_gather_last(logits)[:, : self.vocab_size]
