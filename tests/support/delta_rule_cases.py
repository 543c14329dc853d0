"""Delta-rule cases for fla's kernels against the CPU path: seeded prefill and decode inputs
(KDA with per-channel gates, GDN with scalar ones), the bf16 rounding a bf16 model applies to
them, and the relative error the checks bound.  Used by the interpreter lane
(`test_cuda_branches_interpreted`) and by the same checks on a GPU (`test_cuda_bf16_operands`)."""

from __future__ import annotations

import torch

from kernels.delta_rule.naive import l2norm_div
from model_runner.ops.linear_attention import delta_rule_decode, delta_rule_prefill

SCALE = 0.25
CU_SEQLENS = [0, 66, 71]  # the first sequence crosses fla's 64-token chunk
CASES = {f"{arch}-{op}": (op, per_channel)
         for arch, per_channel in (("kda", True), ("gdn", False)) for op in ("prefill", "decode")}
BF16_ULP = 2**-8  # bf16 keeps 8 significant bits: one unit in the last place, relative


def inputs(per_channel: bool):
    """q, k with 1 key head serving 2 value heads (GVA), log-space g, post-sigmoid beta."""
    gen = torch.Generator().manual_seed(int(per_channel))
    num_tokens, k_dim, v_dim = CU_SEQLENS[-1], 16, 16
    q = l2norm_div(torch.randn(num_tokens, 1, k_dim, generator=gen))
    k = l2norm_div(torch.randn(num_tokens, 1, k_dim, generator=gen))
    v = torch.randn(num_tokens, 2, v_dim, generator=gen)
    g_shape = (num_tokens, 2, k_dim) if per_channel else (num_tokens, 2)
    g = -torch.rand(g_shape, generator=gen).pow(3) * 3  # some units forget at once, some never
    beta = torch.rand(num_tokens, 2, generator=gen)
    states = torch.randn(2, 2, k_dim, v_dim, generator=gen)
    return q, k, v, g, beta, states


def decode_args(per_channel: bool):
    q, k, v, g, beta, states = inputs(per_channel)
    rows = [3, 40]  # one token for each of the two states
    return q[rows], k[rows], v[rows], g[rows], beta[rows], states, SCALE


def prefill_args(per_channel: bool):
    return (*inputs(per_channel), CU_SEQLENS, SCALE)


def case_args(case: str):
    """The arguments of `delta_rule_prefill` / `_decode` for one of `CASES`."""
    op, per_channel = CASES[case]
    return prefill_args(per_channel) if op == "prefill" else decode_args(per_channel)


def delta_rule_op(case: str):
    """The product's dispatch for one of `CASES`: `delta_rule_prefill` or `delta_rule_decode`
    (the CPU path on CPU tensors, fla's kernels on CUDA ones)."""
    return delta_rule_prefill if CASES[case][0] == "prefill" else delta_rule_decode


def bf16_operands(args):
    """q, k, v and beta rounded to bf16, as fla reads them in a bf16 model."""
    q, k, v, g, beta, *rest = args
    return (*(t.bfloat16().float() for t in (q, k, v)), g, beta.bfloat16().float(), *rest)


def rel_err(ours: torch.Tensor, ref: torch.Tensor) -> float:
    return ((ours - ref).abs().max() / ref.abs().max()).item()
