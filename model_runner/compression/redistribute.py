"""Store-time balancing: the TP group as one pool of checkpoint rows of width C per rank.

Rank r packs U_r rows (its compute-local checkpoint rows, in local row order). With
C = ceil(sum_r U_r / T), every rank's checkpoint slot has C rows:
    slot rows [0, min(U_r, C))        own packed rows [0, min(U_r, C))
    slot rows [U_r, U_r + in_r)       rows received from donors, in source-rank order (U_r < C)
    the rest                          unused slack (zero)
Own packed rows [C, U_r) (donors, U_r > C) live on other ranks: the excess of all donors in rank
order is matched to the free space of all receivers in rank order, so every (src, dst) pair moves
one contiguous row range and one variable-split `all_to_all_single` carries a whole store (load
runs the same exchange backwards). Every rank derives the same schedule from the counts alone.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass(frozen=True, slots=True)
class StorageBalance:
    counts: tuple[int, ...]  # U_r: packed rows per rank
    width: int  # C: checkpoint rows per rank
    send: tuple[tuple[int, ...], ...]  # send[r][d]: rows rank r hands to rank d

    @property
    def tp_size(self) -> int:
        return len(self.counts)

    @property
    def moved_rows(self) -> int:
        """Rows crossing ranks per stored checkpoint."""
        return sum(map(sum, self.send))

    def kept(self, rank: int) -> int:
        return min(self.counts[rank], self.width)

    def received(self, rank: int) -> list[int]:
        """Rows rank `rank` receives from each source rank."""
        return [self.send[s][rank] for s in range(self.tp_size)]


def balance_storage(counts: list[int]) -> StorageBalance:
    """Two-pointer match of donor excess rows to receiver free rows (both in rank order)."""
    if not counts or any(c < 0 for c in counts):
        raise ValueError(f"need non-negative per-rank row counts, got {counts}")
    tp_size = len(counts)
    width = math.ceil(sum(counts) / tp_size)
    send = [[0] * tp_size for _ in range(tp_size)]
    excess = [max(c - width, 0) for c in counts]
    free = [max(width - c, 0) for c in counts]
    dst = 0
    for src in range(tp_size):
        while excess[src]:
            while free[dst] == 0:
                dst += 1
            n = min(excess[src], free[dst])
            send[src][dst] += n
            excess[src] -= n
            free[dst] -= n
    return StorageBalance(tuple(counts), width, tuple(tuple(row) for row in send))


def to_storage(
    bal: StorageBalance, rank: int, packed: torch.Tensor, group: dist.ProcessGroup | None = None
) -> torch.Tensor:
    """Collective. packed [B, U_rank, W] -> checkpoint rows [B, C, W] (layout in module doc)."""
    num_reqs, width = packed.shape[0], packed.shape[2]
    if packed.shape[1] != bal.counts[rank]:
        raise ValueError(f"rank {rank} packed {packed.shape[1]} rows, expected {bal.counts[rank]}")
    out = packed.new_zeros(num_reqs, bal.width, width)
    keep = bal.kept(rank)
    out[:, :keep] = packed[:, :keep]
    if bal.moved_rows == 0:
        return out
    outgoing = [packed[:, bal.width :]]  # rows [C, U_r), destinations in rank order
    received = _exchange(bal.send[rank], bal.received(rank), outgoing, packed, group)
    start = bal.counts[rank]
    for chunk in received:
        out[:, start : start + chunk.shape[1]] = chunk
        start += chunk.shape[1]
    return out


def from_storage(
    bal: StorageBalance, rank: int, stored: torch.Tensor, group: dist.ProcessGroup | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Collective inverse of `to_storage`: checkpoint rows [B, C, W] -> packed [B, U_rank, W],
    written to `out` when given."""
    num_reqs, width = stored.shape[0], stored.shape[2]
    if stored.shape[1] != bal.width:
        raise ValueError(f"stored slot has {stored.shape[1]} rows, expected {bal.width}")
    shape = (num_reqs, bal.counts[rank], width)
    if out is not None and (tuple(out.shape) != shape or out.dtype != stored.dtype):
        raise ValueError(f"out must be {stored.dtype} {shape}, got {out.dtype} {tuple(out.shape)}")
    packed = stored.new_empty(shape) if out is None else out
    keep = bal.kept(rank)
    packed[:, :keep] = stored[:, :keep]
    if bal.moved_rows == 0:
        return packed
    start, held = bal.counts[rank], bal.received(rank)
    outgoing = [stored[:, start : start + sum(held)]]  # back to their sources, in rank order
    returned = _exchange(held, bal.send[rank], outgoing, stored, group)
    row = bal.width
    for chunk in returned:
        packed[:, row : row + chunk.shape[1]] = chunk
        row += chunk.shape[1]
    return packed


def _exchange(
    send_rows: list[int] | tuple[int, ...],
    recv_rows: list[int],
    outgoing: list[torch.Tensor],
    like: torch.Tensor,
    group: dist.ProcessGroup | None,
) -> list[torch.Tensor]:
    """One all_to_all_single; `outgoing` [B, sum(send_rows), W] is ordered by destination.

    Each destination's rows travel as one [B * n, W] block so dim 0 carries the split.
    Returns, per source rank, the received rows [B, n, W].
    """
    num_reqs, width = like.shape[0], like.shape[2]
    rows = torch.cat(outgoing, dim=1)  # [B, sum send, W]
    blocks, start = [], 0
    for n in send_rows:
        blocks.append(rows[:, start : start + n].reshape(num_reqs * n, width))
        start += n
    send_buf = torch.cat(blocks) if blocks else like.new_empty(0, width)
    recv_buf = like.new_empty(num_reqs * sum(recv_rows), width)
    dist.all_to_all_single(
        recv_buf,
        send_buf.contiguous(),
        output_split_sizes=[num_reqs * n for n in recv_rows],
        input_split_sizes=[num_reqs * n for n in send_rows],
        group=group,
    )
    chunks, start = [], 0
    for n in recv_rows:
        chunks.append(recv_buf[start : start + num_reqs * n].view(num_reqs, n, width))
        start += num_reqs * n
    return chunks


def int8_to_bytes(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """int8 q [B, R, D] + fp32 scale [B, R, rpu] -> one uint8 row [B, R, D + 4*rpu] per unit."""
    num_reqs, num_rows, unit_dim = q.shape
    rows = q.new_empty(num_reqs, num_rows, unit_dim + 4 * scale.shape[-1], dtype=torch.uint8)
    if rows.numel():  # dtype views refuse the zero strides of empty tensors
        rows[..., :unit_dim] = q.view(torch.uint8)
        rows[..., unit_dim:] = scale.contiguous().view(torch.uint8)
    return rows


def int8_from_bytes(rows: torch.Tensor, unit_dim: int, rows_per_unit: int):
    """Inverse of `int8_to_bytes`: uint8 [B, R, D + 4*rpu] -> (int8 [B, R, D], fp32 [B, R, rpu])."""
    num_reqs, num_rows, _ = rows.shape
    if rows.numel() == 0:
        return (rows.new_empty(num_reqs, num_rows, unit_dim, dtype=torch.int8),
                rows.new_empty(num_reqs, num_rows, rows_per_unit, dtype=torch.float32))
    q = rows[..., :unit_dim].contiguous().view(torch.int8)
    s = rows[..., unit_dim:].contiguous().view(torch.float32)
    return q, s
