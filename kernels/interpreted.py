"""Run this package's Triton kernels on CPU tensors through the Triton interpreter.

`TRITON_INTERPRET=1` only works when it is set before `triton` is first imported: `triton.jit`
picks the compiler or the interpreter when a decorator runs, and the `@jit` helpers of
`triton.language` itself (`tl.zeros`, `tl.max`, ...) are decorated when triton is imported.
Setting it inside a test process would leak into every other module that uses Triton, so the
calls run in a fresh child process instead: inputs and outputs travel through `torch.save`.

Usage (tests): `run_interpreted("kernels.int8_quant.triton", [("quantize_int8_triton", (x,))])`.
Child entry point: `python -m kernels.interpreted REQUEST RESULT`.
"""

from __future__ import annotations

import importlib
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch

_PROJECT_ROOT = Path(__file__).resolve().parent.parent


def run_interpreted(
    module_name: str, calls: list[tuple[str, tuple[Any, ...]]], timeout_s: float = 300.0
) -> list[Any]:
    """Return `[getattr(module, fn)(*args) for fn, args in calls]`, computed in a child process.

    The child runs with `TRITON_INTERPRET=1`, so Triton kernels accept CPU tensors. Arguments and
    results must be saveable by `torch.save` and loadable with `weights_only=True` (tensors,
    numbers, strings, tuples, lists, dicts). In-place kernels should return what they wrote.
    Raises RuntimeError with the child's stderr if it fails.
    """
    with tempfile.TemporaryDirectory(prefix="dasc-interp-") as tmp:
        request, result = Path(tmp) / "request.pt", Path(tmp) / "result.pt"
        torch.save({"module": module_name, "calls": calls}, request)
        python_path = os.pathsep.join(
            filter(None, [str(_PROJECT_ROOT), os.environ.get("PYTHONPATH")])
        )
        env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": python_path}
        proc = subprocess.run(
            [sys.executable, "-m", "kernels.interpreted", str(request), str(result)],
            env=env, capture_output=True, text=True, timeout=timeout_s,
        )  # fmt: skip
        if proc.returncode != 0:
            raise RuntimeError(f"interpreted run of {module_name} failed:\n{proc.stderr[-6000:]}")
        return torch.load(result, weights_only=True)


def _index_scalars_of_any_rank() -> None:
    """Let a kernel loop up to a scalar argument (`range(0, dim, BLOCK)`) on numpy >= 2.5.

    Triton's interpreter holds a scalar argument as a one-element 1-d array and, before Triton
    3.9, indexed it with `int(array)`, which numpy 2.5 refuses ("only 0-dimensional arrays can
    be converted to Python scalars"): seen with Triton 3.6 and numpy 2.5.2, the image of an H200
    machine.  The interpreter patches `tl.tensor` for each launch and undoes it afterwards; this
    adds one more patch to the same scope, so it is undone with the rest.
    """
    from triton.runtime import interpreter

    patch_tensor = interpreter._patch_lang_tensor

    def patched(tensor, scope) -> None:
        patch_tensor(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))

    interpreter._patch_lang_tensor = patched


def _main(request_path: str, result_path: str) -> None:
    if os.environ.get("TRITON_INTERPRET") != "1":
        raise SystemExit("set TRITON_INTERPRET=1 before starting this entry point")
    _index_scalars_of_any_rank()
    request = torch.load(request_path, weights_only=True)
    module = importlib.import_module(request["module"])
    results = [getattr(module, name)(*args) for name, args in request["calls"]]
    torch.save(results, result_path)


if __name__ == "__main__":
    _main(*sys.argv[1:3])
