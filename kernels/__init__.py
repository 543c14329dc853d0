"""Checkpoint kernels and the CPU paths' C kernels, one package per op, the torch reference
beside every fast path (as fla).

    ragged_state/  gather / scatter of state units between the active pool and checkpoint slots
        layout.py     UnitIndex, build_unit_index (where units live), argument checks
        naive.py      torch reference
        triton.py     Triton kernels (CUDA)
        flat_rows.py  torch CPU fast path (flat row gathers and block writes)
        native.py     one-pass CPU path: ctypes over native.c, INT8 inside the copy
    int8_quant/    symmetric per-row INT8 quantisation
        naive.py      torch reference
        triton.py     Triton kernels (CUDA)
    cpu_decode/    one-token updates in the state slots (CPU decode): the delta rule, one pass
        native.c      per state (AVX-512 for 128-wide values), and the short conv; the torch
                      forms in model_runner/ops/ are the references and fallbacks
    delta_rule/    the gated delta rule's compiled forms
        cpu_chunk.c   CPU prefill (GDN): chunk by chunk by forward substitution, each state
                      in its slot; model_runner/ops/delta_rule.py is the torch form
    cpu_fused/     norm and activation passes in one pass each (CPU): the GDN gated output
        fused.c       norm, q/k L2 norms with v's conversion, a dense MLP's silu(gate) * up,
                      the RMS norms
    decode_attention/  one query token per sequence over its KV rows in the pool (CPU);
        attention.c   model_runner/layers/attention.py's _decode_each is the torch form
    moe_decode/    a decode step's experts, each used expert's weights streamed once (CPU);
        experts.c     model_runner/layers/mlp.py's SparseMoE forms are the torch forms
    cpu_simd.h     the helpers cpu_decode's and those three C files share (bf16 roundings,
                   exp, AVX-512 forms)
    native_build.py compiles and loads the C libraries on first use (ctypes)
    interpreted.py runs the Triton kernels on CPU under the Triton interpreter (tests)
"""
