"""The runner's linear-attention dispatch: fla's kernels on CUDA, the C or torch forms of
``kernels/delta_rule`` on a CPU."""
