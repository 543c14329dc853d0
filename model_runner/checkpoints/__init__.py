"""Checkpoint slots on one TP rank (the runtime of `model_runner/compression/`'s plans).

Modules:
    pool          CheckpointFormat, CheckpointPool: store / load in ragged | padded x fp32 | int8
                  x placement
    paths         the three ways a pool moves state (Triton/CUDA, C library, torch flat rows)
    redistribute  the all_to_all_single exchange of a balanced store or load
"""
