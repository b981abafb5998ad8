"""Listener lifecycle: bind, count connections, graceful close.

``HttpServer`` lives on the event loop thread. ``ServerThread`` runs one on
its own uvloop thread for tests, benchmarks and embedding code that is not
async itself.
"""

from __future__ import annotations

import asyncio
import dataclasses
import email.utils
import socket
import threading
import time
from collections.abc import Callable

from flared.server.http.config import HttpConfig
from flared.server.http.messages import Headers, Request
from flared.server.http.protocol import HttpProtocol
from flared.server.http.routing import Router

# Admission hook: called on routes marked admit=True after route and auth
# checks, before the body is read. It returns a release callback (called once
# when the request's response is done or its connection is lost) or None, or
# raises a FlareError/HttpError (e.g. ErrorKind.HTTP_CAPACITY -> 429).
Admission = Callable[[Request], "Callable[[], None] | None"]


@dataclasses.dataclass(slots=True)
class HttpStats:
    """Counters the metrics module reads; written only on the event loop."""

    num_open_connections: int = 0
    num_accepted_connections_total: int = 0
    num_refused_connections_total: int = 0
    num_requests_total: int = 0
    num_responses_total: int = 0
    num_client_disconnects_total: int = 0
    num_protocol_errors_total: int = 0
    num_header_timeouts_total: int = 0
    num_body_timeouts_total: int = 0


class HttpServer:
    def __init__(self, router: Router, config: HttpConfig | None = None, *, admission: Admission | None = None):
        self.router = router
        self.config = config or HttpConfig()
        self.admission = admission
        self.stats = HttpStats()
        self.api_key_bytes = self.config.api_key.encode() if self.config.api_key is not None else b""
        self.loop: asyncio.AbstractEventLoop | None = None
        self._server: asyncio.Server | None = None
        self._connections: set[HttpProtocol] = set()
        # running handler tasks (HttpProtocol adds and removes them)
        self._tasks: set[asyncio.Task[None]] = set()
        self._all_closed: asyncio.Event | None = None
        self._closing = False
        self._started_monotonic_s = 0.0
        self._date_second = -1
        self._date_value = b""

    # -- lifecycle ----------------------------------------------------------------
    async def start(self, sock: socket.socket | None = None) -> tuple[str, int] | str:
        """Bind and start accepting; returns the bound address (see ``address``).

        ``sock`` is an already bound listening socket: systemd socket
        activation, a parent process that picked the port, or a Unix socket
        (the admin socket); host and port of the config are then ignored.
        """
        self.loop = asyncio.get_running_loop()
        self._all_closed = asyncio.Event()
        self._all_closed.set()
        cfg = self.config
        if sock is not None:
            self._server = await self.loop.create_server(lambda: HttpProtocol(self), sock=sock, backlog=cfg.backlog,
                                                         ssl=cfg.ssl if sock.family != socket.AF_UNIX else None)
        else:
            self._server = await self.loop.create_server(
                lambda: HttpProtocol(self), host=cfg.host, port=cfg.port, backlog=cfg.backlog, reuse_address=True,
                ssl=cfg.ssl)
        self._started_monotonic_s = time.monotonic()
        return self.address

    @property
    def address(self) -> tuple[str, int] | str:
        """(host, port) of a TCP listener; the path of a Unix socket (admin socket)."""
        if self._server is None or not self._server.sockets:
            raise RuntimeError("server is not listening")
        sockname = self._server.sockets[0].getsockname()
        if isinstance(sockname, str):
            return sockname
        return sockname[0], sockname[1]

    @property
    def uptime_s(self) -> float:
        return time.monotonic() - self._started_monotonic_s if self._started_monotonic_s else 0.0

    async def close(self, grace_s: float | None = None) -> None:
        """Stop accepting, let in-flight responses finish within the grace
        period, then drop whatever is left."""
        if self._server is None:
            return
        grace_s = self.config.shutdown_grace_s if grace_s is None else grace_s
        self._closing = True
        self._server.close()
        for connection in list(self._connections):
            connection.shutdown()
        try:
            await asyncio.wait_for(self._all_closed.wait(), timeout=grace_s)
        except asyncio.TimeoutError:
            for connection in list(self._connections):
                connection.abort()
            # aborted transports report connection_lost on the next iterations
            try:
                await asyncio.wait_for(self._all_closed.wait(), timeout=1.0)
            except asyncio.TimeoutError:
                pass
        if self._tasks:
            # handlers saw their disconnect; give them a moment to wind down
            _, pending = await asyncio.wait(list(self._tasks), timeout=1.0)
            for task in pending:
                task.cancel()
            if pending:
                await asyncio.wait(pending, timeout=1.0)
        self._server = None

    @property
    def closing(self) -> bool:
        return self._closing

    # -- bookkeeping (called by HttpProtocol) -------------------------------------
    def _register(self, connection: HttpProtocol) -> bool:
        if self._closing or len(self._connections) >= self.config.max_connections:
            return False
        self._connections.add(connection)
        self._all_closed.clear()
        self.stats.num_accepted_connections_total += 1
        self.stats.num_open_connections = len(self._connections)
        return True

    def _unregister(self, connection: HttpProtocol) -> None:
        self._connections.discard(connection)
        self.stats.num_open_connections = len(self._connections)
        if not self._connections:
            self._all_closed.set()

    def date_header(self) -> bytes:
        """RFC 9110 Date value, formatted once per second."""
        now_s = int(time.time())
        if now_s != self._date_second:
            self._date_second = now_s
            self._date_value = email.utils.formatdate(now_s, usegmt=True).encode()
        return self._date_value

    def cors_headers(self, origin: bytes) -> Headers | None:
        allowed = self.config.cors_allow_origins
        if "*" in allowed:
            return [(b"access-control-allow-origin", b"*")]
        if origin.decode("latin-1") in allowed:
            return [(b"access-control-allow-origin", origin), (b"vary", b"origin")]
        return None


class ServerThread:
    """An HttpServer on its own uvloop event-loop thread.

    ``start()`` returns once the socket is bound (the address is known);
    ``stop()`` closes gracefully and joins the thread.
    """

    def __init__(self, router: Router, config: HttpConfig | None = None, *, admission: Admission | None = None):
        self.server = HttpServer(router, config, admission=admission)
        self.loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._ready = threading.Event()
        self._stop: asyncio.Event | None = None
        self._error: BaseException | None = None
        self.address: tuple[str, int] | None = None

    def start(self) -> tuple[str, int]:
        self._thread = threading.Thread(target=self._main, name="flared-http", daemon=True)
        self._thread.start()
        self._ready.wait()
        if self._error is not None:
            raise self._error
        return self.address

    def _main(self) -> None:
        import uvloop

        self.loop = uvloop.new_event_loop()
        asyncio.set_event_loop(self.loop)
        try:
            self.loop.run_until_complete(self._serve())
        except BaseException as exc:  # surfaced by start()
            self._error = exc
            self._ready.set()
        finally:
            self.loop.close()

    async def _serve(self) -> None:
        self._stop = asyncio.Event()
        self.address = await self.server.start()
        self._ready.set()
        await self._stop.wait()
        await self.server.close()

    def call(self, fn: Callable[[], object]) -> object:
        """Run fn() on the server's loop and return its result (for tests that inspect state)."""
        result: list[object] = []
        done = threading.Event()

        def run() -> None:
            try:
                result.append(fn())
            finally:
                done.set()

        self.loop.call_soon_threadsafe(run)
        done.wait()
        return result[0] if result else None

    def stop(self, timeout_s: float = 10.0) -> None:
        if self._thread is None:
            return
        if self.loop is not None and self._stop is not None and not self.loop.is_closed():
            self.loop.call_soon_threadsafe(self._stop.set)
        self._thread.join(timeout_s)
        self._thread = None

    def __enter__(self) -> ServerThread:
        self.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.stop()
