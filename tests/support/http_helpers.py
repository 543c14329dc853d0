"""HTTP calls to a real dasc-serve over httpx, with the checks every caller wants: a 200 answer's
JSON, a stream's SSE framing (``data: <payload>\\n\\n`` only, ending ``[DONE]``), ``/v1/stats``,
and an idle server whose pools balance."""

from __future__ import annotations

import json
import time

import httpx


def post(url: str, path: str, body: dict, timeout: float = 60) -> httpx.Response:
    return httpx.post(url + path, json=body, timeout=timeout)


def complete(url: str, body: dict, path: str = "/v1/completions") -> dict:
    r = post(url, path, body)
    assert r.status_code == 200, r.text
    return r.json()


def sse_payloads(url: str, body: dict, path: str = "/v1/completions") -> list[str]:
    """The payloads of a streamed answer, checking the framing: ``data: <payload>\\n\\n`` only,
    the last one ``[DONE]`` (returned without it)."""
    with httpx.stream("POST", url + path, json={**body, "stream": True}, timeout=60) as r:
        assert r.status_code == 200, r.read()
        assert r.headers["content-type"].startswith("text/event-stream")
        raw = r.read().decode()
    assert raw.endswith("\n\n"), raw[-200:]
    frames = raw.split("\n\n")[:-1]
    for frame in frames:
        assert frame.startswith("data: ") and "\n" not in frame, frame
    payloads = [f.removeprefix("data: ") for f in frames]
    assert payloads[-1] == "[DONE]" and "[DONE]" not in payloads[:-1]
    return payloads[:-1]


def stream_chunks(url: str, body: dict, path: str = "/v1/completions") -> list[dict]:
    return [json.loads(p) for p in sse_payloads(url, body, path)]


def stats(url: str) -> dict:
    r = httpx.get(url + "/v1/stats", timeout=30)
    assert r.status_code == 200, r.text
    return r.json()


def wait_idle(url: str, timeout: float = 20.0) -> dict:
    """Poll until nothing runs or waits (bounded); then the pools must balance."""
    deadline = time.monotonic() + timeout
    while (s := stats(url))["num_running"] or s["num_waiting"]:
        assert time.monotonic() < deadline, f"still busy after {timeout:.0f} s: {s}"
        time.sleep(0.05)
    assert s["integrity"] == "ok", s["integrity"]
    assert s["kv_rows_free"] + s["kv_rows_cached"] == s["kv_rows_total"], s
    assert s["checkpoint_slots_free"] + s["checkpoint_slots_cached"] == \
        s["checkpoint_slots_total"], s
    return s


def cached_tokens(body: dict) -> int:
    return body["usage"]["prompt_tokens_details"]["cached_tokens"]
