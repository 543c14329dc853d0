"""bf16 q, k, v and beta into fla's kernels on a GPU (prefill and decode), state kept fp32.

The interpreter lane (`test_cuda_branches_interpreted`) checks the same cases with the Triton
interpreter made to compute bf16 on values; this is the same check on real kernels, at the same
bound (two bf16 ulps of the largest value against the CPU path on the same bf16-rounded
operands).  It is what settles that fla's bf16 chunk kernels are right on the device, not only
under the emulation.  Skipped without a GPU; `tests/gpu/validate.sh` runs it.
"""

from __future__ import annotations

import pytest
import test_cuda_branches_interpreted as lane
import torch

from model_runner.ops.linear_attention import delta_rule_decode, delta_rule_prefill

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@pytest.mark.parametrize("case", list(lane.CASES))
def test_bf16_operands_on_cuda_match_cpu_path(case):
    op, per_channel = lane.CASES[case]
    args = lane._prefill_args(per_channel) if op == "prefill" else lane._decode_args(per_channel)
    fn = delta_rule_prefill if op == "prefill" else delta_rule_decode
    o_ref, final_ref = fn(*lane._bf16_operands(args))
    on_cuda = (a.cuda() if isinstance(a, torch.Tensor) else a for a in args)
    o, final = (t.cpu() for t in fn(*on_cuda, operand_dtype=torch.bfloat16))
    assert o.dtype == final.dtype == torch.float32
    bound = 2 * lane.BF16_ULP
    assert lane._rel_err(o, o_ref) < bound and lane._rel_err(final, final_ref) < bound
