"""Dense checkpoints (--wmax 0) through a real dasc-serve: greedy tokens through the prefix cache
equal the offline engine's (no cache) for A,B,B,A interleaving, shared-prefix families, prompts
shorter than the checkpoint interval, exact repeats (which must hit), multi-turn follow-ups and
related prompts arriving together while cold.  Kimi-Linear and Qwen3-Next (built in) and a
random Qwen3.5 as Qwen ships it (vision tower beside a nested language model), TP=1 and TP=2,
and a random OLMo-Hybrid at TP=2.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest
from support.random_checkpoints import make_served_model
from support.serving import KIMI, QWEN, ids, running_server
from support.serving_reference import FAMILY, MAX_TOKENS, PROMPT_A, PROMPT_B, SHARED, Reference

INTERVAL = 32
SHORT = ids("Hi there.")  # shorter than the checkpoint interval


@pytest.fixture(scope="module")
def random_dirs(tmp_path_factory):
    """Random served models by architecture, made on first use."""
    made = {}

    def get(arch: str):
        if arch not in made:
            made[arch] = tmp_path_factory.mktemp(arch)
            make_served_model(arch, made[arch], seed=5)
        return made[arch]

    return get


@pytest.fixture(scope="module", params=[(KIMI, 1), (KIMI, 2), (QWEN, 1), (QWEN, 2),
                                        ("qwen3_5_vl", 1), ("qwen3_5_vl", 2),
                                        ("olmo_hybrid", 2)],
                ids=["kimi-tp1", "kimi-tp2", "qwen-tp1", "qwen-tp2", "qwen3_5-tp1",
                     "qwen3_5-tp2", "olmo-hybrid-tp2"])
def served(request):
    model, tp = request.param
    if isinstance(model, str):
        model = request.getfixturevalue("random_dirs")(model)
    with running_server("--model", str(model), "--tp", str(tp), "--wmax", "0",
                        "--checkpoint-interval", str(INTERVAL)) as server:
        yield server, Reference(model)


def generate(server, prompt: list[int]) -> tuple[list[int], int]:
    body = server.complete(prompt, max_tokens=MAX_TOKENS, ignore_eos=True)
    choice = body["choices"][0]
    assert choice["prompt_token_ids"] == prompt
    return choice["token_ids"], body["usage"]["prompt_tokens_details"]["cached_tokens"]


def test_abba_interleaving_equals_no_cache_and_repeats_hit(served):
    server, ref = served
    server.flush()
    seen = []
    for prompt in (PROMPT_A, PROMPT_B, PROMPT_B, PROMPT_A):
        tokens, cached = generate(server, prompt)
        assert tokens == ref(prompt)
        seen.append(cached)
    assert seen[0] == 0
    # B shares "The grass ... value of " with A; its repeat and A's hit at prompt_len - 1.
    assert seen[2] == len(PROMPT_B) - 1 and seen[3] == len(PROMPT_A) - 1


def test_shared_prefix_family_hits_at_the_interval_boundary(served):
    server, ref = served
    server.flush()
    cached = []
    for prompt in FAMILY:
        tokens, hit = generate(server, prompt)
        assert tokens == ref(prompt)
        cached.append(hit)
    boundary = len(ids(SHARED)) // INTERVAL * INTERVAL
    assert cached[0] == 0 and all(c >= boundary for c in cached[1:]), cached


def test_prompt_shorter_than_the_interval_hits_on_repeat(served):
    server, ref = served
    server.flush()
    first, c1 = generate(server, SHORT)
    again, c2 = generate(server, SHORT)
    assert first == again == ref(SHORT)
    assert (c1, c2) == (0, len(SHORT) - 1)


def test_next_turn_hits_the_finished_request(served):
    server, ref = served
    server.flush()
    out, _ = generate(server, PROMPT_A)
    follow = PROMPT_A + out + ids("\nvalue of mdrte:")
    tokens, cached = generate(server, follow)
    assert tokens == ref(follow)
    assert cached == len(PROMPT_A) + len(out) - 1  # everything the first request processed


def test_related_prompts_arriving_together_while_cold(served):
    server, ref = served
    server.flush()
    prompts = FAMILY + [PROMPT_A, PROMPT_A]
    with ThreadPoolExecutor(len(prompts)) as pool:
        results = list(pool.map(lambda p: generate(server, p), prompts))
    for prompt, (tokens, _) in zip(prompts, results):
        assert tokens == ref(prompt)


def test_no_prefix_cache_server_gives_the_same_tokens_and_never_hits():
    ref = Reference(KIMI)
    with running_server("--model", str(KIMI), "--no-prefix-cache") as server:
        for prompt in (PROMPT_A, PROMPT_B, PROMPT_A, SHORT, SHORT):
            tokens, cached = generate(server, prompt)
            assert tokens == ref(prompt) and cached == 0
