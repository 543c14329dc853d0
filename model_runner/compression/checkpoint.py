"""Checkpoint slots of one TP rank: store = select, pack, quantise, balance; load = inverse.

Active state (the runner's): temporal [L, S, H_loc, K, V] fp32, conv [L, S, conv_dim_loc, k-1].
Viewed per unit as pool [L, S, U_loc, D]: GDN U_loc = H_loc, D = K*V; KDA U_loc = H_loc*K, D = V.
Checkpoint buffers, per slot c in [0, num_slots):
    temporal[c] [rows, D]   fp32, or int8 with scale[c] [rows, K] (GDN) / [rows, 1] (KDA) fp32:
                            one symmetric scale per (layer, head, k) over V (paper eq. 10)
    conv[:, c]  [L, conv_dim_loc, k-1], stored whole in the active conv dtype
Rows without storage balancing (rows = R): layer l occupies [o_l, o_l + r_l); ragged
o_{l+1} = o_l + r_l; padded o_l = l * R_max with padding rows [o_l + r_l, o_l + R_max).
With storage balancing (placement storage/hybrid) rows = C and the packed rows are spread over
the group as `redistribute.py` describes; store and load are then collectives.
Conv dtype: kept as the runner's (BF16 in production, so bytes match the paper's accounting;
FP32 tiny models stay bit-identical at W_max = 0). The accounting always counts BF16 conv.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from kernels.int8_quant import dequantize_int8, quantize_int8
from kernels.ragged_state import LAYOUTS, build_unit_index, gather_units, scatter_units
from model_runner.compression.placement import (
    PLACEMENTS,
    HeadOrder,
    check_head_order,
    head_permutation,
    local_units,
    rank_row_counts,
)
from model_runner.compression.plan import ModelIdentity, PlanError, SelectionPlan
from model_runner.compression.redistribute import (
    StorageBalance,
    balance_storage,
    from_storage,
    to_storage,
)
from model_runner.config import ModelConfig

PAYLOADS = ("fp32", "int8")


@dataclass(frozen=True, slots=True)
class CheckpointFormat:
    layout: str = "ragged"  # "ragged" | "padded"
    payload: str = "fp32"  # "fp32" | "int8"
    placement: str = "off"  # "off" | "storage" | "hybrid"

    def __post_init__(self) -> None:
        for name, value, known in (("layout", self.layout, LAYOUTS),
                                   ("payload", self.payload, PAYLOADS),
                                   ("placement", self.placement, PLACEMENTS)):
            if value not in known:
                raise PlanError(f"{name} must be one of {', '.join(known)}, got {value!r}")

    @property
    def is_balanced(self) -> bool:
        return self.placement != "off"


def local_masks(
    plan: SelectionPlan, cfg: ModelConfig, head_order: HeadOrder | None, tp_rank: int,
    tp_size: int,
) -> list[torch.Tensor]:
    """Per layer, bool [U_loc]: is local unit u retained by the plan."""
    mask = plan.mask()  # [L, n]
    units = local_units(cfg, head_order, tp_rank, tp_size)
    return [mask[l, torch.tensor(u, dtype=torch.long)] for l, u in enumerate(units)]


class CheckpointPool:
    """Checkpoint slots on one rank. Slot ids index these buffers, not the active state.

    All checks (plan vs model, TP degree, head order) run before any allocation. With a
    balancing placement `store` and `load` are collectives over `group`: every rank calls them
    with the same number of slots, in the same order.
    """

    def __init__(
        self,
        cfg: ModelConfig,
        plan: SelectionPlan,
        num_slots: int,
        fmt: CheckpointFormat | None = None,
        *,
        tp_rank: int = 0,
        tp_size: int = 1,
        head_order: HeadOrder | None = None,
        conv_dtype: torch.dtype = torch.bfloat16,
        device: torch.device | str = "cpu",
        group: dist.ProcessGroup | None = None,
        identity: ModelIdentity | None = None,
    ):
        fmt = fmt or CheckpointFormat()
        if identity is not None:
            plan.check_matches(identity)
        plan.check_config(cfg)
        order = check_head_order(cfg, head_order)
        if fmt.placement == "hybrid" and order != head_permutation(plan, cfg, tp_size):
            raise PlanError("hybrid placement needs the model loaded with head_permutation(...)")
        if num_slots < 1:
            raise PlanError(f"need at least one checkpoint slot, got {num_slots}")
        self.cfg, self.plan, self.fmt, self.group = cfg, plan, fmt, group
        self.tp_rank, self.tp_size, self.head_order = tp_rank, tp_size, order
        self.num_slots, self.device = num_slots, torch.device(device)
        k, v = cfg.linear_key_head_dim, cfg.linear_value_head_dim
        self.unit_dim = cfg.unit_numel  # D
        self.rows_per_unit = 1 if cfg.is_kda else k  # scale rows (over V) per unit
        self.unit_rows = (self.rows_per_unit, v)  # one unit [D] seen as [rpu, V]
        self.index = build_unit_index(
            local_masks(plan, cfg, order, tp_rank, tp_size), fmt.layout, self.device
        )
        self.balance: StorageBalance | None = None
        num_rows = self.index.num_rows
        if fmt.is_balanced:
            counts = rank_row_counts(plan, cfg, order, tp_size, fmt.layout)
            self.balance = balance_storage(counts)
            num_rows = self.balance.width
        heads_loc = cfg.linear_num_value_heads // tp_size
        conv_loc = cfg.linear_conv_dim // tp_size
        num_layers = cfg.num_linear_layers
        dtype = torch.int8 if fmt.payload == "int8" else torch.float32
        # [N, rows, D]; int8 scales [N, rows, rows_per_unit]
        self.temporal = torch.zeros(num_slots, num_rows, self.unit_dim, dtype=dtype,
                                    device=self.device)
        self.scale = (torch.zeros(num_slots, num_rows, self.rows_per_unit, device=self.device)
                      if fmt.payload == "int8" else None)
        # [L, N, conv_dim_loc, k-1]
        self.conv = torch.zeros(num_layers, num_slots, conv_loc, cfg.linear_conv_kernel_dim - 1,
                                dtype=conv_dtype, device=self.device)
        self.temporal_shape = (num_layers, heads_loc, k, v)

    # ---- sizes ------------------------------------------------------------------------------
    @property
    def num_rows(self) -> int:
        return self.temporal.shape[1]

    def nbytes_per_slot(self) -> int:
        """Bytes this rank really allocates per slot (payload, scales, conv)."""
        total = self.temporal[0].nbytes + self.conv[:, 0].nbytes
        return total + (self.scale[0].nbytes if self.scale is not None else 0)

    # ---- store / load -----------------------------------------------------------------------
    def store(self, temporal: torch.Tensor, conv: torch.Tensor, src_slots: torch.Tensor,
              dst_slots: torch.Tensor) -> None:
        """Active slots src_slots [B] -> checkpoint slots dst_slots [B] (distinct)."""
        pool = self.unit_view(temporal)  # [L, S, U_loc, D]
        self._check_conv(conv)
        src, dst = src_slots.to(self.device), dst_slots.to(self.device)
        self.conv[:, dst] = conv[:, src].to(self.conv.dtype)
        idx = self.index
        if not self.fmt.is_balanced and self.scale is None:
            gather_units(pool, src, idx.unit_layer, idx.unit_index, self.temporal, dst)
            return
        num_reqs = src.numel()
        packed = pool.new_empty(num_reqs, idx.num_rows, self.unit_dim)  # [B, R, D] fp32
        gather_units(pool, src, idx.unit_layer, idx.unit_index, packed,
                     torch.arange(num_reqs, device=self.device))
        if self.scale is None:
            self.temporal[dst] = self._balance_out(packed)
            return
        q, s = quantize_int8(packed.view(num_reqs, idx.num_rows, *self.unit_rows))
        q = q.view(num_reqs, idx.num_rows, self.unit_dim)  # [B, R, D] int8; s [B, R, rpu]
        if self.balance is not None:  # payload and scales travel together as byte rows
            q, s = _from_bytes(self._balance_out(_to_bytes(q, s)), self.unit_dim,
                               self.rows_per_unit)
        self.temporal[dst], self.scale[dst] = q, s

    def load(self, temporal: torch.Tensor, conv: torch.Tensor, src_slots: torch.Tensor,
             dst_slots: torch.Tensor) -> None:
        """Checkpoint slots src_slots [B] -> active slots dst_slots [B] (distinct).

        Retained units are restored (exactly in fp32), omitted units are zero-filled (dasc-nr),
        conv state is restored whole.
        """
        pool = self.unit_view(temporal)  # [L, S, U_loc, D]
        self._check_conv(conv)
        src, dst = src_slots.to(self.device), dst_slots.to(self.device)
        conv[:, dst] = self.conv[:, src].to(conv.dtype)
        idx = self.index
        if not self.fmt.is_balanced and self.scale is None:
            scatter_units(self.temporal, src, idx.unit_pos, pool, dst)
            return
        num_reqs = src.numel()
        if self.scale is None:
            packed = self._balance_in(self.temporal[src])  # [B, R, D]
        else:
            q, s = self.temporal[src], self.scale[src]
            if self.balance is not None:
                q, s = _from_bytes(self._balance_in(_to_bytes(q, s)), self.unit_dim,
                                   self.rows_per_unit)
            q = q.view(num_reqs, idx.num_rows, *self.unit_rows)  # [B, R, rpu, V]
            packed = dequantize_int8(q, s).view(num_reqs, idx.num_rows, self.unit_dim)
        scatter_units(packed, torch.arange(num_reqs, device=self.device), idx.unit_pos, pool, dst)

    # ---- helpers ----------------------------------------------------------------------------
    def unit_view(self, temporal: torch.Tensor) -> torch.Tensor:
        num_layers, heads_loc, k, v = self.temporal_shape
        if (temporal.dim() != 5 or temporal.shape[0] != num_layers
                or tuple(temporal.shape[2:]) != (heads_loc, k, v)
                or temporal.dtype != torch.float32):
            raise ValueError(f"active temporal state must be fp32 [{num_layers}, S, {heads_loc}, "
                             f"{k}, {v}], got {temporal.dtype} {tuple(temporal.shape)}")
        slots = temporal.shape[1]
        if self.cfg.is_kda:
            return temporal.view(num_layers, slots, heads_loc * k, v)
        return temporal.view(num_layers, slots, heads_loc, k * v)

    def _check_conv(self, conv: torch.Tensor) -> None:
        want = (self.conv.shape[0], self.conv.shape[2], self.conv.shape[3])
        if conv.dim() != 4 or (conv.shape[0], conv.shape[2], conv.shape[3]) != want:
            raise ValueError(f"active conv state must be [{want[0]}, S, {want[1]}, {want[2]}], "
                             f"got {tuple(conv.shape)}")

    def _balance_out(self, packed: torch.Tensor) -> torch.Tensor:
        if self.balance is None:
            return packed
        return to_storage(self.balance, self.tp_rank, packed, self.group)

    def _balance_in(self, stored: torch.Tensor) -> torch.Tensor:
        if self.balance is None:
            return stored
        return from_storage(self.balance, self.tp_rank, stored, self.group)


def _to_bytes(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """int8 q [B, R, D] + fp32 scale [B, R, rpu] -> one uint8 row [B, R, D + 4*rpu] per unit."""
    num_reqs, num_rows, unit_dim = q.shape
    rows = q.new_empty(num_reqs, num_rows, unit_dim + 4 * scale.shape[-1], dtype=torch.uint8)
    if rows.numel():  # dtype views refuse the zero strides of empty tensors
        rows[..., :unit_dim] = q.view(torch.uint8)
        rows[..., unit_dim:] = scale.contiguous().view(torch.uint8)
    return rows


def _from_bytes(rows: torch.Tensor, unit_dim: int, rows_per_unit: int):
    """Inverse of `_to_bytes`: uint8 [B, R, D + 4*rpu] -> (int8 [B, R, D], fp32 [B, R, rpu])."""
    num_reqs, num_rows, _ = rows.shape
    if rows.numel() == 0:
        return (rows.new_empty(num_reqs, num_rows, unit_dim, dtype=torch.int8),
                rows.new_empty(num_reqs, num_rows, rows_per_unit, dtype=torch.float32))
    q = rows[..., :unit_dim].contiguous().view(torch.int8)
    s = rows[..., unit_dim:].contiguous().view(torch.float32)
    return q, s
