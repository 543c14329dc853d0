"""Tensor-parallel building blocks with per-parameter weight loaders."""
