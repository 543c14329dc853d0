"""Checkpoint and CPU decode kernels, one package per op, the torch reference beside every
fast path (as fla).

    ragged_state/  gather / scatter of state units between the active pool and checkpoint slots
        layout.py     UnitIndex, build_unit_index (where units live), argument checks
        naive.py      torch reference
        triton.py     Triton kernels (CUDA)
        flat_rows.py  torch CPU fast path (flat row gathers and block writes)
        native.py     one-pass CPU path: ctypes over native.c, INT8 inside the copy
    int8_quant/    symmetric per-row INT8 quantisation
        naive.py      torch reference
        triton.py     Triton kernels (CUDA)
    delta_decode/  the delta rule's one-token update, one pass per state (CPU decode)
        native.c      C, AVX-512 for 128-wide values; model_runner/ops/delta_rule_decode.py
                      is the torch reference and fallback
    native_build.py compiles and loads the C libraries on first use (ctypes)
    interpreted.py runs the Triton kernels on CPU under the Triton interpreter (tests)
"""
