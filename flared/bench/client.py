"""One streamed OpenAI chat request over a raw asyncio connection, timed per SSE event.

Rules:
- Times are `time.perf_counter_ns()` taken when the bytes of an event were
  read, so TTFT includes the server's queueing, templating and prefill.
- A token is counted when an event carries content (or reasoning) text; the
  server's `usage.completion_tokens`, when sent, replaces the count because
  one event may carry several tokens.
- Any failure becomes an outcome (`error` set), never an exception: the
  benchmark counts errors by kind instead of dying on the first one.
"""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass, field


@dataclass
class Outcome:
    status: int = 0  # HTTP status; 0 when no response arrived
    error: str | None = None  # "http_<status>", "connect", "timeout", "stream_error", "protocol"
    start_ns: int = 0
    first_token_ns: int = 0
    end_ns: int = 0
    token_times_ns: list[int] = field(default_factory=list)  # one per content event
    text: str = ""
    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    cached_tokens: int | None = None
    done: bool = False  # the stream ended with [DONE]
    finish_reason: str | None = None

    @property
    def num_output_tokens(self) -> int:
        return self.completion_tokens if self.completion_tokens is not None else len(self.token_times_ns)


async def _read_body_chunks(reader: asyncio.StreamReader, headers: dict[str, str]):
    """Yield the response body as it arrives (chunked, sized, or to EOF)."""
    if headers.get("transfer-encoding", "").lower() == "chunked":
        while True:
            size_line = await reader.readline()
            if not size_line:
                raise ConnectionError("eof in chunked body")
            size = int(size_line.split(b";")[0].strip() or b"0", 16)
            if size == 0:
                await reader.readline()
                return
            data = await reader.readexactly(size)
            await reader.readexactly(2)
            yield data
    elif "content-length" in headers:
        remaining = int(headers["content-length"])
        while remaining > 0:
            data = await reader.read(min(remaining, 65536))
            if not data:
                raise ConnectionError("eof in sized body")
            remaining -= len(data)
            yield data
    else:
        while data := await reader.read(65536):
            yield data


def _note_usage(out: Outcome, obj: dict) -> None:
    usage = obj.get("usage")
    if isinstance(usage, dict):
        out.prompt_tokens = usage.get("prompt_tokens", out.prompt_tokens)
        out.completion_tokens = usage.get("completion_tokens", out.completion_tokens)
        details = usage.get("prompt_tokens_details")
        if isinstance(details, dict) and details.get("cached_tokens") is not None:
            out.cached_tokens = details["cached_tokens"]
    timings = obj.get("timings")  # llama.cpp's server reports reuse here
    if isinstance(timings, dict) and out.cached_tokens is None and "cache_n" in timings:
        out.cached_tokens = timings["cache_n"]


def _note_event(out: Outcome, payload: bytes, now_ns: int) -> bool:
    """Apply one SSE data payload; False once the stream is done."""
    if payload.strip() == b"[DONE]":
        out.done = True
        return False
    try:
        obj = json.loads(payload)
    except ValueError:
        out.error = "protocol"
        return False
    if "error" in obj:
        out.error = "stream_error"
        return False
    for choice in obj.get("choices") or ():
        delta = choice.get("delta") or {}
        out.finish_reason = choice.get("finish_reason") or out.finish_reason
        piece = delta.get("content") or delta.get("reasoning_content") or choice.get("text") or ""
        if piece:
            if not out.token_times_ns:
                out.first_token_ns = now_ns
            out.token_times_ns.append(now_ns)
            out.text += piece
    _note_usage(out, obj)
    return True


async def stream_chat(host: str, port: int, path: str, body: dict, *, api_key: str | None,
                      timeout_s: float) -> Outcome:
    out = Outcome(start_ns=time.perf_counter_ns())
    data = json.dumps(body).encode()
    auth = f"Authorization: Bearer {api_key}\r\n" if api_key else ""
    head = (f"POST {path} HTTP/1.1\r\nHost: {host}:{port}\r\nContent-Type: application/json\r\n"
            f"Accept: text/event-stream\r\n{auth}Content-Length: {len(data)}\r\nConnection: close\r\n\r\n")
    writer = None
    try:
        async with asyncio.timeout(timeout_s):
            try:
                reader, writer = await asyncio.open_connection(host, port)
            except OSError:
                out.error = "connect"
                return out
            writer.write(head.encode() + data)
            status_line = await reader.readline()
            parts = status_line.split()
            if len(parts) < 2:
                out.error = "protocol"
                return out
            out.status = int(parts[1])
            headers: dict[str, str] = {}
            while (line := await reader.readline()) not in (b"\r\n", b"\n", b""):
                k, _, v = line.decode("latin-1").partition(":")
                headers[k.strip().lower()] = v.strip()
            if out.status != 200:
                out.error = f"http_{out.status}"
                async for _ in _read_body_chunks(reader, headers):
                    pass
                return out
            buf = b""
            going = True
            async for chunk in _read_body_chunks(reader, headers):
                now = time.perf_counter_ns()
                buf += chunk
                while going and b"\n\n" in buf:
                    event, buf = buf.split(b"\n\n", 1)
                    for line in event.split(b"\n"):
                        if line.startswith(b"data:") and not _note_event(out, line[5:].strip(), now):
                            going = False
                            break
                if not going:
                    break
    except TimeoutError:
        out.error = "timeout"
    except (OSError, ConnectionError, asyncio.IncompleteReadError, ValueError):
        out.error = out.error or "protocol"
    finally:
        out.end_ns = time.perf_counter_ns()
        if writer is not None:
            writer.close()
    return out
