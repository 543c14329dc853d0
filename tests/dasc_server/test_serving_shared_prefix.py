"""A served batch of prompts that share a prefix off the checkpoint grid (vLLM's bench shape: a
192-token prefix under the 256-token interval): the first prefills it and stores a checkpoint
where the prompts part, the others wait for it and hit the whole prefix, so the prefix is hit
from its second sharer on; every answer is the tokens its prompt gets without a cache.  A small
prefill budget makes the first prompt take several steps, so the others are queued while it
prefills whatever the order the front end hands them over in."""

from __future__ import annotations

import pytest
from support.serving import KIMI, running_server
from support.serving_reference import Reference


@pytest.mark.parametrize("prefix_len", [192])
def test_a_shared_prefix_is_hit_from_its_second_sharer_in_flight(prefix_len):
    prefix = list(range(40, 40 + 95)) * 3
    prompts = [prefix[:prefix_len] + list(f"{i}: and what now?".encode()) for i in range(3)]
    with running_server("--model", str(KIMI), "--chunked-prefill-size", "32") as server:
        body = server.complete(prompts, max_tokens=4, ignore_eos=True)
        stats = server.stats()
    assert body["usage"]["prompt_tokens_details"]["cached_tokens"] == 2 * prefix_len
    assert stats["integrity"] == "ok"
    ref = Reference(KIMI)
    for choice in body["choices"]:
        assert choice["token_ids"] == ref.engine.generate([prompts[choice["index"]]], 4)[0]
