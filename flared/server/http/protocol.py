"""One HTTP/1.1 connection: an asyncio.Protocol driving an h11.Connection.

Rules:

- h11 owns parsing and the connection state machine; this class feeds bytes
  in, takes events out, and writes what ``h11.Connection.send`` returns.
- One exchange (request + response) at a time. Once a request is complete
  and its handler runs, parsing stops: a pipelined request waits in h11's
  buffer and socket reads pause; when the response is complete the next
  cycle starts and the buffer is parsed again, so responses leave strictly in
  request order.
- Before any body byte is read, in this order: head size (431), OPTIONS and
  CORS preflight (answered here, never routed), route (404, 405), bearer
  token (401), declared Content-Length against body_limit_bytes (413), the
  admission hook (429 or whatever it raises).
  Only then ``100 Continue`` and body reading. A chunked body is counted as
  it streams and answered 413 when it passes the limit.
- An answer given before the body was read keeps the connection only if the
  rest of the body is bounded: we read and discard it (still counted against
  the limit). A 413, or a client that waits for 100-continue, gets the answer
  and a close.
- A close while the client may still be sending (413, malformed input,
  refusal) lingers: half-close, discard input until EOF or linger_s. Closing
  with unread input would make the kernel reset the connection and the client
  would lose our error response.
- One timer at a time: waiting for a request head (header_timeout_s after
  connect or after the first byte of a head, 408 if some of it came, silent
  close if none did), body progress (408 when no body byte came for
  body_timeout_s while we were reading), idle keep-alive
  (keep_alive_timeout_s, silent close), or linger.
- The connection closes after the response when h11 says so (HTTP/1.0,
  ``Connection: close``), when we chose to (errors that leave the input
  stream unknown), or when the server is shutting down.
"""

from __future__ import annotations

import asyncio
import hmac
import http
import logging
import secrets
from typing import TYPE_CHECKING
from urllib.parse import unquote_to_bytes

import h11

from flared.errors import FlareError
from flared.server.http.flow import (
    READ_PAUSED_BODY,
    READ_PAUSED_PIPELINE,
    BodyStream,
    Disconnect,
    FlowControl,
    body_too_large,
)
from flared.server.http.messages import (
    ClientDisconnected,
    Headers,
    HttpError,
    Request,
    Response,
    StreamingResponse,
    error_body,
    error_response,
    request_id_ok,
)
from flared.server.http.writer import ResponseWriter

if TYPE_CHECKING:
    from flared.server.http.routing import Route
    from flared.server.http.server import HttpServer

log = logging.getLogger("flared.server.http")

_REASONS = {status.value: status.phrase.encode() for status in http.HTTPStatus}

# timer kinds
_TIMER_HEAD = 1
_TIMER_IDLE = 2
_TIMER_LINGER = 3
_TIMER_BODY = 4

_NO_BODY_STATUSES = frozenset((204, 304))
# answers after which the rest of the input cannot be trusted or is unwanted
_CLOSING_STATUSES = frozenset((413, 431))
_FRAMING_HEADERS = frozenset((b"content-length", b"transfer-encoding"))


class _Exchange:
    """State of one request/response cycle on a connection."""

    __slots__ = ("request", "route", "is_head", "content_length", "num_body_bytes", "body_parts", "body_stream",
                 "discard_body", "over_limit", "keep_alive", "handler_started", "response_started",
                 "response_complete", "release_permit", "task", "cors_headers", "request_id")

    def __init__(self, request: Request, is_head: bool):
        self.request = request
        self.route: Route | None = None
        self.is_head = is_head
        self.content_length: int | None = None
        self.num_body_bytes = 0
        self.body_parts: list[bytes] = []
        self.body_stream: BodyStream | None = None
        # the response went out before the body was consumed: read and drop the rest
        self.discard_body = False
        self.over_limit = False
        # False once we decided to close after this response
        self.keep_alive = True
        self.handler_started = False
        self.response_started = False
        self.response_complete = False
        # the admission hook's release callback; called exactly once
        self.release_permit = None
        self.task: asyncio.Task[None] | None = None
        self.cors_headers: Headers | None = None
        # the response's X-Request-Id: the client's own where it sent a usable one, else made up when needed
        self.request_id: bytes | None = None


class HttpProtocol(asyncio.Protocol):
    def __init__(self, server: HttpServer):
        self._server = server
        self._config = server.config
        self._router = server.router
        self._loop = server.loop
        self._conn = h11.Connection(h11.SERVER, max_incomplete_event_size=server.config.max_header_bytes)
        self._transport: asyncio.Transport | None = None
        self._flow: FlowControl | None = None
        self._client: tuple[str, int] | None = None
        self._exchange: _Exchange | None = None
        self._timer: asyncio.TimerHandle | None = None
        self._timer_kind = 0
        # some byte of the next request head has arrived in this cycle
        self._cycle_has_bytes = False
        # _handle_events is on the stack: a response finished inside it must
        # not parse again recursively, the running loop continues instead
        self._in_events = False
        self._shutting_down = False
        self._lingering = False
        self._closing = False
        self._lost = False
        # body bytes seen when the body timer last fired
        self._body_progress_mark = -1

    # -- asyncio.Protocol -------------------------------------------------------
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._transport = transport
        self._flow = FlowControl(transport, self._loop)
        peer = transport.get_extra_info("peername")
        self._client = (peer[0], peer[1]) if isinstance(peer, tuple) else None
        cfg = self._config
        transport.set_write_buffer_limits(high=cfg.write_high_water_bytes, low=cfg.write_low_water_bytes)
        if not self._server._register(self):
            self._refuse()
            return
        self._arm_timer(_TIMER_HEAD, cfg.header_timeout_s)

    def data_received(self, data: bytes) -> None:
        if self._lingering or self._closing or self._conn.their_state is h11.ERROR:
            return
        self._cycle_has_bytes = True
        if self._timer_kind == _TIMER_IDLE:
            self._cancel_timer()
        conn = self._conn
        conn.receive_data(data)
        ex = self._exchange
        if ex is not None and not ex.response_complete and conn.their_state is not h11.SEND_BODY:
            # A pipelined request behind one still being answered: h11 keeps
            # it until the next cycle; stop reading more meanwhile.
            self._flow.pause_reading(READ_PAUSED_PIPELINE)
            return
        self._handle_events()
        if self._timer is None:
            self._arm_wait_timer()

    def eof_received(self) -> bool | None:
        # The client closed its sending side. A request in flight is treated
        # as abandoned (like uvicorn): returning None closes the transport and
        # connection_lost fires the request's Disconnect.
        return None

    def connection_lost(self, exc: Exception | None) -> None:
        self._lost = True
        self._cancel_timer()
        if self._flow is not None:
            self._flow.connection_lost()
        self._server._unregister(self)
        ex = self._exchange
        if ex is None:
            return
        if not ex.response_complete:
            self._server.stats.num_client_disconnects_total += 1
            ex.request.disconnected.fire()
        if ex.body_stream is not None:
            ex.body_stream.fail(ClientDisconnected("client disconnected while sending the body"))
        if not ex.handler_started:
            self._release(ex)

    def pause_writing(self) -> None:
        self._flow.pause_writing()

    def resume_writing(self) -> None:
        self._flow.resume_writing()

    # -- server control ---------------------------------------------------------
    def shutdown(self) -> None:
        """Graceful close: finish the response in flight (if any), then close."""
        self._shutting_down = True
        ex = self._exchange
        if ex is None or ex.response_complete:
            self._close()
        else:
            ex.keep_alive = False

    def abort(self) -> None:
        """Grace period over: drop the connection. The handler sees its
        request's Disconnect fire (and its writes fail) so it can cancel its
        model work; the server cancels handlers that still do not finish."""
        ex = self._exchange
        if ex is not None and not ex.response_complete:
            ex.request.disconnected.fire()
        if self._transport is not None:
            self._transport.abort()

    @property
    def busy(self) -> bool:
        return self._exchange is not None and not self._exchange.response_complete

    # -- parsing ----------------------------------------------------------------
    def _handle_events(self) -> None:
        if self._in_events:
            return
        self._in_events = True
        conn = self._conn
        try:
            while not (self._closing or self._lingering or self._lost):
                try:
                    event = conn.next_event()
                except h11.RemoteProtocolError as exc:
                    self._on_protocol_error(exc)
                    break
                if event is h11.NEED_DATA:
                    break
                if event is h11.PAUSED:
                    self._flow.pause_reading(READ_PAUSED_PIPELINE)
                    break
                event_type = type(event)
                if event_type is h11.Data:
                    self._on_body_data(event.data)
                elif event_type is h11.Request:
                    self._on_request(event)
                elif event_type is h11.EndOfMessage:
                    self._on_body_end()
                    ex = self._exchange
                    if ex is not None and not ex.response_complete:
                        # The handler runs; nothing more can be parsed before
                        # the next cycle (h11 would only answer PAUSED).
                        if conn.trailing_data[0]:
                            self._flow.pause_reading(READ_PAUSED_PIPELINE)
                        break
                else:  # ConnectionClosed
                    break
        finally:
            self._in_events = False

    def _on_request(self, event: h11.Request) -> None:
        self._cancel_timer()
        server = self._server
        cfg = self._config
        server.stats.num_requests_total += 1
        method = event.method.decode("ascii")
        target = event.target
        raw_path, _, query_string = target.partition(b"?")
        # routes match the raw path; handlers get the decoded one
        route_path = raw_path.decode("latin-1")
        if b"%" in raw_path or not raw_path.isascii():
            path = unquote_to_bytes(raw_path).decode("utf-8", "replace")
        else:
            path = route_path
        headers = event.headers
        request = Request(method, target, path, query_string, headers, event.http_version, self._client,
                          Disconnect(self._loop))
        ex = _Exchange(request, method == "HEAD")
        self._exchange = ex
        if self._shutting_down:
            ex.keep_alive = False

        token = origin = requested_headers = None
        preflight = False
        # h11 enforces max_header_bytes only on a head that arrives in pieces;
        # one that arrives whole is measured here (4 = ": " + CRLF).
        num_head_bytes = len(target) + 16
        for name, value in headers:
            num_head_bytes += len(name) + len(value) + 4
            if name == b"content-length":
                ex.content_length = int(value)
            elif name == b"authorization":
                scheme, _, credentials = value.partition(b" ")
                if scheme.lower() == b"bearer":
                    token = credentials.strip()
            elif name == b"x-api-key":  # the Anthropic SDK's header
                token = value.strip()
            elif name == b"origin":
                origin = value
            elif name == b"access-control-request-method":
                preflight = True
            elif name == b"access-control-request-headers":
                requested_headers = value
            elif name == b"x-request-id" and request_id_ok(value):
                ex.request_id = request.request_id = value
        if origin is not None and cfg.cors_allow_origins:
            ex.cors_headers = server.cors_headers(origin)

        try:
            if num_head_bytes > cfg.max_header_bytes:
                raise HttpError(431, f"request header section exceeds {cfg.max_header_bytes} bytes",
                                code="headers_too_large")
            if method == "OPTIONS":
                self._respond_now(ex, self._options_response(route_path, preflight, ex.cors_headers is not None,
                                                             requested_headers))
                return
            route, params = self._router.resolve(method, route_path)
            request.params = params
            if cfg.api_key is not None and not route.public and not self._token_ok(token):
                raise HttpError(401, "missing or invalid API key (send 'Authorization: Bearer <key>')",
                                type="authentication_error", code="invalid_api_key",
                                headers=[(b"www-authenticate", b"Bearer")])
            limit = route.body_limit or cfg.body_limit_bytes
            if ex.content_length is not None and ex.content_length > limit:
                raise body_too_large(limit)
            if route.admit and server.admission is not None:
                ex.release_permit = server.admission(request)
        except Exception as exc:  # HttpError, FlareError, or a bug in the admission hook
            if not isinstance(exc, (HttpError, FlareError)):
                log.exception("admission hook failed")
            self._respond_now(ex, error_response(exc))
            return

        ex.route = route
        conn = self._conn
        if conn.they_are_waiting_for_100_continue:
            self._transport.write(conn.send(h11.InformationalResponse(status_code=100, headers=[], reason=b"Continue")))
        if route.stream_body:
            ex.body_stream = BodyStream(self._flow, self._loop, cfg.read_high_water_bytes)
            request._body_stream = ex.body_stream
            self._start_handler(ex)

    def _on_body_data(self, data: bytes) -> None:
        ex = self._exchange
        ex.num_body_bytes += len(data)
        limit = (ex.route.body_limit if ex.route is not None else None) or self._config.body_limit_bytes
        if ex.num_body_bytes > limit:
            if ex.over_limit:
                return
            ex.over_limit = True
            ex.keep_alive = False
            if ex.response_complete:
                self._close_after_response()
            elif ex.handler_started:
                # the handler is reading a streamed body: its next read raises
                # 413; its response (413 or other) then closes the connection
                if ex.body_stream is not None:
                    ex.body_stream.fail(body_too_large(limit))
                ex.discard_body = True
            else:
                self._respond_now(ex, error_response(body_too_large(limit)))
            return
        if ex.discard_body:
            return
        if ex.body_stream is not None:
            ex.body_stream.feed(data)
        else:
            ex.body_parts.append(data)

    def _on_body_end(self) -> None:
        ex = self._exchange
        if self._timer_kind == _TIMER_BODY:
            self._cancel_timer()
        if ex.discard_body:
            if ex.response_complete:
                self._next_cycle()
            return
        if ex.body_stream is not None:
            ex.body_stream.end()
            return
        parts = ex.body_parts
        ex.request.body = parts[0] if len(parts) == 1 else b"".join(parts)
        ex.body_parts = []
        self._start_handler(ex)

    def _on_protocol_error(self, exc: h11.RemoteProtocolError) -> None:
        if exc.error_status_hint == 431:
            error = HttpError(431, f"request header section exceeds {self._config.max_header_bytes} bytes",
                              code="headers_too_large")
        else:
            error = HttpError(400, f"malformed HTTP request: {exc}", code="malformed_request")
        self._server.stats.num_protocol_errors_total += 1
        ex = self._exchange
        if ex is None or not (ex.handler_started or ex.response_started):
            self._send_unsolicited_error(error)
            if ex is not None:
                self._release(ex)  # do not hold a permit through the linger
            self._linger()
            return
        # A handler runs (or ran) on a request whose body turned out broken:
        # it learns through its body stream; the connection ends after its
        # response, since the input stream can no longer be trusted.
        if ex.body_stream is not None:
            ex.body_stream.fail(error)
        ex.keep_alive = False
        if ex.response_complete:
            self._linger()

    # -- answering --------------------------------------------------------------
    def _options_response(self, path: str, preflight: bool, cors: bool, requested_headers: bytes | None = None
                          ) -> Response:
        if path == "*":
            allow = "GET, HEAD, POST, OPTIONS"
        else:
            methods = self._router.allowed_methods(path)
            if not methods:
                raise HttpError(404, f"no route for {path}", type="not_found_error", code="not_found")
            allow = ", ".join(methods)
        headers = [(b"allow", allow.encode())]
        if preflight and cors:
            # the headers the browser asks to send are allowed as asked (SDKs add their own: x-stainless-*,
            # anthropic-version, ...); the origin check is what guards
            allowed = requested_headers or b"authorization, content-type, x-api-key"
            headers += [(b"access-control-allow-methods", allow.encode()),
                        (b"access-control-allow-headers", allowed),
                        (b"access-control-max-age", b"600")]
        return Response(status=204, headers=headers)

    def _token_ok(self, token: bytes | None) -> bool:
        if token is None:
            return False
        return hmac.compare_digest(token, self._server.api_key_bytes)

    def _respond_now(self, ex: _Exchange, response: Response) -> None:
        """Answer before the handler ran (errors, OPTIONS)."""
        conn = self._conn
        if response.status in _CLOSING_STATUSES:
            ex.keep_alive = False
        elif conn.their_state is h11.SEND_BODY:
            if conn.they_are_waiting_for_100_continue:
                # the client may or may not send the body now: unknowable
                ex.keep_alive = False
            else:
                ex.discard_body = True
        self._write_complete(ex, response)

    def _base_headers(self, ex: _Exchange, media_type: bytes | None) -> Headers:
        headers = [(b"date", self._server.date_header()), (b"server", b"flared")]
        if media_type is not None:
            headers.append((b"content-type", media_type))
        if ex.cors_headers:
            headers += ex.cors_headers
        # as vLLM's --enable-request-id-headers: the client's id echoed, else one made for this response
        headers.append((b"x-request-id", ex.request_id or secrets.token_hex(16).encode()))
        if not ex.keep_alive:
            headers.append((b"connection", b"close"))
        return headers

    def _write_complete(self, ex: _Exchange, response: Response) -> None:
        if self._lost or self._closing:
            return
        body = response.body
        status = response.status
        headers = self._base_headers(ex, response.media_type)
        if status not in _NO_BODY_STATUSES and status >= 200:
            headers.append((b"content-length", b"%d" % len(body)))
        if response.headers:
            # we frame the body; a handler's own length would contradict ours
            headers += [(name, value) for name, value in response.headers if name not in _FRAMING_HEADERS]
        conn = self._conn
        try:
            head = conn.send(h11.Response(status_code=status, headers=headers, reason=_REASONS.get(status, b"")))
            if body and not ex.is_head and status not in _NO_BODY_STATUSES:
                conn.send(h11.Data(data=body))
            else:
                body = b""
            conn.send(h11.EndOfMessage())
        except h11.LocalProtocolError:
            log.exception("could not frame a response")
            self._transport.abort()
            return
        ex.response_started = True
        if len(body) < 65536:
            self._transport.write(head + body)
        else:  # spare a copy of a large body
            self._transport.writelines((head, body))
        self._response_complete(ex)

    def _stream_head(self, ex: _Exchange, response: StreamingResponse) -> None:
        headers = self._base_headers(ex, response.media_type)
        headers.append((b"cache-control", b"no-cache"))
        if response.media_type == b"text/event-stream":
            # reverse proxies (nginx) must not buffer events
            headers.append((b"x-accel-buffering", b"no"))
        if response.headers:
            # the body is framed by us (chunked, or close-delimited for HTTP/1.0)
            headers += [(name, value) for name, value in response.headers if name not in _FRAMING_HEADERS]
        status = response.status
        self._transport.write(self._conn.send(
            h11.Response(status_code=status, headers=headers, reason=_REASONS.get(status, b""))))
        ex.response_started = True

    def _send_unsolicited_error(self, error: HttpError) -> None:
        """Error answer when no request is being handled (malformed, 431, 408).
        h11 lets a server answer from IDLE after the peer misbehaved."""
        conn = self._conn
        if conn.our_state not in (h11.IDLE, h11.SEND_RESPONSE):
            return
        response = error_response(error)
        headers = [(b"date", self._server.date_header()), (b"server", b"flared"),
                   (b"content-type", response.media_type), (b"content-length", b"%d" % len(response.body)),
                   (b"connection", b"close")]
        try:
            data = conn.send(h11.Response(status_code=error.status, headers=headers,
                                          reason=_REASONS.get(error.status, b"")))
            data += conn.send(h11.Data(data=response.body))
            data += conn.send(h11.EndOfMessage())
        except h11.LocalProtocolError:
            return
        self._transport.write(data)

    def _refuse(self) -> None:
        """Over max_connections: a 503 before reading anything, then close."""
        self._server.stats.num_refused_connections_total += 1
        body = error_body("too many connections; retry later", "overloaded_error", "too_many_connections")
        head = (b"HTTP/1.1 503 Service Unavailable\r\ncontent-type: application/json\r\n"
                b"content-length: %d\r\nretry-after: 1\r\nconnection: close\r\n\r\n" % len(body))
        self._transport.write(head + body)
        self._linger()

    # -- handler ----------------------------------------------------------------
    def _start_handler(self, ex: _Exchange) -> None:
        ex.handler_started = True
        ex.task = self._loop.create_task(self._run_handler(ex))
        # The loop keeps only weak references to tasks: the server holds it
        # until _run_handler's finally (cheaper than a done callback).
        self._server._tasks.add(ex.task)

    async def _run_handler(self, ex: _Exchange) -> None:
        try:
            try:
                result = await ex.route.handler(ex.request)
            except (ClientDisconnected, asyncio.CancelledError):
                raise
            except Exception as exc:
                if not isinstance(exc, (HttpError, FlareError)):
                    log.exception("handler %s %s failed", ex.request.method, ex.request.path)
                result = error_response(exc)
            if self._lost:
                return
            if isinstance(result, Response):
                self._write_complete(ex, result)
            elif isinstance(result, StreamingResponse):
                await self._write_streaming(ex, result)
            else:
                log.error("handler %s %s returned %r, not a Response", ex.request.method, ex.request.path,
                          type(result).__name__)
                self._write_complete(ex, error_response(TypeError()))
        except (ClientDisconnected, asyncio.CancelledError):
            pass
        except Exception as exc:
            if not isinstance(exc, (HttpError, FlareError)):
                log.exception("streaming response %s %s failed", ex.request.method, ex.request.path)
            if not ex.response_started and not self._lost:
                self._write_complete(ex, error_response(exc))
            elif self._transport is not None:
                # Mid-body there is no way to send a status any more; an
                # unterminated chunked body tells the client it failed.
                self._transport.abort()
        finally:
            self._release(ex)
            self._server._tasks.discard(ex.task)

    async def _write_streaming(self, ex: _Exchange, response: StreamingResponse) -> None:
        if not ex.is_head:
            await response.producer(ResponseWriter(self, ex, response))
        if self._lost:
            return
        if not ex.response_started:
            self._stream_head(ex, response)
        self._transport.write(self._conn.send(h11.EndOfMessage()))
        self._response_complete(ex)

    # -- cycle end --------------------------------------------------------------
    def _response_complete(self, ex: _Exchange) -> None:
        ex.response_complete = True
        self._server.stats.num_responses_total += 1
        # before the next cycle: a pipelined request must find the permit free
        self._release(ex)
        conn = self._conn
        if not ex.keep_alive or conn.our_state is h11.MUST_CLOSE or self._shutting_down:
            self._close_after_response()
        elif conn.their_state is h11.DONE:
            self._next_cycle()
        else:
            # the handler answered before consuming the body: drop the rest
            ex.discard_body = True
            self._flow.resume_reading(READ_PAUSED_BODY)

    def _next_cycle(self) -> None:
        conn = self._conn
        conn.start_next_cycle()
        self._exchange = None
        self._cycle_has_bytes = False
        self._arm_timer(_TIMER_IDLE, self._config.keep_alive_timeout_s)
        self._flow.resume_reading(READ_PAUSED_PIPELINE | READ_PAUSED_BODY)
        if not self._in_events and conn.trailing_data[0]:
            self._handle_events()
            if self._exchange is not None:
                self._arm_wait_timer()
            elif self._timer_kind == _TIMER_IDLE and conn.trailing_data[0]:
                # part of the next head is already buffered: it is no longer idle
                self._cycle_has_bytes = True
                self._arm_timer(_TIMER_HEAD, self._config.header_timeout_s)

    def _close_after_response(self) -> None:
        if self._conn.their_state in (h11.SEND_BODY, h11.ERROR):
            self._linger()
        else:
            self._close()

    def _close(self) -> None:
        if self._closing or self._lost:
            return
        self._closing = True
        self._cancel_timer()
        self._transport.close()

    def _linger(self) -> None:
        if self._lingering or self._closing or self._lost:
            return
        self._lingering = True
        transport = self._transport
        if transport.can_write_eof():
            transport.write_eof()
        self._flow.resume_reading(READ_PAUSED_PIPELINE | READ_PAUSED_BODY)
        self._arm_timer(_TIMER_LINGER, self._config.linger_s)

    def _release(self, ex: _Exchange) -> None:
        release, ex.release_permit = ex.release_permit, None
        if release is not None:
            try:
                release()
            except Exception:
                log.exception("admission release failed")

    # -- timers -----------------------------------------------------------------
    def _arm_timer(self, kind: int, delay_s: float) -> None:
        if self._timer is not None:
            self._timer.cancel()
        self._timer_kind = kind
        self._timer = self._loop.call_later(delay_s, self._on_timer)

    def _arm_wait_timer(self) -> None:
        """After parsing, give the client we now wait on a deadline: for its
        request head, or for the rest of a body. Armed only here, once a
        parse pass is over, so a request that arrived whole costs no timer."""
        if self._timer is not None or self._closing or self._lingering or self._lost:
            return
        ex = self._exchange
        if ex is None:
            self._arm_timer(_TIMER_HEAD, self._config.header_timeout_s)
        elif self._conn.their_state is h11.SEND_BODY:
            # also covers a body we discard after an early answer
            self._body_progress_mark = -1
            self._arm_timer(_TIMER_BODY, self._config.body_timeout_s)

    def _cancel_timer(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
            self._timer_kind = 0

    def _on_timer(self) -> None:
        kind = self._timer_kind
        self._timer = None
        self._timer_kind = 0
        if self._lost:
            return
        if kind == _TIMER_HEAD and self._cycle_has_bytes and self._exchange is None:
            self._server.stats.num_header_timeouts_total += 1
            self._send_unsolicited_error(HttpError(
                408, f"request head not received within {self._config.header_timeout_s} s",
                code="request_timeout"))
            self._linger()
        elif kind == _TIMER_BODY:
            self._on_body_timer()
        elif kind == _TIMER_LINGER:
            self._transport.abort()
        elif self._exchange is None:
            # idle keep-alive, or a connection that never sent a byte: close
            # without an answer (a speculative pre-connect must not read one)
            self._close()

    def _on_body_timer(self) -> None:
        ex = self._exchange
        if ex is None or self._conn.their_state is not h11.SEND_BODY:
            return
        if ex.num_body_bytes != self._body_progress_mark or self._flow.read_paused:
            # progress since the last check, or we are the ones not reading
            self._body_progress_mark = ex.num_body_bytes
            self._arm_timer(_TIMER_BODY, self._config.body_timeout_s)
            return
        self._server.stats.num_body_timeouts_total += 1
        error = HttpError(408, f"request body stalled: no byte for {self._config.body_timeout_s} s",
                          code="request_timeout")
        ex.keep_alive = False
        if ex.response_complete:
            self._close_after_response()
        elif ex.handler_started:
            if ex.body_stream is not None:
                ex.body_stream.fail(error)
            ex.discard_body = True
        else:
            self._respond_now(ex, error_response(error))
