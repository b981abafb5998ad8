"""Raw-socket HTTP for tests that must control exactly when a client stops reading or goes away."""

from __future__ import annotations

import json
import re
import socket

_FIRST_TOKEN = re.compile(rb'"(?:content|text)":"[^"]')


def post_bytes(path: str, body: dict) -> bytes:
    """One complete POST request with a JSON body, as bytes for sendall."""
    data = json.dumps(body).encode()
    return (f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(data)}\r\n\r\n").encode() + data


def read_until(sock: socket.socket, marker: bytes, limit_s: float = 60.0) -> bytes:
    """Bytes received until ``marker`` appears or the server closes."""
    sock.settimeout(limit_s)
    buf = b""
    while marker not in buf:
        chunk = sock.recv(65536)
        if not chunk:
            break
        buf += chunk
    return buf


def read_until_first_token(sock: socket.socket, limit_s: float = 60.0) -> bytes:
    """Bytes received until an SSE chunk carries non-empty text: the request is decoding.

    The role chunk's ``"content":""`` goes out before the model thread has even
    admitted the request, so it does not count."""
    sock.settimeout(limit_s)
    buf = b""
    while _FIRST_TOKEN.search(buf) is None:
        chunk = sock.recv(65536)
        assert chunk, buf
        buf += chunk
    return buf
