"""Decay-aware state compression, plan-time math: horizons, selection plans, placement, bytes.

Modules (import them directly; this package imports nothing so the scheduler stays light):
    defaults      the horizon's gate input and decay floor (torch-free)
    horizons      static retention horizons H_s from A_log / dt_bias, DecayParams, digests
    weights       read the decay parameters from (sharded) safetensors
    plan          ModelIdentity, SelectionPlan (dense | dasc | random), JSON, identity checks
    placement     head bundles per TP rank, local_units, head_permutation
    balance       store-time balancing schedule (rows each rank hands to each other rank)
    accounting    bytes per rank, compression ratios, slots at a budget (torch-free)
    target        the smallest W_max whose slots fit a target count
    analysis/     the paper's validation measures, horizon plots and `dasc-plan`
The rank-side store and load of checkpoints live in `model_runner/checkpoints/`.
"""
