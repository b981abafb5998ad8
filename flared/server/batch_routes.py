"""OpenAI's Files and Batch APIs: a JSONL file of requests run in the background, its answers a file to fetch.

    POST   /v1/files                  multipart/form-data: ``file`` and ``purpose`` -> a file object
    GET    /v1/files                  ?purpose=&limit=&order=&after= -> a list
    GET    /v1/files/{id}             the file object;  DELETE /v1/files/{id}
    GET    /v1/files/{id}/content     the file's bytes
    POST   /v1/batches                {input_file_id, endpoint, completion_window: "24h", metadata} -> a batch
    GET    /v1/batches                ?limit=&after= -> a list, newest first
    GET    /v1/batches/{id}           the batch;  POST /v1/batches/{id}/cancel

As OpenAI (and SGLang) serve them, so ``client.files.create(purpose="batch")`` and ``client.batches.create``
of the openai SDK work unchanged. Each input line is ``{"custom_id", "method": "POST", "url", "body"}``;
``url`` must be the batch's ``endpoint`` (``/v1/chat/completions``, ``/v1/completions``, ``/v1/embeddings``,
``/v1/responses``). A file that is not such lines fails the batch (status ``failed``, ``errors`` names each
bad line) before any request runs. Otherwise every line runs through the same route handler an HTTP request
would reach, with the same admission (a line waits while the server is at its request limit), at most the
core's concurrency at once. An answer with a 2xx status goes to the output file, any other to the error file,
each line ``{"id", "custom_id", "response": {"status_code", "request_id", "body"}, "error": null}`` in input
order. ``stream: true`` in a line is answered 400 on that line. Cancelling stops starting lines; the ones
running finish, and the rest go to the error file with error ``batch_cancelled`` (after the window,
``batch_expired``).

Files and batches live in the daemon's memory (they do not survive a restart): at most FILE_LIMIT_BYTES a
file and STORE_LIMIT_BYTES in all; a batch holds its input file until it ends, and a file another batch
still reads cannot be deleted.
"""

from __future__ import annotations

import asyncio
import json
import re
import secrets
import time
from dataclasses import dataclass, field
from typing import Any

from flared.errors import AdmissionError, ErrorKind, FlareError
from flared.server.http import Request, Response, Router
from flared.server.http.flow import Disconnect
from flared.server.http.messages import HttpError, StreamingResponse, error_response
from flared.server.openai_schema import json_object

FILE_LIMIT_BYTES = 200 * 1000 * 1000  # OpenAI's limit on a batch input file
STORE_LIMIT_BYTES = 1 << 30
MAX_BATCH_LINES = 50_000  # OpenAI's limit on requests in one batch
ENDPOINTS = ("/v1/chat/completions", "/v1/completions", "/v1/embeddings", "/v1/responses")
# what a line of an offline file (flared run-batch) may name, each its own, as vLLM's run-batch takes them
OFFLINE_ENDPOINTS = ENDPOINTS + ("/v1/rerank", "/v1/score", "/v1/messages")
PURPOSES = ("batch", "assistants", "fine-tune", "vision", "user_data", "evals")
WINDOW_S = 24 * 3600  # the one completion window OpenAI offers, "24h"
_FINAL = ("completed", "failed", "expired", "cancelled")


def _id(prefix: str) -> str:
    return prefix + secrets.token_hex(12)


def jsonl(rows: list[dict]) -> bytes:
    return "".join(json.dumps(r, ensure_ascii=False, separators=(",", ":")) + "\n" for r in rows).encode()


def _bad(param: str, message: str) -> AdmissionError:
    err = AdmissionError(f"'{param}' {message}")
    err.param = param
    return err


def _missing(what: str, ident: str, param: str = "id") -> AdmissionError:
    err = AdmissionError(f"no {what} {ident!r} on this server", ErrorKind.NOT_FOUND)
    err.param = param
    return err


@dataclass
class StoredFile:
    id: str
    filename: str
    purpose: str
    data: bytes
    created_at: int

    def describe(self) -> dict:
        return {"id": self.id, "object": "file", "bytes": len(self.data), "created_at": self.created_at,
                "filename": self.filename, "purpose": self.purpose, "status": "processed", "expires_at": None,
                "status_details": None}


@dataclass
class Batch:
    id: str
    endpoint: str | None  # None: an offline file whose lines each name their url
    input_file_id: str
    metadata: dict | None
    created_at: int
    status: str = "validating"
    errors: list | None = None
    output_file_id: str | None = None
    error_file_id: str | None = None
    times: dict = field(default_factory=dict)  # in_progress_at, finalizing_at, completed_at, ...
    total: int = 0
    expired: bool = False  # the window ended before every line had started
    completed: int = 0
    failed: int = 0
    task: asyncio.Task | None = None

    @property
    def expires_at(self) -> int:
        return self.created_at + WINDOW_S

    def describe(self) -> dict:
        out = {"id": self.id, "object": "batch", "endpoint": self.endpoint,
               "errors": None if self.errors is None else {"object": "list", "data": self.errors},
               "input_file_id": self.input_file_id, "completion_window": "24h", "status": self.status,
               "output_file_id": self.output_file_id, "error_file_id": self.error_file_id,
               "created_at": self.created_at, "expires_at": self.expires_at,
               "request_counts": {"total": self.total, "completed": self.completed, "failed": self.failed},
               "metadata": self.metadata}
        for name in ("in_progress_at", "finalizing_at", "completed_at", "failed_at", "expired_at", "cancelling_at",
                     "cancelled_at"):
            out[name] = self.times.get(name)
        return out


_PARAM = re.compile(r';\s*([A-Za-z0-9_*-]+)\s*=\s*(?:"((?:[^"\\]|\\.)*)"|([^;\s]+))')


def _params(header: str) -> dict[str, str]:
    """A header's ``; name=value`` parameters (quoted or not), names lower-cased."""
    return {m.group(1).lower(): m.group(2).replace('\\"', '"') if m.group(2) is not None else m.group(3)
            for m in _PARAM.finditer(header)}


def parse_multipart(content_type: str | None, body: bytes,
                    expected: str = "the 'file' and 'purpose' fields") -> dict[str, tuple[str | None, bytes]]:
    """The fields of a multipart/form-data body (RFC 7578): name -> (filename or None, bytes). The parts are
    found by searching for the boundary, so a 200 MB file costs a few copies, not a line-by-line parse.
    ``expected``: the fields the route reads, as its error names them."""
    if not content_type or not content_type.lower().startswith("multipart/form-data"):
        raise AdmissionError(f"expected a multipart/form-data body ({expected})")
    boundary = _params(content_type).get("boundary")
    if not boundary:
        raise AdmissionError("multipart/form-data without a boundary")
    delimiter = b"--" + boundary.encode("latin-1")
    pos = body.find(delimiter)
    if pos < 0:
        raise AdmissionError("the multipart/form-data body holds no part")
    def next_delimiter(at: int) -> int:
        """Where the next CRLF + delimiter that ends a part starts (followed by CRLF or "--"), or -1."""
        while True:
            at = body.find(b"\r\n" + delimiter, at)
            if at < 0:
                return -1
            j = at + 2 + len(delimiter)
            if body.startswith(b"--", j):
                return at
            while j < len(body) and body[j] in b" \t":  # transport padding
                j += 1
            if body.startswith(b"\r\n", j):
                return at
            at += 2

    fields: dict[str, tuple[str | None, bytes]] = {}
    pos += len(delimiter)
    while not body.startswith(b"--", pos):  # "--" after a delimiter closes the body
        head_end = body.find(b"\r\n\r\n", pos)
        following = next_delimiter(head_end + 2) if head_end >= 0 else -1
        if head_end < 0 or following < 0:
            raise AdmissionError("the multipart/form-data body ends inside a part")
        name = filename = None
        for line in body[pos:head_end].decode("utf-8", "replace").split("\r\n"):
            key, _, value = line.partition(":")
            if key.strip().lower() == "content-disposition":
                params = _params(value)
                name, filename = params.get("name"), params.get("filename")
        if name:
            fields[name] = (filename, body[head_end + 4:following])
        pos = following + 2 + len(delimiter)
    return fields


def _listing(items: list, query: dict, *, limit_max: int, default: int) -> Response:
    """OpenAI's list answer over ``items`` (each with ``id`` and ``describe()``, in listing order): those after the
    ``after`` id, at most ``limit``."""
    after = query.get("after", [None])[0]
    raw = query.get("limit", [str(default)])[0]
    try:
        limit = int(raw)
    except ValueError:
        raise _bad("limit", f"must be an integer, got {raw!r}") from None
    if not 1 <= limit <= limit_max:
        raise _bad("limit", f"must be between 1 and {limit_max}")
    if after:
        ids = [x.id for x in items]
        if after not in ids:
            raise _bad("after", f"names no listed object ({after!r})")
        items = items[ids.index(after) + 1:]
    page = items[:limit]
    return Response.json({"object": "list", "data": [x.describe() for x in page], "has_more": len(items) > limit,
                          "first_id": page[0].id if page else None, "last_id": page[-1].id if page else None})


# Where a line of these routes names no priority, it runs at this one: behind interactive requests (priority 0) for
# free slots and in the scheduler's value per duration, as a batch is the work that can wait.
BATCH_PRIORITY = 1
_PRIORITIZED = ("/v1/chat/completions", "/v1/completions")  # the routes that take vLLM's priority field


def line_body(url: str, body: dict) -> dict:
    """A line's body as it is dispatched: BATCH_PRIORITY where the route takes a priority and the line sets none."""
    if url in _PRIORITIZED and "priority" not in body:
        return {**body, "priority": BATCH_PRIORITY}
    return body


async def dispatch(state, router: Router, url: str, body: dict, *,
                   error=error_response) -> tuple[int, Any, str | None]:
    """One batch line through its route's handler, with the route's admission: (status, body, the answer's id).
    ``error`` renders a failure before the handler answers (the route's own error shape)."""
    if body.get("stream"):
        return 400, json.loads(error(AdmissionError("'stream' is not available in a batch")).body), None
    loop = asyncio.get_running_loop()
    request = Request("POST", url.encode(), url, b"", [(b"content-type", b"application/json")], b"1.1", None,
                      Disconnect(loop))
    request.body = json.dumps(line_body(url, body)).encode()
    release = None
    try:
        route, request.params = router.resolve("POST", url)
        # Wait for room (a 429) or for admission to resume (paused: a 503), as a client would retry; at
        # shutdown the daemon cancels the batch instead.
        while route.admit:
            try:
                release = state.admit(request)
                break
            except FlareError as exc:
                if exc.kind not in (ErrorKind.HTTP_CAPACITY, ErrorKind.UNAVAILABLE):
                    raise
                await asyncio.sleep(0.05)
        response = await route.handler(request)
        if isinstance(response, StreamingResponse):
            raise HttpError(500, "the route answered a stream in a batch", code="internal_error")
    except Exception as exc:  # noqa: BLE001 - every failure becomes that line's error answer
        response = error(exc)
    finally:
        if release is not None:
            release()
    try:
        answer = json.loads(response.body) if response.body else None
    except ValueError:
        answer = response.body.decode("utf-8", "replace")
    rid = answer["id"] if isinstance(answer, dict) and isinstance(answer.get("id"), str) else None
    return response.status, answer, rid


async def run_lines(state, count: int, one, going) -> None:
    """``await one(i)`` for i in 0..count-1, started in order, at most the core's concurrency at once; none starts
    once ``going()`` is false (a cancel, the window's end)."""
    next_index = 0

    async def worker() -> None:
        nonlocal next_index
        while next_index < count and going():
            i = next_index
            next_index += 1
            await one(i)

    concurrency = max(1, int(state.manifest.capacities.concurrency))
    await asyncio.gather(*(worker() for _ in range(min(concurrency, count))))


def _answered(row: dict) -> bool:
    """A result row whose line was answered 2xx (the output file's; the rest go to the error file)."""
    return row["response"] is not None and 200 <= row["response"]["status_code"] < 300


class BatchRoutes:
    def __init__(self, state, router: Router):
        self.state = state
        self.router = router  # the routes each line is dispatched to
        self.files: dict[str, StoredFile] = {}
        self.batches: dict[str, Batch] = {}

    def register(self, router: Router) -> None:
        router.add("POST", "/v1/files", self.upload, body_limit=FILE_LIMIT_BYTES + (1 << 20))
        router.add("GET", "/v1/files", self.list_files)
        router.add("GET", "/v1/files/{file_id}", self.get_file)
        router.add("DELETE", "/v1/files/{file_id}", self.delete_file)
        router.add("GET", "/v1/files/{file_id}/content", self.file_content)
        router.add("POST", "/v1/batches", self.create)
        router.add("GET", "/v1/batches", self.list_batches)
        router.add("GET", "/v1/batches/{batch_id}", self.get_batch)
        router.add("POST", "/v1/batches/{batch_id}/cancel", self.cancel)

    # -- files -------------------------------------------------------------------------------------

    def _add_file(self, filename: str, purpose: str, data: bytes) -> StoredFile:
        f = StoredFile(_id("file-"), filename, purpose, data, int(time.time()))
        self.files[f.id] = f
        return f

    def _file(self, file_id: str, param: str = "file_id") -> StoredFile:
        f = self.files.get(file_id)
        if f is None:
            raise _missing("file", file_id, param)
        return f

    async def upload(self, request: Request) -> Response:
        # a large upload is split off the event loop
        fields = await asyncio.get_running_loop().run_in_executor(None, parse_multipart, request.header("content-type"),
                                                                  request.body or b"")
        if "file" not in fields:
            raise _bad("file", "is required (a multipart field holding the file)")
        if "purpose" not in fields:
            raise _bad("purpose", "is required")
        purpose = fields["purpose"][1].decode("utf-8", "replace").strip()
        if purpose not in PURPOSES:
            raise _bad("purpose", f"must be one of {', '.join(PURPOSES)}; got {purpose!r}")
        filename, data = fields["file"]
        if len(data) > FILE_LIMIT_BYTES:
            raise HttpError(413, f"the file is {len(data)} bytes; at most {FILE_LIMIT_BYTES} are taken",
                            code="file_too_large")
        stored = sum(len(f.data) for f in self.files.values())
        if stored + len(data) > STORE_LIMIT_BYTES:
            raise AdmissionError(f"the server holds {stored} bytes of files and takes at most "
                                 f"{STORE_LIMIT_BYTES} in all: delete some first", ErrorKind.HTTP_CAPACITY)
        return Response.json(self._add_file(filename or "upload", purpose, data).describe())

    async def list_files(self, request: Request) -> Response:
        purpose = request.query.get("purpose", [None])[0]
        order = request.query.get("order", ["desc"])[0]
        if order not in ("asc", "desc"):
            raise _bad("order", "must be 'asc' or 'desc'")
        items = [f for f in self.files.values() if purpose is None or f.purpose == purpose]
        if order == "desc":
            items.reverse()
        return _listing(items, request.query, limit_max=10_000, default=10_000)

    async def get_file(self, request: Request) -> Response:
        return Response.json(self._file(request.params["file_id"]).describe())

    async def file_content(self, request: Request) -> Response:
        f = self._file(request.params["file_id"])
        media = "application/jsonl" if f.filename.endswith(".jsonl") else "application/octet-stream"
        return Response(f.data, media_type=media)

    async def delete_file(self, request: Request) -> Response:
        f = self._file(request.params["file_id"])
        for b in self.batches.values():
            if b.input_file_id == f.id and b.status not in _FINAL:
                raise HttpError(409, f"file {f.id!r} is the input of batch {b.id!r}, which has not ended",
                                code="file_in_use")
        del self.files[f.id]
        return Response.json({"id": f.id, "object": "file", "deleted": True})

    # -- batches -----------------------------------------------------------------------------------

    def _batch(self, batch_id: str) -> Batch:
        b = self.batches.get(batch_id)
        if b is None:
            raise _missing("batch", batch_id, "batch_id")
        return b

    async def create(self, request: Request) -> Response:
        body = json_object(request)
        input_file_id = body.get("input_file_id")
        if not isinstance(input_file_id, str) or not input_file_id:
            raise _bad("input_file_id", "is required (the id of an uploaded file of purpose 'batch')")
        f = self._file(input_file_id, "input_file_id")
        if f.purpose != "batch":
            raise _bad("input_file_id", f"names a file of purpose {f.purpose!r}, not 'batch'")
        endpoint = body.get("endpoint")
        if endpoint not in ENDPOINTS:
            raise _bad("endpoint", f"must be one of {', '.join(ENDPOINTS)}; got {endpoint!r}")
        window = body.get("completion_window", "24h")
        if window != "24h":
            raise _bad("completion_window", f"must be '24h'; got {window!r}")
        metadata = body.get("metadata")
        if metadata is not None:
            if (not isinstance(metadata, dict) or len(metadata) > 16
                    or not all(isinstance(k, str) and len(k) <= 64 and isinstance(v, str) and len(v) <= 512
                               for k, v in metadata.items())):
                raise _bad("metadata", "must be at most 16 string pairs (keys up to 64 characters, values up to 512)")
        b = Batch(_id("batch_"), endpoint, f.id, metadata, int(time.time()))
        self.batches[b.id] = b
        b.task = asyncio.get_running_loop().create_task(self._run(b, f.data))
        return Response.json(b.describe())

    async def list_batches(self, request: Request) -> Response:
        return _listing(list(self.batches.values())[::-1], request.query, limit_max=100, default=20)

    async def get_batch(self, request: Request) -> Response:
        return Response.json(self._batch(request.params["batch_id"]).describe())

    async def cancel(self, request: Request) -> Response:
        b = self._batch(request.params["batch_id"])
        if b.status in _FINAL:
            raise AdmissionError(f"batch {b.id!r} has ended ({b.status}); it cannot be cancelled")
        if b.status != "cancelling":
            b.status = "cancelling"
            b.times["cancelling_at"] = int(time.time())
        return Response.json(b.describe())

    # -- running a batch -----------------------------------------------------------------------------

    def _validate(self, b: Batch, data: bytes) -> list[dict] | None:
        """The input's lines, or None after recording why the file is not a batch (b.errors)."""
        errors, lines, seen = [], [], set()

        def bad(line: int, code: str, message: str, param: str | None = None) -> None:
            errors.append({"code": code, "message": message, "param": param, "line": line})

        try:
            text = data.decode("utf-8")
        except UnicodeDecodeError as exc:
            bad(1, "invalid_file", f"the file is not UTF-8 (invalid byte at offset {exc.start})")
            text = ""
        for number, raw in enumerate(text.splitlines(), 1):
            if not raw.strip():
                continue
            try:
                item = json.loads(raw)
            except json.JSONDecodeError as exc:
                bad(number, "invalid_json_line", f"line {number} is not JSON: {exc.msg}")
                continue
            except (RecursionError, ValueError):
                bad(number, "invalid_json_line", f"line {number} is nested too deeply or holds an invalid number")
                continue
            if not isinstance(item, dict):
                bad(number, "invalid_json_line", f"line {number} is not a JSON object")
                continue
            custom_id = item.get("custom_id")
            if not isinstance(custom_id, str) or not custom_id:
                bad(number, "missing_required_parameter", f"line {number} has no custom_id", "custom_id")
            elif custom_id in seen:
                bad(number, "duplicate_custom_id", f"custom_id {custom_id!r} appears more than once", "custom_id")
            else:
                seen.add(custom_id)
            if item.get("method", "POST") != "POST":
                bad(number, "invalid_method", f"line {number}: method must be POST", "method")
            if b.endpoint is None:  # an offline file (flared run-batch): each line names its own
                if item.get("url") not in OFFLINE_ENDPOINTS:
                    bad(number, "invalid_url", f"line {number}: url {item.get('url')!r} is not one of "
                        f"{', '.join(OFFLINE_ENDPOINTS)}", "url")
            elif item.get("url") != b.endpoint:
                bad(number, "invalid_url", f"line {number}: url {item.get('url')!r} is not the batch's endpoint "
                    f"{b.endpoint!r}", "url")
            if not isinstance(item.get("body"), dict):
                bad(number, "missing_required_parameter", f"line {number} has no body object", "body")
            lines.append(item)
        if not lines and not errors:
            bad(1, "empty_file", "the input file holds no request lines")
        if len(lines) > MAX_BATCH_LINES:
            bad(MAX_BATCH_LINES + 1, "too_many_requests", f"a batch takes at most {MAX_BATCH_LINES} requests")
        if errors:
            b.errors = errors[:1000]
            return None
        return lines

    async def _run(self, b: Batch, data: bytes) -> None:
        # Parsing a large file (up to 200 MB) is a worker thread's job, not the event loop's.
        try:
            lines = await asyncio.get_running_loop().run_in_executor(None, self._validate, b, data)
        except Exception as exc:  # noqa: BLE001 - a batch never stays validating
            b.errors = [{"code": "invalid_file", "message": f"the file could not be read: {type(exc).__name__}",
                         "param": None, "line": None}]
            lines = None
        if lines is None:
            b.status = "failed"
            b.times["failed_at"] = int(time.time())
            return
        rows = await self.execute(b, lines)
        out = [r for r in rows if _answered(r)]
        err = [r for r in rows if not _answered(r)]
        if out:
            b.output_file_id = self._add_file(f"{b.id}_output.jsonl", "batch_output", jsonl(out)).id
        if err:
            b.error_file_id = self._add_file(f"{b.id}_error.jsonl", "batch_output", jsonl(err)).id
        b.status = "cancelled" if b.status == "cancelling" else "expired" if b.expired else "completed"
        b.times[f"{b.status}_at"] = int(time.time())

    async def execute(self, b: Batch, lines: list[dict]) -> list[dict]:
        """Run ``lines`` (validated, each with its ``url``): one result row each, in input order, a line never
        started (cancelled, or past the window) with its ``error``. ``b`` counts them as they end and leaves
        ``status`` cancelling or finalizing (``expired`` set where the window ended first)."""
        b.total = len(lines)
        if b.status != "cancelling":  # a cancel that came while the file was validated holds: no line starts
            b.status = "in_progress"
            b.times["in_progress_at"] = int(time.time())
        results: list[dict | None] = [None] * len(lines)

        async def one(i: int) -> None:
            item = lines[i]
            status, answer, rid = await dispatch(self.state, self.router, item["url"], item["body"])
            results[i] = {"id": _id("batch_req_"), "custom_id": item["custom_id"],
                          "response": {"status_code": status, "request_id": rid or _id("req_"), "body": answer},
                          "error": None}
            if 200 <= status < 300:
                b.completed += 1
            else:
                b.failed += 1

        try:
            await run_lines(self.state, len(lines), one,
                            lambda: b.status != "cancelling" and time.time() < b.expires_at)
        finally:
            if b.status == "in_progress":
                b.expired = time.time() >= b.expires_at
                b.status = "finalizing"
            b.times["finalizing_at"] = int(time.time())
        rows = []
        for item, result in zip(lines, results):
            if result is None:
                cancelled = b.status == "cancelling"
                result = {"id": _id("batch_req_"), "custom_id": item["custom_id"], "response": None,
                          "error": {"code": "batch_cancelled" if cancelled else "batch_expired",
                                    "message": "the batch was cancelled before this request ran" if cancelled
                                    else "the batch's window ended before this request ran"}}
            rows.append(result)
        return rows

    def close(self) -> None:
        """Stop every running batch (the daemon is shutting down)."""
        for b in self.batches.values():
            if b.task is not None and not b.task.done():
                b.task.cancel()


async def run_offline(batches: BatchRoutes, data: bytes, *, report=None,
                      report_every_s: float = 5.0) -> tuple[list[dict] | None, list[dict] | None]:
    """An offline batch file (flared run-batch): each line's ``url`` one of OFFLINE_ENDPOINTS. Returns (result rows
    in input order, None), or (None, the file's errors) when it is not such lines. ``report(done, total)`` is
    called every ``report_every_s`` while it runs."""
    b = Batch(_id("batch_"), None, "", None, int(time.time()))
    lines = await asyncio.get_running_loop().run_in_executor(None, batches._validate, b, data)
    if lines is None:
        return None, b.errors
    run = asyncio.ensure_future(batches.execute(b, lines))
    while not run.done():
        await asyncio.wait([run], timeout=report_every_s)
        if report is not None and not run.done():
            report(b.completed + b.failed, len(lines))
    return run.result(), None

