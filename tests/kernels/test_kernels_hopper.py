"""Every project Triton kernel compiles ahead of time for Hopper (sm_90), at the server's shapes.

The launches come from the kernels' own wrappers (`*_triton`), called with CPU tensors shaped like
the checkpoint pool's buffers for the real models (Qwen3-Next-80B, Kimi-Linear-48B) at TP 1 and
TP 8 and for the shipped tiny models; each launch is caught before it runs and compiled with the
specialisation the runtime would give it on a GPU (`hopper_aot`).  A kernel that does not
compile, or for which ptxas reports spills over `SPILL_LIMIT_BYTES`, fails.  A kernel in
`kernels/` that no server shape launches (and no launched kernel calls) fails too: give it a
launch here.
"""

from __future__ import annotations

import importlib

import pytest
import torch
import triton
import triton.language as tl
from support.hopper_aot import Launch, build_key, captured_launches, compile_for_hopper
from support.paths import ROOT
from triton.runtime.jit import JITFunction

from kernels.int8_quant.triton import dequantize_int8_triton, quantize_int8_triton
from kernels.ragged_state import build_unit_index
from kernels.ragged_state.triton import gather_units_triton, scatter_units_triton

SPILL_LIMIT_BYTES = 0  # the checkpoint kernels are streaming copies: nothing should spill
NUM_SLOTS, NUM_CKPT_SLOTS, NUM_REQS = 16, 4, 2  # strides stay i32 and 16-divisible
# name: (arch, value heads, K, V, linear layers, TP sizes)
MODELS = {
    "qwen3-next-80b": ("gdn", 32, 128, 128, 36, (1, 8)),
    "kimi-linear-48b": ("kda", 32, 128, 128, 20, (1, 8)),
    "qwen3-next-tiny": ("gdn", 8, 32, 32, 4, (1,)),
    "kimi-linear-tiny": ("kda", 4, 32, 32, 4, (1,)),
}
KERNEL_MODULES = sorted(".".join(p.relative_to(ROOT).with_suffix("").parts)
                        for p in (ROOT / "kernels").rglob("*.py") if p.stem != "__init__")


def checkpoint_pool_launches(arch: str, heads: int, k: int, v: int, layers: int) -> None:
    """Store and load one batch the way `CheckpointPool` does on CUDA: ragged gather / scatter
    of units, INT8 quantise / dequantise of the packed rows.  Buffers are never touched."""
    temporal = torch.empty(layers, NUM_SLOTS, heads, k, v)
    pool = (temporal.view(layers, NUM_SLOTS, heads * k, v) if arch == "kda"
            else temporal.view(layers, NUM_SLOTS, heads, k * v))  # [L, S, U, D]
    num_units, unit_dim = pool.shape[2:]
    rows_per_unit = 1 if arch == "kda" else k
    for masks in ([torch.ones(num_units, dtype=torch.bool)] * layers,  # dense
                  [torch.arange(num_units) % 7 == layer % 7 for layer in range(layers)]):
        index = build_unit_index(masks, "ragged")
        ckpt = torch.empty(NUM_CKPT_SLOTS, index.num_rows, unit_dim)  # [C, R, D]
        src, dst = torch.tensor([3, 9]), torch.tensor([1, 5])
        gather_units_triton(pool, src, index.unit_layer, index.unit_index, ckpt, dst)
        scatter_units_triton(ckpt, dst, index.unit_pos, pool, src)
        packed = torch.empty(NUM_REQS, index.num_rows, rows_per_unit, v)  # [B, R, rpu, V]
        quantize_int8_triton(packed)
        dequantize_int8_triton(torch.empty(packed.shape, dtype=torch.int8),
                               torch.empty(packed.shape[:-1]))


def project_kernels() -> dict[str, JITFunction]:
    found = {}
    for module_name in KERNEL_MODULES:
        module = importlib.import_module(module_name)
        for name, obj in vars(module).items():
            if isinstance(obj, JITFunction) and obj.fn.__module__ == module.__name__:
                found[f"{module_name}.{name}"] = obj
    return found


def server_launches() -> dict[str, Launch]:
    """One launch per distinct Hopper specialisation, keyed by a readable id."""
    with captured_launches(list(project_kernels().values())) as launches:
        for arch, heads, k, v, layers, tp_sizes in MODELS.values():
            for tp in tp_sizes:
                checkpoint_pool_launches(arch, heads // tp, k, v, layers)
    unique: dict[str, Launch] = {}
    for launch in launches:
        unique.setdefault(build_key(launch), launch)
    named = {}
    for launch in unique.values():
        blocks = ",".join(f"{n}={launch.kwargs[n]}" for n in sorted(launch.kwargs)
                          if n.startswith("BLOCK"))
        name = f"{launch.kernel.fn.__name__}[{blocks}]"
        named[name if name not in named else f"{name}#{len(named)}"] = launch
    return named


LAUNCHES = server_launches()


@pytest.mark.parametrize("name", list(LAUNCHES))
def test_kernel_compiles_for_hopper_without_spills(name):
    build = compile_for_hopper(LAUNCHES[name])
    assert build.spill_bytes <= SPILL_LIMIT_BYTES, build.ptxas_log
    assert 0 < build.num_regs <= 255


def test_every_project_kernel_has_a_server_launch():
    launched = {launch.kernel for launch in LAUNCHES.values()}
    called = " ".join(kernel.src for kernel in launched)  # helpers are called from a kernel
    missing = [name for name, fn in project_kernels().items()
               if fn not in launched and fn.fn.__name__ not in called]
    assert not missing, f"no server-shape launch for {missing}: add one to this test"
    assert len(launched) >= 4


# ---------------------------------------------------------------- the lane catches breakage


@triton.jit
def _broken_kernel(x_ptr, n, BLOCK: tl.constexpr):
    offs = tl.arange(0, BLOCK)  # BLOCK = 48 is not a power of two: no Triton target accepts it
    tl.store(x_ptr + offs, tl.load(x_ptr + offs, mask=offs < n), mask=offs < n)


def test_lane_fails_on_a_kernel_that_does_not_compile():
    x = torch.empty(64)
    with captured_launches([_broken_kernel]) as launches:
        _broken_kernel[(1,)](x, 64, BLOCK=48)
    with pytest.raises(triton.CompilationError):
        compile_for_hopper(launches[0])


def test_lane_reports_spills():
    """The INT8 quantiser at its Kimi-Linear shape, squeezed into 24 registers, must spill."""
    name = next(n for n in LAUNCHES if n.startswith("_quantize_int8_kernel[BLOCK_N=32,"))
    build = compile_for_hopper(LAUNCHES[name], maxnreg=24)
    assert build.num_regs <= 24 and build.spill_bytes > SPILL_LIMIT_BYTES


def test_launches_use_the_server_block_sizes():
    names = set(LAUNCHES)
    # GDN units are K*V = 16,384 floats: 4 rows x 1,024 columns per program; KDA units 128.
    assert any(n.startswith("_gather_units_kernel[BLOCK_D=1024,BLOCK_R=4]") for n in names)
    assert any(n.startswith("_scatter_units_kernel[BLOCK_D=128,BLOCK_N=32]") for n in names)
    assert any(n.startswith("_quantize_int8_kernel[BLOCK_N=32,BLOCK_V=128]") for n in names)
