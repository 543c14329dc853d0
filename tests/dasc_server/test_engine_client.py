"""The front end's engine client (dasc_server/engine_client.py) on its own: a scheduler that
reads nothing never blocks the event loop."""

from __future__ import annotations


def test_sends_to_a_scheduler_that_does_not_read_never_block_the_event_loop(monkeypatch):
    """The front end's messages go out on a writer thread: with a scheduler that
    reads nothing, so that the socket buffers fill, the event loop still runs on time."""
    import asyncio
    import threading
    import time

    from support.serving import ipc_pair

    from dasc_server.engine_client import EngineClient
    from scheduler.wire.messages import SamplingParams

    conn, scheduler_end = ipc_pair(monkeypatch)  # never read from
    engine = EngineClient(conn, info=None)
    lags: list[float] = []

    async def main() -> None:
        engine.start(asyncio.get_running_loop())
        prompt = list(range(100_000))  # ~0.5 MB a request: 16 of them fill any socket buffer
        streams = [engine.generate(f"r{i}", prompt, SamplingParams()) for i in range(16)]
        waits = [asyncio.create_task(anext(s)) for s in streams]
        for _ in range(20):
            started = time.perf_counter()
            await asyncio.sleep(0.01)
            lags.append(time.perf_counter() - started - 0.01)
        for w in waits:
            w.cancel()
        await asyncio.gather(*waits, return_exceptions=True)

    loop_thread = threading.Thread(target=lambda: asyncio.run(main()), daemon=True)
    loop_thread.start()
    loop_thread.join(20)
    blocked = loop_thread.is_alive()
    scheduler_end.close()  # the writer (or, before, the blocked loop) then fails and ends
    for t in threading.enumerate():
        if t.name == "engine-writer":
            t.join(10)
    conn.close()
    assert not blocked, "the event loop blocked writing to the scheduler"
    assert len(lags) == 20 and sorted(lags)[10] < 0.1
