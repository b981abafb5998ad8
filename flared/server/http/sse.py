"""Pure encoders for streamed bodies: Server-Sent Events and NDJSON.

No I/O here: each function returns the bytes of one frame, which a handler
hands to ``ResponseWriter.write``. Rules of the SSE wire format (WHATWG HTML,
"server-sent events"):

- a frame is field lines ending in ``\\n`` followed by one empty line;
- a payload with line breaks becomes one ``data:`` line per line (the client
  joins them with ``\\n``), so ``\\r\\n``, ``\\r`` and ``\\n`` all split;
- ``event:`` and ``id:`` values cannot carry line breaks (and ``id`` no NUL):
  we refuse them rather than emit a frame the client parses differently;
- a line starting with ``:`` is a comment, which clients ignore: a keep-alive
  ping that also defeats idle timeouts of proxies.
"""

from __future__ import annotations

import json
import re
from typing import Any

# OpenAI's stream terminator.
DONE = b"data: [DONE]\n\n"
# A bare comment frame; clients ignore it, proxies see traffic.
PING = b":\n\n"

_LINE_BREAK = re.compile(r"\r\n|\r|\n")


def _check_field(name: str, value: str) -> None:
    if "\n" in value or "\r" in value:
        raise ValueError(f"SSE {name} must not contain a line break: {value!r}")


def encode_event(data: str, event: str | None = None, id: str | None = None,
                 retry_ms: int | None = None) -> bytes:
    """One SSE frame carrying ``data`` (possibly multi-line)."""
    parts = []
    if event is not None:
        _check_field("event", event)
        parts.append(f"event: {event}\n")
    if id is not None:
        _check_field("id", id)
        if "\0" in id:
            raise ValueError("SSE id must not contain NUL")
        parts.append(f"id: {id}\n")
    if retry_ms is not None:
        if retry_ms < 0:
            raise ValueError("SSE retry must be >= 0 ms")
        parts.append(f"retry: {int(retry_ms)}\n")
    if "\n" in data or "\r" in data:
        for line in _LINE_BREAK.split(data):
            parts.append(f"data: {line}\n")
    else:
        parts.append(f"data: {data}\n")
    parts.append("\n")
    return "".join(parts).encode()


def encode_json_event(obj: Any, event: str | None = None) -> bytes:
    """An SSE frame whose data is compact JSON (never multi-line)."""
    data = json.dumps(obj, ensure_ascii=False, separators=(",", ":"))
    if event is None:
        return b"data: " + data.encode() + b"\n\n"
    _check_field("event", event)
    return f"event: {event}\ndata: {data}\n\n".encode()


def encode_comment(text: str = "") -> bytes:
    """A comment frame (keep-alive ping); multi-line text becomes several comment lines."""
    if not text:
        return PING
    return ("".join(f": {line}\n" for line in _LINE_BREAK.split(text)) + "\n").encode()


def encode_ndjson(obj: Any) -> bytes:
    """One newline-delimited JSON record (Ollama's streaming format)."""
    return json.dumps(obj, ensure_ascii=False, separators=(",", ":")).encode() + b"\n"


def decode_events(stream: bytes) -> list[dict[str, str]]:
    """Parse SSE bytes into events ({"event", "data", "id"}) the way a client
    does; the tests and the benchmark use it to check what we send."""
    events = []
    current: dict[str, Any] = {}
    data_lines: list[str] = []
    for line in _LINE_BREAK.split(stream.decode()):
        if line == "":
            if data_lines or current:
                current["data"] = "\n".join(data_lines)
                events.append(current)
            current, data_lines = {}, []
            continue
        if line.startswith(":"):
            continue
        name, _, value = line.partition(":")
        if value.startswith(" "):
            value = value[1:]
        if name == "data":
            data_lines.append(value)
        elif name in ("event", "id", "retry"):
            current[name] = value
    return events
