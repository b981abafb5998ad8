"""Faults on the real daemon: a model-thread failure mid-batch, SIGTERM under load, SIGKILL and restart."""

from __future__ import annotations

import asyncio
import hashlib
import signal
import socket
import time

from flared.bench.client import stream_chat
from flared_testing.rawhttp import post_bytes, read_until


def _healthy(d, timeout_s: float = 60.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if d.request("GET", "/health")[0] == 200:
            return True
    return False


def _core_digest(core) -> str:
    h = hashlib.sha256()
    for path in sorted(p for p in core.rglob("*") if p.is_file()):
        h.update(str(path.relative_to(core)).encode())
        h.update(path.read_bytes())
    return h.hexdigest()


def test_model_thread_failure_mid_batch_errors_every_inflight_request(tiny_core, start_daemon):
    d = start_daemon(tiny_core, "--debug-fail-after-steps", "8")

    async def batch():
        bodies = [{"model": "tiny", "messages": [{"role": "user", "content": f"request {i}"}], "max_tokens": 200,
                   "ignore_eos": True, "stream": i % 2 == 0} for i in range(4)]
        return await asyncio.gather(*(stream_chat("127.0.0.1", d.port, "/v1/chat/completions", b, api_key=None,
                                                  timeout_s=60) for b in bodies))

    outcomes = asyncio.run(batch())
    # Streams end in an SSE error event; unary requests get a 500; a request that arrived after
    # the failure is refused with 503. None completes.
    for o in outcomes:
        assert o.error in ("stream_error", "http_500", "http_503"), (o.error, o.status)
    assert any(o.error == "stream_error" for o in outcomes) and any(o.error == "http_500" for o in outcomes)
    try:
        status, body = d.request("POST", "/v1/completions", {"model": "tiny", "prompt": "hi", "max_tokens": 2})
        assert status == 503 and "error" in body, (status, body)
    except ConnectionError:
        pass  # already exited
    assert d.proc.wait(60) == 1, d.log()


def test_sigterm_under_load_finishes_admitted_streams_then_exits_0(tiny_core, start_daemon):
    d = start_daemon(tiny_core)
    socks = []
    for i in range(4):
        s = socket.create_connection(("127.0.0.1", d.port))
        s.sendall(post_bytes("/v1/completions", {"model": "tiny", "prompt": f"load {i}", "max_tokens": 120, "ignore_eos": True,
                                 "stream": True}))
        socks.append(s)
    firsts = [read_until(s, b"data: ") for s in socks]  # all four are decoding
    assert all(b"200 OK" in f for f in firsts)
    d.proc.send_signal(signal.SIGTERM)
    for s, first in zip(socks, firsts):
        stream = first + read_until(s, b"data: [DONE]")
        s.close()
        assert b'"finish_reason":"length"' in stream and b"data: [DONE]" in stream, stream[-200:]
    assert d.proc.wait(60) == 0, d.log()


def test_sigkill_then_restart_comes_back_healthy(tiny_core, start_daemon):
    before = _core_digest(tiny_core)
    d = start_daemon(tiny_core)
    s = socket.create_connection(("127.0.0.1", d.port))
    s.sendall(post_bytes("/v1/completions", {"model": "tiny", "prompt": "killed", "max_tokens": 200, "ignore_eos": True,
                             "stream": True}))
    assert b"200 OK" in read_until(s, b"data: ")
    d.proc.send_signal(signal.SIGKILL)
    assert d.proc.wait(30) == -signal.SIGKILL
    s.close()
    assert _core_digest(tiny_core) == before, "the core changed on disk"
    again = start_daemon(tiny_core)
    assert _healthy(again), again.log()
    status, body = again.request("POST", "/v1/completions", {"model": "tiny", "prompt": "back", "max_tokens": 4,
                                                             "ignore_eos": True})
    assert status == 200 and body["usage"]["completion_tokens"] == 4, body
    assert again.stop() == 0
