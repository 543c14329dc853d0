"""CPU lane for the CUDA branches: fla's kernels as the runner calls them, and the fixed-shape
decode step (what a CUDA graph replays) through them, under the Triton interpreter.

One child process (`run_interpreted`, `TRITON_INTERPRET=1`) runs everything; `fla_interpreted`
makes the interpreter adjustments fla's chunk kernels need, in the harness only.  The references
are the CPU path of `model_runner.ops.linear_attention` (pure torch) and the runner's CPU eager
decode.  The interpreter computes exact fp32, so the bounds are fp32 reassociation, far below
what a wrong layout, gate, scale, state or GVA mapping gives (~1e-1); the bf16 bounds are fla's
own bf16 roundings (`test_fla_wrapper_takes_bf16_operands`).
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
from support.paths import TESTS
from support.serving import KIMI, QWEN

from kernels.interpreted import run_interpreted

# (model, prompts, decode steps): Kimi pads 3 sequences to the batch-4 step; fla's GDN decode
# kernel runs ~60 ms per program interpreted, so Qwen decodes one sequence.
DECODES = [(KIMI, [[5, 9, 33, 12, 7, 80, 3, 44, 21], [6, 2, 77], [90, 14, 15, 16]], 2),
           (QWEN, [[5, 9, 33, 12, 7, 80, 3]], 2)]
# (model, prompts) of a prefill step that snapshots the state before each prompt's last token
SNAPSHOTS = [(KIMI, [[5, 9, 33, 12, 7, 80, 3, 44, 21], [6, 2, 77]]),
             (QWEN, [[5, 9, 33, 12, 7, 80, 3]])]
# bf16 models hand fla's kernels q, k, v and beta in bf16 (g and the state stay fp32).
BF16_CASES = list(CASES)


@pytest.fixture(scope="module")
def interpreted(monkeypatch_module) -> dict:
    calls = [("reference_bindings", ())]
    for case, (op, _) in CASES.items():
        calls.append((f"fla_{op}", case_args(case)))
    for case in BF16_CASES:
        calls.append((f"fla_{CASES[case][0]}", (*case_args(case), torch.bfloat16)))
    for model_dir, prompts, steps in DECODES:
        calls += [("greedy_decode", (str(model_dir), prompts, steps, fixed))
                  for fixed in (False, True)]
    for model_dir, prompts in SNAPSHOTS:
        calls += [("snapshot_step", (str(model_dir), prompts, fla)) for fla in (False, True)]
    out = run_interpreted("support.fla_interpreted", calls, timeout_s=900)
    results = {"bindings": out[0], **dict(zip(CASES, out[1 : 1 + len(CASES)]))}
    bf16 = out[1 + len(CASES) : 1 + len(CASES) + len(BF16_CASES)]
    results.update({f"{case}-bf16": r for case, r in zip(BF16_CASES, bf16)})
    first = 1 + len(CASES) + len(BF16_CASES)
    for i, (model_dir, _, _) in enumerate(DECODES):
        results[model_dir.name] = out[first + 2 * i : first + 2 + 2 * i]
    first += 2 * len(DECODES)
    for i, (model_dir, _) in enumerate(SNAPSHOTS):
        results[f"{model_dir.name}-snapshot"] = out[first + 2 * i : first + 2 + 2 * i]
    return results


@pytest.fixture(scope="module")
def monkeypatch_module():
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("PYTHONPATH", str(TESTS))  # the child imports the harness from tests/
        yield mp


@pytest.mark.parametrize("case", list(CASES))
def test_fla_wrapper_matches_cpu_path(case, interpreted):
    ref = delta_rule_op(case)(*case_args(case))
    (o, final), (o_ref, final_ref) = interpreted[case], ref
    assert o.shape == o_ref.shape and final.shape == final_ref.shape
    assert o.dtype == final.dtype == torch.float32
    assert rel_err(o, o_ref) < 2e-6 and rel_err(final, final_ref) < 2e-6


@pytest.mark.parametrize("case", BF16_CASES)
def test_fla_wrapper_takes_bf16_operands(case, interpreted):
    """The CPU path on the same bf16-rounded operands is the reference, so what remains is
    fla's own rounding inside its kernels: it stores the output and, in prefill, its chunk
    intermediates (per-chunk states, WY factors, attention blocks) in bf16, each rounded to
    nearest.  Measured, in bf16 ulps of the largest value: 0.8-1.3 in prefill, 0.5-0.6 in
    decode; 1.9-2.7 in prefill with the interpreter's own truncating casts, ~1e9 with its bf16
    `tl.dot` on bit patterns (tests/support/fla_interpreted.py); 160-720 with v's heads swapped
    or beta before its sigmoid, far more with g in linear space."""
    ref = delta_rule_op(case)(*bf16_operands(case_args(case)))
    (o, final), (o_ref, final_ref) = interpreted[f"{case}-bf16"], ref
    assert o.dtype == final.dtype == torch.float32
    assert rel_err(o, o_ref) < 2 * BF16_ULP and rel_err(final, final_ref) < 2 * BF16_ULP
    exact = interpreted[case]  # the fp32 run: bf16 operands really reached the kernels
    assert not torch.equal(o, exact[0])


@pytest.mark.parametrize("model", [m.name for m, _, _ in DECODES])
def test_fixed_shape_step_through_fla_matches_cpu_decode(model, interpreted):
    eager, fixed = interpreted[model]
    assert len(fixed) == len(eager) > 1
    for ours, ref in zip(fixed, eager):
        assert ours.argmax(-1).tolist() == ref.argmax(-1).tolist()
        assert rel_err(ours, ref) < 1e-5


@pytest.mark.parametrize("model", [m.name for m, _ in SNAPSHOTS])
def test_a_snapshot_step_through_fla_matches_the_cpu_path(model, interpreted):
    """fla's chunk kernels on the sequences one token short, the snapshot copy, then its fused
    recurrent kernel on the last tokens: the logits, the sequences' states and the snapshots
    match the CPU path (measured: at most 6e-7)."""
    cpu, fla = interpreted[f"{model}-snapshot"]
    for name in ("logits", "temporal", "conv"):
        assert rel_err(fla[name], cpu[name]) < 1e-5, name
    n = cpu["logits"].shape[0]
    own, snap = cpu["temporal"][:, 1 : n + 1], cpu["temporal"][:, n + 1 : 2 * n + 1]
    assert snap.abs().amax(dim=(0, 2, 3, 4)).min() > 0, "every snapshot slot was written"
    assert rel_err(snap, own) > 1e-2, "a snapshot is the state before the last token"


def test_reference_imports_keep_fla_importable(interpreted):
    """What conftest does on a CUDA machine: transformers' reference modules bind their torch
    functions, and fla.ops imports afterwards (the GPU tests need both)."""
    assert interpreted["bindings"] == {"fla_bound": [], "fla_ops": True}
