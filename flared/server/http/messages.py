"""What handlers see and return: Request, Response, StreamingResponse, errors.

Errors leave the server in the OpenAI shape
``{"error": {"message", "type", "param", "code"}}``. A handler raises either a
``FlareError`` (its kind gives status and type) or an ``HttpError`` (transport
conditions that are not part of the request-path taxonomy: 404, 405, 408,
413, 431, malformed HTTP).
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import TYPE_CHECKING, Any
from urllib.parse import parse_qs

from flared.errors import AdmissionError, FlareError

if TYPE_CHECKING:
    from flared.server.http.flow import BodyStream, Disconnect
    from flared.server.http.writer import ResponseWriter

Headers = list[tuple[bytes, bytes]]

_JSON_TYPE = b"application/json"


class HttpError(Exception):
    """A transport-level rejection with its own status and OpenAI error fields."""

    def __init__(self, status: int, message: str, *, type: str = "invalid_request_error",
                 code: str | None = None, param: str | None = None, headers: Headers | None = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.code = code
        self.param = param
        self.headers = headers or []


class ClientDisconnected(ConnectionError):
    """The client went away; raised by writes and body reads after the disconnect."""


def request_id_ok(value: bytes) -> bool:
    """Whether a client's X-Request-Id may be echoed and used: 1-128 visible ASCII characters."""
    return 0 < len(value) <= 128 and all(0x21 <= b <= 0x7E for b in value)


def error_body(message: str, type: str, code: str | None = None, param: str | None = None) -> bytes:
    return json.dumps({"error": {"message": message, "type": type, "param": param, "code": code}},
                      ensure_ascii=False, separators=(",", ":")).encode()


def error_response(exc: BaseException) -> Response:
    """Map an exception raised on the request path to a JSON error response.

    Anything that is neither HttpError nor FlareError is a bug of ours: the
    client gets a generic 500 without the exception text.
    """
    if isinstance(exc, HttpError):
        body = error_body(exc.message, exc.type, exc.code, exc.param)
        return Response(body, status=exc.status, headers=exc.headers, media_type=_JSON_TYPE)
    if isinstance(exc, FlareError):
        body = error_body(str(exc), exc.kind.wire_name, exc.kind.wire_name, getattr(exc, "param", None))
        return Response(body, status=exc.http_status, media_type=_JSON_TYPE)
    body = error_body("internal server error", "server_error", "internal_error")
    return Response(body, status=500, media_type=_JSON_TYPE)


class Request:
    """One parsed request. ``body`` holds the complete body (at most
    body_limit_bytes) unless the route streams it, in which case it is None
    and the handler reads ``stream()``."""

    __slots__ = ("method", "target", "path", "query_string", "headers", "http_version", "client",
                 "params", "body", "disconnected", "request_id", "_body_stream", "_query")

    def __init__(self, method: str, target: bytes, path: str, query_string: bytes, headers: Headers,
                 http_version: bytes, client: tuple[str, int] | None, disconnected: Disconnect):
        self.method = method
        self.target = target
        self.path = path
        self.query_string = query_string
        # (lower-case name, value) pairs as h11 normalised them
        self.headers = headers
        self.http_version = http_version
        self.client = client
        self.params: dict[str, str] = {}
        self.body: bytes | None = None
        # Fires when the client goes away before the response is complete;
        # generating handlers await or poll it to cancel their request.
        self.disconnected = disconnected
        # the client's X-Request-Id (1-128 visible ASCII characters), or None
        self.request_id: bytes | None = None
        self._body_stream: BodyStream | None = None
        self._query: dict[str, list[str]] | None = None

    def header(self, name: str) -> str | None:
        """First value of a header (case-insensitive name), decoded as latin-1."""
        key = name.lower().encode("ascii")
        for header_name, value in self.headers:
            if header_name == key:
                return value.decode("latin-1")
        return None

    @property
    def query(self) -> dict[str, list[str]]:
        if self._query is None:
            self._query = parse_qs(self.query_string.decode("latin-1"), keep_blank_values=True)
        return self._query

    def json(self) -> Any:
        """Decode the body as UTF-8 JSON; a client mistake becomes a 400."""
        if self.body is None:
            raise RuntimeError("json() needs a buffered body; this route streams its body")
        if not self.body:
            raise AdmissionError("request body is empty; expected a JSON document")
        try:
            text = self.body.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise AdmissionError(f"request body is not valid UTF-8 (invalid byte at offset {exc.start})") from None
        try:
            doc = json.loads(text, parse_constant=_reject_constant)
        except json.JSONDecodeError as exc:
            raise AdmissionError(
                f"request body is not valid JSON: {exc.msg} at line {exc.lineno} column {exc.colno}") from None
        except RecursionError:
            # The decoder recurses per nesting level; a hostile body must not become a 500.
            raise AdmissionError("request body is nested too deeply") from None
        if "\\ud" in text or "\\uD" in text:
            _reject_lone_surrogates(doc)
        return doc

    def stream(self) -> AsyncIterator[bytes]:
        """Body chunks as they arrive (routes registered with stream_body=True)."""
        if self._body_stream is None:
            raise RuntimeError("stream() is only available on routes registered with stream_body=True")
        return self._body_stream.chunks()

    async def read(self) -> bytes:
        if self.body is not None:
            return self.body
        parts = [chunk async for chunk in self.stream()]
        self.body = b"".join(parts)
        return self.body


def _reject_constant(name: str) -> Any:
    # Python's json accepts NaN and Infinity, which are not JSON; other
    # clients and the tokenizer settings expect finite numbers only.
    raise AdmissionError(f"request body is not valid JSON: {name} is not a JSON number")


def _reject_lone_surrogates(doc: Any) -> None:
    """A ``\\ud800``-style escape without its pair decodes to a str that UTF-8 (the tokenizer,
    our responses) cannot carry; refuse it here rather than fail deep in a route."""
    stack = [doc]
    while stack:
        item = stack.pop()
        if isinstance(item, str):
            try:
                item.encode("utf-8")
            except UnicodeEncodeError:
                raise AdmissionError("request body holds an unpaired UTF-16 surrogate escape") from None
        elif isinstance(item, dict):
            stack.extend(item.keys())
            stack.extend(item.values())
        elif isinstance(item, list):
            stack.extend(item)


def _normalise(headers: Any) -> Headers:
    out = []
    for name, value in headers:
        if isinstance(name, str):
            name = name.encode("ascii")
        if isinstance(value, str):
            value = value.encode("latin-1")
        out.append((name.lower(), value))
    return out


class Response:
    """A complete response: the server adds Content-Length, Date and Server."""

    __slots__ = ("status", "headers", "body", "media_type")

    def __init__(self, body: bytes = b"", status: int = 200, headers: Any = None,
                 media_type: bytes | str | None = None):
        self.status = status
        self.body = body
        self.headers: Headers = _normalise(headers) if headers else []
        if isinstance(media_type, str):
            media_type = media_type.encode("ascii")
        self.media_type = media_type

    @classmethod
    def json(cls, obj: Any, status: int = 200, headers: Any = None) -> Response:
        body = json.dumps(obj, ensure_ascii=False, separators=(",", ":")).encode()
        return cls(body, status=status, headers=headers, media_type=_JSON_TYPE)


# The producer writes the body through the writer and returns; the server then
# ends the chunked body. It is not called for HEAD requests.
Producer = Callable[["ResponseWriter"], Awaitable[None]]


class StreamingResponse:
    """A response whose body a producer writes with backpressure (SSE, NDJSON)."""

    __slots__ = ("status", "headers", "producer", "media_type")

    def __init__(self, producer: Producer, status: int = 200, headers: Any = None,
                 media_type: bytes | str = b"text/event-stream"):
        self.status = status
        self.producer = producer
        self.headers: Headers = _normalise(headers) if headers else []
        if isinstance(media_type, str):
            media_type = media_type.encode("ascii")
        self.media_type = media_type
