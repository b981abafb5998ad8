"""The HTTP layer over real sockets on 127.0.0.1:0.

Each test starts a server thread with the test router from conftest.py and
talks raw HTTP/1.1 to it, so fragmentation, pipelining and malformed input are
exactly what the bytes say.
"""

from __future__ import annotations

import asyncio
import json
import socket
import threading

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from flared.errors import AdmissionError, ErrorKind
from flared.server.http import sse

TIMEOUT_S = 10.0


def _chunked(*parts: bytes) -> bytes:
    return b"".join(b"%x\r\n%s\r\n" % (len(p), p) for p in parts) + b"0\r\n\r\n"


# -- keep-alive, fragmentation, pipelining, chunked bodies ------------------------
def test_keep_alive_serves_many_requests_on_one_connection(server, connect):
    client = connect(server)
    for index in range(20):
        client.request("POST", f"/echo?i={index}", json.dumps({"i": index}).encode())
        reply = client.read_response()
        assert reply.status == 200
        assert reply.json()["json"] == {"i": index}
        assert reply.json()["query"] == {"i": [str(index)]}
        assert "connection" not in reply.headers
    assert server.server.stats.num_accepted_connections_total == 1
    assert server.call(lambda: server.server.stats.num_responses_total) == 20


def test_byte_by_byte_headers_and_body(server, connect):
    client = connect(server)
    client.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    body = json.dumps({"fragmented": "yes"}).encode()
    raw = b"POST /echo HTTP/1.1\r\nHost: t\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body)
    for index in range(len(raw)):
        client.send(raw[index:index + 1])
    reply = client.read_response()
    assert reply.status == 200
    assert reply.json()["json"] == {"fragmented": "yes"}


def test_three_pipelined_requests_in_one_send_are_answered_in_order(server, connect):
    client = connect(server)
    # The first is the slowest to produce (a stream) so a server that ran
    # them concurrently would answer out of order.
    client.send(b"GET /sse?n=50 HTTP/1.1\r\nHost: t\r\n\r\n"
                b"POST /echo HTTP/1.1\r\nHost: t\r\nContent-Length: 8\r\n\r\n{\"n\": 2}"
                b"GET /v1/models/org/model-3 HTTP/1.1\r\nHost: t\r\n\r\n")
    first, second, third = (client.read_response() for _ in range(3))
    assert len(sse.decode_events(first.body)) == 51
    assert second.json()["json"] == {"n": 2}
    assert third.json() == {"id": "org/model-3"}


def test_chunked_request_body(server, connect):
    client = connect(server)
    payload = [b'{"parts"', b': [1, 2, ', b'3]}']
    client.send(b"POST /echo HTTP/1.1\r\nHost: t\r\nTransfer-Encoding: chunked\r\n\r\n" + _chunked(*payload))
    reply = client.read_response()
    assert reply.status == 200 and reply.json()["json"] == {"parts": [1, 2, 3]}
    # the connection stays usable after a chunked body
    client.request("PUT", "/raw", b"abc")
    assert client.read_response().body == b"abc"


def test_streamed_request_body_reaches_the_handler_in_chunks(server, connect):
    client = connect(server)
    chunk = b"z" * 100_000
    client.send(b"POST /upload HTTP/1.1\r\nHost: t\r\nTransfer-Encoding: chunked\r\n\r\n"
                + _chunked(*([chunk] * 20)))
    reply = client.read_response()
    assert reply.json() == {"num_bytes": 2_000_000}


def test_expect_100_continue(server, connect):
    client = connect(server)
    client.send(b"PUT /raw HTTP/1.1\r\nHost: t\r\nContent-Length: 5\r\nExpect: 100-continue\r\n\r\n")
    assert client.read_response().status == 100
    client.send(b"hello")
    assert client.read_response().body == b"hello"


# -- limits ------------------------------------------------------------------------
def test_header_section_over_limit_is_431(start_server, connect):
    server = start_server(max_header_bytes=4096)
    client = connect(server)
    client.send(b"GET /health HTTP/1.1\r\nHost: t\r\nX-Big: " + b"a" * 8000 + b"\r\n\r\n")
    reply = client.read_response()
    assert reply.status == 431
    assert reply.json()["error"]["code"] == "headers_too_large"
    assert reply.headers["connection"] == "close"
    assert client.at_eof()


def test_declared_body_over_limit_is_413_before_reading_it(start_server, connect):
    server = start_server(body_limit_bytes=1000)
    client = connect(server)
    # Only the head is sent: the answer must not wait for the body.
    client.send(b"POST /echo HTTP/1.1\r\nHost: t\r\nContent-Length: 5000\r\n\r\n")
    reply = client.read_response()
    assert reply.status == 413
    assert reply.json()["error"] == {"message": "request body exceeds the limit of 1000 bytes",
                                     "type": "invalid_request_error", "param": None, "code": "request_too_large"}
    assert client.at_eof()


def test_declared_body_over_limit_sent_in_full_still_reads_413(start_server, connect):
    # The client pushes its whole body before reading: lingering close keeps
    # the kernel from resetting the connection over unread input.
    server = start_server(body_limit_bytes=1000)
    client = connect(server)
    client.send(b"POST /echo HTTP/1.1\r\nHost: t\r\nContent-Length: 200000\r\n\r\n" + b"x" * 200_000)
    assert client.read_response().status == 413


def test_chunked_body_over_limit_is_413(start_server, connect):
    server = start_server(body_limit_bytes=1000)
    client = connect(server)
    client.send(b"POST /echo HTTP/1.1\r\nHost: t\r\nTransfer-Encoding: chunked\r\n\r\n"
                + b"%x\r\n%s\r\n" % (600, b"a" * 600) + b"%x\r\n%s\r\n" % (600, b"b" * 600))
    reply = client.read_response()
    assert reply.status == 413
    assert reply.json()["error"]["code"] == "request_too_large"
    assert client.at_eof()


def test_streamed_body_over_limit_is_413(start_server, connect):
    server = start_server(body_limit_bytes=250_000)
    client = connect(server)
    client.send(b"POST /upload HTTP/1.1\r\nHost: t\r\nTransfer-Encoding: chunked\r\n\r\n"
                + _chunked(*([b"q" * 100_000] * 3)))
    assert client.read_response().status == 413


def test_slow_client_header_timeout_is_408(start_server, connect):
    server = start_server(header_timeout_s=0.2)
    client = connect(server)
    client.send(b"GET /health HTTP/1.1\r\nHost: t\r\n")  # never finishes its head
    reply = client.read_response()
    assert reply.status == 408
    assert reply.json()["error"]["code"] == "request_timeout"
    assert client.at_eof()
    assert server.server.stats.num_header_timeouts_total == 1


def test_stalled_body_is_408(start_server, connect):
    server = start_server(body_timeout_s=0.1)
    client = connect(server)
    client.send(b"POST /echo HTTP/1.1\r\nHost: t\r\nContent-Length: 10\r\n\r\n{\"a\"")
    reply = client.read_response()
    assert reply.status == 408 and "stalled" in reply.json()["error"]["message"]
    assert client.at_eof()
    assert server.server.stats.num_body_timeouts_total == 1


def test_stalled_body_of_a_pipelined_request_is_408(start_server, connect):
    # The second request is parsed only when the first response completes
    # (outside any data_received): its body deadline must be armed there too.
    server = start_server(body_timeout_s=0.1)
    client = connect(server)
    client.send(b"GET /sse?n=1 HTTP/1.1\r\nHost: t\r\n\r\n"
                b"POST /echo HTTP/1.1\r\nHost: t\r\nContent-Length: 10\r\n\r\n{\"a\"")
    assert client.read_response().status == 200
    reply = client.read_response()
    assert reply.status == 408 and reply.json()["error"]["code"] == "request_timeout"


def test_idle_keep_alive_connection_is_closed_silently(start_server, connect):
    server = start_server(keep_alive_timeout_s=0.2)
    client = connect(server)
    client.request("GET", "/health")
    assert client.read_response().status == 200
    assert client.at_eof()  # closed without any unsolicited bytes


def test_max_connections_refuses_politely(start_server, connect):
    server = start_server(max_connections=2)
    first, second = connect(server), connect(server)
    for client in (first, second):
        client.request("GET", "/health")
        assert client.read_response().status == 200
    third = connect(server)
    reply = third.read_response()
    assert reply.status == 503
    assert reply.json()["error"]["code"] == "too_many_connections"
    assert third.at_eof()
    first.close()
    # once a slot frees, a new connection is served
    fourth = None
    while fourth is None:
        candidate = connect(server)
        candidate.request("GET", "/health")
        reply = candidate.read_response()
        if reply.status == 200:
            fourth = candidate
        # 503 only while the server has not yet seen the first close
    assert server.server.stats.num_refused_connections_total >= 1


# -- malformed input and handler-level errors -------------------------------------
@pytest.mark.parametrize(
    "raw",
    [
        b"GARBAGE\r\n\r\n",
        b"GET / HTTP/1.1\r\nHost: t\r\nBad Header: x\r\n\r\n",
        b"GET / HTTP/1.1\r\nHost: t\r\nContent-Length: 5\r\nContent-Length: 6\r\n\r\n",
        b"POST /echo HTTP/1.1\r\nHost: t\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n",
        b"GET / HTTP/1.1\r\n\r\n",  # HTTP/1.1 without Host
    ],
)
def test_malformed_http_is_400_json(server, connect, raw):
    client = connect(server)
    client.send(raw)
    reply = client.read_response()
    assert reply.status == 400
    error = reply.json()["error"]
    assert error["code"] == "malformed_request" and error["message"].startswith("malformed HTTP request")
    assert client.at_eof()


@pytest.mark.parametrize(
    ("body", "fragment"),
    [(b'{"x": "\xc3\x28"}', "not valid UTF-8"), (b'{"x": ', "not valid JSON"), (b"", "empty")],
)
def test_invalid_json_body_is_400_from_request_json(server, connect, body, fragment):
    client = connect(server)
    client.request("POST", "/echo", body)
    reply = client.read_response()
    assert reply.status == 400
    assert reply.json()["error"]["type"] == "invalid_request_error"
    assert fragment in reply.json()["error"]["message"]
    client.request("GET", "/health")  # still keep-alive
    assert client.read_response().status == 200


def test_handler_errors_map_to_json(server, connect):
    client = connect(server)
    client.request("GET", "/fail")
    reply = client.read_response()
    assert reply.status == 500 and b"secret" not in reply.body
    client.request("GET", "/reject")
    reply = client.read_response()
    assert reply.status == 400 and reply.json()["error"]["message"] == "max_tokens must be positive"
    client.request("GET", "/stream-fails-early")
    reply = client.read_response()
    assert reply.status == 503 and reply.json()["error"]["type"] == "overloaded_error"


def test_not_found_wrong_method_head_and_options(server, connect):
    client = connect(server)
    client.request("GET", "/nope")
    reply = client.read_response()
    assert reply.status == 404 and reply.json()["error"]["type"] == "not_found_error"
    client.request("DELETE", "/echo")
    reply = client.read_response()
    assert reply.status == 405 and reply.headers["allow"] == "OPTIONS, POST"
    client.request("HEAD", "/v1/models/a/b")
    reply = client.read_response(head_request=True)
    assert reply.status == 200 and reply.headers["content-length"] == str(len(b'{"id":"a/b"}'))
    client.request("OPTIONS", "/raw")
    reply = client.read_response()
    assert reply.status == 204 and reply.headers["allow"] == "GET, HEAD, OPTIONS, POST, PUT"
    client.request("GET", "/items/7/parts/x%2Fy")
    assert client.read_response().json() == {"item": "7", "part": "x/y"}


def test_cors_headers_and_preflight(start_server, connect):
    server = start_server(cors_allow_origins=("https://app.example",), api_key="k")
    client = connect(server)
    client.request("OPTIONS", "/echo", headers=[("Origin", "https://app.example"),
                                                ("Access-Control-Request-Method", "POST")])
    reply = client.read_response()  # preflight needs no token
    assert reply.status == 204
    assert reply.headers["access-control-allow-origin"] == "https://app.example"
    assert "POST" in reply.headers["access-control-allow-methods"]
    client.request("GET", "/health", headers=[("Origin", "https://other.example")])
    assert "access-control-allow-origin" not in client.read_response().headers
    # the headers a browser SDK asks to send are allowed as asked (the openai SDK adds x-stainless-*)
    asked = "authorization,content-type,x-stainless-os,x-stainless-lang"
    client.request("OPTIONS", "/echo", headers=[("Origin", "https://app.example"),
                                                ("Access-Control-Request-Method", "POST"),
                                                ("Access-Control-Request-Headers", asked)])
    reply = client.read_response()
    assert reply.status == 204 and reply.headers["access-control-allow-headers"] == asked


def test_http10_client_gets_close(server, connect):
    client = connect(server)
    client.send(b"GET /health HTTP/1.0\r\n\r\n")
    reply = client.read_response()
    assert reply.status == 200 and reply.json() == {"status": "ok"}
    assert client.at_eof()


# -- auth and admission --------------------------------------------------------------
@pytest.mark.parametrize(
    ("headers", "status"),
    [
        ((), 401),
        ((("Authorization", "Bearer wrong"),), 401),
        ((("Authorization", "Basic c2VjcmV0"),), 401),
        ((("Authorization", "Bearer s3cret"),), 200),
        ((("authorization", "bearer s3cret"),), 200),
        ((("x-api-key", "s3cret"),), 200),
    ],
)
def test_bearer_token(start_server, connect, headers, status):
    server = start_server(api_key="s3cret")
    client = connect(server)
    client.request("POST", "/echo", b"{}", headers=headers)
    reply = client.read_response()
    assert reply.status == status
    if status == 401:
        assert reply.json()["error"]["type"] == "authentication_error"
        assert reply.headers["www-authenticate"] == "Bearer"
    # public routes never need the token, and the connection stays usable
    client.request("GET", "/health")
    assert client.read_response().status == 200


def test_admission_runs_before_the_body_and_releases_after_the_response(server, connect, observed):
    client = connect(server)
    client.request("POST", "/generate", b'{"prompt": "hi"}')
    reply = client.read_response()
    assert reply.json() == {"ok": True, "json": {"prompt": "hi"}}
    assert observed.admission_calls == [None]  # body not read yet when the hook ran
    assert observed.release_event.wait(TIMEOUT_S)
    assert observed.admission_releases == 1
    client.request("GET", "/health")  # not an admitted route
    client.read_response()
    assert len(observed.admission_calls) == 1


def test_admission_rejection_is_429_without_reading_the_body(server, connect, observed):
    observed.admission_reject = True
    client = connect(server)
    # 100-continue: a 429 instead of "100 Continue" proves no body was asked for
    client.send(b"POST /generate HTTP/1.1\r\nHost: t\r\nContent-Length: 10\r\nExpect: 100-continue\r\n\r\n")
    reply = client.read_response()
    assert reply.status == 429
    assert reply.json()["error"]["type"] == "rate_limit_error"
    # a client that sends its body anyway keeps a usable connection
    second = connect(server)
    second.request("POST", "/generate", b"0123456789")
    assert second.read_response().status == 429
    second.request("GET", "/health")
    assert second.read_response().status == 200


# -- streaming, disconnects, backpressure -------------------------------------------
def test_sse_stream_frames(server, connect):
    client = connect(server)
    client.request("GET", "/sse?n=5")
    reply = client.read_response()
    assert reply.headers["content-type"] == "text/event-stream"
    assert reply.headers["cache-control"] == "no-cache"
    events = sse.decode_events(reply.body)
    assert [json.loads(e["data"])["index"] for e in events[:-1]] == list(range(5))
    assert all(e["event"] == "count" for e in events[:-1])
    assert events[-1] == {"data": "[DONE]"}
    client.request("HEAD", "/sse")
    assert client.read_response(head_request=True).status == 200


def test_sse_to_http10_client_is_close_delimited(server, connect):
    client = connect(server)
    client.send(b"GET /sse?n=2 HTTP/1.0\r\n\r\n")
    reply = client.read_response()
    assert "transfer-encoding" not in reply.headers and reply.headers["connection"] == "close"
    assert [e["data"] for e in sse.decode_events(reply.body)] == ['{"index":0}', '{"index":1}', "[DONE]"]


def test_ndjson_stream(server, connect):
    client = connect(server)
    client.request("GET", "/ndjson")
    reply = client.read_response()
    assert reply.headers["content-type"] == "application/x-ndjson"
    lines = reply.body.decode().splitlines()
    assert [json.loads(line)["index"] for line in lines] == [0, 1, 2]


def test_client_dropping_mid_sse_stream_is_observed(server, connect, observed):
    client = connect(server)
    client.request("GET", "/sse-forever")
    client.read_until(b"\r\n\r\n")  # response head
    client.read_until(b"\n\n")  # first event
    client.read_until(b"\n\n")
    client.close()
    assert observed.stream_disconnected.wait(TIMEOUT_S)
    assert server.call(lambda: server.server.stats.num_client_disconnects_total) == 1


def test_waiting_handler_observes_disconnect(server, connect, observed):
    client = connect(server)
    client.request("GET", "/hold")
    assert observed.hold_started.wait(TIMEOUT_S)
    client.close()
    assert observed.hold_disconnected.wait(TIMEOUT_S)


def test_slow_reader_makes_the_writer_wait(start_server, connect, observed):
    high_water_bytes = 128 * 1024
    server = start_server(write_high_water_bytes=high_water_bytes, write_low_water_bytes=32 * 1024)
    client = connect(server, rcvbuf_bytes=64 * 1024)
    num_chunks = 256  # 16 MiB in 64 KiB writes, far above any socket buffer
    client.request("GET", f"/big?chunks={num_chunks}")
    client.read_until(b"\r\n\r\n")
    # Not reading: the producer must block in drain, not buffer 16 MiB.
    assert observed.big_paused.wait(TIMEOUT_S)
    assert not observed.big_done.is_set()
    assert observed.big_max_buffered_bytes <= high_water_bytes + 65536 + 64
    # Now read everything: the producer resumes and finishes.
    total = 0
    while True:
        size = int(client.read_until(b"\r\n"), 16)
        if size == 0:
            client.read_until(b"\r\n")
            break
        client.read_exact(size + 2)
        total += size
    assert total == num_chunks * 65536
    assert observed.big_done.wait(TIMEOUT_S)
    assert observed.big_num_drain_waits > 0
    assert observed.big_max_buffered_bytes <= high_water_bytes + 65536 + 64


# -- lifecycle -------------------------------------------------------------------------
def test_bound_address_is_reported(server):
    host, port = server.address
    assert host == "127.0.0.1" and port > 0
    with socket.create_connection((host, port), timeout=TIMEOUT_S):
        pass


def test_graceful_close_finishes_in_flight_response(start_server, connect, observed):
    server = start_server(shutdown_grace_s=10.0)
    release = server.call(asyncio.Event)
    observed.slow_release = release
    busy = connect(server)
    busy.request("POST", "/generate", b'{"slow": true}')
    idle = connect(server)
    idle.request("GET", "/health")
    assert idle.read_response().status == 200
    # The handler is running (waiting) before we start closing.
    assert observed.generate_started.wait(TIMEOUT_S)
    stopping = threading.Thread(target=server.stop)
    stopping.start()
    assert idle.at_eof()  # idle connections close at once
    server.loop.call_soon_threadsafe(release.set)
    reply = busy.read_response()
    assert reply.status == 200 and reply.headers["connection"] == "close"
    stopping.join(TIMEOUT_S)
    assert not stopping.is_alive()
    with pytest.raises(OSError):
        socket.create_connection(server.address, timeout=TIMEOUT_S)


def test_many_concurrent_keep_alive_clients(server):
    """100 asyncio clients x 10 requests each, interleaved on the server loop."""

    async def one_client(index: int) -> list[int]:
        reader, writer = await asyncio.open_connection(*server.address)
        seen = []
        for step in range(10):
            body = json.dumps({"client": index, "step": step}).encode()
            writer.write(b"POST /echo HTTP/1.1\r\nHost: t\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body))
            head = await reader.readuntil(b"\r\n\r\n")
            length = int(head.lower().split(b"content-length: ")[1].split(b"\r\n")[0])
            reply = json.loads(await reader.readexactly(length))
            assert reply["json"]["client"] == index
            seen.append(reply["json"]["step"])
        writer.close()
        return seen

    async def run() -> list[list[int]]:
        return await asyncio.wait_for(asyncio.gather(*(one_client(i) for i in range(100))), TIMEOUT_S * 3)

    assert asyncio.run(run()) == [list(range(10))] * 100


def test_unconsumed_streamed_body_pauses_reading(start_server, connect, observed):
    high_water_bytes = 256 * 1024
    server = start_server(body_limit_bytes=64 * 1024 * 1024, read_high_water_bytes=high_water_bytes)
    client = connect(server)
    client.sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 64 * 1024)
    num_body_bytes = 16 * 1024 * 1024  # far more than kernel buffers on both sides hold
    chunk = b"u" * 65536
    payload = (b"POST /upload-gated HTTP/1.1\r\nHost: t\r\nTransfer-Encoding: chunked\r\n\r\n"
               + _chunked(*([chunk] * (num_body_bytes // len(chunk)))))
    sender = threading.Thread(target=client.send, args=(payload,), daemon=True)
    sender.start()

    def read_paused() -> bool:
        return any(c._flow.read_paused for c in server.server._connections)

    # Each probe is one round trip to the server loop, no sleeping.
    probes = 0
    while not server.call(read_paused):
        probes += 1
        assert probes < 1_000_000
    queued = server.call(lambda: [c._exchange.body_stream._num_queued_bytes for c in server.server._connections])
    assert max(queued) <= high_water_bytes + 256 * 1024  # high water + one socket read
    assert sender.is_alive()  # the client is blocked: backpressure reached it
    server.loop.call_soon_threadsafe(observed.gate.set)
    reply = client.read_response()
    assert reply.json() == {"num_bytes": num_body_bytes}
    sender.join(TIMEOUT_S)
    assert not sender.is_alive()


def test_real_http_client_library(server):
    """httpx (what the openai and anthropic SDKs use) against the layer."""
    httpx = pytest.importorskip("httpx")
    base_url = "http://%s:%d" % server.address
    with httpx.Client(base_url=base_url, timeout=TIMEOUT_S) as client:
        for index in range(3):
            reply = client.post("/echo", json={"i": index})
            assert reply.status_code == 200 and reply.json()["json"] == {"i": index}
        with client.stream("GET", "/sse", params={"n": 4}) as stream:
            lines = [line for line in stream.iter_lines() if line.startswith("data: ")]
        assert lines[-1] == "data: [DONE]" and len(lines) == 5
        reply = client.get("/v1/models/HuggingFaceTB/SmolLM2-135M-Instruct")
        assert reply.json() == {"id": "HuggingFaceTB/SmolLM2-135M-Instruct"}
    assert server.server.stats.num_accepted_connections_total == 1  # all on one keep-alive connection


# -- fragmentation as a property ------------------------------------------------------
_PIPELINE = (
    b"POST /echo?k=1 HTTP/1.1\r\nHost: t\r\nContent-Length: 11\r\n\r\n{\"a\": [1]}\n"
    b"PUT /raw HTTP/1.1\r\nHost: t\r\nTransfer-Encoding: chunked\r\n\r\n3\r\nabc\r\n2\r\nde\r\n0\r\n\r\n"
    b"GET /sse?n=2 HTTP/1.1\r\nHost: t\r\n\r\n"
)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(cuts=st.lists(st.integers(min_value=1, max_value=len(_PIPELINE) - 1), max_size=12, unique=True))
def test_any_fragmentation_of_a_pipeline_gives_the_same_answers(server, connect, cuts):
    client = connect(server)
    client.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    try:
        bounds = [0, *sorted(cuts), len(_PIPELINE)]
        for start, end in zip(bounds, bounds[1:]):
            client.send(_PIPELINE[start:end])
        echo, raw, stream = (client.read_response() for _ in range(3))
    finally:
        client.close()
    assert echo.json()["json"] == {"a": [1]} and echo.json()["query"] == {"k": ["1"]}
    assert raw.body == b"abcde"
    assert [e["data"] for e in sse.decode_events(stream.body)] == ['{"index":0}', '{"index":1}', "[DONE]"]


def test_permit_is_released_when_the_client_leaves_mid_body(server, connect, observed):
    client = connect(server)
    client.send(b"POST /generate HTTP/1.1\r\nHost: t\r\nContent-Length: 100\r\n\r\n{\"partial\":")
    client.close()
    assert observed.release_event.wait(TIMEOUT_S)
    assert observed.admission_releases == 1
    assert not observed.generate_started.is_set()  # the handler never ran


def test_grace_period_over_aborts_the_handler(start_server, connect, observed):
    server = start_server(shutdown_grace_s=0.1)
    client = connect(server)
    client.request("GET", "/hold")
    assert observed.hold_started.wait(TIMEOUT_S)
    server.stop()  # returns after the grace period and the abort
    assert observed.hold_disconnected.is_set()
    assert client.at_eof()


def test_pipelined_admitted_requests_reuse_a_single_permit(start_server, connect, observed):
    # Capacity one: the second request is admitted only if the first
    # released its permit before the next cycle began.
    free = [1]

    def one_permit(request):
        if not free[0]:
            raise AdmissionError("HTTP capacity exhausted", ErrorKind.HTTP_CAPACITY)
        free[0] = 0

        def release():
            free[0] = 1

        return release

    server = start_server()
    server.server.admission = one_permit
    client = connect(server)
    body = b'{"n": 1}'
    one = b"POST /generate HTTP/1.1\r\nHost: t\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body)
    client.send(one * 3)
    assert [client.read_response().status for _ in range(3)] == [200, 200, 200]


def test_x_request_id_is_echoed_or_made(server, connect):
    """As vLLM's --enable-request-id-headers: every response carries X-Request-Id, the client's own where it sent
    a usable one (1-128 visible ASCII characters)."""
    client = connect(server)
    client.request("GET", "/health", headers=[("X-Request-Id", "trace-42")])
    assert client.read_response().headers["x-request-id"] == "trace-42"
    client.request("GET", "/health")
    made = client.read_response().headers["x-request-id"]
    client.request("GET", "/no/such/route", headers=[("X-Request-Id", "x" * 129)])
    reply = client.read_response()
    assert reply.status == 404 and reply.headers["x-request-id"] not in ("x" * 129, made)
    assert len(made) == 32 and int(made, 16) >= 0
