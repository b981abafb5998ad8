"""Drive a ModelRuntime without HTTP: submit requests, collect each one's events until it ends."""

from __future__ import annotations

import asyncio


def run_requests(runtime, requests) -> list[list]:
    """Submit every request at once; returns each one's events, the last a FinishEvent or ErrorEvent."""
    from flared.runtime.request import ErrorEvent, EventSink, FinishEvent

    async def go():
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue = asyncio.Queue()
        for i, r in enumerate(requests):
            runtime.submit(r, EventSink(loop, queue, i))
        events = [[] for _ in requests]
        done = 0
        while done < len(requests):
            i, e = await queue.get()
            events[i].append(e)
            done += isinstance(e, (FinishEvent, ErrorEvent))
        return events
    return asyncio.run(go())
