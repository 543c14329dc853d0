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
Memory: payload rows [g + N * rows, D] (scales alike) behind g zero rows, g = FlatIndex.group,
so CPU loads read omitted units there; conv slot-major [N, L, conv_dim_loc, k-1], so one slot is
one block.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from kernels.int8_quant import dequantize_int8, quantize_int8, quantize_int8_inplace
from kernels.ragged_state import LAYOUTS, build_unit_index, gather_units, scatter_units
from kernels.ragged_state_cpu import (
    FlatIndex,
    Scratch,
    load_rows,
    put_rows,
    put_units,
    slot_blocks,
    stage_units,
    take_rows,
)
from kernels.state_copy import (
    StateRuns,
    check_slots,
    conv_runs,
    copy_runs,
    dequantize_runs,
    native_library,
    quantize_runs,
)
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
    int8_from_bytes,
    int8_to_bytes,
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
        self._flat = FlatIndex.of(self.index)
        group = self._flat.group
        all_rows = group + num_slots * num_rows  # rows [0, g) stay zero
        self._rows = torch.zeros(all_rows, self.unit_dim, dtype=dtype, device=self.device)
        self.temporal = self._rows[group:].view(num_slots, num_rows, self.unit_dim)  # [N, rows, D]
        self._scale_rows, self.scale = None, None  # int8: [N, rows, rows_per_unit]
        if fmt.payload == "int8":
            self._scale_rows = torch.zeros(all_rows, self.rows_per_unit, device=self.device)
            self.scale = self._scale_rows[group:].view(num_slots, num_rows, self.rows_per_unit)
        self._conv_slots = torch.zeros(num_slots, num_layers, conv_loc,
                                       cfg.linear_conv_kernel_dim - 1, dtype=conv_dtype,
                                       device=self.device)
        self.conv = self._conv_slots.transpose(0, 1)  # [L, N, conv_dim_loc, k-1]
        self.temporal_shape = (num_layers, heads_loc, k, v)
        self._scratch = Scratch(self.device)  # CPU staging buffers
        self._runs = StateRuns.of(self.index, self.unit_dim)  # CPU one-pass runs
        self._slot_bytes = self.temporal.stride(0) * self.temporal.element_size()

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
        self._check_call(pool, conv, src_slots, dst_slots)
        src, dst = src_slots.to(self.device), dst_slots.to(self.device)
        if src.numel():  # ranks of a balanced pool all skip an empty call together
            self._cpu_path(pool, conv, self._store_native, self._store_flat,
                           self._store_kernels)(pool, conv, src, dst)

    def load(self, temporal: torch.Tensor, conv: torch.Tensor, src_slots: torch.Tensor,
             dst_slots: torch.Tensor) -> None:
        """Checkpoint slots src_slots [B] -> active slots dst_slots [B] (distinct).

        Retained units are restored (exactly in fp32), omitted units are zero-filled (dasc-nr),
        conv state is restored whole.
        """
        pool = self.unit_view(temporal)  # [L, S, U_loc, D]
        self._check_call(pool, conv, src_slots, dst_slots)
        src, dst = src_slots.to(self.device), dst_slots.to(self.device)
        if src.numel():
            self._cpu_path(pool, conv, self._load_native, self._load_flat,
                           self._load_kernels)(pool, conv, src, dst)

    # ---- CUDA (Triton kernels; also any non-contiguous state) -------------------------------
    def _store_kernels(self, pool, conv, src, dst) -> None:
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
            q, s = self._balance_int8_out(q, s)
        self.temporal[dst], self.scale[dst] = q, s

    def _load_kernels(self, pool, conv, src, dst) -> None:
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
                q, s = self._balance_int8_in(q, s)
            q = q.view(num_reqs, idx.num_rows, *self.unit_rows)  # [B, R, rpu, V]
            packed = dequantize_int8(q, s).view(num_reqs, idx.num_rows, self.unit_dim)
        scatter_units(packed, torch.arange(num_reqs, device=self.device), idx.unit_pos, pool, dst)

    def _cpu_path(self, pool, conv, native, flat, kernels):
        """Contiguous CPU state: the one-pass C runs when the library is built, else torch's
        flat rows; CUDA or strided state: the kernel path."""
        if pool.device.type != "cpu" or not pool.is_contiguous() or not conv.is_contiguous():
            return kernels
        return native if native_library() is not None else flat

    # ---- CPU: one pass per buffer over precomputed runs (kernels/state_copy.py) -------------
    def _copy_conv(self, conv, src, dst, store: bool) -> None:
        ckpt = self._conv_slots  # [N, L, C, k-1]
        if conv.dtype != ckpt.dtype:  # a conversion, not a copy: torch's
            if store:
                self.conv[:, dst] = conv[:, src].to(ckpt.dtype)
            else:
                conv[:, dst] = self.conv[:, src].to(conv.dtype)
            return
        block = conv.stride(1) * conv.element_size()  # one layer of one slot
        to_ckpt, to_pool = conv_runs(conv.shape[0], conv.shape[1], block)
        if store:
            copy_runs(conv, ckpt, src, dst, block, conv.shape[0] * block, to_ckpt)
        else:
            copy_runs(ckpt, conv, src, dst, conv.shape[0] * block, block, to_pool)

    def _store_native(self, pool, conv, src, dst) -> None:
        num_slots, slot_floats = pool.shape[1], pool.stride(1)
        src, dst = check_slots(src, num_slots, "active"), check_slots(dst, self.num_slots,
                                                                      "checkpoint")
        self._copy_conv(conv, src, dst, store=True)
        if self.scale is not None and self.balance is None:
            quantize_runs(pool, self.temporal, self.scale, src, dst, slot_floats,
                          self._runs.int8(num_slots)[0], *self.unit_rows)
            return
        runs = self._runs.fp32(num_slots)[0]
        if self.balance is None:
            copy_runs(pool, self.temporal, src, dst, slot_floats * 4, self._slot_bytes, runs)
            return
        num_reqs = src.numel()  # pack [B, R, D] fp32, then balance (and quantise)
        packed = self._scratch.get("units_out", (num_reqs, self.index.num_rows, self.unit_dim),
                                   torch.float32)
        copy_runs(pool, packed, src, torch.arange(num_reqs), slot_floats * 4,
                  packed.stride(0) * 4, runs)
        self._store_packed(packed, dst)

    def _load_native(self, pool, conv, src, dst) -> None:
        num_slots, slot_floats = pool.shape[1], pool.stride(1)
        src, dst = check_slots(src, self.num_slots, "checkpoint"), check_slots(dst, num_slots,
                                                                               "active")
        self._copy_conv(conv, src, dst, store=False)
        if self.scale is not None and self.balance is None:
            dequantize_runs(self.temporal, self.scale, pool, src, dst, slot_floats,
                            self._runs.int8(num_slots)[1], *self.unit_rows)
            return
        runs = self._runs.fp32(num_slots)[1]
        if self.balance is None:
            copy_runs(self.temporal, pool, src, dst, self._slot_bytes, slot_floats * 4, runs)
            return
        packed = self._unbalance(src)[self._flat.group:]  # collective; fp32 [B * R, D]
        copy_runs(packed, pool, torch.arange(src.numel()), dst,
                  self.index.num_rows * self.unit_dim * 4, slot_floats * 4, runs)

    # ---- CPU without the C library: one flat row gather + one block write per buffer --------

    def _store_flat(self, pool, conv, src, dst) -> None:
        num_reqs, buffer = src.numel(), self._scratch.get
        layer_starts = self._flat.active(pool.shape[1])[1]
        conv_rows = conv.view(-1, conv.shape[2] * conv.shape[3])  # [L * S, conv]
        staged = take_rows(conv_rows, slot_blocks(src, layer_starts, slot_major=True),
                           buffer("conv_out", (num_reqs, self._conv_slots[0].numel()),
                                  conv.dtype))  # [B, L * conv]
        put_rows(self._conv_slots.flatten(1), dst, staged.to(self.conv.dtype))
        shape = (num_reqs, self.index.num_rows, self.unit_dim)  # [B, R, D]
        self._store_packed(stage_units(pool, src, self._flat,
                                       buffer("units_out", shape, torch.float32)), dst)

    def _store_packed(self, packed, dst) -> None:
        """Packed rows [B, R, D] fp32 (overwritten) -> checkpoint slots dst: balance and
        quantise as the format asks."""
        shape, buffer = packed.shape, self._scratch.get
        if self.scale is None:
            put_rows(self.temporal.flatten(1), dst, self._balance_out(packed).flatten(1))
            return
        units = packed.view(*shape[:2], *self.unit_rows)  # [B, R, rpu, V]
        q, s = quantize_int8_inplace(units, buffer("q", units.shape, torch.int8),
                                     buffer("abs", units.shape, torch.float32))
        q = q.view(shape)  # [B, R, D] int8; s [B, R, rpu]
        if self.balance is not None:
            q, s = self._balance_int8_out(q, s)
        put_rows(self.temporal.flatten(1), dst, q.flatten(1))
        put_rows(self.scale.flatten(1), dst, s.flatten(1))

    def _load_flat(self, pool, conv, src, dst) -> None:
        num_reqs, width = src.numel(), self._flat.group * self.unit_dim
        layer_starts, buffer = self._flat.active(pool.shape[1])[1], self._scratch.get
        staged = take_rows(self._conv_slots.flatten(1), src,
                           buffer("conv_in", (num_reqs, self._conv_slots[0].numel()),
                                  self.conv.dtype))  # [B, L * conv]
        conv_rows = conv.view(-1, conv.shape[2] * conv.shape[3])  # [L * S, conv]
        put_rows(conv_rows, slot_blocks(dst, layer_starts, slot_major=True),
                 staged.to(conv.dtype).view(-1, conv_rows.shape[1]))
        if self.balance is None:  # gather straight from the checkpoint rows
            rows = load_rows(self._flat, src)
            staged = take_rows(self._rows.view(-1, width), rows,
                               buffer("units_in", (rows.numel(), width), self._rows.dtype))
            if self.scale is not None:  # [M, g * D] int8 -> fp32
                scale = take_rows(self._scale_rows.view(-1, width // self.unit_rows[1]), rows)
                q = staged.view(-1, *self.unit_rows)
                staged = dequantize_int8(q, scale.view(q.shape[:-1]),
                                         buffer("fp32", q.shape, torch.float32))
        else:
            rows = load_rows(self._flat, torch.arange(num_reqs))
            staged = take_rows(self._unbalance(src).view(-1, width), rows)
        put_units(pool, dst, staged.view(-1, width), self._flat)

    def _unbalance(self, src: torch.Tensor) -> torch.Tensor:
        """Collective: checkpoint slots src [B] -> packed fp32 rows [g + B * R, D], rows [0, g)
        zero."""
        num_reqs, num_rows, group = src.numel(), self.index.num_rows, self._flat.group
        packed = self._rows.new_empty(group + num_reqs * num_rows, self.unit_dim,
                                      dtype=torch.float32)
        packed[:group] = 0
        out = packed[group:].view(num_reqs, num_rows, self.unit_dim)
        stored = take_rows(self.temporal.flatten(1), src).view(num_reqs, *self.temporal.shape[1:])
        if self.scale is None:
            self._balance_in(stored, out)
            return packed
        scale = take_rows(self.scale.flatten(1), src).view(num_reqs, *self.scale.shape[1:])
        q, s = self._balance_int8_in(stored, scale)
        dequantize_int8(q.view(num_reqs, num_rows, *self.unit_rows), s,
                        out.view(num_reqs, num_rows, *self.unit_rows))
        return packed

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

    def _check_call(self, pool: torch.Tensor, conv: torch.Tensor, src: torch.Tensor,
                    dst: torch.Tensor) -> None:
        """Shapes the kernels rely on: conv state with the pool's slots, one dst per src."""
        want = (self.conv.shape[0], pool.shape[1], self.conv.shape[2], self.conv.shape[3])
        if conv.dim() != 4 or tuple(conv.shape) != want:
            raise ValueError(f"active conv state must be [{want[0]}, S={want[1]}, {want[2]}, "
                             f"{want[3]}], got {tuple(conv.shape)}")
        if src.dim() != 1 or src.shape != dst.shape:
            raise ValueError(f"src_slots and dst_slots must both be [B], got {tuple(src.shape)} "
                             f"and {tuple(dst.shape)}")

    def _balance_out(self, packed: torch.Tensor) -> torch.Tensor:
        if self.balance is None:
            return packed
        return to_storage(self.balance, self.tp_rank, packed, self.group)

    def _balance_int8_out(self, q: torch.Tensor, s: torch.Tensor):
        """Payload and scales travel together as byte rows."""
        stored = self._balance_out(int8_to_bytes(q, s))
        return int8_from_bytes(stored, self.unit_dim, self.rows_per_unit)

    def _balance_int8_in(self, q: torch.Tensor, s: torch.Tensor):
        packed = self._balance_in(int8_to_bytes(q, s))
        return int8_from_bytes(packed, self.unit_dim, self.rows_per_unit)

    def _balance_in(self, stored: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        if self.balance is None:
            return stored
        return from_storage(self.balance, self.tp_rank, stored, self.group, out)
