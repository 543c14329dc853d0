"""Paper analysis of the compression (sec. 3.4, Figures 2 and 4-6) and the `dasc-plan` report.

Modules:
    measures  empirical horizons, state / readout norms, Spearman over captured tensors
    plot      horizon profiles (matplotlib)
    cli       `dasc-plan`: checkpoint accounting, plan export and horizon plots
"""
