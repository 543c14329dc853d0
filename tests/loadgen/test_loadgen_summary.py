"""dasc-loadgen without a dasc server: summary math on known inputs, SSE parsing against a
small HTTP server on 127.0.0.1 that sends given frames (role-only and usage-only frames, cached
tokens not reported, a line split across reads, a frame longer than aiohttp's default buffer),
workloads and the phase plan."""

from __future__ import annotations

import asyncio
import json

import numpy as np
import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer

from loadgen.phases import plan_phases, replay_order
from loadgen.stream import RequestResult, make_client, send_streaming
from loadgen.summary import format_table, summarize
from loadgen.workload import PromptFileError, Request, multi_turn, read_prompt_file, shared_prefix


def result(ttft, prompt=100, cached=0, out=1, e2el=None, cold=None, error=None):
    tags = {} if cold is None else {"cold": cold}
    return RequestResult(ttft_ms=ttft, ttfb_ms=ttft, e2el_ms=e2el or ttft, prompt_tokens=prompt,
                         cached_tokens=cached, output_tokens=out, error=error, tags=tags)


def test_summary_math():
    rs = [result(10, cached=0, cold=True), result(20, cached=50, cold=False),
          result(30, cached=100, cold=False), result(40, prompt=200, cached=100, cold=True),
          result(None, error="HTTP 400: bad token", cold=False)]
    s = summarize(rs, duration=2.0)
    assert (s["completed"], s["failed"]) == (4, 1)
    assert s["total_input_tokens"] == 500 and s["total_cached_tokens"] == 250
    assert s["cache_hit_rate"] == pytest.approx(250 / 500)
    assert s["input_throughput"] == pytest.approx(250.0)
    assert s["request_throughput"] == pytest.approx(2.0)
    assert s["mean_ttft_ms"] == pytest.approx(25.0)
    assert s["median_ttft_ms"] == pytest.approx(25.0)
    assert s["p90_ttft_ms"] == pytest.approx(37.0)  # numpy linear: 30 + 0.7 * 10
    assert s["p99_ttft_ms"] == pytest.approx(np.percentile([10, 20, 30, 40], 99))
    assert s["std_ttft_ms"] == pytest.approx(np.std([10, 20, 30, 40]))
    assert s["num_hits"] == 3
    assert (s["cold_completed"], s["warm_completed"]) == (2, 2)
    assert s["cold_mean_ttft_ms"] == pytest.approx(25.0)
    assert s["warm_mean_ttft_ms"] == pytest.approx(25.0)
    assert s["cold_cache_hit_rate"] == pytest.approx(100 / 300)
    assert s["warm_cache_hit_rate"] == pytest.approx(150 / 200)
    assert s["errors"] == {"HTTP 400: bad token": 1}
    table = format_table(s)
    assert "Failed requests:" in table and "HTTP 400: bad token" in table


def test_tpot_itl_and_not_reported():
    r = RequestResult(ttft_ms=100, e2el_ms=400, itl_ms=[100, 100, 100], prompt_tokens=10,
                      cached_tokens=None, output_tokens=4)
    s = summarize([r], duration=1.0)
    assert s["mean_tpot_ms"] == pytest.approx(100.0)
    assert s["mean_itl_ms"] == pytest.approx(100.0)
    assert s["cache_hit_rate"] is None and s["total_cached_tokens"] is None
    table = format_table(s)
    assert "Cache hit rate (tokens):" in table and "not reported" in table
    assert "Mean TPOT (ms):" in table


def sse(frames: list[dict | str]) -> bytes:
    return "".join(f"data: {f if isinstance(f, str) else json.dumps(f)}\n\n"
                   for f in frames).encode()


def stream_once(frames: list, status: int = 200, piece: int = 0) -> RequestResult:
    """One request against a server that answers with ``frames`` (written ``piece`` bytes at a
    time when given, so lines arrive split across reads)."""
    async def handler(request: web.Request) -> web.StreamResponse:
        body = await request.json()
        assert body["stream"] and body["stream_options"] == {"include_usage": True}
        if status != 200:
            return web.json_response({"error": {"message": "nope"}}, status=status)
        resp = web.StreamResponse()
        await resp.prepare(request)
        data = sse(frames)
        step = piece or len(data) or 1
        for i in range(0, len(data), step):
            await resp.write(data[i:i + step])
        await resp.write_eof()
        return resp

    async def go():
        app = web.Application()
        app.router.add_post("/v1/completions", handler)
        async with TestServer(app, host="127.0.0.1") as server:
            async with make_client(str(server.make_url("/")), 1) as client:
                return await send_streaming(client, Request([1, 2, 3], 2), None, 0.0)

    return asyncio.run(go())


def test_sse_role_and_usage_frames_are_not_tokens():
    role = {"choices": [{"index": 0, "delta": {"role": "assistant"}}]}
    tok = {"choices": [{"index": 0, "text": "a"}]}
    usage = {"choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": 2,
                                      "prompt_tokens_details": None}}
    r = stream_once([role, tok, tok, usage, "[DONE]"])
    assert r.ok and r.output_tokens == 2 and len(r.itl_ms) == 1
    assert r.ttfb_ms <= r.ttft_ms <= r.e2el_ms
    assert r.prompt_tokens == 3 and r.cached_tokens is None  # not reported, not 0
    r = stream_once([role, usage, "[DONE]"])
    assert r.error == "no generated content in the stream"
    r = stream_once([], status=400)
    assert r.error == "HTTP 400: nope"


def test_sse_lines_split_across_reads_and_long_frames():
    tok = {"choices": [{"index": 0, "text": "a"}]}
    long = {"choices": [{"index": 0, "text": "b" * 200_000}]}  # past aiohttp's 64 KiB default
    usage = {"choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": 3,
                                      "prompt_tokens_details": {"cached_tokens": 2}}}
    r = stream_once([tok, long, tok, usage, "[DONE]"], piece=7)
    assert r.ok, r.error
    assert r.output_tokens == 3 and len(r.itl_ms) == 2 and r.cached_tokens == 2


def test_workloads(tmp_path):
    reqs = shared_prefix(2, 3, 8, 4, (0, 50), seed=1)
    assert [r.tags["cold"] for r in reqs] == [True, False, False] * 2
    assert reqs[1].prompt[:8] == reqs[0].prompt[:8] != reqs[3].prompt[:8]
    assert [r.depends_on for r in reqs] == [None, 0, 0, None, 3, 3]
    turns = multi_turn(3, 2, 8, 4, (0, 50), seed=5)
    for r in turns:
        if r.depends_on is not None:
            prev = turns[r.depends_on]
            assert r.prompt[:len(prev.prompt)] == prev.prompt and r.tags["turn"] == 1
    assert sorted(map(tuple, (r.prompt for r in turns))) == sorted(
        map(tuple, (r.prompt for r in multi_turn(3, 2, 8, 4, (0, 50), seed=6))))
    f = tmp_path / "p.jsonl"
    f.write_text('{"prompt": [1, 2]}\n{"prompt": "hi", "warmup": true}\n'
                 '{"prompt": [3], "max_tokens": 4}\n{"prompt": "w2", "warmup": true}\n')
    reqs = read_prompt_file(f)
    assert [r.prompt for r in reqs] == ["hi", "w2", [1, 2], [3]]
    assert [r.is_warmup for r in reqs] == [True, True, False, False]
    assert reqs[3].max_tokens == 4
    f.write_text('{"prompt": []}\n')
    with pytest.raises(PromptFileError):
        read_prompt_file(f)


def test_phase_plan_matches_the_paper():
    # 127 deployable dense slots, 12,032 prompts: Q = ceil(127 / 0.85) = 150 -> 80 blocks.
    phases = plan_phases([("dense", 127), ("W512", 2000)], 12032)
    assert [(p.block_len, p.num_blocks, p.num_replays) for p in phases] == [
        (150, 80, 6), (2353, 5, 1), (12032, 1, 1)]
    small = plan_phases([("dense", 100)], 50, dense_replays=2)
    assert [(p.block_len, p.num_blocks) for p in small] == [(50, 1), (50, 1)]
    assert small[0].num_requests == 150
    order = replay_order(20, 42, "dense", 3, 1)
    assert sorted(order) == list(range(20)) and order == replay_order(20, 42, "dense", 3, 1)
    assert order != replay_order(20, 123, "dense", 3, 1)


def test_chat_turns_carry_only_their_new_tokens_and_only_later_turns_extend(capsys):
    from loadgen.cli import main

    plain = multi_turn(2, 3, 8, 4, (0, 50), seed=5)
    chat = multi_turn(2, 3, 8, 4, (0, 50), seed=5, with_replies=True)
    for p, c in zip(plain, chat):
        t = c.tags["turn"]
        assert c.extends_reply == (t > 0) and c.returns_ids == (t < 2)
        assert c.prompt == (p.prompt if t == 0 else p.prompt[-4:])
    code = main(["--base-url", "http://127.0.0.1:9", "--workload", "shared-prefix",
                 "--with-replies"])
    assert code == 2 and "--with-replies needs --workload multi-turn" in capsys.readouterr().err


@pytest.mark.parametrize(("flag", "value", "low"), [
    ("--num-groups", "0", 1), ("--prompts-per-group", "0", 1), ("--concurrency", "0", 1),
    ("--prefix-len", "-1", 0), ("--suffix-len", "-1", 0), ("--max-tokens", "-1", 0)])
def test_counts_that_would_send_nothing_are_refused(capsys, flag, value, low):
    """An empty workload is an error before anything is sent, not a run of no requests."""
    from loadgen.cli import main

    code = main(["--base-url", "http://127.0.0.1:9", "--workload", "multi-turn", flag, value])
    assert code == 2
    assert f"{flag} must be at least {low} (got {value})" in capsys.readouterr().err


def test_multi_turn_system_prompt_is_shared_by_every_conversation():
    turns = multi_turn(4, 3, 5, 7, (0, 50), seed=1, system_len=20)
    system = turns[0].prompt[:20]
    assert all(r.prompt[:20] == system for r in turns)
    firsts = [r for r in turns if r.tags["turn"] == 0]
    assert len({tuple(r.prompt[20:]) for r in firsts}) == 4  # then each its own context
    assert all(len(r.prompt) == 20 + 5 + 7 * (r.tags["turn"] + 1) for r in turns)
    # the same prompts without the system prompt, behind it
    plain = multi_turn(4, 3, 5, 7, (0, 50), seed=1)
    assert [r.prompt[20:] for r in turns] == [r.prompt for r in plain]
