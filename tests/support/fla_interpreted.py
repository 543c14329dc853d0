"""The CUDA branches on CPU under the Triton interpreter: fla's kernels and the fixed-shape step.

Runs in a child process started with `TRITON_INTERPRET=1` (`kernels.interpreted.run_interpreted`),
where importing this module makes the adjustments fla 0.6.0's chunk kernels need there
(1 and 2 below), here in the test harness and never in the product:
1. an autotuner launches one config: there is no driver to benchmark with.  It takes the last
   (fla lists small blocks first; the interpreter runs one program at a time, so the largest
   blocks are the quickest, ~2x on the KDA intra-chunk kernel).  Any listed config is valid;
2. the index of a `range` / `tl.range` loop becomes an interpreter tensor, as it is when
   compiled: fla calls `i_t.to(tl.int64)` on it, which a Python int lacks.
3. bf16 is computed on its values.  The interpreter stores bf16 as the uint16 bit pattern and
   only converts it in casts (Triton's debugging guide: no bf16 arithmetic; triton-lang/triton
   #11584, not fixed in 3.9.0), so fla's chunk kernels, which `tl.dot` bf16 blocks, multiplied
   bit patterns: ~1e9.  Here bf16 enters `tl.dot` as fp32 (bf16 products are exact in fp32, an
   MMA accumulates them in fp32), elementwise ops round the fp32 result to nearest even (a
   correctly rounded bf16 op), and so do fp32 -> bf16 casts, as `cvt.rn.bf16.f32` does (the
   interpreter truncates: ~2x the error).  On bf16 values fla's chunk and fused recurrent
   kernels only move bits (load, store, transpose, broadcast, select), cast, `tl.dot` and
   multiply; no reduction or scan (counted, for the cases the tests run).
The entry points run the product's dispatch (`delta_rule_prefill` / `_decode`) with `is_cuda`
claimed, so their CUDA branches, operand casts included, run on CPU tensors.
"""

from __future__ import annotations

import ast
import os
from contextlib import contextmanager

import numpy as np
import torch

if os.environ.get("TRITON_INTERPRET") != "1":
    raise ImportError("fla_interpreted needs TRITON_INTERPRET=1 before triton is imported")

import triton.language as tl  # noqa: E402
from triton.runtime import interpreter  # noqa: E402
from triton.runtime.autotuner import Autotuner  # noqa: E402

from model_runner.batch import SeqInput  # noqa: E402
from model_runner.ops import linear_attention  # noqa: E402
from model_runner.runner import ModelRunner, RunnerConfig  # noqa: E402
from support.runner_scenarios import snapshot_cuts  # noqa: E402


def _one_config_run(self, *args, **kwargs):
    config = self.configs[-1]
    self.nargs = dict(zip(self.arg_names, args))
    self.best_config = config
    if config.pre_hook is not None:
        config.pre_hook({**self.nargs, **kwargs, **config.all_kwargs()})
    return self.fn.run(*args, **kwargs, **config.all_kwargs())


class _TensorLoopIndex(interpreter.ASTTransformer):
    """`for i in range(...)` gets `i = i` as its first statement, which the interpreter's own
    assignment rewrite turns into `i = to_tensor(i)`."""

    def visit_For(self, node):
        loop = node.iter
        is_range = isinstance(loop, ast.Call) and (
            (isinstance(loop.func, ast.Name) and loop.func.id == "range")
            or (isinstance(loop.func, ast.Attribute) and loop.func.attr == "range"))
        if is_range and isinstance(node.target, ast.Name):
            name = node.target.id
            node.body.insert(0, ast.Assign(targets=[ast.Name(id=name, ctx=ast.Store())],
                                           value=ast.Name(id=name, ctx=ast.Load())))
        return self.generic_visit(node)


_DEVICE_CALL = interpreter.InterpretedFunction.__call__


def _device_call(self, *args, **kwargs):
    # Speed only: the interpreter re-patches triton.language on every call of a @jit helper
    # (fla's exp2, ...), ~10 ms each, though the launch running it has patched `tl` already.
    # Helpers that see only `tl` skip that; triton's own (they see `tl.core`) go the usual way.
    if any(v is tl.core for v in self.fn.__globals__.values()):
        return _DEVICE_CALL(self, *args, **kwargs)
    try:
        return self.rewrite()(*args, **kwargs)
    except Exception as e:
        raise interpreter.InterpreterError(repr(e)) from e


def _bf16_values(data: np.ndarray) -> np.ndarray:
    """bf16 bit patterns (uint16, how the interpreter stores bf16) -> fp32 values, exactly."""
    bits = torch.from_numpy(np.ascontiguousarray(data).view(np.int16))
    return bits.view(torch.bfloat16).float().numpy()


def _bf16_bits(values: np.ndarray) -> np.ndarray:
    """fp32 values -> bf16 bit patterns, rounded to nearest even (torch rounds as a GPU does)."""
    rounded = torch.from_numpy(np.ascontiguousarray(values, dtype=np.float32)).bfloat16()
    return rounded.view(torch.int16).numpy().view(np.uint16)


def _is_bf16(handle) -> bool:
    return handle.dtype.scalar == tl.bfloat16


_BUILDER = interpreter.InterpreterBuilder
_DOT, _BINARY, _UNARY, _CAST = (_BUILDER.create_dot, _BUILDER.binary_op, _BUILDER.unary_op,
                                _BUILDER.cast_impl)


def _dot(self, a, b, d, *args):
    a, b = (interpreter.TensorHandle(_bf16_values(x.data), tl.float32) if _is_bf16(x) else x
            for x in (a, b))
    return _DOT(self, a, b, d, *args)


def _binary_op(self, lhs, rhs, op):
    if not (_is_bf16(lhs) and _is_bf16(rhs)):
        return _BINARY(self, lhs, rhs, op)
    out = op(_bf16_values(lhs.data), _bf16_values(rhs.data))  # a comparison gives bools
    return interpreter.TensorHandle(_bf16_bits(out) if out.dtype == np.float32 else out,
                                    tl.bfloat16)


def _unary_op(self, arg, op):
    if not _is_bf16(arg):
        return _UNARY(self, arg, op)
    return interpreter.TensorHandle(_bf16_bits(op(_bf16_values(arg.data))), tl.bfloat16)


def _cast(self, src, dst_type):
    if dst_type.scalar == tl.bfloat16 and src.dtype.scalar == tl.float32:
        return interpreter.TensorHandle(_bf16_bits(src.data), tl.bfloat16)
    return _CAST(self, src, dst_type)


Autotuner.run = _one_config_run
interpreter.FunctionRewriter.ast_transformer = _TensorLoopIndex()
interpreter.InterpretedFunction.__call__ = _device_call
_BUILDER.create_dot, _BUILDER.binary_op, _BUILDER.unary_op, _BUILDER.cast_impl = (
    _dot, _binary_op, _unary_op, _cast)


def fla_prefill(q, k, v, g, beta, states, cu_seqlens, scale, operand_dtype=torch.float32):
    """The CUDA branch of `delta_rule_prefill` (fla's chunk kernels), operand cast included."""
    with tensors_claim_cuda():
        return linear_attention.delta_rule_prefill(q, k, v, g, beta, states, cu_seqlens, scale,
                                                   operand_dtype)


def fla_decode(q, k, v, g, beta, states, scale, operand_dtype=torch.float32):
    """The CUDA branch of `delta_rule_decode` (fla's fused recurrent kernels)."""
    with tensors_claim_cuda():
        return linear_attention.delta_rule_decode(q, k, v, g, beta, states, scale, operand_dtype)


@contextmanager
def tensors_claim_cuda():
    """Every `Tensor.is_cuda` reads True: the runner's device dispatch takes its CUDA branches
    (fla, the SDPA attention forms) while the tensors stay on CPU."""
    torch.Tensor.is_cuda = property(lambda self: True)
    try:
        yield
    finally:
        del torch.Tensor.is_cuda


def greedy_decode(model_dir: str, prompts: list[list[int]], num_steps: int,
                  fixed_shape_cuda: bool) -> list[torch.Tensor]:
    """Prefill `prompts` on the CPU path, then `num_steps` greedy decode steps; returns the
    logits of every step.  `fixed_shape_cuda`: the decode steps take the fixed-shape step (what
    a CUDA graph replays) with the CUDA branches; else the CPU eager decode."""
    page_size, pages_per_seq = 4, 16
    runner = ModelRunner(RunnerConfig(
        model_dir, device="cpu", num_pages=pages_per_seq * len(prompts) + 1,
        page_size=page_size, num_state_slots=len(prompts) + 2,
        cuda_graph_max_bs=4 if fixed_shape_cuda else 0, cuda_graph_max_context=256))
    seqs = [SeqInput(list(p), 0, list(range(i * pages_per_seq, (i + 1) * pages_per_seq)), i + 2)
            for i, p in enumerate(prompts)]  # slots 2.. (1 stays unused)
    logits = [runner.forward(seqs)]
    for _ in range(num_steps):
        for seq, token in zip(seqs, logits[-1].argmax(-1).tolist()):
            seq.prefix_len += len(seq.token_ids)
            seq.token_ids = [token]
        if fixed_shape_cuda:
            assert runner.decode_graphs.fits(seqs)
            with tensors_claim_cuda():
                logits.append(runner.forward(seqs))
        else:
            logits.append(runner.forward(seqs))
    return logits


def snapshot_step(model_dir: str, prompts: list[list[int]], through_fla: bool) -> dict:
    """One prefill step of ``prompts`` in which each sequence also snapshots its states at
    ``snapshot_cuts`` (``SeqInput.snapshots``), on the CPU path or with the CUDA branches (fla's
    chunk kernels on each round's segments, its fused recurrent kernel on a round of single
    tokens); returns the logits and the states of the sequences' slots and snapshot slots."""
    page_size, pages_per_seq = 4, 16
    runner = ModelRunner(RunnerConfig(
        model_dir, device="cpu", num_pages=pages_per_seq * len(prompts) + 1,
        page_size=page_size, num_state_slots=3 * len(prompts) + 1))
    n = len(prompts)
    seqs = [SeqInput(list(p), 0, list(range(i * pages_per_seq, (i + 1) * pages_per_seq)),
                     i + 1, [(cut, n + 2 * i + j + 1) for j, cut in enumerate(snapshot_cuts(p))])
            for i, p in enumerate(prompts)]
    if through_fla:
        with tensors_claim_cuda():
            logits = runner.forward(seqs)
    else:
        logits = runner.forward(seqs)
    return {"logits": logits, "temporal": runner.state.temporal.clone(),
            "conv": runner.state.conv.clone()}


def reference_bindings() -> dict:
    """`reference_imports.import_references_then_fla` run in a fresh process (before anything
    imported fla): which transformers functions bound fla, and whether fla.ops imports after."""
    import importlib

    from support.reference_imports import fla_bound_functions, import_references_then_fla

    import_references_then_fla()
    return {"fla_bound": fla_bound_functions(),
            "fla_ops": importlib.import_module("fla.ops.kda") is not None}
