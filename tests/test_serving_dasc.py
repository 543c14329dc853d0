"""dasc-nr, dasc-wr and INT8 checkpoints through a real dasc-serve: a hit restores the same state
as the offline ``dasc-eval`` arm on the same prompt and W_max, so greedy tokens agree.

Server protocol: send the context alone (max_tokens 1); when it finishes, the state after the
whole context is checkpointed (finished-request caching).  Then context + question hits at
exactly len(context), and the question runs on the compressed-then-restored state.
"""

from __future__ import annotations

import pytest
from serving import KIMI, QWEN, running_server

from loadgen.offline_eval import apply_arm, prepare_arm
from loadgen.tasks import make_instances
from model_runner.batch import SeqInput
from model_runner.engine import decode_until
from model_runner.runner import ModelRunner, RunnerConfig

W_MAX = 16
NUM_TOKENS = 8
CASES = [("nr@16", KIMI, []), ("wr@16", KIMI, ["--load-policy", "wr"]),
         ("nr-int8@16", QWEN, ["--int8-checkpoints"]), ("wr@16", QWEN, ["--load-policy", "wr"])]


def offline_arm(model_dir, arm: str, context: list[int], question: list[int]) -> list[int]:
    """What ``dasc-eval`` computes for one instance: prefill the context, apply the arm's
    store/load (and refresh), prefill the question, decode greedily."""
    rc = RunnerConfig(str(model_dir), num_pages=64, page_size=16, num_state_slots=3)
    runner = ModelRunner(rc)
    prepare_arm(runner, arm, batch=1)
    seq = SeqInput(context, 0, list(range(64)), 1)
    runner.forward([seq])
    seq.prefix_len, seq.token_ids = len(context), question
    apply_arm(runner, [seq], arm, [context])
    return decode_until(runner, [seq], runner.forward([seq]), NUM_TOKENS, set())[0]


@pytest.mark.parametrize("arm,model,flags", CASES,
                         ids=[f"{a}-{m.name.split('-')[0]}" for a, m, _ in CASES])
def test_hit_equals_the_offline_eval_arm(arm, model, flags):
    insts = make_instances("s1", 512, 2, seed=5) + make_instances("mk1", 512, 1, seed=5)
    with running_server("--model", str(model), "--wmax", str(W_MAX), "--checkpoint-interval",
                        "0", *flags) as server:
        for inst in insts:
            context, question = list(inst.context.encode()), list(inst.question.encode())
            server.complete(context, max_tokens=1)
            body = server.complete(context + question, max_tokens=NUM_TOKENS, ignore_eos=True)
            assert body["usage"]["prompt_tokens_details"]["cached_tokens"] == len(context)
            assert body["choices"][0]["token_ids"] == offline_arm(model, arm, context, question)
