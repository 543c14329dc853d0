"""Rank 0's top logprobs (model_runner/sampling.py): the k likeliest tokens of the model's own
log-softmax, the distribution the sampled token's logprob comes from, for the rows that ask
only, row by row (batch-invariant), and without changing any token that is sampled."""

from __future__ import annotations

import pytest
import torch

from model_runner.sampling import RequestControls, sample_tokens, top_logprobs
from scheduler.wire.rank_messages import LogitControls, Sample

VOCAB = 64


def spec(k: int, temperature: float = 0.0, seed: int = 0, top_p: float = 1.0) -> Sample:
    return Sample(temperature, top_p, 0, seed, 0, num_top_logprobs=k)


def random_logits(seed: int, rows: int) -> torch.Tensor:
    return torch.randn(rows, VOCAB, generator=torch.Generator().manual_seed(seed)) * 4


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("k", [1, 5, 20])
def test_top_k_is_log_softmax_topk(dtype, k):
    logits = random_logits(k, rows=3).to(dtype)
    out = sample_tokens(logits, [spec(k), spec(k, 1.0, 4), spec(k, 0.8, 5, 0.9)])
    ref = torch.log_softmax(logits.float(), dim=-1).topk(k)
    assert out.top_ids == ref.indices.tolist()
    torch.testing.assert_close(torch.tensor(out.top_logprobs), ref.values, rtol=0, atol=0)
    # the sampled token's logprob is the same number as its entry in the top-k
    for token, logprob, ids, values in zip(*out):
        if token in ids:
            assert values[ids.index(token)] == logprob
    assert out.top_ids[0][0] == out.token_ids[0]  # greedy: the top-1


def test_only_rows_that_ask_and_nothing_without():
    logits = random_logits(1, rows=3)
    mixed = sample_tokens(logits, [spec(0), spec(3, 1.0, 7), spec(0, 1.0, 8)])
    assert [len(ids) for ids in mixed.top_ids] == [0, 3, 0]
    plain = sample_tokens(logits, [spec(0), Sample(1.0, 1.0, 0, 7, 0), spec(0, 1.0, 8)])
    assert plain.top_ids == [] and plain.top_logprobs == []
    # asking for top logprobs changes no sampled token, and no logprob
    assert mixed.token_ids == plain.token_ids and mixed.logprobs == plain.logprobs
    assert top_logprobs(torch.log_softmax(logits, -1), [0, 0, 0]) == ([], [])


def test_batch_invariant():
    logits = random_logits(2, rows=6)
    specs = [spec(k, 1.0, seed) for k, seed in zip([2, 0, 5, 20, 1, 3], range(6))]
    together = sample_tokens(logits, specs)
    for i in range(6):
        alone = sample_tokens(logits[i:i + 1], specs[i:i + 1])
        if specs[i].num_top_logprobs:
            assert alone.top_ids == [together.top_ids[i]]
            assert alone.top_logprobs == [together.top_logprobs[i]]
        assert alone.token_ids == [together.token_ids[i]]


def test_logit_controls_do_not_change_the_reported_distribution():
    logits = random_logits(3, rows=1)
    worst = int(logits[0].argmin())
    ctl = RequestControls(LogitControls({worst: 100.0}, 0.0, 0.0, 1.0, 0, [], []), VOCAB,
                          logits.device)
    out = sample_tokens(logits, [spec(4)], [ctl])
    assert out.token_ids == [worst]
    ref = torch.log_softmax(logits, -1).topk(4)
    assert out.top_ids == ref.indices.tolist() and worst not in out.top_ids[0]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_greedy_takes_the_first_maximum(dtype):
    """Greedy rows take argmax's token: the first of tied maxima, and a NaN where the row has
    one (as argmax does), in FP32 (as the LM head returns them) and bf16."""
    logits = torch.zeros(3, VOCAB, dtype=dtype)
    logits[0, [7, 3, 40]] = 2.0  # tied maxima: the first is 3
    logits[1, 60] = 1.0
    logits[2, [9, 20]] = float("nan")
    logits[2, 5] = 10.0
    out = sample_tokens(logits, [spec(0)] * 3)
    assert out.token_ids == logits.float().argmax(-1).tolist() == [3, 60, 9]
