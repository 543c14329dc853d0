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
    delta_rule/    the gated delta rule
        naive.py      torch forms and references: the recurrence, the chunked form over packed
                      sequences
        decode.py     torch decode in the state slots (C where it is built)
        cpu_chunk.c   CPU prefill (GDN): chunk by chunk by forward substitution, each state
                      in its slot
        cpu_decode.c  CPU decode: one pass over each state in its slot (AVX-512 for 128-wide
                      values)
    short_conv/    the short causal convolution
        naive.py      torch forms: prefill over packed sequences, decode in the state slots
        cpu.c         CPU window sums for decode (state shifted in place) and prefill
    cpu_fused/     norm and activation passes in one pass each (CPU): the GDN gated output
        fused.c       norm, q/k L2 norms with v's conversion, a dense MLP's silu(gate) * up,
                      the RMS norms
    decode_attention/  one query token per sequence over its KV rows in the pool (CPU);
        attention.c   model_runner/layers/attention.py's _decode_each is the torch form
    moe_decode/    a decode step's experts, each used expert's weights streamed once (CPU);
        experts.c     model_runner/layers/mlp.py's SparseMoE forms are the torch forms
    gemv/          a decode step's GEMMs: a few rows against a bf16 weight streamed once (CPU);
        gemv.c        model_runner/layers/linear.py's oneDNN packed GEMM is the other form
    derived.py     weights derived once from a parameter (cast, packed, transposed), cached
    cpu_simd.h     the helpers the C files share (bf16 roundings, exp, AVX-512 forms)
    native_build.py compiles and loads the C libraries on first use (ctypes)
    interpreted.py runs the Triton kernels on CPU under the Triton interpreter (tests)
"""
