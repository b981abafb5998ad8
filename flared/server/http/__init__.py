"""The HTTP transport of the daemon: h11 on uvloop, routing, SSE/NDJSON streaming.

Routes that generate (OpenAI, Anthropic, Ollama adapters) plug into this
layer through ``Router``::

    router = Router()

    @router.get("/health", public=True)             # no bearer token needed
    async def health(request: Request) -> Response:
        return Response.json({"status": "ok"})

    @router.post("/v1/chat/completions", admit=True)  # admission hook runs first
    async def chat(request: Request) -> Response | StreamingResponse:
        body = request.json()                        # 400 on bad UTF-8 / JSON
        async def produce(writer: ResponseWriter) -> None:
            request.disconnected.add_callback(cancel_in_scheduler)
            async for chunk in tokens:               # waits while the client is slow
                await writer.send_json_event(chunk)
            await writer.write(sse.DONE)
        return StreamingResponse(produce)

    server = HttpServer(router, HttpConfig(port=8000, api_key=key), admission=reserve_permit)
    await server.start()        # (host, port); port 0 picks a free one
    ...
    await server.close()        # stop accepting, let responses finish, then drop

Modules: ``config`` (HttpConfig), ``messages`` (Request, Response,
StreamingResponse, errors), ``routing`` (Router), ``protocol`` (the h11
connection), ``flow`` (backpressure, disconnects, streamed request bodies),
``writer`` (streaming response bodies), ``sse`` (pure encoders), ``server``
(listener lifecycle, ServerThread).
"""

from flared.server.http.config import HttpConfig
from flared.server.http.flow import Disconnect
from flared.server.http.writer import ResponseWriter
from flared.server.http.messages import (
    ClientDisconnected,
    HttpError,
    Request,
    Response,
    StreamingResponse,
    error_body,
    error_response,
)
from flared.server.http.routing import Route, Router
from flared.server.http.server import HttpServer, HttpStats, ServerThread

__all__ = [
    "ClientDisconnected",
    "Disconnect",
    "HttpConfig",
    "HttpError",
    "HttpServer",
    "HttpStats",
    "Request",
    "Response",
    "ResponseWriter",
    "Route",
    "Router",
    "ServerThread",
    "StreamingResponse",
    "error_body",
    "error_response",
]
