"""Scheduler process: request queue, radix prefix cache, KV-page and checkpoint-slot allocators.

It reasons on token ids, page indices and slot indices only; it imports no model code and no CUDA.
"""
