"""Reliability harness: a real daemon (subprocess) or an in-process serving session, plus leak checks.

Everything targets 127.0.0.1 and is bounded in count and time; waits poll a
condition with a deadline, never a bare sleep.
"""

from __future__ import annotations

import asyncio
import json
import os
import socket
import threading
import time
import weakref
from pathlib import Path

import pytest
from flared_testing.daemon import Daemon


SLOW = os.environ.get("FLARED_SLOW_TESTS") == "1"


def wait_for(predicate, timeout_s: float, what: str, poll_s: float = 0.01):
    deadline = time.monotonic() + timeout_s
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(poll_s)  # polling a condition owned by another thread or process


class InProcessServer:
    """A ServingSession on its own event-loop thread, so tests can read the live scheduler."""

    def __init__(self, core: Path, **config):
        from flared.config import ServerConfig
        from flared.runtime.session import LoadedSession

        self.session = LoadedSession.load(core, ServerConfig(port=0, torch_threads=1, **config))
        self._started = threading.Event()
        self._box: dict = {}
        self._thread = threading.Thread(target=lambda: asyncio.run(self._serve()), daemon=True)
        self._thread.start()
        assert self._started.wait(120), "in-process server did not start"
        self.serving = self._box["serving"]
        self.port = self.serving.address[1]
        self.runtime = self.serving.loaded.runtime
        self.model = self.serving.loaded.manifest.model_name

    async def _serve(self):
        serving = await self.session.start()
        self._box.update(serving=serving, loop=asyncio.get_running_loop(), stop=asyncio.Event())
        self._started.set()
        await self._box["stop"].wait()
        await serving.close(grace_s=1.0)

    def snapshot(self) -> dict:
        return self.runtime.snapshot()

    def wait_idle(self, timeout_s: float = 60.0) -> dict:
        return wait_for(lambda: (lambda s: s if s["live_slots"] == 0 and s["outstanding"] == 0 else None)(
            self.snapshot()), timeout_s, "the runtime to go idle")

    def assert_no_leaks(self) -> dict:
        """Idle: no live slot, every page free or held by the prefix cache, the scheduler consistent."""
        rt = self.wait_idle()
        scheduler = self.runtime.scheduler
        scheduler.check_integrity()
        cached = sum(1 for p in range(rt["total_pages"]) if scheduler.cache.owns_page(p))
        assert rt["free_pages"] + cached == rt["total_pages"], rt
        # A permit returns when its response ends, a moment after the model is done with it.
        wait_for(lambda: self.serving.state.http_in_use == 0, 30, "HTTP admission permits to return")
        return rt

    def close(self) -> None:
        self._box["loop"].call_soon_threadsafe(self._box["stop"].set)
        self._thread.join(60)


@pytest.fixture
def in_process():
    servers: list[InProcessServer] = []

    def start(core: Path, **config) -> InProcessServer:
        s = InProcessServer(core, **config)
        servers.append(s)
        return s

    yield start
    for s in servers:
        s.close()


@pytest.fixture(scope="module")
def shared_daemon(tiny_core, tmp_path_factory):
    """One daemon for a module's many small hostile exchanges (it must survive them all)."""
    d = Daemon(tiny_core, tmp_path_factory.mktemp("daemon"))
    yield d
    d.kill()


# Bytes read past the end of one response (a pipelined next response), per socket.
_LEFTOVER: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def _chunked_end(data: bytes) -> int:
    """Index just past a complete chunked body at the start of ``data``, or -1 if it is incomplete."""
    at = 0
    while True:
        line_end = data.find(b"\r\n", at)
        if line_end < 0:
            return -1
        size = int(data[at:line_end].split(b";")[0] or b"0", 16)
        at = line_end + 2
        if size == 0:
            trailer_end = data.find(b"\r\n", at)  # no trailers: the blank line follows
            return -1 if trailer_end < 0 else trailer_end + 2
        at += size + 2
        if at > len(data):
            return -1


def read_response(sock, timeout_s: float) -> tuple[int, dict, bytes] | None:
    """One HTTP/1.1 response off a raw socket; None if the server sent nothing before closing or timing out.
    Bytes of a following (pipelined) response are kept for the next call on the same socket."""
    import socket as _socket

    sock.settimeout(timeout_s)
    buf = _LEFTOVER.pop(sock, b"")
    try:
        while b"\r\n\r\n" not in buf:
            chunk = sock.recv(65536)
            if not chunk:
                return None if not buf else _parse(buf, b"")
            buf += chunk
        head, _, rest = buf.partition(b"\r\n\r\n")
        headers = _headers(head)
        if "content-length" in headers:
            n = int(headers["content-length"])
            while len(rest) < n:
                chunk = sock.recv(65536)
                if not chunk:
                    break
                rest += chunk
            rest, _LEFTOVER[sock] = rest[:n], rest[n:]
        elif headers.get("transfer-encoding") == "chunked":
            while _chunked_end(rest) < 0:
                chunk = sock.recv(65536)
                if not chunk:
                    break
                rest += chunk
            end = _chunked_end(rest)
            if end >= 0:
                rest, _LEFTOVER[sock] = rest[:end], rest[end:]
        return _parse(head, rest)
    except (_socket.timeout, ConnectionError):
        return _parse(*buf.partition(b"\r\n\r\n")[::2]) if b"\r\n\r\n" in buf else None


def _headers(head: bytes) -> dict:
    out = {}
    for line in head.split(b"\r\n")[1:]:
        k, _, v = line.decode("latin-1").partition(":")
        out[k.strip().lower()] = v.strip()
    return out


def _parse(head: bytes, body: bytes) -> tuple[int, dict, bytes]:
    status_line = head.split(b"\r\n", 1)[0]
    assert status_line.startswith(b"HTTP/1.1 "), status_line
    return int(status_line.split()[1]), _headers(head), body


def assert_error_shape(status: int, headers: dict, body: bytes) -> None:
    """A refusal is a 4xx whose body, when it has one, is a JSON error object."""
    assert 400 <= status < 500, (status, body[:300])
    if body and "json" in headers.get("content-type", ""):
        if headers.get("transfer-encoding") == "chunked":
            return  # a streamed route's error arrives as an event; not a single document
        doc = json.loads(body)
        assert "error" in doc, doc


class RawHttp:
    """Raw-socket helpers for the hostile-input tests (a fixture: conftest modules are not importable)."""

    read_response = staticmethod(read_response)
    assert_error_shape = staticmethod(assert_error_shape)

    def __init__(self, daemon: Daemon):
        self.daemon = daemon

    def exchange(self, data: bytes, timeout_s: float = 5.0):
        with socket.create_connection(("127.0.0.1", self.daemon.port)) as s:
            s.sendall(data)
            return read_response(s, timeout_s)

    def assert_serving(self) -> None:
        """A fresh client is answered at once: the daemon survived and is not stuck."""
        started = time.monotonic()
        with socket.create_connection(("127.0.0.1", self.daemon.port)) as s:
            s.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
            got = read_response(s, 10.0)
        assert got is not None and got[0] == 200, got
        assert time.monotonic() - started < 10.0
        assert self.daemon.proc.poll() is None, self.daemon.log()


@pytest.fixture(scope="module")
def raw_http(shared_daemon) -> RawHttp:
    return RawHttp(shared_daemon)
