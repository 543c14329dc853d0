"""The collectives of store-time balancing: one variable-split ``all_to_all_single`` per store
moves the rows a `StorageBalance` schedules (row layout in ``model_runner/compression/balance.py``)
and load runs the same exchange backwards; INT8 rows travel as bytes, payload and scales together.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from model_runner.compression.balance import StorageBalance


def to_storage(
    bal: StorageBalance, rank: int, packed: torch.Tensor, group: dist.ProcessGroup | None = None
) -> torch.Tensor:
    """Collective. packed [B, U_rank, W] -> checkpoint rows [B, C, W] (layout in `balance.py`)."""
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
