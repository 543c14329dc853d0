"""``--cpu-lm-head-screen on`` through a real dasc-serve (bf16): greedy requests that ask for no
logprobs take the screened LM head (``/v1/stats`` counts its tokens) and get the tokens that
requests asking for logprobs, which take the full head, get.  (Batched rows:
tests/model_runner/test_runner_greedy.py.)"""

from __future__ import annotations

import httpx
import pytest
from support.serving import running_server

from kernels import lm_head
from kernels.gemv import simd_available as gemv_simd

pytestmark = pytest.mark.skipif(
    not (lm_head.simd_available() and gemv_simd()),
    reason="the screen runs where AVX-512 VNNI and the AVX-512 GEMV do")

PROMPTS = [[5 + i, 17, 29 + 2 * i, 40, 41, 3 * i + 7] * (1 + i) for i in range(4)]


@pytest.fixture(scope="module")
def server():
    with running_server("--dtype", "bfloat16", "--cpu-lm-head-screen", "on",
                        "--max-total-tokens", "1024") as s:
        yield s


def complete(server, prompt: list[int], logprobs: bool) -> list[int]:
    body = {"prompt": prompt, "max_tokens": 12, "temperature": 0, "ignore_eos": True,
            "return_token_ids": True, **({"logprobs": 0} if logprobs else {})}
    r = httpx.post(f"{server.base_url}/v1/completions", json=body, timeout=60)
    r.raise_for_status()
    choice = r.json()["choices"][0]
    assert (choice["logprobs"] is not None) == logprobs
    if logprobs:
        assert all(lp <= 0 for lp in choice["logprobs"]["token_logprobs"])
    return choice["token_ids"]


def screened_tokens(server) -> int:
    return httpx.get(f"{server.base_url}/v1/stats", timeout=10).json()["counters"][
        "screened_tokens"]


def flush(server) -> None:
    """An empty cache before each request: a hit computes the prompt from a checkpoint, in
    another order than a whole prefill, so only requests computed alike compare bit for bit."""
    httpx.post(f"{server.base_url}/flush_cache", timeout=30).raise_for_status()


def test_screened_tokens_are_the_full_heads(server):
    for prompt in PROMPTS:
        flush(server)
        before = screened_tokens(server)
        screened = complete(server, prompt, False)
        assert screened_tokens(server) - before == 12
        flush(server)
        assert complete(server, prompt, True) == screened  # logprobs: the full head
        assert screened_tokens(server) - before == 12
