"""Transport settings of the HTTP layer.

One frozen dataclass, validated once at construction; the daemon builds it
from ``ServerConfig`` and nothing here reads the environment.
"""

from __future__ import annotations

import dataclasses

_KIB = 1024
_MIB = 1024 * 1024


@dataclasses.dataclass(frozen=True, slots=True)
class HttpConfig:
    # Address to bind; port 0 asks the kernel for an ephemeral port, which
    # HttpServer.address reports after start().
    host: str = "127.0.0.1"
    port: int = 0
    # Largest request body accepted (413 above it), checked against
    # Content-Length before any body byte is read and again while a chunked
    # body streams in. The daemon sizes it from the core (images x context).
    body_limit_bytes: int = 16 * _MIB
    # Largest request line + header section (431 above it). h11 buffers an
    # incomplete head up to this size, so it also bounds per-connection memory
    # for a client that never finishes its headers.
    max_header_bytes: int = 64 * _KIB
    # A request head must arrive complete within this time after its first
    # byte (slow-header clients get 408 and a close).
    header_timeout_s: float = 10.0
    # A request body that makes no progress (no byte arrives while we are
    # reading) for this long is answered 408 and the connection closed.
    body_timeout_s: float = 30.0
    # An idle keep-alive connection (no byte of a next request) is closed
    # silently after this time.
    keep_alive_timeout_s: float = 5.0
    # Connections beyond this are answered 503 and closed at once, before
    # their request is parsed.
    max_connections: int = 1024
    # Write backpressure: a streaming producer waits in drain() while more
    # than high-water bytes sit in the transport buffer, until it falls to
    # low-water. 256 KiB holds thousands of SSE events, so a reader that keeps
    # up never waits, and one that stalls costs at most this much memory.
    write_high_water_bytes: int = 256 * _KIB
    write_low_water_bytes: int = 64 * _KIB
    # Read backpressure for handlers that stream the request body: reading
    # from the socket pauses while this many body bytes wait unconsumed.
    read_high_water_bytes: int = 256 * _KIB
    # After an error that ends the connection while the client may still be
    # sending (413, 503 refusal), we half-close and discard input for up to
    # this long so the kernel does not reset the connection and destroy the
    # error response before the client reads it.
    linger_s: float = 2.0
    # Graceful close: in-flight responses get this long to finish.
    shutdown_grace_s: float = 5.0
    # Optional bearer token; None disables auth. Routes marked public
    # (/health, /metrics) never need it.
    api_key: str | None = None
    # Origins that get CORS headers ("*" for any); empty disables CORS.
    cors_allow_origins: tuple[str, ...] = ()
    # Listen backlog handed to the kernel.
    backlog: int = 1024
    # TLS: an ssl.SSLContext with the server's certificate chain loaded (HTTPS); None serves plain HTTP.
    ssl: object | None = None

    def __post_init__(self) -> None:
        if not 0 <= self.port <= 65535:
            raise ValueError(f"port must be in 0..65535, got {self.port}")
        for name in ("body_limit_bytes", "max_header_bytes", "max_connections", "write_high_water_bytes",
                     "read_high_water_bytes", "backlog"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        if not 0 <= self.write_low_water_bytes <= self.write_high_water_bytes:
            raise ValueError("write_low_water_bytes must be in 0..write_high_water_bytes")
        for name in ("header_timeout_s", "body_timeout_s", "keep_alive_timeout_s", "linger_s"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        if self.shutdown_grace_s < 0:
            raise ValueError("shutdown_grace_s must be >= 0")
        if self.api_key is not None and not self.api_key:
            raise ValueError("api_key must be None or a nonempty string")
        if isinstance(self.cors_allow_origins, str):
            raise ValueError("cors_allow_origins must be a tuple of origins, not a string")
