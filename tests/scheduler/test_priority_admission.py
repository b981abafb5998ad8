"""vLLM's priority through a real ModelRuntime (tiny core, 4 request slots, no HTTP): a request with a lower
priority value waiting for a slot is admitted before those that came earlier with the default."""

from __future__ import annotations

import asyncio

from flared.core.load import open_core
from flared.model.sampling import SamplingParams
from flared.runtime.request import EventSink, FinishEvent, GenerateRequest
from flared.runtime.worker import ModelRuntime


def _finish_order(runtime, priorities) -> list[int]:
    """Submit one 24-token greedy request per priority at once; the order in which they finish."""
    requests = [GenerateRequest(tuple(range(5 + i, 25 + i)), (), SamplingParams(temperature=0, max_tokens=24),
                                frozenset(), priority=p) for i, p in enumerate(priorities)]

    async def go():
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue = asyncio.Queue()
        for i, r in enumerate(requests):
            runtime.submit(r, EventSink(loop, queue, i))
        order = []
        while len(order) < len(requests):
            i, e = await queue.get()
            if isinstance(e, FinishEvent):
                order.append(i)
        return order
    return asyncio.run(go())


def test_a_lower_priority_value_takes_the_next_free_slot(tiny_core):
    rt = ModelRuntime(open_core(tiny_core), torch_threads=1)
    rt.start(max_pending=16)
    try:
        slots = rt.core.manifest.capacities.concurrency
        assert slots == 4
        # five requests for four slots: the fifth waits, and finishes last
        assert _finish_order(rt, [0] * 5)[-1] == 4
        # the fifth at priority -1 goes ahead of the fourth, which waits instead
        assert _finish_order(rt, [0, 0, 0, 0, -1])[-1] == 3
        # and a higher value waits behind every default
        assert _finish_order(rt, [0, 5, 0, 0, 0])[-1] == 1
    finally:
        rt.stop()
