"""Hostile bytes at the HTTP layer: fuzzed request lines and headers, chunked encodings, pipelining,
slowloris. The daemon answers 4xx (never 5xx), never hangs, and keeps serving everyone else."""

from __future__ import annotations

import json
import os
import socket
import time

from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

SLOW = os.environ.get("FLARED_SLOW_TESTS") == "1"
EXAMPLES = 600 if SLOW else 60
FUZZ = settings(max_examples=EXAMPLES, deadline=None, derandomize=True, database=None,
                suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])

ROUTES = [b"/health", b"/metrics", b"/v1/models", b"/v1/models/tiny", b"/v1/chat/completions", b"/v1/completions",
          b"/v1/messages", b"/v1/responses", b"/v1/responses/resp_x", b"/api/tags", b"/api/chat", b"/v1/decisions"]
junk = st.binary(min_size=0, max_size=40)
methods = st.one_of(st.sampled_from([b"GET", b"POST", b"PUT", b"DELETE", b"HEAD", b"OPTIONS", b"PATCH", b"CONNECT",
                                     b"TRACE", b"get", b"G\x00T", b""]), junk)
targets = st.one_of(st.sampled_from(ROUTES), st.sampled_from([b"*", b"http://127.0.0.1/health", b"/%00", b"/..%2f..",
                                                              b"/" + b"a" * 20000, b"/v1/models/%ff%fe"]), junk)
versions = st.sampled_from([b"HTTP/1.1", b"HTTP/1.0", b"HTTP/2.0", b"HTTP/0.9", b"HTTP/1.1 x", b"", b"HTTP/1.10"])
header_names = st.one_of(st.sampled_from([b"Host", b"Content-Length", b"Transfer-Encoding", b"Content-Type",
                                          b"Authorization", b"Connection", b"Expect", b"X-" + b"h" * 9000]), junk)
header_values = st.one_of(st.sampled_from([b"0", b"-1", b"5", b"99999999999999999999", b"chunked", b"gzip, chunked",
                                           b"application/json", b"100-continue", b"close", b"Bearer \xff",
                                           b"v" * 70000]), junk)


def _request(method, target, version, headers, body) -> bytes:
    head = method + b" " + target + b" " + version + b"\r\n"
    head += b"".join(k + b": " + v + b"\r\n" for k, v in headers)
    return head + b"\r\n" + body


@FUZZ
@given(method=methods, target=targets, version=versions,
       headers=st.lists(st.tuples(header_names, header_values), max_size=6), body=st.binary(max_size=200))
def test_fuzzed_request_heads_get_4xx_or_a_normal_answer(raw_http, method, target, version, headers, body):
    got = raw_http.exchange(_request(method, target, version, headers, body), timeout_s=2.0)
    event("no answer (waiting for promised bytes)" if got is None else f"status {got[0]}")
    # None: the server is (rightly) still waiting for bytes the head promised, or closed a hopeless stream.
    if got is not None:
        status, hdrs, payload = got
        if status >= 400:
            raw_http.assert_error_shape(status, hdrs, payload)
        else:
            assert status < 300, got
    raw_http.assert_serving()


CHAT = json.dumps({"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}).encode()


def _chunked(chunks: list[bytes]) -> bytes:
    return (b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"Transfer-Encoding: chunked\r\n\r\n" + b"".join(chunks))


def test_chunked_bodies_valid_and_malformed(raw_http):
    halves = [CHAT[:10], CHAT[10:]]
    valid = [b"%x\r\n%s\r\n" % (len(h), h) for h in halves] + [b"0\r\n\r\n"]
    got = raw_http.exchange(_chunked(valid))
    assert got is not None and got[0] == 200, got
    with_ext = [b"%x;name=value\r\n%s\r\n" % (len(CHAT), CHAT), b"0\r\nX-Trailer: 1\r\n\r\n"]
    got = raw_http.exchange(_chunked(with_ext))
    assert got is not None and got[0] == 200, got
    malformed = [
        [b"zz\r\n" + CHAT + b"\r\n0\r\n\r\n"],  # size not hex
        [b"-5\r\nhello\r\n0\r\n\r\n"],  # negative size
        [b"ffffffffffffffffffffffff\r\n" + CHAT + b"\r\n0\r\n\r\n"],  # size overflow
        [b"%x\r\n%sXX0\r\n\r\n" % (len(CHAT), CHAT)],  # chunk not followed by CRLF
        [b"3\r\n{\"a\r\n0\r\n\r\n"],  # valid framing, truncated JSON inside
    ]
    for chunks in malformed:
        got = raw_http.exchange(_chunked(chunks), timeout_s=5.0)
        assert got is not None, chunks
        raw_http.assert_error_shape(*got)
    raw_http.assert_serving()


def test_pipelined_requests_are_answered_in_order(raw_http):
    bad = b"{not json"
    pipeline = (b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n"
                b"GET /v1/models HTTP/1.1\r\nHost: x\r\n\r\n"
                b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                b"Content-Length: %d\r\n\r\n%s" % (len(bad), bad) +
                b"GET /nowhere HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
    statuses = []
    with socket.create_connection(("127.0.0.1", raw_http.daemon.port)) as s:
        s.sendall(pipeline)
        for _ in range(4):
            got = raw_http.read_response(s, 10.0)
            assert got is not None, statuses
            statuses.append(got[0])
    assert statuses == [200, 200, 400, 404]
    raw_http.assert_serving()


def test_slowloris_clients_neither_block_others_nor_stay_forever(raw_http):
    head = b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
    slow = [socket.create_connection(("127.0.0.1", raw_http.daemon.port)) for _ in range(8)]
    try:
        closed = [False] * len(slow)
        started = time.monotonic()
        i = 0
        # Dribble one byte per connection per round; the server's head timeout (10 s) must cut them.
        while not all(closed):
            assert time.monotonic() - started < 30, "slow clients were never cut off"
            for k, s in enumerate(slow):
                if closed[k]:
                    continue
                try:
                    s.sendall(head[i % len(head): i % len(head) + 1])
                except OSError:
                    closed[k] = True
                    continue
                s.settimeout(0.05)
                try:
                    data = s.recv(4096)
                    if data == b"" or data.startswith(b"HTTP/1.1 408"):
                        closed[k] = True
                except socket.timeout:
                    pass
            raw_http.assert_serving()  # others are served promptly the whole time
            i += 1
    finally:
        for s in slow:
            s.close()
