"""Anthropic's Message Batches API: many /v1/messages requests run in the background, their results as JSONL.

    POST   /v1/messages/batches               {"requests": [{"custom_id", "params"}]} -> a message_batch
    GET    /v1/messages/batches               ?limit=&after_id=&before_id= -> a page, newest first
    GET    /v1/messages/batches/{id}          the batch
    GET    /v1/messages/batches/{id}/results  JSONL, once it has ended
    POST   /v1/messages/batches/{id}/cancel
    DELETE /v1/messages/batches/{id}          once it has ended

As Anthropic serves them, so the anthropic SDK's ``client.messages.batches`` works unchanged. The request list
is checked at creation (1 to 100,000 requests; each ``custom_id`` 1-64 letters, digits, ``_`` or ``-``, unique;
``params`` an object): a bad list is a 400 naming the request. Each request's ``params`` then runs through
/v1/messages' own handler and admission (batch_routes.dispatch), at most the core's concurrency at once; a
request /v1/messages would refuse (or ``stream: true``) ends ``errored`` with that error. Results, in request
order: ``{"custom_id", "result": {"type": "succeeded", "message"}}``, or ``errored`` with ``error``, or
``canceled`` (cancelled before it ran) or ``expired`` (not run within 24 hours). Batches live in memory.
"""

from __future__ import annotations

import asyncio
import re
import time
from dataclasses import dataclass, field

from flared.errors import AdmissionError, ErrorKind
from flared.server.anthropic_routes import _anthropic_errors, anthropic_error
from flared.server.batch_routes import WINDOW_S, _id, dispatch, jsonl, run_lines
from flared.server.http import Request, Response, Router
from flared.server.openai_schema import json_object

MAX_REQUESTS = 100_000
_CUSTOM_ID = re.compile(r"[A-Za-z0-9_-]{1,64}")


def _iso(t: float | None) -> str | None:
    if t is None:
        return None
    return time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(t)) + f".{int(t % 1 * 1e6):06d}Z"


@dataclass
class MessageBatch:
    id: str
    requests: list[dict]
    created_at: float
    status: str = "in_progress"  # then canceling, ended
    results: list[dict | None] = field(default_factory=list)
    ended_at: float | None = None
    cancel_initiated_at: float | None = None
    task: asyncio.Task | None = None

    def counts(self) -> dict:
        kinds = [r["result"]["type"] if r is not None else None for r in self.results]
        return {"processing": kinds.count(None), "succeeded": kinds.count("succeeded"),
                "errored": kinds.count("errored"), "canceled": kinds.count("canceled"),
                "expired": kinds.count("expired")}

    def describe(self, base: str) -> dict:
        return {"id": self.id, "type": "message_batch", "processing_status": self.status,
                "request_counts": self.counts(), "ended_at": _iso(self.ended_at), "created_at": _iso(self.created_at),
                "expires_at": _iso(self.created_at + WINDOW_S), "archived_at": None,
                "cancel_initiated_at": _iso(self.cancel_initiated_at),
                "results_url": f"{base}/v1/messages/batches/{self.id}/results" if self.status == "ended" else None}


class MessageBatchRoutes:
    def __init__(self, state, router: Router):
        self.state = state
        self.router = router
        self.batches: dict[str, MessageBatch] = {}

    def register(self, router: Router) -> None:
        router.add("POST", "/v1/messages/batches", _anthropic_errors(self.create))
        router.add("GET", "/v1/messages/batches", _anthropic_errors(self.list))
        router.add("GET", "/v1/messages/batches/{batch_id}", _anthropic_errors(self.retrieve))
        router.add("DELETE", "/v1/messages/batches/{batch_id}", _anthropic_errors(self.delete))
        router.add("GET", "/v1/messages/batches/{batch_id}/results", _anthropic_errors(self.results))
        router.add("POST", "/v1/messages/batches/{batch_id}/cancel", _anthropic_errors(self.cancel))

    def _base(self, request: Request) -> str:
        """This server as the client reached it (results_url is absolute: the SDK fetches it as given)."""
        return f"{self.state.scheme}://{request.header('host') or '127.0.0.1'}"

    def _batch(self, request: Request) -> MessageBatch:
        b = self.batches.get(request.params["batch_id"])
        if b is None:
            raise AdmissionError(f"no message batch {request.params['batch_id']!r} on this server",
                                 ErrorKind.NOT_FOUND)
        return b

    async def create(self, request: Request) -> Response:
        body = json_object(request)
        requests = body.get("requests")
        if not isinstance(requests, list) or not 1 <= len(requests) <= MAX_REQUESTS:
            raise AdmissionError(f"requests: must be an array of 1 to {MAX_REQUESTS} requests")
        seen = set()
        for i, r in enumerate(requests):
            if not isinstance(r, dict):
                raise AdmissionError(f"requests.{i}: must be an object with custom_id and params")
            cid = r.get("custom_id")
            if not isinstance(cid, str) or not _CUSTOM_ID.fullmatch(cid):
                raise AdmissionError(f"requests.{i}.custom_id: must be 1 to 64 letters, digits, '_' or '-'")
            if cid in seen:
                raise AdmissionError(f"requests.{i}.custom_id: {cid!r} is used by an earlier request")
            seen.add(cid)
            if not isinstance(r.get("params"), dict):
                raise AdmissionError(f"requests.{i}.params: must be an object (a /v1/messages request)")
        b = MessageBatch(_id("msgbatch_"), [{"custom_id": r["custom_id"], "params": r["params"]} for r in requests],
                         time.time())
        b.results = [None] * len(b.requests)
        self.batches[b.id] = b
        b.task = asyncio.get_running_loop().create_task(self._run(b))
        return Response.json(b.describe(self._base(request)))

    async def list(self, request: Request) -> Response:
        q = request.query
        try:
            limit = int(q.get("limit", ["20"])[0])
        except ValueError:
            raise AdmissionError("limit: must be an integer") from None
        if not 1 <= limit <= 1000:
            raise AdmissionError("limit: must be between 1 and 1000")
        items = list(self.batches.values())[::-1]
        ids = [b.id for b in items]
        for name in ("after_id", "before_id"):
            mark = q.get(name, [None])[0]
            if mark is not None and mark not in ids:
                raise AdmissionError(f"{name}: names no message batch ({mark!r})")
        after, before = q.get("after_id", [None])[0], q.get("before_id", [None])[0]
        if before:  # the page just newer than it
            items = items[:ids.index(before)]
            page, more = items[-limit:], len(items) > limit
        else:  # the page just older than after_id, or the newest
            items = items[ids.index(after) + 1:] if after else items
            page, more = items[:limit], len(items) > limit
        base = self._base(request)
        return Response.json({"data": [b.describe(base) for b in page], "has_more": more,
                              "first_id": page[0].id if page else None, "last_id": page[-1].id if page else None})

    async def retrieve(self, request: Request) -> Response:
        return Response.json(self._batch(request).describe(self._base(request)))

    async def cancel(self, request: Request) -> Response:
        b = self._batch(request)
        if b.status == "in_progress":  # the requests running finish; the rest end canceled
            b.status = "canceling"
            b.cancel_initiated_at = time.time()
        return Response.json(b.describe(self._base(request)))

    async def delete(self, request: Request) -> Response:
        b = self._batch(request)
        if b.status != "ended":
            raise AdmissionError(f"message batch {b.id!r} is still {b.status}: cancel it first, or wait until it ends")
        del self.batches[b.id]
        return Response.json({"id": b.id, "type": "message_batch_deleted"})

    async def results(self, request: Request) -> Response:
        b = self._batch(request)
        if b.status != "ended":
            raise AdmissionError(f"message batch {b.id!r} has not ended ({b.status}); its results come once it has")
        return Response(jsonl(b.results), media_type="application/binary")

    def _end(self, b: MessageBatch) -> None:
        kind = "canceled" if b.status == "canceling" else "expired"
        for i, r in enumerate(b.results):
            if r is None:
                b.results[i] = {"custom_id": b.requests[i]["custom_id"], "result": {"type": kind}}
        b.status = "ended"
        b.ended_at = time.time()

    async def _run(self, b: MessageBatch) -> None:
        async def one(i: int) -> None:
            status, answer, _ = await dispatch(self.state, self.router, "/v1/messages", b.requests[i]["params"],
                                               error=anthropic_error)
            if 200 <= status < 300:
                result = {"type": "succeeded", "message": answer}
            else:
                error = answer if isinstance(answer, dict) and answer.get("type") == "error" else {
                    "type": "error", "error": {"type": "api_error", "message": str(answer)}}
                result = {"type": "errored", "error": error}
            b.results[i] = {"custom_id": b.requests[i]["custom_id"], "result": result}

        try:
            await run_lines(self.state, len(b.requests), one,
                            lambda: b.status == "in_progress" and time.time() < b.created_at + WINDOW_S)
        finally:
            self._end(b)

    def close(self) -> None:
        for b in self.batches.values():
            if b.task is not None and not b.task.done():
                b.task.cancel()
