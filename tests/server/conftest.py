"""Real-socket fixtures for the HTTP layer: a server on 127.0.0.1:0 in its own
uvloop thread with a small router of test handlers, and a raw socket client
that sends exact bytes and parses responses itself (so malformed, fragmented
and pipelined input can be sent on purpose).

Waiting is always on readiness: blocking reads with a timeout, or a
threading.Event the handler sets. Nothing sleeps.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import socket
import threading

import pytest

from flared.errors import AdmissionError, ErrorKind
from flared.server.http import (
    ClientDisconnected,
    HttpConfig,
    Request,
    Response,
    Router,
    ServerThread,
    StreamingResponse,
)
from flared.server.http import sse

TIMEOUT_S = 10.0


@dataclasses.dataclass
class Observed:
    """What handlers report back to the test thread."""

    stream_disconnected: threading.Event = dataclasses.field(default_factory=threading.Event)
    stream_events_sent: int = 0
    hold_disconnected: threading.Event = dataclasses.field(default_factory=threading.Event)
    hold_started: threading.Event = dataclasses.field(default_factory=threading.Event)
    big_paused: threading.Event = dataclasses.field(default_factory=threading.Event)
    big_done: threading.Event = dataclasses.field(default_factory=threading.Event)
    big_max_buffered_bytes: int = 0
    big_num_drain_waits: int = 0
    big_num_bytes_written: int = 0
    admission_calls: list = dataclasses.field(default_factory=list)
    admission_releases: int = 0
    admission_reject: bool = False
    release_event: threading.Event = dataclasses.field(default_factory=threading.Event)
    slow_release: asyncio.Event | None = None
    generate_started: threading.Event = dataclasses.field(default_factory=threading.Event)
    gate: asyncio.Event = dataclasses.field(default_factory=asyncio.Event)


def build_router(observed: Observed) -> Router:
    router = Router()

    @router.post("/echo")
    async def echo(request: Request) -> Response:
        return Response.json({"method": request.method, "path": request.path, "query": request.query,
                              "json": request.json()})

    @router.route(("GET", "POST", "PUT"), "/raw")
    async def raw(request: Request) -> Response:
        return Response(request.body, media_type="application/octet-stream",
                        headers=[("x-body-length", str(len(request.body)))])

    @router.get("/v1/models/{model:path}")
    async def model(request: Request) -> Response:
        return Response.json({"id": request.params["model"]})

    @router.get("/items/{item}/parts/{part}")
    async def item(request: Request) -> Response:
        return Response.json(request.params)

    @router.get("/health", public=True)
    async def health(request: Request) -> Response:
        return Response.json({"status": "ok"})

    @router.get("/sse")
    async def sse_counter(request: Request) -> StreamingResponse:
        num_events = int(request.query.get("n", ["3"])[0])

        async def produce(writer):
            await writer.send_comment("ping")
            for index in range(num_events):
                await writer.send_json_event({"index": index}, event="count")
            await writer.write(sse.DONE)

        return StreamingResponse(produce)

    @router.get("/ndjson")
    async def ndjson(request: Request) -> StreamingResponse:
        async def produce(writer):
            for index in range(3):
                await writer.send_ndjson({"index": index, "done": index == 2})

        return StreamingResponse(produce, media_type="application/x-ndjson")

    @router.get("/sse-forever")
    async def sse_forever(request: Request) -> StreamingResponse:
        # Emits events the way a generating request does (one per model step)
        # until the client goes away.
        async def produce(writer):
            try:
                while not request.disconnected.is_set():
                    await writer.send_json_event({"index": observed.stream_events_sent})
                    observed.stream_events_sent += 1
                    await asyncio.sleep(0.001)  # the model step cadence, server side
            except ClientDisconnected:
                pass
            if request.disconnected.is_set():
                observed.stream_disconnected.set()

        return StreamingResponse(produce)

    @router.get("/hold")
    async def hold(request: Request) -> Response:
        # A handler waiting on something else (the model thread) that must
        # still learn of the disconnect.
        observed.hold_started.set()
        await request.disconnected.wait()
        observed.hold_disconnected.set()
        return Response.json({"never": "seen"})

    @router.get("/big")
    async def big(request: Request) -> StreamingResponse:
        num_chunks = int(request.query["chunks"][0])
        chunk = b"x" * 65536

        async def produce(writer):
            for _ in range(num_chunks):
                # Run the write as a task for one loop step: if it has not
                # finished by then it is parked in drain(), i.e. paused.
                write = asyncio.ensure_future(writer.write(chunk))
                await asyncio.sleep(0)
                observed.big_max_buffered_bytes = max(observed.big_max_buffered_bytes, writer.buffered_bytes())
                if not write.done():
                    observed.big_paused.set()
                await write
            observed.big_num_drain_waits = writer.num_drain_waits
            observed.big_num_bytes_written = writer.num_bytes_written
            observed.big_done.set()

        return StreamingResponse(produce, media_type="application/octet-stream")

    @router.post("/upload", stream_body=True)
    async def upload(request: Request) -> Response:
        num_bytes = 0
        async for chunk in request.stream():
            num_bytes += len(chunk)
        return Response.json({"num_bytes": num_bytes})

    @router.post("/upload-gated", stream_body=True)
    async def upload_gated(request: Request) -> Response:
        # Does not consume its body until the test opens the gate.
        await observed.gate.wait()
        num_bytes = 0
        async for chunk in request.stream():
            num_bytes += len(chunk)
        return Response.json({"num_bytes": num_bytes})

    @router.post("/generate", admit=True)
    async def generate(request: Request) -> Response:
        observed.generate_started.set()
        if observed.slow_release is not None:
            await observed.slow_release.wait()
        return Response.json({"ok": True, "json": request.json()})

    @router.get("/fail")
    async def fail(request: Request) -> Response:
        raise RuntimeError("secret internal detail")

    @router.get("/reject")
    async def reject(request: Request) -> Response:
        raise AdmissionError("max_tokens must be positive")

    @router.get("/stream-fails-early")
    async def stream_fails_early(request: Request) -> StreamingResponse:
        async def produce(writer):
            raise AdmissionError("model refused the request", ErrorKind.MODEL_CAPACITY)

        return StreamingResponse(produce)

    return router


def make_admission(observed: Observed):
    def admission(request: Request):
        observed.admission_calls.append(request.body)
        if observed.admission_reject:
            raise AdmissionError("HTTP capacity exhausted", ErrorKind.HTTP_CAPACITY)

        def release():
            observed.admission_releases += 1
            observed.release_event.set()

        return release

    return admission


class RawClient:
    """A blocking socket client that sends exact bytes and parses responses."""

    def __init__(self, address, rcvbuf_bytes: int | None = None):
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        if rcvbuf_bytes is not None:
            self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf_bytes)
        self.sock.settimeout(TIMEOUT_S)
        self.sock.connect(address)
        self.buffer = b""

    def send(self, data: bytes) -> None:
        self.sock.sendall(data)

    def request(self, method: str, path: str, body: bytes | None = None, headers=()) -> None:
        lines = [f"{method} {path} HTTP/1.1", "Host: test"]
        lines += [f"{name}: {value}" for name, value in headers]
        if body is not None:
            lines.append(f"Content-Length: {len(body)}")
        self.send(("\r\n".join(lines) + "\r\n\r\n").encode() + (body or b""))

    def _fill(self) -> bool:
        data = self.sock.recv(65536)
        if not data:
            return False
        self.buffer += data
        return True

    def read_until(self, marker: bytes) -> bytes:
        while marker not in self.buffer:
            if not self._fill():
                raise ConnectionError(f"closed before {marker!r}; got {self.buffer!r}")
        head, _, self.buffer = self.buffer.partition(marker)
        return head

    def read_exact(self, num_bytes: int) -> bytes:
        while len(self.buffer) < num_bytes:
            if not self._fill():
                raise ConnectionError("closed mid-body")
        data, self.buffer = self.buffer[:num_bytes], self.buffer[num_bytes:]
        return data

    def read_response(self, head_request: bool = False) -> "Reply":
        head = self.read_until(b"\r\n\r\n").decode("latin-1")
        status_line, *header_lines = head.split("\r\n")
        version, status, *_ = status_line.split(" ", 2)
        headers = {}
        for line in header_lines:
            name, _, value = line.partition(":")
            headers[name.strip().lower()] = value.strip()
        status = int(status)
        if head_request or status in (100, 204, 304):
            body = b""
        elif "content-length" in headers:
            body = self.read_exact(int(headers["content-length"]))
        elif headers.get("transfer-encoding") == "chunked":
            parts = []
            while True:
                size = int(self.read_until(b"\r\n"), 16)
                if size == 0:
                    self.read_until(b"\r\n")
                    break
                parts.append(self.read_exact(size))
                self.read_exact(2)
            body = b"".join(parts)
        else:
            while self._fill():
                pass
            body, self.buffer = self.buffer, b""
        return Reply(status, headers, body)

    def at_eof(self) -> bool:
        """True once the server closed (blocks until data or close)."""
        if self.buffer:
            return False
        try:
            return not self._fill()
        except ConnectionResetError:
            return True

    def close(self) -> None:
        self.sock.close()


@dataclasses.dataclass
class Reply:
    status: int
    headers: dict
    body: bytes

    def json(self):
        return json.loads(self.body)


@pytest.fixture
def observed() -> Observed:
    return Observed()


@pytest.fixture
def start_server(observed):
    """start_server(**config) -> ServerThread serving the test router."""
    threads = []

    def start(**config_fields) -> ServerThread:
        config = HttpConfig(host="127.0.0.1", port=0, **config_fields)
        thread = ServerThread(build_router(observed), config, admission=make_admission(observed))
        thread.start()
        threads.append(thread)
        return thread

    yield start
    for thread in threads:
        thread.stop()


@pytest.fixture
def server(start_server) -> ServerThread:
    return start_server()


@pytest.fixture
def connect():
    clients = []

    def make(server_thread, **kwargs) -> RawClient:
        client = RawClient(server_thread.address, **kwargs)
        clients.append(client)
        return client

    yield make
    for client in clients:
        client.close()
