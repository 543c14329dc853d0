"""The front end's listening socket (``launch.bind_http``): asyncio turns Nagle's algorithm off
on a TCP connection only when the socket says ``proto == IPPROTO_TCP``.  A socket made with proto
0 left it on, and on a kept-alive connection each streamed frame written after the response
headers waited for the client's delayed ACK: ~30 ms added to every TTFT from a connection's
second request on (docs/results/serving.md, "Nagle's algorithm on the front end's socket").
The front end runs on uvloop, which turns it off on every TCP connection; the socket stays right
for asyncio's loop as well."""

from __future__ import annotations

import asyncio
import socket

import pytest
import uvloop

from dasc_server.launch import bind_http


@pytest.mark.parametrize("run", [uvloop.run, asyncio.run], ids=["uvloop", "asyncio"])
def test_connections_accepted_on_the_http_socket_have_nagle_off(run):
    sock = bind_http("127.0.0.1", 0)
    seen: list[int] = []

    class Probe(asyncio.Protocol):
        def connection_made(self, transport: asyncio.BaseTransport) -> None:
            conn = transport.get_extra_info("socket")
            seen.append(conn.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY))
            transport.close()

    async def accept_one() -> None:
        server = await asyncio.get_running_loop().create_server(Probe, sock=sock)
        port = sock.getsockname()[1]
        _, writer = await asyncio.open_connection("127.0.0.1", port)
        for _ in range(200):
            if seen:
                break
            await asyncio.sleep(0.01)
        writer.close()
        server.close()
        await server.wait_closed()

    run(accept_one())
    assert seen and seen[0] != 0, "the accepted connection still runs Nagle's algorithm"
