"""Static retention horizons from decay weights (paper eqs. 2-3) and the model identity.

Unit numbering inside one linear layer (the same on every rank, before any TP split):
    GDN: unit u = value head h, u in [0, H_v)
    KDA: unit u = h * K + k,    u in [0, H * K)   (key channel k of head h: state row [h, k, :])
`DecayParams` keeps one row per linear layer, in `cfg.linear_layer_ids` order:
    A_log   [L, H_v]        fp32 (KDA: H_v = H, the (1,1,H,1) on-disk shape is flattened)
    dt_bias [L, n_units]    fp32 (GDN: per value head; KDA: index h * K + k)
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from model_runner.compression.defaults import DEFAULT_EPS, DEFAULT_GATE_INPUT
from model_runner.config import ModelConfig


@dataclass(frozen=True, slots=True)
class DecayParams:
    """Decay parameters of every linear layer, fp32, on CPU."""

    A_log: torch.Tensor  # [L, H_v]
    dt_bias: torch.Tensor  # [L, n_units]

    @classmethod
    def from_layers(
        cls, cfg: ModelConfig, a_logs: list[torch.Tensor], dt_biases: list[torch.Tensor]
    ) -> DecayParams:
        """Stack per-layer tensors in any of their on-disk shapes; checks the geometry."""
        num_layers, heads = cfg.num_linear_layers, cfg.linear_num_value_heads
        if len(a_logs) != num_layers or len(dt_biases) != num_layers:
            raise ValueError(
                f"decay parameters for {len(a_logs)}/{len(dt_biases)} layers, "
                f"the config has {num_layers} linear layers"
            )
        n_units = heads * cfg.units_per_head
        rows_a, rows_dt = [], []
        for i, (a, dt) in enumerate(zip(a_logs, dt_biases, strict=True)):
            layer = cfg.linear_layer_ids[i]
            if a.numel() != heads:
                raise ValueError(f"layer {layer}: A_log has {a.numel()} values, expected {heads}")
            if dt.numel() != n_units:
                raise ValueError(
                    f"layer {layer}: dt_bias has {dt.numel()} values, expected {n_units}"
                )
            rows_a.append(a.detach().reshape(heads).to("cpu", torch.float32))
            rows_dt.append(dt.detach().reshape(n_units).to("cpu", torch.float32))
        return cls(torch.stack(rows_a), torch.stack(rows_dt))

    def sha256(self) -> str:
        """Digest of shapes and fp32 little-endian bytes: names the weights a plan was built on."""
        h = hashlib.sha256()
        for t in (self.A_log, self.dt_bias):
            h.update(repr(tuple(t.shape)).encode())
            h.update(t.contiguous().numpy().astype("<f4").tobytes())
        return h.hexdigest()


def static_log_decay(
    cfg: ModelConfig, params: DecayParams, gate_input: float = DEFAULT_GATE_INPUT
) -> torch.Tensor:
    """g = -exp(A_log[h]) * softplus(gate_input + dt_bias[u]) in fp32.  Returns [L, n_units]."""
    a = params.A_log.to(torch.float32)  # [L, H_v]
    dt = params.dt_bias.to(torch.float32)  # [L, n_units]
    per_head = -torch.exp(a)  # [L, H_v]
    per_unit = per_head.repeat_interleave(cfg.units_per_head, dim=1)  # [L, n_units]
    return per_unit * F.softplus(dt + gate_input)


def static_horizons(
    cfg: ModelConfig,
    params: DecayParams,
    gate_input: float = DEFAULT_GATE_INPUT,
    eps: float = DEFAULT_EPS,
) -> torch.Tensor:
    """H_s = ln(eps) / g per unit, fp32 [L, n_units]; +inf where g underflows to 0."""
    if not 0.0 < eps < 1.0:
        raise ValueError(f"eps must be in (0, 1), got {eps}")
    g = static_log_decay(cfg, params, gate_input)
    return torch.tensor(math.log(eps), dtype=torch.float32) / g


def random_decay_params(
    cfg: ModelConfig,
    seed: int = 0,
    a_range: tuple[float, float] = (1.0, 16.0),
    dt_range: tuple[float, float] = (1e-3, 1e-1),
) -> DecayParams:
    """fla-style draws: A_log = log U(a_range), dt ~ logU(dt_range), dt_bias = softplus^-1(dt).

    Gives the realistic spread of horizons that tiny test models and balance reports need.
    """
    gen = torch.Generator().manual_seed(seed)
    num_layers, heads = cfg.num_linear_layers, cfg.linear_num_value_heads
    n_units = heads * cfg.units_per_head
    lo, hi = a_range
    a = torch.empty(num_layers, heads, dtype=torch.float64).uniform_(lo, hi, generator=gen)
    u = torch.rand(num_layers, n_units, dtype=torch.float64, generator=gen)
    dt = torch.exp(math.log(dt_range[0]) + u * (math.log(dt_range[1]) - math.log(dt_range[0])))
    dt_bias = dt + torch.log(-torch.expm1(-dt))  # inverse softplus
    return DecayParams(torch.log(a).float(), dt_bias.float())
