"""Compile, for Hopper, the fla kernels the runner's CUDA branches launch (child process).

    python tests/support/fla_hopper_aot.py {decode|all}   # one JSON line per build on stdout

fla picks block sizes and code paths on the host from the device it sees, so this process first
shows it an H200 (sm_90, 132 SMs, 227 KiB shared memory) through a stand-in Triton driver and
`torch.cuda` queries: no kernel runs.  Then `_fla_prefill` / `_fla_decode` are called with
never-touched CPU tensors at the real models' shapes, every launch is caught (an autotuner
launches each of its configs, as it compiles them all on a GPU) and compiled with `hopper_aot`.
`decode`: fla's fused recurrent kernels (what the decode graphs replay), fp32 and bf16 q/k/v, at
TP 1 and 8; `all` adds the chunk kernels of prefill with every autotune config (~120 builds).
"""

from __future__ import annotations

import json
import sys
import types
from pathlib import Path

import torch
import triton
from triton.backends.compiler import GPUTarget

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
H200_SHARED_MEM = 232448


class _H200Utils:
    def get_device_properties(self, index: int) -> dict:
        return {"multiprocessor_count": 132, "max_shared_mem": H200_SHARED_MEM,
                "max_num_regs": 65536, "warpSize": 32}


class _H200Driver:
    utils = _H200Utils()

    def get_current_target(self) -> GPUTarget:
        return GPUTarget("cuda", 90, 32)

    def get_current_device(self) -> int:
        return 0

    def is_active(self) -> bool:
        return True


def show_fla_an_h200() -> None:
    triton.runtime.driver.set_active(_H200Driver())
    props = types.SimpleNamespace(name="NVIDIA H200", major=9, minor=0, multi_processor_count=132,
                                  shared_memory_per_block=49152,
                                  shared_memory_per_block_optin=H200_SHARED_MEM)
    torch.cuda.get_device_name = lambda *a, **k: props.name
    torch.cuda.get_device_capability = lambda *a, **k: (9, 0)
    torch.cuda.get_device_properties = lambda *a, **k: props
    torch.cuda.device_count = lambda: 1
    torch.cuda.current_device = lambda: 0


def _every_config(self, *args, **kwargs):
    for config in self.configs:
        self.fn.run(*args, **kwargs, **config.all_kwargs())


# arch: (key heads, value heads, K, V) of the real models at TP 1
MODELS = {"gdn": (16, 32, 128, 128), "kda": (32, 32, 128, 128)}  # Qwen3-Next-80B, Kimi-48B


def server_launches(mode: str):
    from triton.runtime.autotuner import Autotuner

    from model_runner.ops import linear_attention
    from support.hopper_aot import captured_launches

    Autotuner.run = _every_config
    with captured_launches() as launches:
        for arch, (key_heads, value_heads, k_dim, v_dim) in MODELS.items():
            for tp in (1, 8):
                hk, hv = key_heads // tp, value_heads // tp
                for dtype in (torch.float32, torch.bfloat16):
                    n = 4  # decode batch
                    q = torch.empty(n, hk, k_dim, dtype=dtype)
                    k, v = torch.empty_like(q), torch.empty(n, hv, v_dim, dtype=dtype)
                    g = torch.empty(n, hv, k_dim) if arch == "kda" else torch.empty(n, hv)
                    beta, states = torch.empty(n, hv), torch.empty(n, hv, k_dim, v_dim)
                    operands = linear_attention._operands(dtype, q, k, v, beta)  # as the runner
                    linear_attention._fla_decode(*operands, g, states, k_dim**-0.5)
            if mode == "all":
                hk, hv = key_heads, value_heads
                cu = [0, 700, 1024]  # two sequences, the first ends inside a chunk
                n = cu[-1]
                for dtype in (torch.float32, torch.bfloat16):  # operands: the model's dtype
                    q, k = torch.empty(n, hk, k_dim), torch.empty(n, hk, k_dim)
                    v = torch.empty(n, hv, v_dim)
                    g = torch.empty(n, hv, k_dim) if arch == "kda" else torch.empty(n, hv)
                    beta, states = torch.empty(n, hv), torch.empty(2, hv, k_dim, v_dim)
                    operands = linear_attention._operands(dtype, q, k, v, beta)
                    linear_attention._fla_prefill(*operands, g, states, cu, k_dim**-0.5)
    return launches


def main(mode: str) -> None:
    show_fla_an_h200()
    from support.hopper_aot import build_key, compile_for_hopper

    seen = set()
    for launch in server_launches(mode):
        key = build_key(launch)
        if key in seen:
            continue
        seen.add(key)
        row = {"kernel": launch.kernel.fn.__name__,
               "options": {n: launch.kwargs[n] for n in ("num_warps", "num_stages")
                           if n in launch.kwargs}}
        try:
            build = compile_for_hopper(launch)
            row |= {"constexprs": {n: v for n, v in build.constexprs.items()
                                   if isinstance(v, (int, float, str, bool))},
                    "num_regs": build.num_regs, "spill_bytes": build.spill_bytes}
        except Exception as exc:  # reported, and failed by the test
            row["error"] = f"{type(exc).__name__}: {exc}"[:2000]
        print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main(sys.argv[1])
