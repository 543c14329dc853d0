"""Numerical ops: delta-rule recurrences, causal conv, attention; chosen by device at run time."""
