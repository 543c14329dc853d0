"""RMS norms in the exact operation order of each architecture (needed for bitwise-close logits).

Qwen3-Next and Qwen3.5: ``(x_hat * (1 + w)).to(dtype)``, gated ``(w * x_hat.to(dtype)) * silu(z)``.
Kimi-Linear (Llama style): ``w * x_hat.to(dtype)``, gated ``w * x_hat * sigmoid(z)`` in FP32.
OLMo-Hybrid: ``(w * x_hat).to(dtype)`` (the product in FP32), gated as Qwen's.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from kernels.cpu_fused import gated_rmsnorm, rmsnorm
from kernels.derived import derived
from model_runner.layers.linear import attach_loader, new_param


def _normalize(x: torch.Tensor, eps: float) -> torch.Tensor:
    x = x.float()
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float, dtype: torch.dtype, unit_offset: bool,
                 fp32_product: bool = False):
        super().__init__()
        self.eps, self.unit_offset, self.fp32_product = eps, unit_offset, fp32_product
        self.weight = attach_loader(new_param(dim, dtype=dtype), {None: None})

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.device.type == "cpu" and x.dtype == self.weight.dtype:  # one pass in C
            out = rmsnorm(x, self._fp32_weight(), self.eps, round_first=self._rounds_first)
            if out is not None:
                return out
        if self.unit_offset:  # Qwen stores w - 1
            return (_normalize(x, self.eps) * (1.0 + self.weight.float())).type_as(x)
        if self.fp32_product:
            return (self.weight * _normalize(x, self.eps)).to(x.dtype)
        return self.weight * _normalize(x, self.eps).to(x.dtype)

    @property
    def _rounds_first(self) -> bool:
        """Llama's order rounds x_hat to the model dtype before the weight's product."""
        return not self.unit_offset and not self.fp32_product

    def _fp32_weight(self) -> torch.Tensor:
        """The weight as the product applies it, in FP32: (1 + w) with Qwen's offset."""
        offset = self.unit_offset
        return derived(self.weight, "_norm_fp32",
                       lambda w: ((1.0 + w.float()) if offset else w.float()).contiguous())


class GatedRMSNorm(nn.Module):
    """Per-head output norm of a linear-attention layer, gated by z (silu: GDN, sigmoid: KDA)."""

    def __init__(self, dim: int, eps: float, dtype: torch.dtype, gate: str):
        super().__init__()
        self.eps, self.gate = eps, gate
        self.weight = attach_loader(new_param(dim, dtype=dtype), {None: None})

    def forward(self, x: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        if self.gate == "silu":
            y = self.weight * _normalize(x, self.eps).to(dtype)
            return (y * F.silu(z.float())).to(dtype)
        y = self.weight.float() * _normalize(x, self.eps)
        return (y * torch.sigmoid(z.float())).to(dtype)

    def from_fp32(self, o: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        """``forward`` of o [N, H, dim] FP32 rounded to z's dtype, z [N, H * dim]: in one pass
        of ``kernels/cpu_fused`` on a CPU (silu gate), else in torch."""
        if self.gate == "silu":
            weight = derived(self.weight, "_fp32", lambda w: w.float().contiguous())
            out = gated_rmsnorm(o, z, weight, self.eps)
            if out is not None:
                return out
        dim = o.shape[-1]
        return self(o.to(z.dtype).reshape(-1, dim), z.reshape(-1, dim))
