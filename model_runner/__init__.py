"""Rank-side tensor-parallel model runner for hybrid linear-attention models (GDN and KDA)."""
