"""A batch cancelled while its input file is still being validated (flared.server.batch_routes): no line starts,
and it ends cancelled, every line in the error file as batch_cancelled. (The daemon-level test in
tests/api/test_batches.py hits this window only when validation is slow, as on a loaded machine: execute used to
set the batch in_progress over the cancel, and every line then ran.)"""

from __future__ import annotations

import asyncio
import json
from types import SimpleNamespace

from flared.server import batch_routes
from flared.server.batch_routes import Batch, BatchRoutes


def test_a_cancel_during_validation_holds(monkeypatch):
    started = []

    async def dispatch(*args, **kwargs):
        started.append(args)
        return 200, {}, "req"

    monkeypatch.setattr(batch_routes, "dispatch", dispatch)
    state = SimpleNamespace(manifest=SimpleNamespace(capacities=SimpleNamespace(concurrency=4)))
    routes = BatchRoutes(state, router=None)
    lines = [{"custom_id": f"c{i}", "method": "POST", "url": "/v1/completions", "body": {"prompt": "hi"}}
             for i in range(3)]
    validate = routes._validate

    def slow_validate(b, data):  # the cancel request lands while the file is read
        got = validate(b, data)
        b.status, b.times["cancelling_at"] = "cancelling", 1
        return got

    monkeypatch.setattr(routes, "_validate", slow_validate)
    b = Batch("batch_1", "/v1/completions", "file-1", None, created_at=10**10)
    asyncio.run(routes._run(b, "\n".join(json.dumps(line) for line in lines).encode()))
    assert not started
    assert b.status == "cancelled" and "cancelled_at" in b.times and "in_progress_at" not in b.times
    assert b.output_file_id is None
    errors = [json.loads(x) for x in routes.files[b.error_file_id].data.decode().splitlines()]
    assert [e["custom_id"] for e in errors] == ["c0", "c1", "c2"]
    assert all(e["error"]["code"] == "batch_cancelled" for e in errors)
