"""The client's SSE parser and OpenAI frame handling on handcrafted byte streams (no server)."""

from __future__ import annotations

import asyncio
import json
import random

import pytest

from client.protocol import http_error, request_body, stream_events
from client.sse import SSEDecoder, aiter_sse_json, iter_sse_data, iter_sse_json
from client.types import DascError, StreamEvent, Usage


def frame(obj: dict, sep: str = " ") -> bytes:
    return f"data:{sep}{json.dumps(obj)}\n\n".encode()


def chunk(text: str, index: int = 0, finish: str | None = None, **kw) -> dict:
    return {"id": "cmpl-1", "object": "text_completion",
            "choices": [{"index": index, "text": text, "finish_reason": finish, **kw}]}


USAGE = {"id": "cmpl-1", "choices": [],
         "usage": {"prompt_tokens": 7, "completion_tokens": 3, "total_tokens": 10,
                   "prompt_tokens_details": {"cached_tokens": 4}}}

COMPLETION_STREAM = (
    b": keep-alive comment\n\n"
    + frame(chunk("Hel", token_ids=[1, 2], prompt_token_ids=[5, 6]))
    + frame(chunk("lo é🙂"), sep="")  # no space after "data:", multibyte text
    + b": another comment\n"
    + frame(chunk("", finish="length"))
    + frame(USAGE)
    + b"data: [DONE]\n\n"
    + frame(chunk("after done"))  # must never be seen
)


def cuts(data: bytes, sizes: list[int]) -> list[bytes]:
    out, pos, i = [], 0, 0
    while pos < len(data):
        size = sizes[i % len(sizes)]
        out.append(data[pos:pos + size])
        pos, i = pos + size, i + 1
    return out


def random_cuts(data: bytes, seed: int) -> list[bytes]:
    rng = random.Random(seed)
    return cuts(data, [rng.randint(1, 9) for _ in range(len(data))])


CHUNKINGS = [[1], [2], [3], [5, 1, 8], [len(COMPLETION_STREAM)]]


def events_of(chunks: list[bytes], *, is_chat: bool = False) -> list[StreamEvent]:
    return [event for f in iter_sse_json(chunks, require_done=True)
            for event in stream_events(f, is_chat=is_chat)]


def check_completion_events(events: list[StreamEvent]) -> None:
    assert [e.text for e in events] == ["Hel", "lo é🙂", "", ""]
    assert events[0].token_ids == [1, 2] and events[1].token_ids is None
    assert events[0].prompt_token_ids == [5, 6] and events[1].prompt_token_ids is None
    assert [e.finish_reason for e in events] == [None, None, "length", None]
    assert events[-1].usage == Usage(prompt_tokens=7, completion_tokens=3, cached_tokens=4)
    assert all(e.usage is None for e in events[:-1])


@pytest.mark.parametrize("sizes", CHUNKINGS)
def test_completion_stream_any_chunking(sizes: list[int]) -> None:
    check_completion_events(events_of(cuts(COMPLETION_STREAM, sizes)))


@pytest.mark.parametrize("seed", range(20))
def test_completion_stream_random_chunking(seed: int) -> None:
    check_completion_events(events_of(random_cuts(COMPLETION_STREAM, seed)))


@pytest.mark.parametrize("eol", ["\n", "\r\n", "\r"])
@pytest.mark.parametrize("sizes", [[1], [2], [4, 3], [1000]])
def test_line_endings_and_multiline_data(eol: str, sizes: list[int]) -> None:
    text = eol.join([": comment", "event: message", "id: 3", "data:first", "data:  second",
                     "data", "retry: 10", "", "data: x", "", "data: [DONE]", "", ""])
    # "data" without a colon adds an empty line; only one leading space is dropped.
    assert list(iter_sse_data(cuts(text.encode(), sizes))) == ["first\n second\n", "x"]


def test_crlf_split_between_chunks_does_not_end_the_event() -> None:
    chunks = [b"data: a\r", b"\ndata: b\r", b"\n\r", b"\n"]
    assert list(iter_sse_data(chunks)) == ["a\nb"]


def test_only_cr_and_lf_end_lines() -> None:
    payload = json.dumps(chunk("a\u2028b\x0cc\x85d"), ensure_ascii=False)
    data = f"data: {payload}\n\n".encode()
    for sizes in ([1], [len(data)]):
        assert list(iter_sse_data(cuts(data, sizes))) == [payload]


def test_byte_order_mark_and_str_chunks() -> None:
    assert list(iter_sse_data([b"\xef\xbb", b"\xbfdata: 1\n\n"])) == ["1"]
    assert list(iter_sse_data(["data: 1\n", "\n", "data: 2\n\n"])) == ["1", "2"]


def test_done_stops_the_stream() -> None:
    decoder = SSEDecoder()
    assert decoder.feed(b"data: 1\n\ndata: [DONE]\n\ndata: 2\n\n") == ["1"]
    assert decoder.is_done
    assert decoder.feed(b"data: 3\n\n") == [] and decoder.close() == []


def test_end_of_stream_without_done() -> None:
    # A last frame without its blank line is still delivered...
    assert list(iter_sse_data([b"data: 1\n\ndata: 2"])) == ["1", "2"]
    assert list(iter_sse_data([b"data: 1\n\ndata: 2\r"])) == ["1", "2"]
    # ...but a client that needs the whole answer learns it was cut off.
    stream = iter_sse_json([frame(chunk("a")), b"data: {\"id\""], require_done=True)
    assert next(stream)["choices"][0]["text"] == "a"
    with pytest.raises(DascError, match="malformed"):
        next(stream)
    with pytest.raises(DascError, match=r"before \[DONE\]"):
        list(iter_sse_json([frame(chunk("a"))], require_done=True))
    assert len(list(iter_sse_json([frame(chunk("a"))]))) == 1


def test_empty_payload_is_skipped() -> None:
    assert list(iter_sse_json([b"data:\n\n", b"data: {}\n\n", b"data: [DONE]\n\n"])) == [{}]


@pytest.mark.parametrize("body, status, message", [
    ({"error": {"message": "prompt too long", "type": "invalid_request_error", "code": 400}},
     400, "prompt too long"),
    ({"error": {"message": "engine died"}}, None, "engine died"),
    ({"error": "plain text error"}, None, "plain text error"),
    ({"object": "error", "message": "vllm style", "code": 500}, 500, "vllm style"),
])
def test_error_frame_raises_after_earlier_frames(body: dict, status: int | None,
                                                 message: str) -> None:
    data = frame(chunk("ok")) + frame(body) + frame(chunk("never")) + b"data: [DONE]\n\n"
    for sizes in ([1], [7], [len(data)]):
        seen = []
        with pytest.raises(DascError) as info:
            for f in iter_sse_json(cuts(data, sizes)):
                seen.append(f)
        assert info.value.message == message and info.value.status == status
        assert [f["choices"][0]["text"] for f in seen] == ["ok"]


def test_usage_only_chunk_and_cached_tokens_not_reported() -> None:
    usage = {"prompt_tokens": 5, "completion_tokens": 2}
    events = stream_events({"choices": [], "usage": usage}, is_chat=False)
    assert events == [StreamEvent(usage=Usage(5, 2, None))]
    assert events[0].usage.cached_tokens is None  # "not reported" never becomes 0
    assert stream_events({"choices": [], "usage": None}, is_chat=False) == []
    assert stream_events({"usage": {**usage, "prompt_tokens_details": None}},
                         is_chat=True)[0].usage.cached_tokens is None
    reported_zero = {**usage, "prompt_tokens_details": {"cached_tokens": 0}}
    assert stream_events({"choices": [], "usage": reported_zero},
                         is_chat=False)[0].usage.cached_tokens == 0


def test_usage_on_a_choice_frame_goes_on_its_last_event() -> None:
    f = {"choices": [{"index": 0, "text": "a"}, {"index": 1, "text": "b", "finish_reason": "stop"}],
         "usage": {"prompt_tokens": 1, "completion_tokens": 2}}
    events = stream_events(f, is_chat=False)
    assert [(e.index, e.text, e.usage is not None) for e in events] == [(0, "a", False),
                                                                         (1, "b", True)]


CHAT_STREAM = b"".join([
    frame({"object": "chat.completion.chunk",
           "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]}),
    frame({"object": "chat.completion.chunk",
           "choices": [{"index": 0, "delta": {"role": "assistant"}, "finish_reason": None}]}),
    frame({"choices": [{"index": 0, "delta": {"content": "Hi"}}]}, sep=""),
    frame({"choices": [{"index": 0, "delta": {"content": None}, "finish_reason": "stop"}]}),
    frame({"choices": [], "usage": {"prompt_tokens": 9, "completion_tokens": 1,
                                    "prompt_tokens_details": {"cached_tokens": 8}}}),
    b"data: [DONE]\n\n",
])


@pytest.mark.parametrize("seed", range(10))
def test_chat_stream_role_only_first_chunk(seed: int) -> None:
    events = events_of(random_cuts(CHAT_STREAM, seed), is_chat=True)
    assert [(e.role, e.text, e.finish_reason) for e in events] == [
        ("assistant", "", None), ("assistant", "", None), (None, "Hi", None),
        (None, "", "stop"), (None, "", None)]
    first_token = next(i for i, e in enumerate(events) if e.text)
    assert first_token == 2  # role-only frames are not the first token (TTFT)
    assert events[-1].usage == Usage(9, 1, 8)


def test_async_parser_matches_sync() -> None:
    async def produce(chunks: list[bytes]):
        for c in chunks:
            await asyncio.sleep(0)
            yield c

    async def collect(chunks: list[bytes]) -> list[dict]:
        return [f async for f in aiter_sse_json(produce(chunks), require_done=True)]

    for seed in range(5):
        chunks = random_cuts(COMPLETION_STREAM, seed)
        assert asyncio.run(collect(chunks)) == list(iter_sse_json(chunks, require_done=True))
    with pytest.raises(DascError, match=r"before \[DONE\]"):
        asyncio.run(collect([frame(chunk("a"))]))
    with pytest.raises(DascError, match="boom"):
        asyncio.run(collect([frame({"error": {"message": "boom"}})]))


def test_http_error_bodies() -> None:
    body = json.dumps({"error": {"message": "max_tokens too large", "code": 400}}).encode()
    err = http_error(400, "Bad Request", body)
    assert (err.status, err.message) == (400, "max_tokens too large")
    detail = json.dumps({"detail": [{"loc": ["body", "prompt"], "msg": "field required"}]})
    assert http_error(422, "", detail.encode()).message == "body.prompt: field required"
    assert http_error(404, "Not Found", b'{"detail": "Not Found"}').message == "Not Found"
    assert http_error(502, "Bad Gateway", b"<html>proxy</html>").message == "<html>proxy</html>"
    assert http_error(503, "Service Unavailable", b"").message == "Service Unavailable"


def test_stream_requests_always_ask_for_usage() -> None:
    body = request_body("prompt", [1, 2], 4, 0.5, {"stream_options": {"x": 1}, "top_k": 3},
                        model=None, stream=True)
    assert body == {"prompt": [1, 2], "max_tokens": 4, "temperature": 0.5, "top_k": 3,
                    "stream": True, "stream_options": {"x": 1, "include_usage": True}}
    plain = request_body("messages", [], 1, 0.0, {"stream": True}, model="m", stream=False)
    assert plain == {"messages": [], "max_tokens": 1, "temperature": 0.0, "model": "m"}
