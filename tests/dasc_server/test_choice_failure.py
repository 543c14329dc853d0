"""One choice of a multi-choice request (``n`` > 1, or a prompt batch) failing mid-flight, while
its siblings are generating: the request answers the failure (a JSON 400 with its message, or
an error frame and ``[DONE]`` on a stream), every sibling is aborted or finished, none is left
in flight, the metrics count it, and the next request is served.

The front end runs in-process (``create_app``, the real routes and response code) over a
scripted engine: a real server has no way to fail one choice alone (the scheduler refuses only
what the front end has already checked, and a dying engine fails every choice), so the failure
is injected where the scheduler would send it, as a finished frame with ``finish_reason``
"error" after a few tokens.
"""

from __future__ import annotations

import asyncio
import json
from itertools import count

import httpx
import pytest
from support.serving import KIMI
from transformers import AutoTokenizer

from dasc_server.app import create_app
from dasc_server.flags import parse_args, serve_config
from scheduler.wire.messages import ServerInfo, TokenOut
from scheduler.wire.rank_messages import RankInfo

RANK = RankInfo(model_type="kimi_linear", tp_size=1, vocab_size=264, eos_token_id=258,
                max_context_len=8192, num_checkpoint_slots=8, checkpoint_bytes_per_slot=1,
                dense_bytes_per_slot=1, refresh_window=0)
INFO = ServerInfo(serve_config(parse_args(["--model", str(KIMI), "--max-total-tokens", "4096"])),
                  RANK, chunked_prefill_size=2048)


class ScriptedEngine:
    """``EngineClient``'s surface: request ``fail_index`` (in send order) fails after
    ``fail_after`` tokens; the others make one token per 10 ms until ``max_tokens``.  It keeps
    the books: who is in flight, finished, aborted (left before its end) or failed."""

    def __init__(self, fail_index: int, fail_after: int = 3):
        self.info, self.dead = INFO, None
        self.fail_index, self.fail_after = fail_index, fail_after
        self._ids = count()
        self.active: set[str] = set()
        self.sent, self.finished, self.aborted, self.failed = [], [], [], []

    @property
    def num_active(self) -> int:
        return len(self.active)

    def new_rid(self) -> str:
        return f"req-{next(self._ids)}"

    async def generate(self, rid, prompt_ids, sampling):
        index, done = len(self.sent), False
        self.sent.append(rid)
        self.active.add(rid)
        try:
            for i in range(sampling.max_tokens):
                await asyncio.sleep(0.01)
                if index == self.fail_index and i == self.fail_after:
                    done = True
                    self.failed.append(rid)
                    yield TokenOut(rid, [], finished=True, finish_reason="error",
                                   prompt_tokens=len(prompt_ids), error="injected failure")
                    return
                last = i == sampling.max_tokens - 1
                done = last
                if last:
                    self.finished.append(rid)
                yield TokenOut(rid, [65 + i % 26], [-0.5], finished=last,
                               finish_reason="length" if last else None,
                               prompt_tokens=len(prompt_ids))
        finally:
            self.active.discard(rid)
            if not done:
                self.aborted.append(rid)


@pytest.fixture(scope="module")
def tokenizer():
    return AutoTokenizer.from_pretrained(KIMI)


BODIES = {
    "n": {"prompt": [72, 105], "n": 3, "max_tokens": 40, "seed": 1},
    "batch": {"prompt": [[72, 105], [79, 107], [87, 111]], "max_tokens": 40},
}


async def exchange(engine, tokenizer, body: dict, stream: bool) -> tuple[int, str, str]:
    app = create_app(engine, tokenizer, "tiny")
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://dasc") as client:
        r = await client.post("/v1/completions", json={**body, "stream": stream})
        after = await client.post("/v1/completions", json={"prompt": [65], "max_tokens": 2})
        return r.status_code, r.text, after.json()["choices"][0]["finish_reason"]


@pytest.mark.parametrize("stream", [False, True], ids=["json", "sse"])
@pytest.mark.parametrize("shape", list(BODIES))
def test_one_failing_choice_ends_the_request_and_frees_its_siblings(tokenizer, shape, stream):
    engine = ScriptedEngine(fail_index=1)
    status, text, after = asyncio.run(exchange(engine, tokenizer, BODIES[shape], stream))
    if stream:
        frames = [f.removeprefix("data: ") for f in text.split("\n\n") if f]
        assert status == 200 and frames[-1] == "[DONE]"
        error = json.loads(frames[-2])["error"]
        assert error["message"] == "injected failure"
        chunks = [json.loads(f) for f in frames[:-2]]
        assert chunks and all(c["choices"][0]["finish_reason"] is None for c in chunks)
    else:
        assert status == 400 and json.loads(text)["error"]["message"] == "injected failure"
    # the books: three choices sent, one failed, the others aborted (none ran to its end),
    # nothing left in flight; then the next request runs to its end
    request_rids = engine.sent[:3]
    assert len(engine.sent) == 4 and engine.failed == [request_rids[1]]
    assert sorted(engine.aborted) == sorted(set(request_rids) - {request_rids[1]})
    assert engine.finished == [engine.sent[3]] and engine.num_active == 0
    assert after == "length"
