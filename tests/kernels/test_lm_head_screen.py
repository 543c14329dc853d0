"""The screened LM head (``kernels.lm_head``): its int8 sums are exact in both forms, and its
greedy token is the full head's, the first index of the largest bf16 logit of the C GEMV,
on random heads, on heads with tied and nearly tied rows, and on hidden rows of any scale."""

from __future__ import annotations

import pytest
import torch

from kernels import lm_head
from kernels.gemv import code_weight, coded_rows, gemv
from kernels.gemv import simd_available as gemv_simd
from kernels.lm_head import ScreenedHead, screen_dots

pytestmark = pytest.mark.skipif(
    not (lm_head.simd_available() and gemv_simd()),
    reason="the screen runs where AVX-512 VNNI and the AVX-512 GEMV do")

K = 128


def full_argmax(hidden: torch.Tensor, weight: torch.Tensor) -> list[int]:
    """The full head's greedy tokens, as the sampler takes them from its logits."""
    return gemv(hidden, weight).float().max(dim=-1).indices.tolist()


def head(num_rows: int, seed: int, std: float = 0.02) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(num_rows, K, generator=gen) * std).bfloat16()


@torch.inference_mode()
@pytest.mark.parametrize("m", [1, 2, 3, 4])
def test_int8_sums_exact(m):
    gen = torch.Generator().manual_seed(m)
    xu = torch.randint(0, 256, (m, 192), generator=gen, dtype=torch.uint8)
    wq = torch.randint(-127, 128, (37, 192), generator=gen, dtype=torch.int8)  # 37: a tail
    want = xu.long() @ wq.long().T
    for simd in (True, False):
        got = screen_dots(xu, wq, simd=simd)
        assert got.dtype == torch.int32 and torch.equal(got.long(), want)


@torch.inference_mode()
@pytest.mark.parametrize("m", [1, 2, 4])
def test_greedy_equals_full_head(m):
    weight = head(5000, seed=m)
    screened = ScreenedHead(weight)
    gen = torch.Generator().manual_seed(100 + m)
    for trial in range(12):
        scale = 10.0 ** (trial % 4 - 1)  # hidden rows from 0.1 to 100
        hidden = (torch.randn(m, K, generator=gen) * scale).bfloat16()
        assert screened.argmax(hidden) == full_argmax(hidden, weight)


@torch.inference_mode()
def test_candidates_from_the_heads_coded_rows():
    """A head that dropped its weight gives the screen its rows from the coded copy: the
    same tokens, and the screen keeps no reference to the weight."""
    weight = head(5000, seed=11)
    coded = code_weight(weight)
    screened = ScreenedHead(weight, rows=lambda ids: coded_rows(coded, ids))
    want = weight.clone()
    weight.zero_()  # the screen reads neither its values nor (below) its storage
    gen = torch.Generator().manual_seed(5)
    for trial in range(8):
        hidden = (torch.randn(2, K, generator=gen) * 10.0 ** (trial % 3)).bfloat16()
        assert screened.argmax(hidden) == full_argmax(hidden, want)
    assert all(t is not weight for t in vars(screened).values())


@torch.inference_mode()
def test_ties_go_to_the_first_row():
    """Rows that are copies of the winning row give the same bf16 logit: the first wins, as in
    the full head; a copy one bf16 unit larger in one weight wins outright or ties."""
    weight = head(3000, seed=7)
    gen = torch.Generator().manual_seed(8)
    hidden = (torch.randn(2, K, generator=gen) * 2).bfloat16()
    best = full_argmax(hidden, weight)
    weight[2900] = weight[best[0]]  # a later copy: the earlier row still wins
    weight[10] = weight[best[1]]  # an earlier copy: it now wins
    nudged = weight[best[0]].clone()
    nudged[0] = torch.nextafter(nudged[0].float(), torch.tensor(1.0)).bfloat16()
    weight[1500] = nudged  # nearly tied with row best[0]
    want = full_argmax(hidden, weight)
    assert want[1] == min(10, best[1])
    assert ScreenedHead(weight).argmax(hidden) == want


@torch.inference_mode()
def test_declines_what_it_cannot_answer():
    weight = head(300, seed=9)
    screened = ScreenedHead(weight)
    nan = torch.zeros(1, K, dtype=torch.bfloat16)
    nan[0, 3] = float("nan")
    assert screened.argmax(nan) is None  # the full head's NaN wins; it must decide
    assert screened.argmax(torch.zeros(5, K, dtype=torch.bfloat16)) is None  # > 4 rows
    assert screened.argmax(torch.zeros(1, K)) is None  # not bf16
    zero = torch.zeros(1, K, dtype=torch.bfloat16)  # every logit 0: the first row
    assert screened.argmax(zero) == full_argmax(zero, weight) == [0]
    weight[77, 5] = float("inf")
    assert ScreenedHead(weight).argmax(torch.ones(1, K, dtype=torch.bfloat16)) is None
