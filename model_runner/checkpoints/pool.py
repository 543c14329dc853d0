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
the group as `model_runner/compression/balance.py` describes; store and load are then
collectives (`redistribute.py`).
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

from kernels.int8_quant import dequantize_int8
from kernels.int8_quant.naive import quantize_int8_inplace
from kernels.ragged_state.flat_rows import FlatIndex, Scratch, put_rows, take_rows
from kernels.ragged_state.layout import LAYOUTS, build_unit_index
from kernels.ragged_state.native import StateRuns, native_library
from model_runner.checkpoints.backends import (
    CheckpointBackend,
    NativeBackend,
    TorchFlatBackend,
    TritonBackend,
)
from model_runner.checkpoints.redistribute import (
    from_storage,
    int8_from_bytes,
    int8_to_bytes,
    to_storage,
)
from model_runner.compression.balance import StorageBalance, balance_storage
from model_runner.compression.placement import (
    PLACEMENTS,
    HeadOrder,
    check_head_order,
    head_permutation,
    local_units,
    rank_row_counts,
)
from model_runner.compression.plan import ModelIdentity, PlanError, SelectionPlan
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
        self.flat = FlatIndex.of(self.index)
        group = self.flat.group
        all_rows = group + num_slots * num_rows  # rows [0, g) stay zero
        self.payload_rows = torch.zeros(all_rows, self.unit_dim, dtype=dtype, device=self.device)
        self.temporal = self.payload_rows[group:].view(num_slots, num_rows, self.unit_dim)
        self.scale_rows, self.scale = None, None  # int8: [N, rows, rows_per_unit]
        if fmt.payload == "int8":
            self.scale_rows = torch.zeros(all_rows, self.rows_per_unit, device=self.device)
            self.scale = self.scale_rows[group:].view(num_slots, num_rows, self.rows_per_unit)
        self.conv_slots = torch.zeros(num_slots, num_layers, conv_loc,
                                      cfg.linear_conv_kernel_dim - 1, dtype=conv_dtype,
                                      device=self.device)
        self.conv = self.conv_slots.transpose(0, 1)  # [L, N, conv_dim_loc, k-1]
        self.temporal_shape = (num_layers, heads_loc, k, v)
        self.scratch = Scratch(self.device)  # CPU staging buffers
        self.runs = StateRuns.of(self.index, self.unit_dim)  # CPU one-pass runs
        self.slot_bytes = self.temporal.stride(0) * self.temporal.element_size()
        self._triton, self._native, self._torch_flat = (TritonBackend(self), NativeBackend(self),
                                                        TorchFlatBackend(self))

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
            self._backend(pool, conv).store(pool, conv, src, dst)

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
            self._backend(pool, conv).load(pool, conv, src, dst)

    def _backend(self, pool: torch.Tensor, conv: torch.Tensor) -> CheckpointBackend:
        """CUDA or strided state: Triton; contiguous CPU state: the one-pass C library when it
        is built (not with DASC_NATIVE_KERNELS=0), else torch's flat rows."""
        if pool.device.type != "cpu" or not pool.is_contiguous() or not conv.is_contiguous():
            return self._triton
        return self._native if native_library() is not None else self._torch_flat

    # ---- what the backends share ------------------------------------------------------------
    def store_packed(self, packed, dst) -> None:
        """Packed rows [B, R, D] fp32 (overwritten) -> checkpoint slots dst: balance and
        quantise as the format asks (the CPU backends' store)."""
        shape, buffer = packed.shape, self.scratch.get
        if self.scale is None:
            put_rows(self.temporal.flatten(1), dst, self.balance_out(packed).flatten(1))
            return
        units = packed.view(*shape[:2], *self.unit_rows)  # [B, R, rpu, V]
        q, s = quantize_int8_inplace(units, buffer("q", units.shape, torch.int8),
                                     buffer("abs", units.shape, torch.float32))
        q, s = self.balance_int8_out(q.view(shape), s)  # [B, R, D] int8; s [B, R, rpu]
        put_rows(self.temporal.flatten(1), dst, q.flatten(1))
        put_rows(self.scale.flatten(1), dst, s.flatten(1))

    def unbalance(self, src: torch.Tensor) -> torch.Tensor:
        """Collective: checkpoint slots src [B] -> packed fp32 rows [g + B * R, D], rows [0, g)
        zero."""
        num_reqs, num_rows, group = src.numel(), self.index.num_rows, self.flat.group
        packed = self.payload_rows.new_empty(group + num_reqs * num_rows, self.unit_dim,
                                      dtype=torch.float32)
        packed[:group] = 0
        out = packed[group:].view(num_reqs, num_rows, self.unit_dim)
        stored = take_rows(self.temporal.flatten(1), src).view(num_reqs, *self.temporal.shape[1:])
        if self.scale is None:
            self.balance_in(stored, out)
            return packed
        scale = take_rows(self.scale.flatten(1), src).view(num_reqs, *self.scale.shape[1:])
        q, s = self.balance_int8_in(stored, scale)
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

    def balance_out(self, packed: torch.Tensor) -> torch.Tensor:
        """Packed rows [B, R, D] -> this rank's stored rows (a collective when balanced)."""
        if self.balance is None:
            return packed
        return to_storage(self.balance, self.tp_rank, packed, self.group)

    def balance_in(self, stored: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        if self.balance is None:
            return stored
        return from_storage(self.balance, self.tp_rank, stored, self.group, out)

    def balance_int8_out(self, q: torch.Tensor, s: torch.Tensor):
        """INT8 payload and its scales travel together as byte rows."""
        if self.balance is None:
            return q, s
        stored = self.balance_out(int8_to_bytes(q, s))
        return int8_from_bytes(stored, self.unit_dim, self.rows_per_unit)

    def balance_int8_in(self, q: torch.Tensor, s: torch.Tensor):
        if self.balance is None:
            return q, s
        packed = self.balance_in(int8_to_bytes(q, s))
        return int8_from_bytes(packed, self.unit_dim, self.rows_per_unit)
