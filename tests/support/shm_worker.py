"""Runs on every torchrun rank: the shared-memory collectives against gloo's.

Usage (by tests): torchrun --nproc-per-node N tests/support/shm_worker.py [--peer-exits]
Each rank prints "rank R: ok, shm" (or "no shm" where the path does not apply).  With
``--peer-exits`` the last rank exits at once and the others print how long their next
collective took to fail: "rank R: peer exit seen in S s".
"""

from __future__ import annotations

import os
import sys
import time

import torch
import torch.distributed as dist

from model_runner.parallel import init_tp_group, shutdown_tp_group


def main() -> None:
    tp = init_tp_group(torch.device("cpu"))
    if "--peer-exits" in sys.argv:
        peer_exits(tp)
        return
    gen = torch.Generator().manual_seed(100 + tp.rank)  # every rank its own data
    cases = [((1,), torch.float32), ((7, 128), torch.float32), ((3, 257), torch.bfloat16),
             ((64, 2304), torch.float32),  # a decode batch of Kimi-shape activations
             ((1200, 1024), torch.float32)]  # 4.9 MB: over a slot, so gloo
    for _ in range(3):  # both buffers, then the first again
        for shape, dtype in cases:
            x = torch.randn(shape, generator=gen).to(dtype)
            ref = x.clone()
            dist.all_reduce(ref)
            # rank-order sum, which the shared path promises bit for bit
            parts = [torch.empty_like(x) for _ in range(tp.size)]
            dist.all_gather(parts, x)
            ordered = parts[0].clone()
            for p in parts[1:]:
                ordered.add_(p)
            got = tp.all_reduce(x.clone())
            assert torch.equal(got, ordered if tp.shm and tp.shm.fits(x) else ref), (shape, dtype)
            # gloo adds in its own order; bf16 rounds after each add, and one bf16 ulp of
            # these sums (|x| < 8) is at most 2^-5, so two orders differ by a few at most
            bf16 = dtype == torch.bfloat16
            torch.testing.assert_close(got, ref, rtol=0 if bf16 else 1e-5,
                                       atol=2.0**-3 if bf16 else 1e-5)
            assert torch.equal(tp.all_gather_last(x), torch.cat(parts, dim=-1)), (shape, dtype)
        strided = torch.randn(8, 64, generator=gen).t()  # not contiguous
        expect = strided.contiguous()
        dist.all_reduce(expect)
        assert torch.allclose(tp.all_reduce(strided), expect, atol=1e-5)
    print(f"rank {tp.rank}: ok, {'shm' if tp.shm is not None else 'no shm'}", flush=True)
    shutdown_tp_group(tp)


def peer_exits(tp) -> None:
    """A rank that dies (here: exits) while the others wait in a shared-memory collective."""
    assert tp.shm is not None
    tp.all_reduce(torch.ones(4))  # every rank set up and past one call
    if tp.rank == tp.size - 1:
        os._exit(0)
    started = time.monotonic()
    try:
        tp.all_reduce(torch.ones(4))
    except RuntimeError as e:
        assert "exited" in str(e), e
        print(f"rank {tp.rank}: peer exit seen in {time.monotonic() - started:.1f} s", flush=True)
        os._exit(0)  # the group is broken: no orderly teardown
    raise AssertionError("the collective completed without the peer")


if __name__ == "__main__":
    sys.exit(main())
