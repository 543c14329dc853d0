"""bf16 q, k, v and beta into fla's kernels on a GPU (prefill and decode), state kept fp32.

The interpreter lane (`test_cuda_branches_interpreted`) checks the same cases (`delta_rule_cases`)
with the Triton interpreter made to compute bf16 on values; this is the same check on real
kernels, at the same bound (two bf16 ulps of the largest value against the CPU path on the same
bf16-rounded operands).  It is what settles that fla's bf16 chunk kernels are right on the
device, not only under the emulation.  Skipped without a GPU; `tests/gpu/validate.sh` runs it.
"""

from __future__ import annotations

import pytest
import torch
from support.delta_rule_cases import (
    BF16_ULP,
    CASES,
    bf16_operands,
    case_args,
    delta_rule_op,
    rel_err,
)

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@pytest.mark.parametrize("case", list(CASES))
def test_bf16_operands_on_cuda_match_cpu_path(case):
    args = case_args(case)
    fn = delta_rule_op(case)
    o_ref, final_ref = fn(*bf16_operands(args))
    on_cuda = (a.cuda() if isinstance(a, torch.Tensor) else a for a in args)
    o, final = (t.cpu() for t in fn(*on_cuda, operand_dtype=torch.bfloat16))
    assert o.dtype == final.dtype == torch.float32
    bound = 2 * BF16_ULP
    assert rel_err(o, o_ref) < bound and rel_err(final, final_ref) < bound
