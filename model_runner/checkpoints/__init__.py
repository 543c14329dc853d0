"""Checkpoint slots on one TP rank (the runtime of `model_runner/compression/`'s plans).

Modules:
    pool          CheckpointFormat, CheckpointPool: store / load in ragged | padded x fp32 | int8
                  x placement; checks, buffers, the backend per call, what backends share
    backends/     one CheckpointBackend per way of moving state: Triton (CUDA or strided state),
                  the native C library (contiguous CPU), torch flat rows (CPU without the library)
    redistribute  the all_to_all_single exchange of a balanced store or load
"""
