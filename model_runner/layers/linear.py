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


def linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``x W^T``.  On a CPU without native bf16 a bf16 GEMM of many rows (a prefill chunk) is
    computed in fp32 and rounded once to bf16: the products of bf16 operands are exact in fp32
    and the emulated bf16 GEMM accumulates in fp32 too, so only the summation order differs,
    at 4-6x the speed.  Small row counts (decode) keep the bf16 GEMM on a contiguous weight,
    which reads half the bytes."""
    if (_EMULATED_BF16 and weight.dtype == torch.bfloat16 and x.device.type == "cpu"
            and (x.numel() >= UPCAST_MIN_ROWS * x.shape[-1] or not weight.is_contiguous())):
        return F.linear(x.float(), weight.float()).to(x.dtype)
    return F.linear(x, weight)


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


class ColumnParallelLinear(nn.Module):
    """y = x W^T keeping the output rows listed in ``parts`` (merged when several)."""

    def __init__(self, in_features: int, parts: dict[object, torch.Tensor], dtype: torch.dtype):
        super().__init__()
        out_features = sum(len(index) for index in parts.values())
        self.weight = attach_loader(new_param(out_features, in_features, dtype=dtype), parts)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight)


class ReplicatedLinear(ColumnParallelLinear):
    def __init__(self, in_features: int, out_features: int, dtype: torch.dtype):
        super().__init__(in_features, {None: torch.arange(out_features)}, dtype)


class RowParallelLinear(nn.Module):
    """y = all_reduce(x_local W_local^T) keeping the input columns listed in ``index``."""

    def __init__(self, index: torch.Tensor, out_features: int, tp: TPGroup, dtype: torch.dtype,
                 reduce: bool = True):
        super().__init__()
        self.tp, self.reduce = tp, reduce
        self.weight = attach_loader(new_param(out_features, len(index), dtype=dtype),
                                    {None: index}, dim=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = linear(x, self.weight)
        return self.tp.all_reduce(y) if self.reduce else y


class VocabParallelEmbedding(nn.Module):
    """Vocabulary rows [rank*V_p, (rank+1)*V_p), V_p = ceil(vocab / tp); padding rows are 0."""

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

    def forward(self, token_ids: torch.Tensor) -> torch.Tensor:
        if self.tp.size == 1:
            return F.embedding(token_ids, self.weight)
        local = token_ids - self.start
        is_mine = (local >= 0) & (local < self.per_rank)
        out = F.embedding(local.clamp(0, self.per_rank - 1), self.weight)
        out = out * is_mine[:, None].to(out.dtype)
        return self.tp.all_reduce(out)


class ParallelLMHead(VocabParallelEmbedding):
    """Vocab-sharded output projection; every rank gets the full [N, vocab] logits."""

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = linear(hidden, self.weight)
        return self.tp.all_gather_last(logits)[:, : self.vocab_size]
