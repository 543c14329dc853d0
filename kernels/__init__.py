"""Triton kernels for checkpoint packing, each with a torch reference beside it."""
