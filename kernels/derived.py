"""Tensors derived from a weight (a transposed or upcast copy), made once and kept on it.

A CPU op that needs a weight in another layout copies it on every call otherwise: the short
conv's FP32 columns (20 us a call at 8,192 channels), MLA's transposed value projection (2.2 ms
a call at Kimi-Linear's shapes).  The copy is kept on the weight, keyed by its version counter
and its storage, so an in-place change (a weight load, a test that edits it) or new data
(``param.data = ...``) makes it again.
"""

from __future__ import annotations

from collections.abc import Callable

import torch


def derived(weight: torch.Tensor, key: str,
            make: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
    """``make(weight)``, kept on ``weight`` under ``key`` while the weight is unchanged.  Made
    afresh on every call where it cannot be kept: a weight that autograd follows (the copy
    must carry its gradient) or an inference tensor (it has no version counter)."""
    if weight.requires_grad or weight.is_inference():
        return make(weight)
    stamp = (weight._version, weight.data_ptr(), weight.dtype)
    cached = getattr(weight, key, None)
    if cached is None or cached[0] != stamp:
        with torch.inference_mode(False):  # autograd may save it after an inference call
            cached = (stamp, make(weight.detach()))
        setattr(weight, key, cached)
    return cached[1]
