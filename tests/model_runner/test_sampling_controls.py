"""Logit controls of the rank-0 sampler (model_runner/sampling.py): logit_bias, presence,
frequency and repetition penalties, min_tokens.  Each is checked against a direct torch
computation of the controlled logits, through ``sample_tokens`` as rank 0 calls it, and for
batch invariance (a request's tokens do not depend on the other rows and their controls)."""

from __future__ import annotations

import pytest
import torch
from support.logit_controls_reference import reference

from model_runner.sampling import LogitControlTable, RequestControls, sample_tokens
from scheduler.wire.rank_messages import LogitControls, Sample

VOCAB = 50
EOS = 7


def controls(bias=None, presence=0.0, frequency=0.0, repetition=1.0, min_tokens=0,
             banned=(EOS,), prompt=()) -> LogitControls:
    return LogitControls(dict(bias or {}), presence, frequency, repetition, min_tokens,
                         list(banned) if min_tokens else [], sorted(set(prompt)))


def spec(index: int, temperature: float = 0.0, seed: int = 3, top_p: float = 1.0,
         top_k: int = 0, c: LogitControls | None = None) -> Sample:
    return Sample(temperature, top_p, top_k, seed, index, c)


def random_logits(seed: int, rows: int = 1) -> torch.Tensor:
    return torch.randn(rows, VOCAB, generator=torch.Generator().manual_seed(seed)) * 3


def history(c: LogitControls, output: list[int]) -> RequestControls:
    ctl = RequestControls(c, VOCAB, torch.device("cpu"))
    for t in output:
        ctl.record(t)
    return ctl


def test_bias_minus_100_bans_the_greedy_token_and_plus_100_forces_one():
    logits = random_logits(0)
    best = int(logits.argmax())
    worst = int(logits.argmin())
    banned = history(controls({best: -100.0}), [])
    tokens, *_ = sample_tokens(logits, [spec(0)], [banned])
    assert tokens[0] != best and tokens[0] == int(reference(logits[0], banned.c, [], []).argmax())
    for temperature, top_p, top_k in ((0.0, 1.0, 0), (1.0, 1.0, 0), (1.5, 0.9, 5)):
        for seed in range(5):
            forced = history(controls({worst: 100.0}), [])
            specs = [spec(0, temperature, seed, top_p, top_k)]
            tokens, logprobs, *_ = sample_tokens(logits, specs, [forced])
            assert tokens == [worst]
            # logprobs stay the model's own (no controls), as without any
            assert logprobs[0] == pytest.approx(float(torch.log_softmax(logits, -1)[0, worst]))
    for seed in range(20):  # sampled: a banned token never comes out
        ctl = history(controls({best: -100.0}), [])
        tokens, *_ = sample_tokens(logits, [spec(0, 2.0, seed)], [ctl])
        assert tokens[0] != best


CASES = {
    "presence": controls(presence=1.5),
    "frequency": controls(frequency=0.7),
    "negative": controls(presence=-1.0, frequency=-2.0),
    "repetition": controls(repetition=1.8, prompt=[1, 2, 3, 40]),
    "repetition<1": controls(repetition=0.5, prompt=[5, 6]),
    "all": controls({4: 3.5, 9: -100.0, 11: 2.0}, 0.4, 0.9, 1.3, 2, (EOS, 12), [1, 4, 9, 13]),
}


@pytest.mark.parametrize("name", CASES)
@pytest.mark.parametrize("num_out", [0, 1, 5, 12])
def test_penalised_logits_equal_the_direct_computation(name, num_out):
    c = CASES[name]
    rng = torch.Generator().manual_seed(num_out)
    output = torch.randint(0, 16, (num_out,), generator=rng).tolist()  # repeats likely
    logits = random_logits(num_out + 100)
    ref = reference(logits[0], c, c.prompt_ids, output)
    got = history(c, output).apply(logits[0])
    torch.testing.assert_close(got, ref, rtol=1e-6, atol=1e-6)
    assert torch.equal(logits, random_logits(num_out + 100)), "the batch's logits were written"
    # through the sampler: greedy and seeded sampling pick what the reference logits give
    for temperature, seed in ((0.0, 0), (1.0, 1), (0.7, 2), (1.3, 3)):
        s = spec(num_out, temperature, seed, top_k=10 if seed == 3 else 0)
        tokens, *_ = sample_tokens(logits, [s], [history(c, output)])
        expect, *_ = sample_tokens(ref[None], [s])
        assert tokens == expect


def test_penalties_move_the_distribution_the_specified_way():
    logits = torch.zeros(1, VOCAB)
    output = [3, 3, 3, 8]
    freq = history(controls(frequency=1.0), output).apply(logits[0])
    assert freq[3] == -3.0 and freq[8] == -1.0 and freq[0] == 0.0
    pres = history(controls(presence=1.0), output).apply(logits[0])
    assert pres[3] == pres[8] == -1.0 and pres[0] == 0.0
    logits = torch.tensor([[2.0, -2.0, 2.0, -2.0] + [0.0] * (VOCAB - 4)])
    rep = history(controls(repetition=2.0, prompt=[0, 1]), []).apply(logits[0])
    assert rep[:4].tolist() == [1.0, -4.0, 2.0, -2.0]  # only seen tokens, sign-aware
    rep = history(controls(repetition=2.0, prompt=[0]), [2, 3]).apply(logits[0])
    assert rep[:4].tolist() == [1.0, -2.0, 1.0, -4.0]  # output tokens count as seen


@pytest.mark.parametrize("min_tokens", [1, 3])
def test_min_tokens_bans_eos_and_stop_ids_before_the_limit(min_tokens):
    logits = random_logits(1)
    logits[0, EOS] = 50.0  # greedy would stop at once
    logits[0, 12] = 49.0  # the stop id next in line
    c = controls(min_tokens=min_tokens, banned=(EOS, 12))
    ctl = history(c, [])
    tokens = []
    for i in range(min_tokens + 2):
        tokens += sample_tokens(logits, [spec(i, 1.0 if i % 2 else 0.0, i)], [ctl])[0]
    assert EOS not in tokens[:min_tokens] and 12 not in tokens[:min_tokens]
    assert set(tokens[min_tokens:]) <= {EOS, 12}  # allowed again: they hold all the mass
    assert ctl.num_sampled == min_tokens + 2


def run_table(rows: dict[str, tuple[LogitControls | None, float]], steps: int,
              seed_of: dict[str, int]) -> dict[str, list[int]]:
    """Rank 0 over ``steps`` plans: every request samples each step, with logits that depend
    only on (request, step); returns each request's tokens."""
    table, out = LogitControlTable(), {rid: [] for rid in rows}
    for step in range(steps):
        rids = list(rows)
        specs = [spec(step, rows[rid][1], seed_of[rid], c=rows[rid][0] if step == 0 else None)
                 for rid in rids]
        logits = torch.cat([random_logits(seed_of[rid] * 1000 + step) for rid in rids])
        tokens, *_ = sample_tokens(logits, specs, table.for_batch(rids, specs, logits))
        for rid, t in zip(rids, tokens):
            out[rid].append(t)
    return out


def test_a_requests_tokens_do_not_depend_on_its_batch():
    seeds = {"a": 1, "b": 2, "c": 3, "plain": 4}
    a = controls({4: 2.0, 5: -100.0}, 0.5, 1.0, 1.4, 3, prompt=[1, 2])
    b = controls(frequency=2.0, repetition=0.7, prompt=[9])
    c = controls({int(random_logits(3000).argmax()): 100.0}, min_tokens=2)
    alone = run_table({"a": (a, 1.0)}, 8, seeds)
    plain_alone = run_table({"plain": (None, 0.8)}, 8, seeds)
    for order in (["a", "b", "c", "plain"], ["plain", "c", "b", "a"]):
        rows = {"a": (a, 1.0), "b": (b, 0.0), "c": (c, 1.2), "plain": (None, 0.8)}
        together = run_table({rid: rows[rid] for rid in order}, 8, seeds)
        assert together["a"] == alone["a"]
        assert together["plain"] == plain_alone["plain"]
    # a request without controls samples exactly as the sampler without any controls does
    logits = random_logits(5, rows=3)
    specs = [spec(0, 0.0), spec(0, 1.0, 9, c=a), spec(0, 0.9, 4, top_p=0.8)]
    table = LogitControlTable()
    rows_controls = table.for_batch(["x", "y", "z"], specs, logits)
    mixed, mixed_lp, *_ = sample_tokens(logits, specs, rows_controls)
    plain, plain_lp, *_ = sample_tokens(logits[[0, 2]], [specs[0], specs[2]])
    assert [mixed[0], mixed[2]] == plain and [mixed_lp[0], mixed_lp[2]] == plain_lp


def test_table_keeps_controls_until_release_and_checks_the_position():
    table = LogitControlTable()
    logits = random_logits(0, rows=2)
    none = [spec(0), spec(0)]
    assert table.for_batch(["p", "q"], none, logits) is None  # the no-controls fast path
    ban = int(logits[0].argmax())
    first = [spec(0, c=controls({ban: -100.0})), spec(0)]
    got = table.for_batch(["p", "q"], first, logits)
    assert got[1] is None and len(table) == 1
    tokens, *_ = sample_tokens(logits, first, got)
    later = [spec(1), spec(1)]  # no controls travel after the first sample
    got = table.for_batch(["p", "q"], later, logits)
    assert got[0] is not None and got[0].num_sampled == 1
    assert sample_tokens(logits, later, got)[0][0] != ban
    with pytest.raises(RuntimeError, match="rank 0 sampled 2 tokens"):
        table.for_batch(["p"], [spec(5)], logits[:1])
    table.release(["p"])
    assert len(table) == 0 and table.for_batch(["p", "q"], later, logits) is None


def test_controls_cross_the_ipc_boundary():
    from multiprocessing import Pipe

    from scheduler.wire import ipc
    from scheduler.wire.messages import GenerateReq, SamplingParams
    from scheduler.wire.rank_messages import BatchPlan, SeqStep

    a, b = Pipe()
    params = SamplingParams(logit_bias={3: -100.0, 5: 2}, presence_penalty=0.5,
                            frequency_penalty=-1.0, repetition_penalty=1.1, min_tokens=2)
    plan = BatchPlan(1, seqs=[SeqStep("r", [1, 2], 0, 1, spec(0, c=controls({3: 1.0}, 0.5,
                                                                             min_tokens=1)))])
    for msg in (GenerateReq("r", [1, 2], params), plan):
        ipc.send(a, msg)
        assert ipc.recv(b) == msg
    assert SamplingParams().has_logit_controls is False and params.has_logit_controls
