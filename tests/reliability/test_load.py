"""Twice the admission capacity for a bounded time: only 429/503 refusals, every admitted request
completes, memory flat after warm-up, and nothing leaks (slots, pages, permits)."""

from __future__ import annotations

import asyncio
import os
import time


from flared.bench.client import stream_chat

SLOW = os.environ.get("FLARED_SLOW_TESTS") == "1"
MAX_ACTIVE, QUEUE = 4, 4
CLIENTS = 2 * (MAX_ACTIVE + QUEUE)  # twice what the daemon admits at once
MEASURE_S = 120.0 if SLOW else 12.0


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


async def _hammer(port: int, model: str, seconds: float, outcomes: list) -> None:
    deadline = time.monotonic() + seconds

    async def client(i: int) -> None:
        n = 0
        while time.monotonic() < deadline:
            body = {"model": model, "messages": [{"role": "user", "content": f"client {i} request {n}"}],
                    "max_tokens": 4 + (i + n) % 12, "ignore_eos": True, "stream": True, "temperature": 0}
            outcomes.append(await stream_chat("127.0.0.1", port, "/v1/chat/completions", body,
                                              api_key=None, timeout_s=60))
            n += 1

    await asyncio.gather(*(client(i) for i in range(CLIENTS)))


def test_twice_capacity_refuses_only_429_503_and_leaks_nothing(tiny_core, in_process):
    srv = in_process(tiny_core, max_active=MAX_ACTIVE, queue_capacity=QUEUE)
    warm: list = []
    asyncio.run(_hammer(srv.port, srv.model, 3.0, warm))
    srv.assert_no_leaks()
    rss_after_warmup = _rss_bytes()
    outcomes: list = []
    asyncio.run(_hammer(srv.port, srv.model, MEASURE_S, outcomes))
    rt = srv.assert_no_leaks()
    rss_end = _rss_bytes()

    every = warm + outcomes
    statuses = {o.status for o in every}
    assert statuses <= {200, 429, 503}, statuses
    admitted = [o for o in every if o.status == 200]
    refused = [o for o in every if o.status in (429, 503)]
    assert refused, "the load never exceeded capacity"
    broken = [o for o in admitted if not (o.done and o.error is None and o.finish_reason == "length")]
    assert not broken, broken[:3]
    # Every admitted request reached the model and finished there; none was lost or cancelled.
    assert rt["counters"]["finished"] == len(admitted)
    assert rt["counters"].get("cancelled", 0) == 0
    growth = (rss_end - rss_after_warmup) / rss_after_warmup
    assert growth < 0.05, f"RSS grew {growth:.1%} ({rss_after_warmup} -> {rss_end})"
    print(f"load: {len(admitted)} completed, {len(refused)} refused, RSS growth {growth:.2%}")
