"""dasc-nr, dasc-wr and INT8 checkpoints through a real dasc-serve: a hit restores the same state
as the offline ``dasc-eval`` arm on the same prompt and W_max, so greedy tokens agree.

Server protocol: send the context alone (max_tokens 1); when it finishes, the state after the
whole context is checkpointed (finished-request caching).  Then context + question hits at
exactly len(context), and the question runs on the compressed-then-restored state.  These
servers run with ``--no-park-finished``: by default the question would adopt the warm
request's own slot, exact, and restore nothing (the last test here proves that).
Greedy tokens alone cannot tell the arms apart on these models (the needle is read from the
full-attention KV), so the log-probabilities of the generated tokens are compared too: they
match the offline arm to float precision and differ from the dense arm's.
"""

from __future__ import annotations

import json

import pytest
import torch
from support.serving import KIMI, QWEN, running_server
from support.serving_reference import NUM_TOKENS, offline_arm

from model_runner.quality.tasks import make_instances

# (arm, model, server flags, the arm it must be told apart from)
CASES = [("nr@128", KIMI, [], "dense"), ("wr@128", KIMI, ["--load-policy", "wr"], "nr@128"),
         ("nr-int8@16", KIMI, ["--int8-checkpoints"], "dense"),
         ("nr@512", QWEN, [], "dense"), ("wr@512", QWEN, ["--load-policy", "wr"], "nr@512"),
         # TP=2 with TP-balanced placement (permuted heads + storage all-to-all) vs TP=1 offline
         ("nr@128", KIMI, ["--tp", "2", "--placement", "hybrid"], "dense"),
         ("wr@512", QWEN, ["--tp", "2", "--placement", "storage", "--load-policy", "wr"],
          "nr@512")]


@pytest.mark.parametrize("arm,model,flags,other", CASES,
                         ids=[f"{a}-{m.name.split('-')[0]}{'-tp2' if '--tp' in f else ''}"
                              for a, m, f, _ in CASES])
def test_hit_equals_the_offline_eval_arm(arm, model, flags, other):
    w_max = arm.partition("@")[2]
    insts = make_instances("s1", 512, 2, seed=5) + make_instances("mk1", 512, 1, seed=5)
    with running_server("--model", str(model), "--wmax", w_max, "--checkpoint-interval",
                        "0", "--no-park-finished", *flags) as server:
        assert_hits_run_on(server, model, insts, arm, other)


def assert_hits_run_on(server, model, insts, arm: str, other: str) -> None:
    """Warm each context, then ask context + question: it hits at len(context), its tokens are
    the offline ``arm``'s and its log-probabilities match that arm's, 10x closer than
    ``other``'s (measured: <= 3e-7 from the arm, float noise of a different prefill chunking;
    >= 3.6e-5 from the other)."""
    for inst in insts:
        context, question = list(inst.context.encode()), list(inst.question.encode())
        server.complete(context, max_tokens=1)
        body = server.complete(context + question, max_tokens=NUM_TOKENS, ignore_eos=True,
                               logprobs=0)
        assert body["usage"]["prompt_tokens_details"]["cached_tokens"] == len(context)
        choice = body["choices"][0]
        tokens, logprobs = offline_arm(model, arm, context, question)
        assert choice["token_ids"] == tokens
        served = torch.tensor(choice["logprobs"]["token_logprobs"])
        _, alternative = offline_arm(model, other, context, question)
        to_arm = (served - torch.tensor(logprobs)).abs().max()
        to_other = (served - torch.tensor(alternative)).abs().max()
        assert to_arm < 1e-5 and 10 * to_arm < to_other, (to_arm, to_other)


def test_dasc_eval_through_the_server_equals_the_offline_arm():
    """``dasc-eval --base-url``: the warm-then-replay answers are the offline arm's."""
    import subprocess
    import sys

    from client import DascClient
    from model_runner.quality.served import answer
    from model_runner.quality.tasks import TASKS

    insts = make_instances("s1", 512, 2, seed=9) + make_instances("fwe", 512, 1, seed=9)
    with running_server("--model", str(KIMI), "--wmax", "128", "--checkpoint-interval",
                        "0", "--no-park-finished") as server:
        with DascClient(server.base_url) as client:
            for inst in insts:
                _, hit, text = answer(client, lambda t: list(t.encode()), inst)
                context, question = list(inst.context.encode()), list(inst.question.encode())
                tokens, _ = offline_arm(KIMI, "nr@128", context, question,
                                        TASKS[inst.task].max_new_tokens)
                want = bytes(t for t in tokens if t < 256).decode(errors="replace")
                assert hit and text == want[: want.index("\n") + 1 if "\n" in want else None]
        cmd = [sys.executable, "-m", "model_runner.quality.eval_cli", "--base-url", server.base_url,
               "--model", str(KIMI), "--tasks", "s1", "--quick", "--json"]
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    row = json.loads(out.stdout.splitlines()[0])
    assert (row["arm"], row["task"], row["n"], row["loaded"]) == ("nr@128", "s1", 3, 1.0)


@pytest.mark.parametrize("flags", [[], ["--tp", "2", "--placement", "hybrid"]],
                         ids=["tp1", "tp2-hybrid"])
def test_a_parked_hit_is_exact_under_a_compressed_format(flags):
    """Parked slots (the default): the question adopts the warm request's own slot, so under
    dasc-nr at W_max 128 it runs on the exact state and matches the dense arm, not nr's.
    ``dasc-eval --base-url`` refuses such a server, since it would not measure the arm."""
    import subprocess
    import sys

    insts = make_instances("s1", 512, 2, seed=7)
    with running_server("--model", str(KIMI), "--wmax", "128", "--checkpoint-interval", "0",
                        *flags) as server:
        before = server.stats()["counters"]
        assert_hits_run_on(server, KIMI, insts, "dense", "nr@128")
        after = server.stats()["counters"]
        assert after["parked_hits"] - before["parked_hits"] == len(insts)
        assert after["loads_nr"] == before["loads_nr"]
        if not flags:
            cmd = [sys.executable, "-m", "model_runner.quality.eval_cli", "--base-url",
                   server.base_url,
                   "--model", str(KIMI), "--tasks", "s1", "--quick", "--json"]
            out = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
            assert out.returncode != 0 and "--no-park-finished" in out.stderr, out.stderr
