"""Completions ``echo``, as lm-eval's ``local-completions`` loglikelihood sends it (``echo``,
``logprobs: 1``, ``max_tokens: 1``, temperature 0, token-id prompts), through the official
``openai`` client against a real dasc-serve whose prefill is chunked (16 tokens a step), and
the scheduler's prompt-logprob plans on their own.

Reference: the prompt's logprobs from one in-process ``ModelRunner`` forward with
``all_logits`` (fp32, as the server runs).  The server prefills in other chunks, so the
numbers agree to a tolerance, not bit for bit."""

from __future__ import annotations

import openai
import pytest
import torch
from support.logprob_helpers import joined_logprobs, text_of
from support.serving import KIMI, running_server

from model_runner.batch import SeqInput
from model_runner.runner import ModelRunner, RunnerConfig
from scheduler.limits import RankLimits
from scheduler.scheduler import Scheduler
from scheduler.wire.messages import SamplingParams
from scheduler.wire.rank_messages import StepResult
from scheduler.wire.serve_config import SchedulingConfig

MODEL_NAME = KIMI.name
PROMPT_IDS = list(b"The grass is green. The sky is blue and the sea is wide. Snow is")  # 64
ATOL = 1e-4  # fp32 logprobs, prefill chunked differently from the reference


@pytest.fixture(scope="module")
def oai():
    flags = ("--max-total-tokens", "512", "--chunked-prefill-size", "16",
             "--checkpoint-interval", "8")
    with running_server(*flags) as s, openai.OpenAI(
            base_url=f"{s.base_url}/v1", api_key="x", max_retries=0, timeout=60) as client:
        yield client


@pytest.fixture(scope="module")
def reference() -> list[float]:
    """log p(prompt[i] | prompt[:i]) for i in [1, n), from one whole-prompt forward."""
    runner = ModelRunner(RunnerConfig(str(KIMI), num_pages=128, page_size=1,
                                      num_state_slots=2))
    n = len(PROMPT_IDS)
    logits = runner.forward([SeqInput(PROMPT_IDS, 0, list(range(n)), 1)], all_logits=True)
    logprobs = torch.log_softmax(logits.float(), dim=-1)  # [n, vocab]
    targets = torch.tensor(PROMPT_IDS[1:])[:, None]
    return logprobs[:-1].gather(1, targets).squeeze(1).tolist()


def complete(oai, prompt=PROMPT_IDS, stream=False, **kwargs):
    args = {"model": MODEL_NAME, "prompt": prompt, "max_tokens": 1, "temperature": 0,
            "extra_body": {"ignore_eos": True}, **kwargs}
    return oai.completions.create(stream=stream, **args)


def prompt_text() -> str:
    return bytes(PROMPT_IDS).decode()


def test_echo_without_logprobs_returns_prompt_and_completion(oai):
    plain = complete(oai, max_tokens=6).choices[0]
    echoed = complete(oai, max_tokens=6, echo=True).choices[0]
    assert echoed.text == prompt_text() + plain.text
    assert echoed.logprobs is None
    streamed = "".join(c.choices[0].text for c in complete(oai, max_tokens=6, echo=True,
                                                           stream=True) if c.choices)
    assert streamed == echoed.text


def check_echo_logprobs(lp, reference: list[float]) -> None:
    n = len(PROMPT_IDS)
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == n + 1
    assert lp.tokens[:n] == [text_of(t) for t in PROMPT_IDS]
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert all(x <= 0 for x in lp.token_logprobs[1:])
    assert lp.text_offset == list(range(n + 1))  # one character per byte token
    torch.testing.assert_close(torch.tensor(lp.token_logprobs[1:n]), torch.tensor(reference),
                               atol=ATOL, rtol=0)


def test_echo_logprobs_as_lm_eval_sends_them(oai, reference):
    choice = complete(oai, echo=True, logprobs=1).choices[0]
    lp = choice.logprobs
    check_echo_logprobs(lp, reference)
    for token, logprob, top in zip(lp.tokens[1:], lp.token_logprobs[1:], lp.top_logprobs[1:]):
        assert top[token] == logprob and 1 <= len(top) <= 2
        assert max(top.values()) == next(iter(top.values()))  # the likeliest first
    assert choice.text.startswith(prompt_text())


def test_repeated_echo_still_has_prompt_logprobs_and_cache_still_serves(oai, reference):
    first = complete(oai, echo=True, logprobs=3)
    again = complete(oai, echo=True, logprobs=3)
    assert again.usage.prompt_tokens_details.cached_tokens == 0  # echo never matches
    check_echo_logprobs(again.choices[0].logprobs, reference)
    # The same tokens, logprobs within ATOL: the second prompt's chunks may end at other
    # boundaries (those whose checkpoint the first one stored are skipped, once it is stored).
    tops = again.choices[0].logprobs.top_logprobs
    first_tops = first.choices[0].logprobs.top_logprobs
    assert tops[0] is None and first_tops[0] is None
    for top, first_top in zip(tops[1:], first_tops[1:], strict=True):
        assert top.keys() == first_top.keys()
        assert all(abs(top[t] - first_top[t]) <= ATOL for t in top)
    for top in again.choices[0].logprobs.top_logprobs[1:]:
        assert 3 <= len(top) <= 4
    plain = complete(oai, max_tokens=2)  # the echo requests stored checkpoints for it
    assert plain.usage.prompt_tokens_details.cached_tokens > 0


def test_echo_logprobs_batch_and_stream(oai, reference):
    other = list(b"Water is wet and fire is")
    batch = complete(oai, prompt=[PROMPT_IDS, other], echo=True, logprobs=1)
    assert [c.index for c in batch.choices] == [0, 1]
    check_echo_logprobs(batch.choices[0].logprobs, reference)
    assert len(batch.choices[1].logprobs.tokens) == len(other) + 1
    whole = complete(oai, echo=True, logprobs=2, max_tokens=4).choices[0].logprobs
    streamed = joined_logprobs(complete(oai, echo=True, logprobs=2, max_tokens=4, stream=True))
    assert streamed == (whole.tokens, whole.token_logprobs, whole.top_logprobs,
                        whole.text_offset)


def test_echo_with_max_tokens_0_is_the_prompt_alone(oai, reference):
    """OpenAI allows ``max_tokens: 0`` with ``echo`` (lm-eval's scoring in some modes): the
    prompt, its logprobs, no generated token."""
    got = complete(oai, echo=True, logprobs=2, max_tokens=0)
    choice, n = got.choices[0], len(PROMPT_IDS)
    assert choice.text == prompt_text() and choice.finish_reason == "length"
    lp = choice.logprobs
    assert lp.tokens == [text_of(t) for t in PROMPT_IDS] and len(lp.token_logprobs) == n
    assert lp.token_logprobs[0] is None and lp.text_offset == list(range(n))
    torch.testing.assert_close(torch.tensor(lp.token_logprobs[1:]), torch.tensor(reference),
                               atol=ATOL, rtol=0)
    assert got.usage.completion_tokens == 0 and got.usage.prompt_tokens == n
    streamed = joined_logprobs(complete(oai, echo=True, logprobs=2, max_tokens=0, stream=True))
    assert streamed == (lp.tokens, lp.token_logprobs, lp.top_logprobs, lp.text_offset)
    plain = complete(oai, prompt=[PROMPT_IDS, list(b"Hi")], echo=True, max_tokens=0)
    assert [c.text for c in plain.choices] == [prompt_text(), "Hi"]
    assert all(c.logprobs is None for c in plain.choices)
    with pytest.raises(openai.BadRequestError) as info:
        complete(oai, max_tokens=0)
    assert info.value.body["param"] == "max_tokens"


def test_scheduler_asks_for_every_prompt_token_once_and_skips_the_cache():
    cfg = SchedulingConfig(max_total_tokens=256, max_running_requests=4, chunked_prefill_size=7,
                           checkpoint_interval=4)
    sched = Scheduler(cfg, RankLimits(num_checkpoint_slots=8, max_context_len=256,
                                      vocab_size=300))
    prompt = list(range(10, 40))
    # echo first (stores checkpoints), a plain request (hits them), echo again (matches none)
    for rid, echo in (("echo", True), ("plain", False), ("echo-again", True)):
        sched.add(rid, prompt, SamplingParams(max_tokens=2, prompt_logprobs=echo,
                                              top_logprobs=1))
        targets, outs = [], []
        while sched.has_work:
            plan = sched.schedule()
            if plan is None:
                break
            got = [s.logprob_targets for s in plan.seqs if s.logprob_targets]
            targets += [t for ts in got for t in ts]
            result = StepResult(plan.step_id, [7 for s in plan.seqs if s.sample], 0.0,
                                [-1.0 for s in plan.seqs if s.sample],
                                target_logprobs=[[-float(t) for t in ts] for ts in got],
                                target_top_ids=[[[t] for t in ts] for ts in got],
                                target_top_logprobs=[[[-0.5] for _ in ts] for ts in got])
            outs += sched.process_result(result)
            sched.check_integrity()
        assert targets == (prompt[1:] if echo else [])
        first = outs[0]
        assert (first.cached_tokens == 0) == echo
        assert first.prompt_logprobs == ([-float(t) for t in prompt[1:]] if echo else [])
        assert first.prompt_top_ids == ([[t] for t in prompt[1:]] if echo else [])
        assert all(not o.prompt_logprobs for o in outs[1:])
