"""Backpressure and disconnects as explicit objects.

Rules:

- Writing: the transport calls ``pause_writing`` when its buffer passes the
  high-water mark and ``resume_writing`` when it falls to low-water.
  ``FlowControl.drain()`` waits in between; writers call it after each write,
  so a reader that stalls holds at most high-water bytes plus one frame in our
  memory, and the producer (a generating request) waits instead.
- Reading: ``pause_reading`` has two independent reasons, pipelined requests
  waiting behind the current response and a streamed request body the
  handler is not consuming; reading resumes only when no reason remains.
- A lost connection wakes every waiter: drains and body reads then raise
  ``ClientDisconnected``, and the request's ``Disconnect`` fires so that a
  handler that is neither writing nor reading (waiting for the model) learns
  it too.
"""

from __future__ import annotations

import asyncio
import logging
from collections import deque
from collections.abc import AsyncIterator, Callable

from flared.server.http.messages import ClientDisconnected, HttpError

log = logging.getLogger("flared.server.http")

READ_PAUSED_PIPELINE = 1
READ_PAUSED_BODY = 2


class Disconnect:
    """Fires once when the client goes away before its response is complete."""

    __slots__ = ("_loop", "_fired", "_waiters", "_callbacks")

    def __init__(self, loop: asyncio.AbstractEventLoop):
        self._loop = loop
        self._fired = False
        self._waiters: list[asyncio.Future[None]] | None = None
        self._callbacks: list[Callable[[], None]] | None = None

    def is_set(self) -> bool:
        return self._fired

    async def wait(self) -> None:
        if self._fired:
            return
        waiter = self._loop.create_future()
        if self._waiters is None:
            self._waiters = []
        self._waiters.append(waiter)
        await waiter

    def add_callback(self, callback: Callable[[], None]) -> None:
        """Run ``callback()`` on the event loop when the disconnect fires (at
        once if it already has): where a request cancels its model work."""
        if self._fired:
            self._loop.call_soon(callback)
            return
        if self._callbacks is None:
            self._callbacks = []
        self._callbacks.append(callback)

    def fire(self) -> None:
        if self._fired:
            return
        self._fired = True
        for waiter in self._waiters or ():
            if not waiter.done():
                waiter.set_result(None)
        for callback in self._callbacks or ():
            try:
                callback()
            except Exception:
                log.exception("disconnect callback failed")
        self._waiters = self._callbacks = None


class FlowControl:
    __slots__ = ("_transport", "_loop", "write_paused", "_drain_waiters", "_read_pause_reasons", "lost")

    def __init__(self, transport: asyncio.Transport, loop: asyncio.AbstractEventLoop):
        self._transport = transport
        self._loop = loop
        self.write_paused = False
        self._drain_waiters: list[asyncio.Future[None]] = []
        self._read_pause_reasons = 0
        self.lost = False

    # -- writing --------------------------------------------------------------
    def pause_writing(self) -> None:
        self.write_paused = True

    def resume_writing(self) -> None:
        self.write_paused = False
        waiters, self._drain_waiters = self._drain_waiters, []
        for waiter in waiters:
            if not waiter.done():
                waiter.set_result(None)

    async def drain(self) -> None:
        if self.lost:
            raise ClientDisconnected("client disconnected")
        while self.write_paused:
            waiter = self._loop.create_future()
            self._drain_waiters.append(waiter)
            await waiter
            if self.lost:
                raise ClientDisconnected("client disconnected")

    # -- reading --------------------------------------------------------------
    def pause_reading(self, reason: int) -> None:
        if not self._read_pause_reasons and not self.lost:
            self._transport.pause_reading()
        self._read_pause_reasons |= reason

    def resume_reading(self, reason: int) -> None:
        if not self._read_pause_reasons & reason:
            return
        self._read_pause_reasons &= ~reason
        if not self._read_pause_reasons and not self.lost:
            self._transport.resume_reading()

    @property
    def read_paused(self) -> bool:
        return bool(self._read_pause_reasons)

    def connection_lost(self) -> None:
        self.lost = True
        self.resume_writing()


class BodyStream:
    """Request body chunks for a handler that streams its body.

    Fed by the protocol from h11 Data events; pauses socket reads while more
    than read_high_water_bytes wait unconsumed.
    """

    __slots__ = ("_flow", "_loop", "_high_water_bytes", "_chunks", "_num_queued_bytes", "_complete", "_error",
                 "_waiter")

    def __init__(self, flow: FlowControl, loop: asyncio.AbstractEventLoop, high_water_bytes: int):
        self._flow = flow
        self._loop = loop
        self._high_water_bytes = high_water_bytes
        self._chunks: deque[bytes] = deque()
        self._num_queued_bytes = 0
        self._complete = False
        self._error: BaseException | None = None
        self._waiter: asyncio.Future[None] | None = None

    def _wake(self) -> None:
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)

    def feed(self, data: bytes) -> None:
        self._chunks.append(data)
        self._num_queued_bytes += len(data)
        if self._num_queued_bytes > self._high_water_bytes:
            self._flow.pause_reading(READ_PAUSED_BODY)
        self._wake()

    def end(self) -> None:
        self._complete = True
        self._wake()

    def fail(self, error: BaseException) -> None:
        self._error = error
        self._wake()

    async def chunks(self) -> AsyncIterator[bytes]:
        while True:
            if self._chunks:
                chunk = self._chunks.popleft()
                self._num_queued_bytes -= len(chunk)
                if self._num_queued_bytes <= self._high_water_bytes:
                    self._flow.resume_reading(READ_PAUSED_BODY)
                yield chunk
                continue
            if self._error is not None:
                raise self._error
            if self._complete:
                return
            self._waiter = self._loop.create_future()
            await self._waiter
            self._waiter = None


def body_too_large(limit_bytes: int) -> HttpError:
    return HttpError(413, f"request body exceeds the limit of {limit_bytes} bytes", code="request_too_large")
