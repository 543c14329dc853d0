"""Ahead-of-time compiles of Triton kernels for Hopper (sm_90) on a machine without a GPU.

A launch `kernel[grid](*args)` made by the code under test is caught before it runs
(`captured_launches`); `compile_for_hopper` then feeds its arguments through Triton's own binder
for a CUDA backend, which gives the very signature, constexprs and alignment / divisibility
specialisation the runtime would compile on a GPU, and compiles that with
`triton.compile(ASTSource(...), target=GPUTarget("cuda", 90, 32))`: TTIR, TTGIR, PTX and a cubin
from the bundled ptxas.  ptxas' own report (`-v`, which Triton always passes) gives registers and
spill bytes.
"""

from __future__ import annotations

import contextlib
import io
import re
from dataclasses import dataclass
from typing import Any

import triton
from triton import knobs
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource, make_backend
from triton.runtime.jit import JITFunction, create_function_from_signature

HOPPER = GPUTarget("cuda", 90, 32)


@dataclass(frozen=True, slots=True)
class Launch:
    kernel: JITFunction
    args: tuple[Any, ...]
    kwargs: dict[str, Any]


@dataclass(frozen=True, slots=True)
class HopperBuild:
    name: str
    signature: dict[str, str]
    constexprs: dict[str, Any]
    num_regs: int
    spill_bytes: int  # spill stores + spill loads, as ptxas reports them
    ptxas_log: str


@contextlib.contextmanager
def captured_launches(kernels: list[JITFunction] | None = None):
    """Record (instead of running) the launches of `kernels`, or of every JITFunction when None;
    yields the list they are appended to."""
    launches: list[Launch] = []

    def record(self, *args, grid, warmup, **kwargs):
        launches.append(Launch(self, args, kwargs))

    if kernels is None:
        saved = JITFunction.run
        JITFunction.run = record
        try:
            yield launches
        finally:
            JITFunction.run = saved
        return
    for kernel in kernels:
        kernel.run = record.__get__(kernel)
    try:
        yield launches
    finally:
        for kernel in kernels:
            del kernel.run


def specialise(launch: Launch, target: GPUTarget = HOPPER, **options):
    """(signature, constexprs, attrs, options) of `launch` as the runtime derives them for
    `target`; `options` override launch options (num_warps, maxnreg, ...)."""
    backend = make_backend(target)
    kernel, kwargs = launch.kernel, {**launch.kwargs, **options}
    binder = create_function_from_signature(kernel.signature, kernel.params, backend)
    bound, specialization, parsed = binder(*launch.args, **kwargs)
    return kernel._pack_args(backend, kwargs, bound, specialization, parsed)


def build_key(launch: Launch, target: GPUTarget = HOPPER) -> str:
    options, signature, constexprs, attrs = specialise(launch, target)
    return repr((launch.kernel.fn.__qualname__, signature, sorted(constexprs.items()),
                 sorted(attrs.items()), sorted(options.__dict__.items())))


def compile_for_hopper(launch: Launch, target: GPUTarget = HOPPER, **options) -> HopperBuild:
    """Compile `launch` for `target` (always afresh, so ptxas runs and reports); raises what
    Triton raises when it does not compile."""
    options, signature, constexprs, attrs = specialise(launch, target, **options)
    log = io.StringIO()
    saved = knobs.compilation.always_compile, knobs.nvidia.dump_ptxas_log
    knobs.compilation.always_compile, knobs.nvidia.dump_ptxas_log = True, True
    try:
        with contextlib.redirect_stdout(log):
            triton.compile(ASTSource(launch.kernel, signature, constexprs, attrs),
                           target=target, options=options.__dict__)
    finally:
        knobs.compilation.always_compile, knobs.nvidia.dump_ptxas_log = saved
    text = log.getvalue()
    regs = re.findall(r"Used (\d+) registers", text)
    spills = re.findall(r"(\d+) bytes spill stores, (\d+) bytes spill loads", text)
    if not regs or not spills:
        raise RuntimeError(f"no ptxas report for {launch.kernel.fn.__name__}:\n{text}")
    names = launch.kernel.arg_names
    return HopperBuild(
        name=launch.kernel.fn.__name__, signature=signature,
        constexprs={names[path[0]]: value for path, value in constexprs.items()},
        num_regs=max(map(int, regs)), spill_bytes=sum(int(a) + int(b) for a, b in spills),
        ptxas_log=text)
