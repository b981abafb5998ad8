"""Sans-IO layer: SSE/NDJSON encoders, router matching, config validation,
error mapping and Request helpers, without sockets."""

from __future__ import annotations

import asyncio
import json

import pytest

from flared.errors import AdmissionError, ErrorKind
from flared.server.http import HttpConfig, HttpError, Request, Response, Router, error_response
from flared.server.http import sse
from flared.server.http.flow import Disconnect


# -- SSE / NDJSON ------------------------------------------------------------------
@pytest.mark.parametrize(
    ("kwargs", "wire"),
    [
        ({"data": "hello"}, b"data: hello\n\n"),
        ({"data": ""}, b"data: \n\n"),
        ({"data": "a\nb"}, b"data: a\ndata: b\n\n"),
        ({"data": "a\r\nb\rc"}, b"data: a\ndata: b\ndata: c\n\n"),
        ({"data": "x", "event": "message_start"}, b"event: message_start\ndata: x\n\n"),
        ({"data": "x", "id": "7", "retry_ms": 1500}, b"id: 7\nretry: 1500\ndata: x\n\n"),
    ],
)
def test_encode_event_wire_format(kwargs, wire):
    assert sse.encode_event(**kwargs) == wire


@pytest.mark.parametrize("field", ["event", "id"])
def test_encode_event_refuses_line_breaks_in_fields(field):
    with pytest.raises(ValueError, match=field):
        sse.encode_event("x", **{field: "a\nb"})


def test_encode_json_event_and_done_and_comment():
    assert sse.encode_json_event({"a": "é", "b": [1, 2]}) == 'data: {"a":"é","b":[1,2]}\n\n'.encode()
    assert sse.encode_json_event({}, event="ping") == b"event: ping\ndata: {}\n\n"
    assert sse.DONE == b"data: [DONE]\n\n"
    assert sse.encode_comment() == b":\n\n"
    assert sse.encode_comment("keep\nalive") == b": keep\n: alive\n\n"


def test_encoded_events_round_trip_through_a_client_parser():
    payloads = ["plain", "two\nlines", "", '{"json": true}', "trailing\n"]
    stream = b"".join(sse.encode_event(p, event=f"e{i}") for i, p in enumerate(payloads))
    stream += sse.encode_comment("ignored") + sse.DONE
    events = sse.decode_events(stream)
    assert [e["data"] for e in events] == payloads + ["[DONE]"]
    assert [e.get("event") for e in events] == [f"e{i}" for i in range(len(payloads))] + [None]


def test_ndjson_is_one_compact_line_per_record():
    line = sse.encode_ndjson({"message": {"content": "a\nb"}, "done": False})
    assert line.endswith(b"\n") and line.count(b"\n") == 1
    assert json.loads(line) == {"message": {"content": "a\nb"}, "done": False}


# -- router ------------------------------------------------------------------------
async def _handler(request):
    return Response()


def _router() -> Router:
    router = Router()
    router.add("GET", "/v1/models", _handler)
    router.add("GET", "/v1/models/{model:path}", _handler)
    router.add(("POST",), "/v1/chat/completions", _handler, admit=True)
    router.add("GET", "/health", _handler, public=True)
    router.add("DELETE", "/items/{item}", _handler)
    return router


@pytest.mark.parametrize(
    ("method", "path", "pattern", "params"),
    [
        ("GET", "/v1/models", "/v1/models", {}),
        ("GET", "/v1/models/HuggingFaceTB/SmolLM2-135M-Instruct", "/v1/models/{model:path}",
         {"model": "HuggingFaceTB/SmolLM2-135M-Instruct"}),
        ("HEAD", "/v1/models/x", "/v1/models/{model:path}", {"model": "x"}),
        ("POST", "/v1/chat/completions", "/v1/chat/completions", {}),
        ("DELETE", "/items/42", "/items/{item}", {"item": "42"}),
    ],
)
def test_router_resolves(method, path, pattern, params):
    route, found = _router().resolve(method, path)
    assert route.pattern == pattern
    assert found == params


def test_router_404_and_405_with_allow():
    router = _router()
    with pytest.raises(HttpError) as not_found:
        router.resolve("GET", "/v2/nothing")
    assert not_found.value.status == 404
    with pytest.raises(HttpError) as wrong_method:
        router.resolve("GET", "/v1/chat/completions")
    assert wrong_method.value.status == 405
    assert dict(wrong_method.value.headers)[b"allow"] == b"OPTIONS, POST"
    with pytest.raises(HttpError):  # one-segment parameters do not take slashes
        router.resolve("DELETE", "/items/a/b")


def test_router_route_policy_and_duplicates():
    router = _router()
    assert router.resolve("POST", "/v1/chat/completions")[0].admit
    assert router.resolve("GET", "/health")[0].public
    with pytest.raises(ValueError, match="twice"):
        router.add("GET", "/health", _handler)
    for bad in ("no-slash", "/x/{a}/{a}", "/x/{bad"):
        with pytest.raises(ValueError):
            Router().add("GET", bad, _handler)


# -- config ------------------------------------------------------------------------
@pytest.mark.parametrize(
    "fields",
    [{"port": 70000}, {"body_limit_bytes": 0}, {"write_low_water_bytes": 10, "write_high_water_bytes": 5},
     {"header_timeout_s": 0}, {"api_key": ""}, {"cors_allow_origins": "*"}],
)
def test_config_rejects_invalid_values(fields):
    with pytest.raises(ValueError):
        HttpConfig(**fields)


# -- errors and request helpers ----------------------------------------------------
def test_error_response_shapes():
    flare = error_response(AdmissionError("too long", ErrorKind.CONTEXT_LENGTH))
    assert flare.status == 400
    assert json.loads(flare.body) == {"error": {"message": "too long", "type": "context_length_exceeded",
                                                "param": None, "code": "context_length_exceeded"}}
    busy = error_response(AdmissionError("busy", ErrorKind.HTTP_CAPACITY))
    assert busy.status == 429
    bug = error_response(KeyError("internal detail"))
    assert bug.status == 500 and b"internal detail" not in bug.body


def _request(body: bytes) -> Request:
    # Disconnect needs a loop only to wait; these tests never wait
    request = Request("POST", b"/x", "/x", b"", [], b"1.1", None, Disconnect(None))
    request.body = body
    return request


@pytest.mark.parametrize(
    ("body", "message"),
    [
        (b"", "empty"),
        (b'{"a": "\xff"}', "not valid UTF-8 (invalid byte at offset 7)"),
        (b'{"a": 1,}', "not valid JSON: Expecting property name enclosed in double quotes at line 1 column 9"),
        (b"[1, 2", "not valid JSON"),
        (b'{"temperature": NaN}', "NaN is not a JSON number"),
        (b"[-Infinity]", "-Infinity is not a JSON number"),
    ],
)
def test_request_json_errors_are_400_with_clear_messages(body, message):
    with pytest.raises(AdmissionError) as info:
        _request(body).json()
    assert info.value.http_status == 400
    assert message in str(info.value)


def test_request_header_and_query():
    request = Request("GET", b"/x?a=1&a=2&b=", "/x", b"a=1&a=2&b=", [(b"x-api-key", b"k")], b"1.1", None,
                      Disconnect(None))
    assert request.header("X-Api-Key") == "k"
    assert request.header("missing") is None
    assert request.query == {"a": ["1", "2"], "b": [""]}


def test_serves_on_a_unix_socket(tmp_path):
    """The admin socket case: an already bound AF_UNIX listener."""
    import socket

    import uvloop

    from flared.server.http import HttpServer

    router = Router()

    async def health(request):
        return Response.json({"client": request.client})

    router.add("GET", "/health", health)
    path = str(tmp_path / "admin.sock")

    async def run() -> bytes:
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        listener.bind(path)
        server = HttpServer(router)
        assert await server.start(sock=listener) == path
        reader, writer = await asyncio.open_unix_connection(path)
        writer.write(b"GET /health HTTP/1.1\r\nHost: admin\r\n\r\n")
        head = await reader.readuntil(b"\r\n\r\n")
        body = await reader.readexactly(int(head.lower().split(b"content-length: ")[1].split(b"\r\n")[0]))
        writer.close()
        await server.close()
        return body

    assert json.loads(uvloop.run(run())) == {"client": None}
