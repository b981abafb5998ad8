"""The HTTP transport of the daemon: h11 on uvloop, routing, SSE/NDJSON streaming.

Routes that generate (OpenAI, Anthropic, Ollama adapters) plug into this layer
through ``Router``; see docs/api.md for the wire contract.
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
