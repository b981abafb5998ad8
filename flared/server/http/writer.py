"""ResponseWriter: the body of a streaming response (SSE, NDJSON), with backpressure.

Rules:

- The response head goes out with the first body bytes (or ``send_head()``),
  not before the producer runs: a producer that fails before writing (the
  model refused the request) still gets a proper JSON error status.
- Body bytes are framed here, not by ``h11.Connection.send``: this is the
  per-token hot path, and h11 does nothing for a chunked body but add the
  chunk size line (its state machine changes only at the head and at
  EndOfMessage, both of which still go through h11). The framing is chunked
  for HTTP/1.1 peers and raw (close-delimited) for HTTP/1.0, the same choice
  h11 made for the head, since streaming heads never carry Content-Length.
- After every write the writer waits while the transport buffer is above
  high-water; after a disconnect writes raise ``ClientDisconnected``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from flared.server.http.messages import ClientDisconnected, StreamingResponse
from flared.server.http.sse import encode_comment, encode_event, encode_json_event, encode_ndjson

if TYPE_CHECKING:
    from flared.server.http.flow import Disconnect
    from flared.server.http.protocol import HttpProtocol, _Exchange

# above this a chunk is handed to the transport as separate buffers instead
# of being copied into one with its framing
_COPY_LIMIT_BYTES = 16384


class ResponseWriter:
    __slots__ = ("_protocol", "_exchange", "_response", "_transport", "_flow", "_chunked", "disconnected",
                 "num_bytes_written", "num_drain_waits")

    def __init__(self, protocol: HttpProtocol, exchange: _Exchange, response: StreamingResponse):
        self._protocol = protocol
        self._exchange = exchange
        self._response = response
        self._transport = protocol._transport
        self._flow = protocol._flow
        self._chunked = True
        # fires when the client goes away; producers waiting on something
        # else (the model) watch it to cancel their work
        self.disconnected: Disconnect = exchange.request.disconnected
        self.num_bytes_written = 0
        # how often write() had to wait for the client: a stalled reader shows here
        self.num_drain_waits = 0

    def _send_head(self) -> None:
        self._protocol._stream_head(self._exchange, self._response)
        self._chunked = self._protocol._conn.their_http_version != b"1.0"

    async def write(self, data: bytes) -> None:
        flow = self._flow
        if flow.lost:
            raise ClientDisconnected("client disconnected")
        if not data:
            return
        if not self._exchange.response_started:
            self._send_head()
        if not self._chunked:
            self._transport.write(data)
        elif len(data) <= _COPY_LIMIT_BYTES:
            self._transport.write(b"%x\r\n%b\r\n" % (len(data), data))
        else:
            self._transport.writelines((b"%x\r\n" % len(data), data, b"\r\n"))
        self.num_bytes_written += len(data)
        if flow.write_paused:
            self.num_drain_waits += 1
            await flow.drain()

    async def send_head(self) -> None:
        """Send status and headers now, before any body byte (a long prefill
        ahead: let the client see the stream has started)."""
        if self._flow.lost:
            raise ClientDisconnected("client disconnected")
        if not self._exchange.response_started:
            self._send_head()
            await self._flow.drain()

    async def drain(self) -> None:
        await self._flow.drain()

    def buffered_bytes(self) -> int:
        """Bytes written but still in the transport buffer (not yet in the kernel)."""
        return self._transport.get_write_buffer_size()

    # Conveniences over the pure encoders in sse.py.
    async def send_event(self, data: str, event: str | None = None, id: str | None = None) -> None:
        await self.write(encode_event(data, event=event, id=id))

    async def send_json_event(self, obj: object, event: str | None = None) -> None:
        await self.write(encode_json_event(obj, event=event))

    async def send_comment(self, text: str = "") -> None:
        await self.write(encode_comment(text))

    async def send_ndjson(self, obj: object) -> None:
        await self.write(encode_ndjson(obj))
