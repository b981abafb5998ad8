"""Long variants: many connections at once, mixed JSON and SSE traffic.

Skipped unless FLARED_SLOW_TESTS=1 (each takes seconds on 2 cores).
"""

from __future__ import annotations

import asyncio
import json
import os

import pytest

from flared.server.http import sse

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(os.environ.get("FLARED_SLOW_TESTS") != "1", reason="set FLARED_SLOW_TESTS=1"),
]


async def _json_client(address, index: int, num_requests: int) -> int:
    reader, writer = await asyncio.open_connection(*address)
    for step in range(num_requests):
        body = json.dumps({"client": index, "step": step}).encode()
        writer.write(b"POST /echo HTTP/1.1\r\nHost: t\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body))
        head = await reader.readuntil(b"\r\n\r\n")
        length = int(head.lower().split(b"content-length: ")[1].split(b"\r\n")[0])
        assert json.loads(await reader.readexactly(length))["json"] == {"client": index, "step": step}
    writer.close()
    return num_requests


async def _sse_client(address, num_events: int) -> int:
    reader, writer = await asyncio.open_connection(*address)
    writer.write(b"GET /sse?n=%d HTTP/1.1\r\nHost: t\r\nConnection: close\r\n\r\n" % num_events)
    raw = await reader.read()  # until the server closes
    writer.close()
    body = raw.partition(b"\r\n\r\n")[2]
    # the chunk framing is irrelevant to the event count: frames end in "\n\n"
    events = sse.decode_events(b"".join(part for part in body.split(b"\r\n")[1::2]))
    assert events[-1]["data"] == "[DONE]"
    return len(events) - 1


def test_500_connections_mixed_traffic(start_server):
    server = start_server(max_connections=2048)

    async def run():
        json_clients = [_json_client(server.address, i, 20) for i in range(500)]
        sse_clients = [_sse_client(server.address, 2000) for _ in range(64)]
        return await asyncio.wait_for(asyncio.gather(*json_clients, *sse_clients), 120)

    results = asyncio.run(run())
    assert results[:500] == [20] * 500
    assert results[500:] == [2000] * 64
    # every connection is released once the clients are gone
    asyncio.run_coroutine_threadsafe(server.server._all_closed.wait(), server.loop).result(30)
    stats = server.server.stats
    assert stats.num_open_connections == 0
    assert stats.num_requests_total == stats.num_responses_total == 500 * 20 + 64
