"""Decay-aware state compression: horizons, selection plans, checkpoint formats, placement.

Modules (import them directly; this package imports nothing so the scheduler stays light):
    horizons      static retention horizons H_s from A_log / dt_bias, DecayParams, digests
    weights       read the decay parameters from (sharded) safetensors
    analysis      empirical horizons, state / readout norms, Spearman (paper sec. 3.4)
    plan          ModelIdentity, SelectionPlan (dense | dasc | random), JSON, identity checks
    placement     head bundles per TP rank, local_units, head_permutation
    redistribute  store-time balancing schedule and its all_to_all_single exchange
    checkpoint    CheckpointPool: store / load in ragged | padded x fp32 | int8 x placement
    accounting    bytes per rank, compression ratios, slots at a budget
    cli, plot     `dasc-plan`
"""
