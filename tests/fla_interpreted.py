"""The CUDA branches on CPU under the Triton interpreter: fla's kernels and the fixed-shape step.

Runs in a child process started with `TRITON_INTERPRET=1` (`kernels.interpreted.run_interpreted`),
where importing this module makes the two adjustments fla 0.6.0's chunk kernels need there
(ENVIRONMENT.md), here in the test harness and never in the product:
1. an autotuner launches one config: there is no driver to benchmark with.  It takes the last
   (fla lists small blocks first; the interpreter runs one program at a time, so the largest
   blocks are the quickest, ~2x on the KDA intra-chunk kernel).  Any listed config is valid;
2. the index of a `range` / `tl.range` loop becomes an interpreter tensor, as it is when
   compiled: fla calls `i_t.to(tl.int64)` on it, which a Python int lacks.
The entry points call what the CUDA branches of the runner call, on CPU tensors.
"""

from __future__ import annotations

import ast
import os
from contextlib import contextmanager

import torch

if os.environ.get("TRITON_INTERPRET") != "1":
    raise ImportError("fla_interpreted needs TRITON_INTERPRET=1 before triton is imported")

import triton.language as tl  # noqa: E402
from triton.runtime import interpreter  # noqa: E402
from triton.runtime.autotuner import Autotuner  # noqa: E402

from model_runner.batch import SeqInput  # noqa: E402
from model_runner.ops import linear_attention  # noqa: E402
from model_runner.runner import ModelRunner, RunnerConfig  # noqa: E402


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


Autotuner.run = _one_config_run
interpreter.FunctionRewriter.ast_transformer = _TensorLoopIndex()
interpreter.InterpretedFunction.__call__ = _device_call


def fla_prefill(q, k, v, g, beta, states, cu_seqlens, scale, operand_dtype=torch.float32):
    """The CUDA branch of `delta_rule_prefill` (fla's chunk kernels)."""
    q, k, v, beta = linear_attention._operands(operand_dtype, q, k, v, beta)
    return linear_attention._fla_prefill(q, k, v, beta, g, states, cu_seqlens, scale)


def fla_decode(q, k, v, g, beta, states, scale, operand_dtype=torch.float32):
    """The CUDA branch of `delta_rule_decode` (fla's fused recurrent kernels)."""
    q, k, v, beta = linear_attention._operands(operand_dtype, q, k, v, beta)
    return linear_attention._fla_decode(q, k, v, beta, g, states, scale)


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


def reference_bindings() -> dict:
    """`reference_imports.import_references_then_fla` run in a fresh process (before anything
    imported fla): which transformers functions bound fla, and whether fla.ops imports after."""
    import importlib

    from reference_imports import fla_bound_functions, import_references_then_fla

    import_references_then_fla()
    return {"fla_bound": fla_bound_functions(),
            "fla_ops": importlib.import_module("fla.ops.kda") is not None}
