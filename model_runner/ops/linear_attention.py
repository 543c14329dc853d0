"""One interface for the delta-rule recurrence, chosen by device at run time.

CPU: the chunked form for prefill, all sequences in one pass (GDN: the C kernel
``kernels/delta_rule/cpu_chunk``; KDA, or without a C compiler: ``varlen_chunk_delta_rule``), and
``decode_step`` for decode and for the one-token sequences of a mixed step (torch; serving
runs them in their pool slots, ``decode_into``, by the C kernel of
``kernels/delta_rule/cpu_decode.py``).
``recurrence_in_pool`` runs a step's sequences straight from and into a state pool (CPU
inference).
CUDA: fla's chunk kernels (varlen via cu_seqlens) and fused recurrent kernels. fla is imported
lazily, so this module imports on machines without a GPU driver.

Shapes: q, k [N, Hk, K] (L2-normalised, FP32); v [N, Hv, V]; g [N, Hv] (GDN) or [N, Hv, K]
(KDA); beta [N, Hv]; states [B, Hv, K, V] FP32, one per sequence.  Hv = ratio * Hk (GVA).

``operand_dtype``: what fla's kernels take q, k, v and beta in, prefill and decode alike (the
model's dtype: a bf16 model runs fla's bf16 chunk and fused recurrent kernels, with fp32
accumulation, log-space fp32 g and an fp32 state).  fla keeps its chunk intermediates
(per-chunk states, WY factors, attention blocks) and the output in the operand dtype; the result
is within two bf16 ulps of the CPU path on the same bf16-rounded operands under the Triton
interpreter, and tests/model_runner/test_cuda_bf16_operands.py checks that on a GPU (not yet run
on one).  Under the interpreter the chunk kernels return ~1e9 for bf16: it multiplies bf16 bit
patterns in `tl.dot` (tests/support/fla_interpreted.py).  The CPU path computes in fp32 whatever
the model's dtype, but for a bf16 model's serving prefill on a CPU with AMX
(``recurrence_in_pool``): there the C kernel's chunk products read bf16 operands, as fla's do.
"""

from __future__ import annotations

from functools import lru_cache

import torch

from kernels.delta_rule.cpu_chunk import amx_runs, chunk_in_pool, chunk_runs
from kernels.delta_rule.decode import decode_into, decode_step
from kernels.delta_rule.naive import default_chunk_size, varlen_chunk_delta_rule

# Tokens per chunk of the C kernel (GDN): at Qwen3.5-0.8B's GDN shape (16 heads of 128 x 128),
# 1,024 tokens, one core: 19.6 ms a layer at 16, 21.6 at 32, 22.7 at 64.
NATIVE_CHUNK = 16
# With its products on AMX (a bf16 model): 1,400 tokens at that shape, one core, 11-15 ms a
# layer at 64, 13-16 at 32, 18-24 at 16 (the FP32 form at 16: 24-25 ms in the same runs).
AMX_CHUNK = 64


def delta_rule_prefill(q, k, v, g, beta, states, cu_seqlens: list[int], scale: float,
                       operand_dtype: torch.dtype = torch.float32
                       ) -> tuple[torch.Tensor, torch.Tensor]:
    """Returns (o [N, Hv, V] FP32, final states [B, Hv, K, V] FP32)."""
    if q.is_cuda:
        return _fla_prefill(*_operands(operand_dtype, q, k, v, beta), g, states, cu_seqlens,
                            scale)
    return _cpu_prefill(q, k, v, g, beta, states, cu_seqlens, scale)


def _cpu_prefill(q, k, v, g, beta, states, cu_seqlens: list[int], scale: float):
    """Every sequence in one pass: one-token sequences (decodes in a mixed step) by the decode
    update, batched; the rest chunked (``_chunked``), batched."""
    split = _split(tuple(cu_seqlens), q.device)
    if split is None:  # no one-token sequence
        return _chunked(q, k, v, g, beta, states, cu_seqlens, scale)
    (ones, one_rows), (longer, longer_rows, longer_cu) = split
    o = v.new_empty(v.shape, dtype=torch.float32)
    finals = torch.empty_like(states, dtype=torch.float32)
    o[one_rows], finals[ones] = decode_step(*(x[one_rows] for x in (q, k, v, g, beta)),
                                            states.index_select(0, ones).float(), scale)
    if len(longer):
        o[longer_rows], finals[longer] = _chunked(
            *(x[longer_rows] for x in (q, k, v, g, beta)), states.index_select(0, longer),
            longer_cu, scale)
    return o, finals


def _chunked(q, k, v, g, beta, states, cu_seqlens: list[int], scale: float):
    """(o, final states) of sequences of any lengths: the C kernel where it runs (GDN, no
    autograd), else ``varlen_chunk_delta_rule``."""
    if chunk_runs(q, k, v, g, beta):
        finals = states.to(torch.float32, copy=True)
        o = chunk_in_pool(q, k, v, g, beta, finals, list(range(len(finals))), cu_seqlens,
                          scale, NATIVE_CHUNK)
        if o is not None:
            return o, finals
    return varlen_chunk_delta_rule(q, k, v, g, beta, states, cu_seqlens, scale,
                                   default_chunk_size(g.dim() == 3))


def recurrence_in_pool(q, k, v, g, beta, pool: torch.Tensor, slots: torch.Tensor,
                       cu_seqlens: list[int], scale: float, bf16: bool = False) -> torch.Tensor:
    """CPU, without autograd: the sequences of ``cu_seqlens`` from and into ``pool[slots]``
    (FP32); returns o [N, Hv, V] FP32.  One-token sequences update their slots in place
    (``decode_into``: no gather, no write-back), and so do longer GDN ones (the C kernel);
    others are gathered, run as ``_cpu_prefill`` runs them and written back.  The same bits
    as ``_cpu_prefill`` on the gathered states, but for ``bf16`` (a bf16 model): there the C
    kernel takes its products on AMX where the CPU has it (``cpu_chunk.amx_runs``),
    from bf16-rounded operands as fla's kernels read them on a GPU."""
    split = _split(tuple(cu_seqlens), q.device)
    if split is None:  # no one-token sequence
        amx = bf16 and amx_runs(q.shape[-1], v.shape[-1])
        o = chunk_in_pool(q, k, v, g, beta, pool, slots.tolist(), cu_seqlens, scale,
                          AMX_CHUNK if amx else NATIVE_CHUNK, bf16=amx)
        if o is not None:
            return o
        o, finals = varlen_chunk_delta_rule(q, k, v, g, beta, pool.index_select(0, slots),
                                            cu_seqlens, scale, default_chunk_size(g.dim() == 3))
        pool.index_copy_(0, slots, finals)
        return o
    (ones, one_rows), (longer, longer_rows, longer_cu) = split
    if not len(longer):
        return decode_into(pool, slots.tolist(), q, k, v, g, beta, scale)
    o = v.new_empty(v.shape, dtype=torch.float32)
    o[one_rows] = decode_into(pool, slots[ones].tolist(),
                              *(x[one_rows] for x in (q, k, v, g, beta)), scale)
    o[longer_rows] = recurrence_in_pool(*(x[longer_rows] for x in (q, k, v, g, beta)), pool,
                                        slots[longer], longer_cu, scale, bf16)
    return o


@lru_cache(maxsize=16)
def _split(cu_seqlens: tuple[int, ...], device: torch.device):
    """A step's one-token sequences and the rest, the same in every linear layer: None when
    none has one token, else ((their indices, their rows), (the others' indices, rows and
    cu_seqlens))."""
    lens = [b - a for a, b in zip(cu_seqlens, cu_seqlens[1:])]
    ones = [i for i, n in enumerate(lens) if n == 1]
    if not ones:
        return None
    longer = [i for i, n in enumerate(lens) if n > 1]
    cu = [0]
    for i in longer:
        cu.append(cu[-1] + lens[i])
    rows = [r for i in longer for r in range(cu_seqlens[i], cu_seqlens[i + 1])]

    def index(x: list[int]) -> torch.Tensor:
        return torch.tensor(x, dtype=torch.long, device=device)

    return ((index(ones), index([cu_seqlens[i] for i in ones])),
            (index(longer), index(rows), cu))


def delta_rule_decode(q, k, v, g, beta, states, scale: float,
                      operand_dtype: torch.dtype = torch.float32, in_place: bool = False
                      ) -> tuple[torch.Tensor, torch.Tensor]:
    """One token per sequence: q, k [B, Hk, K] ... -> (o [B, Hv, V], new states).
    ``in_place``: on CPU, fp32 ``states`` (a caller's gathered copy) become the new states
    instead of a copy of them."""
    if q.is_cuda:
        return _fla_decode(*_operands(operand_dtype, q, k, v, beta), g, states, scale)
    if not (in_place and states.dtype == torch.float32):
        states = states.to(torch.float32, copy=True)
    return decode_step(q, k, v, g, beta, states, scale)


def _operands(dtype: torch.dtype, q, k, v, beta):
    """q, k, v, beta as fla should read them; the fla calls below take (q, k, v, beta, g)."""
    return tuple(t.to(dtype) for t in (q, k, v, beta))


@lru_cache(maxsize=64)
def _cu_seqlens_tensor(cu_seqlens: tuple[int, ...], device: torch.device) -> torch.Tensor:
    # One host-to-device copy per step, not per linear layer: every layer of a step passes the
    # same offsets, and fla only reads them.  A step with snapshots passes one set per round
    # (``batch.Snapshots``, up to 1 + budget / interval of them), hence room for many.
    return torch.tensor(cu_seqlens, dtype=torch.long, device=device)


def _fla_prefill(q, k, v, beta, g, states, cu_seqlens, scale):
    cu = _cu_seqlens_tensor(tuple(cu_seqlens), q.device)
    args = dict(scale=scale, initial_state=states.contiguous(), output_final_state=True,
                cu_seqlens=cu)
    if g.dim() == 3:
        from fla.ops.kda import chunk_kda

        o, final = chunk_kda(q[None], k[None], v[None], g[None], beta[None], **args)
    else:
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule

        o, final = chunk_gated_delta_rule(q[None], k[None], v[None], g=g[None], beta=beta[None],
                                          **args)
    return o[0].float(), final.float()


def _fla_decode(q, k, v, beta, g, states, scale):
    args = dict(scale=scale, initial_state=states.contiguous(), output_final_state=True)
    if g.dim() == 3:
        from fla.ops.kda import fused_recurrent_kda

        o, final = fused_recurrent_kda(q[:, None], k[:, None], v[:, None], g[:, None],
                                       beta[:, None], **args)
    else:
        from fla.ops.gated_delta_rule import fused_recurrent_gated_delta_rule

        o, final = fused_recurrent_gated_delta_rule(q[:, None], k[:, None], v[:, None],
                                                    g=g[:, None], beta=beta[:, None], **args)
    return o[:, 0].float(), final.float()
