"""The admin socket: operator routes on a Unix socket, never on TCP.

``flared run`` serves these on ``--admin-socket`` (default
``$XDG_RUNTIME_DIR/flared/admin.sock``, or ``/run/flared/admin.sock`` as
root), mode 0600: whoever can open the socket is the operator, so there is
no token. ``flarectl`` is the client.

    GET  /admin/status            the session snapshot (+ pid, listener, admin path)
    GET  /admin/models            served names and the core's capacities
    POST /admin/pause             new generation requests get 503; admitted ones finish
    POST /admin/resume            reopen admission
    POST /admin/drain?timeout=S   pause, then wait up to S seconds for admitted requests
    GET  /admin/top?since=SEQ     dashboard feed (enables telemetry while polled)
    GET  /metrics                 the same Prometheus text as the main listener

Route handlers run on the daemon's event loop and only call the serving
session's embedding API; they never touch the model thread directly.
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path

from flared.server.http import HttpError, Request, Response, Router

# A drain longer than this is an operator typo; systemd's stop timeout is
# the real bound.
MAX_DRAIN_TIMEOUT_S = 3600.0


def default_admin_socket(env: dict | None = None) -> Path:
    """Where flared run listens and flarectl connects when no path is given."""
    env = os.environ if env is None else env
    runtime_dir = env.get("XDG_RUNTIME_DIR")
    if runtime_dir:
        return Path(runtime_dir) / "flared" / "admin.sock"
    if os.geteuid() == 0:
        return Path("/run/flared/admin.sock")
    return Path(f"/tmp/flared-{os.geteuid()}") / "admin.sock"


def build_admin_router(serving) -> Router:
    from flared.dashboard.telemetry import TelemetryFeed
    from flared.server.metrics import metrics_route

    router = Router()
    feed = TelemetryFeed(serving.loaded.runtime, serving.snapshot)
    serving.admin_feed = feed

    def status_body() -> dict:
        snap = serving.snapshot().to_dict()
        host, port = serving.address
        snap.update(pid=os.getpid(), listen=f"http://{host}:{port}", admin_socket=serving.admin_path,
                    health=dict(zip(("ok", "reason"), serving.loaded.runtime.health())))
        return snap

    async def status(request: Request) -> Response:
        return Response.json(status_body())

    async def models(request: Request) -> Response:
        m = serving.loaded.manifest
        return Response.json({
            "model": m.model_name, "served_names": list(m.served_names), "dtype": m.dtype,
            "architecture": m.architecture, "capacities": dataclasses.asdict(m.capacities),
            "core": str(serving.loaded.core.path), "kv_cache": serving.loaded.runtime.kv_cache_info(),
            "weights": serving.loaded.runtime.weights_info(),
            "lora_adapters": [{"path": p, "scale": s} for p, s in serving.loaded.runtime.lora_adapters]})

    async def pause(request: Request) -> Response:
        serving.pause_admission()
        return Response.json(status_body())

    async def resume(request: Request) -> Response:
        try:
            serving.resume_admission()
        except RuntimeError as e:
            raise HttpError(409, str(e), type="conflict") from None
        return Response.json(status_body())

    async def drain(request: Request) -> Response:
        timeout_s = _float_param(request, "timeout", 30.0)
        serving.pause_admission()
        drained = await serving.wait_for_requests(timeout_s)
        body = status_body()
        body["drained"] = drained
        return Response.json(body, status=200 if drained else 504)

    async def top(request: Request) -> Response:
        since = int(_float_param(request, "since", 0))
        return Response.json(feed.poll(since))

    router.add("GET", "/admin/status", status)
    router.add("GET", "/admin/models", models)
    router.add("POST", "/admin/pause", pause)
    router.add("POST", "/admin/resume", resume)
    router.add("POST", "/admin/drain", drain)
    router.add("GET", "/admin/top", top)
    router.add("GET", "/metrics", metrics_route(serving.metrics))
    return router


def _float_param(request: Request, name: str, default: float) -> float:
    values = request.query.get(name)
    if not values:
        return default
    try:
        v = float(values[0])
    except ValueError:
        raise HttpError(400, f"query parameter '{name}' must be a number") from None
    if not 0 <= v <= (MAX_DRAIN_TIMEOUT_S if name == "timeout" else float(1 << 62)):
        raise HttpError(400, f"query parameter '{name}' is out of range")
    return v
