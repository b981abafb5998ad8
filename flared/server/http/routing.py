"""Routes: (method, path pattern) -> async handler, with per-route policy.

Patterns are literal paths with ``{name}`` (one segment) and ``{name:path}``
(the rest of the path, slashes included: model names such as
``HuggingFaceTB/SmolLM2-135M-Instruct``). Literal patterns are found by one
dict lookup; patterned ones are tried in registration order. Matching runs on
the raw (still percent-encoded) path and parameter values are decoded after,
so an encoded ``%2F`` stays inside its segment instead of splitting it.

HEAD is served by the GET handler (the server drops the body). A path that
exists under other methods answers 405 with an Allow header; an unknown path
404.
"""

from __future__ import annotations

import dataclasses
import re
from urllib.parse import unquote
from collections.abc import Awaitable, Callable
from typing import Union

from flared.server.http.messages import HttpError, Request, Response, StreamingResponse

Handler = Callable[[Request], Awaitable[Union[Response, StreamingResponse]]]

_PARAM = re.compile(r"\{([A-Za-z_][A-Za-z0-9_]*)(?::(path))?\}")


@dataclasses.dataclass(frozen=True, slots=True)
class Route:
    method: str
    pattern: str
    handler: Handler
    # Public routes skip the bearer-token check (/health, /metrics).
    public: bool = False
    # Admitted routes run the server's admission hook before the body is read
    # (generation routes: the permit bounds queued + active requests).
    admit: bool = False
    # The handler reads the body itself through request.stream() instead of
    # receiving it complete.
    stream_body: bool = False
    # The most body bytes this route takes, in place of the server's
    # body_limit_bytes (file uploads); None: the server's.
    body_limit: int | None = None


def _compile(pattern: str) -> re.Pattern[str] | None:
    """Regex for a patterned path, None for a literal one."""
    if not pattern.startswith("/"):
        raise ValueError(f"route pattern must start with '/': {pattern!r}")
    pos, regex, names = 0, [], set()
    for match in _PARAM.finditer(pattern):
        name = match.group(1)
        if name in names:
            raise ValueError(f"duplicate parameter {name!r} in {pattern!r}")
        names.add(name)
        regex.append(re.escape(pattern[pos:match.start()]))
        regex.append(f"(?P<{name}>.+)" if match.group(2) else f"(?P<{name}>[^/]+)")
        pos = match.end()
    if not names:
        if "{" in pattern or "}" in pattern:
            raise ValueError(f"malformed parameter in route pattern {pattern!r}")
        return None
    regex.append(re.escape(pattern[pos:]))
    return re.compile("".join(regex))


class Router:
    def __init__(self) -> None:
        self._literal: dict[str, dict[str, Route]] = {}
        # (compiled pattern, pattern text, method -> route), in registration order
        self._patterned: list[tuple[re.Pattern[str], str, dict[str, Route]]] = []

    def add(self, methods: str | tuple[str, ...] | list[str], pattern: str, handler: Handler, *,
            public: bool = False, admit: bool = False, stream_body: bool = False,
            body_limit: int | None = None) -> None:
        if isinstance(methods, str):
            methods = (methods,)
        regex = _compile(pattern)
        if regex is None:
            table = self._literal.setdefault(pattern, {})
        else:
            for _, text, existing in self._patterned:
                if text == pattern:
                    table = existing
                    break
            else:
                table = {}
                self._patterned.append((regex, pattern, table))
        for method in methods:
            method = method.upper()
            if method in table:
                raise ValueError(f"route {method} {pattern} registered twice")
            table[method] = Route(method, pattern, handler, public, admit, stream_body, body_limit)

    def route(self, methods: str | tuple[str, ...], pattern: str, **policy: bool) -> Callable[[Handler], Handler]:
        def register(handler: Handler) -> Handler:
            self.add(methods, pattern, handler, **policy)
            return handler
        return register

    def get(self, pattern: str, **policy: bool) -> Callable[[Handler], Handler]:
        return self.route("GET", pattern, **policy)

    def post(self, pattern: str, **policy: bool) -> Callable[[Handler], Handler]:
        return self.route("POST", pattern, **policy)

    def _table(self, path: str) -> tuple[dict[str, Route] | None, dict[str, str]]:
        table = self._literal.get(path)
        if table is not None:
            return table, {}
        for regex, _, table in self._patterned:
            match = regex.fullmatch(path)
            if match is not None:
                params = match.groupdict()
                for name, value in params.items():
                    if "%" in value:
                        params[name] = unquote(value)
                return table, params
        return None, {}

    def allowed_methods(self, path: str) -> list[str]:
        """Methods the path answers (HEAD wherever GET is; OPTIONS always); empty if unknown."""
        table, _ = self._table(path)
        if table is None:
            return []
        methods = set(table)
        if "GET" in methods:
            methods.add("HEAD")
        methods.add("OPTIONS")
        return sorted(methods)

    def resolve(self, method: str, path: str) -> tuple[Route, dict[str, str]]:
        """The route for (method, raw path) and its decoded parameters; HttpError 404/405 otherwise."""
        table, params = self._table(path)
        if table is None:
            raise HttpError(404, f"no route for {path}", type="not_found_error", code="not_found")
        route = table.get(method)
        if route is None and method == "HEAD":
            route = table.get("GET")
        if route is None:
            allow = ", ".join(self.allowed_methods(path))
            raise HttpError(405, f"method {method} is not allowed on {path} (allowed: {allow})",
                            code="method_not_allowed", headers=[(b"allow", allow.encode())])
        return route, params
