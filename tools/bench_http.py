#!/usr/bin/env python3
"""HTTP layer benchmark: flared's transport against uvicorn (h11, uvloop).

Both servers run in their own processes and serve the same two endpoints,
written once for each:

- ``POST /echo``: parse a small JSON body, answer a small JSON document;
- ``GET /sse?n=N``: stream N small SSE events as fast as the client reads.

The client lives in this process (uvloop, raw asyncio protocols, no HTTP
library) and measures, per server, in the same run:

- requests/s over keep-alive connections (``--connections`` clients, one
  request in flight each: no pipelining);
- SSE events/s delivered to ``--streams`` concurrent streaming clients.

The result is the ratio flared / uvicorn (>= 1.0 means at least uvicorn's
rate). Each measurement alternates servers over ``--rounds`` rounds and keeps
the best round of each, which damps noise from other work on the machine.
Prints a table; with ``--json`` the last line is one JSON object.

    .venv/bin/python tools/bench_http.py [--duration-s 3] [--json]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import subprocess
import sys
import time

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ECHO_BODY = json.dumps({"model": "bench", "messages": [{"role": "user", "content": "hello"}]}).encode()


# -- servers (run in child processes) --------------------------------------------------
def _event_payload(index: int) -> dict:
    return {"id": "chatcmpl-bench", "choices": [{"index": 0, "delta": {"content": "tok"}}], "n": index}


def serve_flared(sock: socket.socket) -> None:
    import uvloop

    sys.path.insert(0, REPO_ROOT)
    from flared.server.http import HttpConfig, HttpServer, Response, Router, StreamingResponse
    from flared.server.http import sse

    router = Router()

    @router.post("/echo")
    async def echo(request):
        body = request.json()
        return Response.json({"object": "echo", "num_messages": len(body["messages"])})

    @router.get("/sse")
    async def stream(request):
        num_events = int(request.query["n"][0])

        async def produce(writer):
            for index in range(num_events):
                await writer.write(sse.encode_json_event(_event_payload(index)))
            await writer.write(sse.DONE)

        return StreamingResponse(produce)

    async def main() -> None:
        server = HttpServer(router, HttpConfig(max_connections=4096, keep_alive_timeout_s=60.0))
        await server.start(sock=sock)
        print("READY", flush=True)
        await asyncio.Event().wait()

    uvloop.run(main())


def serve_uvicorn(sock: socket.socket) -> None:
    import uvicorn

    async def app(scope, receive, send):
        if scope["type"] != "http":
            return
        if scope["path"] == "/echo":
            body = b""
            while True:
                message = await receive()
                body += message.get("body", b"")
                if not message.get("more_body"):
                    break
            parsed = json.loads(body)
            out = json.dumps({"object": "echo", "num_messages": len(parsed["messages"])},
                             separators=(",", ":")).encode()
            await send({"type": "http.response.start", "status": 200,
                        "headers": [(b"content-type", b"application/json"),
                                    (b"content-length", str(len(out)).encode())]})
            await send({"type": "http.response.body", "body": out})
        elif scope["path"] == "/sse":
            num_events = int(scope["query_string"].decode().partition("n=")[2])
            await send({"type": "http.response.start", "status": 200,
                        "headers": [(b"content-type", b"text/event-stream"), (b"cache-control", b"no-cache")]})
            for index in range(num_events):
                frame = b"data: " + json.dumps(_event_payload(index), separators=(",", ":")).encode() + b"\n\n"
                await send({"type": "http.response.body", "body": frame, "more_body": True})
            await send({"type": "http.response.body", "body": b"data: [DONE]\n\n"})

    config = uvicorn.Config(app, http="h11", loop="uvloop", lifespan="off", log_level="warning",
                            access_log=False, timeout_keep_alive=60)
    server = uvicorn.Server(config)

    async def main() -> None:
        config.load()
        server.lifespan = config.lifespan_class(config)
        await server.startup(sockets=[sock])
        print("READY", flush=True)
        await server.main_loop()

    import uvloop

    uvloop.run(main())


class ServerProcess:
    def __init__(self, kind: str):
        self.kind = kind
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(1024)
        self.address = self.sock.getsockname()
        self.sock.set_inheritable(True)
        self.process = subprocess.Popen(
            [sys.executable, os.path.abspath(__file__), "--serve", kind, "--fd", str(self.sock.fileno())],
            pass_fds=(self.sock.fileno(),), stdout=subprocess.PIPE, text=True, cwd=REPO_ROOT)
        line = self.process.stdout.readline()
        if line.strip() != "READY":
            self.stop()
            raise RuntimeError(f"{kind} server did not start: {line!r}")
        self.sock.close()

    def cpu_s(self) -> float:
        """CPU seconds (user + system) the server process has used so far."""
        with open(f"/proc/{self.process.pid}/stat") as stat:
            fields = stat.read().rpartition(")")[2].split()
        # fields after the command name start at field 3 (state): utime is 14, stime 15
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")

    def stop(self) -> None:
        self.process.terminate()
        try:
            self.process.wait(10)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()


# -- client --------------------------------------------------------------------------------
class _EchoClient(asyncio.Protocol):
    """One keep-alive connection sending the next request when the last answer is complete."""

    def __init__(self, request: bytes, deadline: float, done: asyncio.Future):
        self.request = request
        self.deadline = deadline
        self.done = done
        self.buffer = b""
        self.num_responses = 0
        self.num_errors = 0

    def connection_made(self, transport):
        self.transport = transport
        transport.write(self.request)

    def data_received(self, data):
        self.buffer += data
        while True:
            head_end = self.buffer.find(b"\r\n\r\n")
            if head_end < 0:
                return
            start = self.buffer.find(b"content-length:", 0, head_end)
            if start < 0:
                start = self.buffer.find(b"Content-Length:", 0, head_end)
            length = int(self.buffer[start + 15:self.buffer.find(b"\r\n", start)])
            end = head_end + 4 + length
            if len(self.buffer) < end:
                return
            if not self.buffer.startswith(b"HTTP/1.1 200"):
                self.num_errors += 1
            self.buffer = self.buffer[end:]
            self.num_responses += 1
            if time.perf_counter() >= self.deadline:
                self.transport.close()
                return
            self.transport.write(self.request)

    def connection_lost(self, exc):
        if not self.done.done():
            self.done.set_result(None)


class _SseClient(asyncio.Protocol):
    """One connection that streams /sse again and again, counting events (blank lines)."""

    def __init__(self, request: bytes, deadline: float, done: asyncio.Future):
        self.request = request
        self.deadline = deadline
        self.done = done
        self.num_events = 0
        self.num_streams = 0
        self.tail = b""

    def connection_made(self, transport):
        self.transport = transport
        transport.write(self.request)

    def data_received(self, data):
        # Chunk framing never holds "\n\n" (it is "\r\n"), and every SSE frame
        # ends with exactly one, so blank lines count events; [DONE] included.
        joined = self.tail + data
        self.num_events += joined.count(b"\n\n") - self.tail.count(b"\n\n")
        self.tail = joined[-8:]
        if joined.endswith(b"\r\n0\r\n\r\n"):
            self.num_streams += 1
            self.tail = b""
            if time.perf_counter() >= self.deadline:
                self.transport.close()
                return
            self.transport.write(self.request)

    def connection_lost(self, exc):
        if not self.done.done():
            self.done.set_result(None)


async def _run_clients(factory, address, num_clients: int, duration_s: float) -> tuple[list, float]:
    loop = asyncio.get_running_loop()
    started = time.perf_counter()
    deadline = started + duration_s
    clients, waits = [], []
    for _ in range(num_clients):
        done = loop.create_future()
        _, protocol = await loop.create_connection(lambda: factory(deadline, done), *address)
        clients.append(protocol)
        waits.append(done)
    await asyncio.wait_for(asyncio.gather(*waits), timeout=duration_s + 30)
    return clients, time.perf_counter() - started


def measure_rps(address, num_connections: int, duration_s: float) -> tuple[float, int]:
    request = (b"POST /echo HTTP/1.1\r\nHost: bench\r\nContent-Type: application/json\r\n"
               b"Content-Length: %d\r\n\r\n%s" % (len(ECHO_BODY), ECHO_BODY))
    clients, elapsed_s = asyncio.run(_run_clients(lambda d, f: _EchoClient(request, d, f), address,
                                                  num_connections, duration_s))
    return sum(c.num_responses for c in clients) / elapsed_s, sum(c.num_errors for c in clients)


def measure_sse(address, num_streams: int, events_per_stream: int, duration_s: float) -> tuple[float, int]:
    request = b"GET /sse?n=%d HTTP/1.1\r\nHost: bench\r\n\r\n" % events_per_stream
    clients, elapsed_s = asyncio.run(_run_clients(lambda d, f: _SseClient(request, d, f), address,
                                                  num_streams, duration_s))
    return sum(c.num_events for c in clients) / elapsed_s, sum(c.num_streams for c in clients)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--duration-s", type=float, default=3.0, help="length of one measurement")
    parser.add_argument("--rounds", type=int, default=2, help="alternating rounds per server; best kept")
    parser.add_argument("--connections", type=int, default=16, help="keep-alive clients for requests/s")
    parser.add_argument("--streams", type=int, default=64, help="concurrent SSE clients")
    parser.add_argument("--events-per-stream", type=int, default=500)
    parser.add_argument("--json", action="store_true", help="print one JSON object as the last line")
    parser.add_argument("--serve", choices=("flared", "uvicorn"), help=argparse.SUPPRESS)
    parser.add_argument("--fd", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()

    if args.serve:
        sock = socket.socket(fileno=args.fd)
        (serve_flared if args.serve == "flared" else serve_uvicorn)(sock)
        return

    import uvloop

    asyncio.set_event_loop_policy(uvloop.EventLoopPolicy())
    best: dict[str, dict[str, float]] = {"flared": {}, "uvicorn": {}}
    errors = 0

    def keep(kind: str, key: str, value: float) -> None:
        best[kind][key] = max(best[kind].get(key, 0.0), value)

    for _ in range(args.rounds):
        for kind in ("flared", "uvicorn"):
            server = ServerProcess(kind)
            try:
                measure_rps(server.address, args.connections, 0.5)  # warm up
                cpu_start_s = server.cpu_s()
                rps, num_errors = measure_rps(server.address, args.connections, args.duration_s)
                rps_cpu_s = server.cpu_s() - cpu_start_s
                cpu_start_s = server.cpu_s()
                events_per_s, num_streams = measure_sse(server.address, args.streams, args.events_per_stream,
                                                        args.duration_s)
                sse_cpu_s = server.cpu_s() - cpu_start_s
            finally:
                server.stop()
            errors += num_errors
            if num_streams == 0:
                raise RuntimeError(f"{kind}: no SSE stream completed")
            keep(kind, "rps", rps)
            keep(kind, "requests_per_cpu_s", rps * args.duration_s / max(rps_cpu_s, 1e-3))
            keep(kind, "sse_events_per_s", events_per_s)
            keep(kind, "sse_events_per_cpu_s", events_per_s * args.duration_s / max(sse_cpu_s, 1e-3))

    # Per wall second depends on what else the machine runs (the client
    # shares it too); per server CPU second is the cost of the layer itself.
    rows = [
        ("requests/s, small JSON, keep-alive", "rps", f"{args.connections} connections"),
        ("  requests per server CPU-s", "requests_per_cpu_s", ""),
        ("SSE events/s", "sse_events_per_s", f"{args.streams} streams x {args.events_per_stream} events"),
        ("  SSE events per server CPU-s", "sse_events_per_cpu_s", ""),
    ]
    result = {"benchmark": "http", "duration_s": args.duration_s, "rounds": args.rounds,
              "connections": args.connections, "streams": args.streams,
              "events_per_stream": args.events_per_stream, "cpu_count": os.cpu_count(),
              "load_avg_1m": round(os.getloadavg()[0], 2), "errors": errors}
    print(f"{'measure':38} {'setup':28} {'flared':>12} {'uvicorn':>12} {'ratio':>7}")
    for title, key, setup in rows:
        ours, theirs = best["flared"][key], best["uvicorn"][key]
        ratio = ours / theirs if theirs else float("inf")
        result[f"flared_{key}"] = round(ours, 1)
        result[f"uvicorn_{key}"] = round(theirs, 1)
        result[f"ratio_{key}"] = round(ratio, 3)
        print(f"{title:38} {setup:28} {ours:12.0f} {theirs:12.0f} {ratio:7.2f}")
    print(f"(best of {args.rounds} alternating rounds of {args.duration_s} s; load average {result['load_avg_1m']})")
    if errors:
        print(f"non-200 responses: {errors}")
    if args.json:
        print(json.dumps(result))


if __name__ == "__main__":
    main()
