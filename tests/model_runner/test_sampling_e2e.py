"""Logit controls end to end: the real Scheduler plans, a real ModelRunner on the built-in
tiny model executes (``serve_rank.execute``, rank 0's path), the scheduler turns the sampled
tokens into frames; the controls change the tokens exactly as a direct computation over the
runner's own logits says, and a request's tokens do not depend on its batch."""

from __future__ import annotations

import pytest
import torch
from support.logit_controls_reference import reference
from support.serving import KIMI

from dasc_server.flags import parse_args, serve_config
from model_runner.batch import SeqInput
from model_runner.checkpoints.pool import CheckpointFormat
from model_runner.runner import ModelRunner, RunnerConfig
from model_runner.sampling import LogitControlTable
from model_runner.serve_rank import build_plan, execute, row_tables
from scheduler.limits import RankLimits
from scheduler.scheduler import Scheduler
from scheduler.wire.messages import SamplingParams
from scheduler.wire.rank_messages import StepResult
from scheduler.wire.serve_config import SchedulingConfig

ROWS, RUNNING = 512, 4
PROMPT = list(b"The grass is green. The sky is blue. The grass is")
OTHER = list(b"Facts to remember: one, two, three")


@pytest.fixture(scope="module")
def runner() -> ModelRunner:
    rc = RunnerConfig(str(KIMI), num_pages=ROWS, page_size=1,
                      num_state_slots=SchedulingConfig(max_running_requests=RUNNING).num_state_slots)
    runner = ModelRunner(rc)
    dense = serve_config(parse_args(["--model", str(KIMI)])).checkpoints
    plan = build_plan(str(KIMI), runner.cfg, dense)
    runner.attach_checkpoints(plan, 8, CheckpointFormat())
    return runner


def serve(runner: ModelRunner, reqs: dict[str, tuple[list[int], SamplingParams]]
          ) -> tuple[dict[str, list[int]], dict[str, str], Scheduler]:
    """The scheduler process's loop with rank 0 in process; tokens and finish reasons."""
    cfg = runner.cfg
    s = Scheduler(SchedulingConfig(max_total_tokens=ROWS, max_running_requests=RUNNING,
                                   chunked_prefill_size=64, checkpoint_interval=16),
                  RankLimits(num_checkpoint_slots=8, max_context_len=4096,
                             vocab_size=cfg.vocab_size, eos_token_id=cfg.eos_token_id))
    for rid, (prompt, params) in reqs.items():
        assert s.add(rid, prompt, params) is None
    tables, controls = row_tables(runner), LogitControlTable()
    tokens = {rid: [] for rid in reqs}
    reasons = {}

    def drain() -> None:
        with torch.inference_mode():
            while s.has_work:
                plan = s.schedule()
                sampled, logprobs = execute(runner, plan, tables, controls)
                for out in s.process_result(StepResult(plan.step_id, sampled, 0.0, logprobs)):
                    tokens[out.rid] += out.token_ids
                    if out.finished:
                        reasons[out.rid] = out.finish_reason

    drain()
    # a last plain request: its plan carries the releases of the ones that ended
    assert s.add("probe", [1], SamplingParams(max_tokens=1)) is None
    tokens["probe"] = []
    drain()
    assert len(controls) == 0, "rank 0 kept controls of requests that ended"
    s.check_integrity()
    del tokens["probe"], reasons["probe"]
    return tokens, reasons, s


def direct(runner: ModelRunner, prompt: list[int], params: SamplingParams) -> list[int]:
    """Greedy decode straight on the runner, the controls applied by ``reference``."""
    from scheduler.wire.rank_messages import LogitControls

    c = LogitControls(params.logit_bias, params.presence_penalty, params.frequency_penalty,
                      params.repetition_penalty, params.min_tokens,
                      [runner.cfg.eos_token_id], sorted(set(prompt)))
    out: list[int] = []
    seq = SeqInput(list(prompt), 0, list(range(len(prompt) + params.max_tokens)), 1)
    with torch.inference_mode():
        for _ in range(params.max_tokens):
            logits = runner.forward([seq])[0]
            out.append(int(reference(logits, c, prompt, out).argmax()))
            seq.prefix_len += len(seq.token_ids)
            seq.token_ids = [out[-1]]
    runner.zero_state(1)
    return out


def test_penalties_and_bias_give_the_directly_computed_tokens(runner):
    plain = SamplingParams(max_tokens=12, ignore_eos=True)
    controlled = SamplingParams(max_tokens=12, ignore_eos=True, presence_penalty=0.8,
                                frequency_penalty=1.2, repetition_penalty=1.5,
                                logit_bias={ord("e"): 1.5, ord("s"): -2.0})
    tokens, _, _ = serve(runner, {"plain": (PROMPT, plain), "ctl": (PROMPT, controlled)})
    assert tokens["plain"] == direct(runner, PROMPT, plain)
    assert tokens["ctl"] == direct(runner, PROMPT, controlled)
    assert tokens["ctl"] != tokens["plain"], "the controls changed nothing: a weak test"
    # a repeat hits the prefix cache and still gets its controls
    tokens2, _, s = serve(runner, {"ctl": (PROMPT, controlled)})
    assert tokens2["ctl"] == tokens["ctl"]


def test_bias_bans_and_forces_and_min_tokens_holds_eos_back(runner):
    eos = runner.cfg.eos_token_id
    plain = SamplingParams(max_tokens=8, ignore_eos=True)
    tokens, _, _ = serve(runner, {"plain": (PROMPT, plain)})
    ban = {t: -100.0 for t in tokens["plain"]}
    reqs = {
        "ban": (PROMPT, SamplingParams(max_tokens=8, ignore_eos=True, logit_bias=ban)),
        "force": (PROMPT, SamplingParams(max_tokens=8, logit_bias={ord("!"): 100.0},
                                         temperature=1.0, seed=3)),
        "eos": (OTHER, SamplingParams(max_tokens=10, logit_bias={eos: 100.0}, min_tokens=4)),
        "stop": (OTHER, SamplingParams(max_tokens=10, logit_bias={ord("z"): 100.0},
                                       stop_token_ids=[ord("z")], min_tokens=2,
                                       temperature=0.8, seed=1)),
    }
    tokens, reasons, _ = serve(runner, reqs)
    assert len(tokens["ban"]) == 8 and not set(tokens["ban"]) & set(ban)
    assert tokens["force"] == [ord("!")] * 8 and reasons["force"] == "length"
    assert len(tokens["eos"]) == 5 and tokens["eos"][-1] == eos and reasons["eos"] == "stop"
    assert eos not in tokens["eos"][:4]
    assert len(tokens["stop"]) == 3 and tokens["stop"][-1] == ord("z")
    assert reasons["stop"] == "stop"


def test_a_requests_tokens_are_the_same_alone_and_in_a_batch(runner):
    a = SamplingParams(max_tokens=10, ignore_eos=True, temperature=0.9, seed=11,
                       frequency_penalty=0.6, repetition_penalty=1.3, logit_bias={ord(" "): 2.0})
    b = SamplingParams(max_tokens=10, ignore_eos=True, presence_penalty=-1.0, min_tokens=3,
                       logit_bias={ord("a"): -100.0})
    c = SamplingParams(max_tokens=10, ignore_eos=True, temperature=0.7, seed=5)
    alone_a, _, _ = serve(runner, {"a": (PROMPT, a)})
    alone_c, _, _ = serve(runner, {"c": (OTHER, c)})
    together, _, _ = serve(runner, {"b": (OTHER, b), "a": (PROMPT, a), "c": (OTHER, c),
                                    "d": (PROMPT, b)})
    assert together["a"] == alone_a["a"]
    assert together["c"] == alone_c["c"]
