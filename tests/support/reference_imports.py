"""Import transformers' Qwen3-Next / Kimi-Linear modules onto their pure-torch paths, then fla.

transformers binds fla's kernels when those modules are imported and fla is importable; the CPU
references cannot run them.  `conftest` calls this on a CUDA machine (fla must stay importable
for the CUDA tests); without CUDA it blocks fla for the whole session instead.  A plain module,
so the interpreter lane can check it in a child process without running conftest.
"""

from __future__ import annotations

import importlib
import inspect
import sys

REFERENCE_MODULES = ("transformers.models.kimi_linear.modeling_kimi_linear",
                     "transformers.models.qwen3_next.modeling_qwen3_next")
# transformers' functions that would bind fla kernels, by module
FLA_BOUND = {REFERENCE_MODULES[0]: ("chunk_kimi_delta_attention", "recurrent_kimi_delta_attention"),
             REFERENCE_MODULES[1]: ("torch_chunk_gated_delta_rule",
                                    "torch_recurrent_gated_delta_rule")}


def import_references_then_fla() -> None:
    """Import the two model modules with fla blocked, then fla itself, so that later imports
    of either find what they need (helpers' `sys.modules.setdefault("fla", None)` is a no-op)."""
    if sys.modules.get("fla") is not None:
        raise RuntimeError("fla was imported before transformers' reference modules")
    sys.modules["fla"] = None
    for name in REFERENCE_MODULES:
        importlib.import_module(name)
    del sys.modules["fla"]
    importlib.import_module("fla")


def fla_bound_functions() -> list[str]:
    """Names of transformers' model functions that run an fla kernel instead of torch."""
    bound = []
    for module_name, names in FLA_BOUND.items():
        module = sys.modules[module_name]
        for name in names:
            closure = inspect.getclosurevars(getattr(module, name)).nonlocals
            if closure["implementation"] is not getattr(module, name).__wrapped__:
                bound.append(name)
    return bound
