#!/usr/bin/env python3
"""What operations cost the serving path.

    .venv/bin/python tools/bench_ops.py [--core CORE] [--rounds 3] [--json]

(a) dashboard telemetry on the model thread: CompletionBuffer.record (the
    only work the model thread does for the dashboard) against the mean
    model step measured in the same run;
(b) a /metrics scrape (collect + render on the event loop) against the same
    model step;
(c) serving throughput with the dashboard feed polled every 500 ms against
    no dashboard, alternating rounds (best of --rounds each) so load on a
    shared machine hits both sides.

CORE defaults to the embedded model's cached core (exported on first use).
With --json the last line is one JSON object.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import threading
import time
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from flared.config import ServerConfig  # noqa: E402
from flared.dashboard.telemetry import CompletionBuffer, TelemetryFeed  # noqa: E402
from flared.runtime.session import LoadedSession  # noqa: E402


def record_ns(samples: int = 200_000) -> float:
    buf = CompletionBuffer()
    best = float("inf")
    for _ in range(5):
        t0 = time.perf_counter_ns()
        for i in range(samples):
            if i % 1000 == 0:
                buf.drain()  # keep it from filling: a full buffer takes the cheaper drop path
            buf.record(i, 6, 4, 4, 4, 1000)
        best = min(best, (time.perf_counter_ns() - t0) / samples)
    return best


def chat(port: int, max_tokens: int) -> None:
    body = json.dumps({"model": "bench", "messages": [{"role": "user", "content": "Tell me a story."}],
                       "max_tokens": max_tokens, "ignore_eos": True}).encode()
    req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/chat/completions", data=body,
                                 headers={"content-type": "application/json"})
    with urllib.request.urlopen(req, timeout=600) as r:
        r.read()


def load_round(port: int, runtime, clients: int, max_tokens: int) -> float:
    """Generated tokens per second with `clients` concurrent requests."""
    before = runtime.stats["generated_tokens"]
    t0 = time.perf_counter()
    threads = [threading.Thread(target=chat, args=(port, max_tokens)) for _ in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return (runtime.stats["generated_tokens"] - before) / (time.perf_counter() - t0)


async def measure(core: Path, rounds: int, clients: int, max_tokens: int) -> dict:
    loaded = LoadedSession.load(core, ServerConfig(port=0, served_names=("bench",)))
    serving = await loaded.start()
    runtime = loaded.runtime
    port = serving.address[1]
    try:
        await asyncio.to_thread(load_round, port, runtime, clients, 8)  # warm up
        steps0, t0 = runtime.steps, time.perf_counter()
        plain, dashboard = [], []
        feed = TelemetryFeed(runtime, serving.snapshot)
        for _ in range(rounds):
            plain.append(await asyncio.to_thread(load_round, port, runtime, clients, max_tokens))
            stop = threading.Event()

            def poll_loop():
                since = 0
                while not stop.is_set():
                    since = feed.poll(since)["next_seq"] - 1
                    stop.wait(0.5)
            poller = threading.Thread(target=poll_loop)
            poller.start()
            dashboard.append(await asyncio.to_thread(load_round, port, runtime, clients, max_tokens))
            stop.set()
            poller.join()
            feed.disable()
        step_ns = (time.perf_counter() - t0) * 1e9 / max(1, runtime.steps - steps0)
        scrape = []
        for _ in range(50):
            s0 = time.perf_counter_ns()
            serving.metrics.render()
            scrape.append(time.perf_counter_ns() - s0)
        return {"step_ns": step_ns, "scrape_ns": statistics.median(scrape), "plain_tps": max(plain),
                "dashboard_tps": max(dashboard)}
    finally:
        await serving.close(grace_s=1.0)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--core", type=Path, default=None)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--clients", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    core = args.core
    if core is None:
        from flared.cli.ctl import default_cache_dir
        from flared.core.default import ensure_default_core

        core = ensure_default_core(default_cache_dir())
    rec = record_ns()
    m = asyncio.run(measure(core, args.rounds, args.clients, args.max_tokens))
    rows = [
        ("telemetry record / model step", f"{rec:,.0f} ns / {m['step_ns'] / 1e3:,.0f} us", rec / m["step_ns"]),
        ("/metrics scrape / model step", f"{m['scrape_ns'] / 1e3:,.0f} us / {m['step_ns'] / 1e3:,.0f} us",
         m["scrape_ns"] / m["step_ns"]),
        ("tokens/s with dashboard / without", f"{m['dashboard_tps']:,.1f} / {m['plain_tps']:,.1f}",
         m["dashboard_tps"] / m["plain_tps"]),
    ]
    print(f"{'measure':<36}{'values':<28}{'ratio':>8}")
    for name, values, ratio in rows:
        print(f"{name:<36}{values:<28}{ratio:>8.4f}")
    if args.json:
        print(json.dumps({"core": str(core), "record_ns": rec, **m,
                          "record_over_step": rec / m["step_ns"], "scrape_over_step": m["scrape_ns"] / m["step_ns"],
                          "dashboard_over_plain_tps": m["dashboard_tps"] / m["plain_tps"]}))


if __name__ == "__main__":
    main()
