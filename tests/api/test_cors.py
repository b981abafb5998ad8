"""`flared run --allowed-origins` (config cors_allow_origins): browser apps on those origins may call the API."""

from __future__ import annotations

import http.client
import json

from flared_testing.daemon import Daemon


def _request(daemon, method: str, path: str, headers: dict, body: bytes | None = None):
    conn = http.client.HTTPConnection("127.0.0.1", daemon.port, timeout=60)
    try:
        conn.request(method, path, body=body, headers=headers)
        resp = conn.getresponse()
        return resp.status, {k.lower(): v for k, v in resp.getheaders()}, resp.read()
    finally:
        conn.close()


def test_allowed_origins_get_cors_headers(tool_core, tmp_path):
    d = Daemon(tool_core, tmp_path, "--allowed-origins", "https://app.example, https://other.example",
               "--api-key", "k")
    try:
        status, headers, _ = _request(d, "OPTIONS", "/v1/chat/completions", {
            "Origin": "https://app.example", "Access-Control-Request-Method": "POST",
            "Access-Control-Request-Headers": "authorization,content-type,x-stainless-os"})
        assert status == 204 and headers["access-control-allow-origin"] == "https://app.example"
        assert "POST" in headers["access-control-allow-methods"]
        assert headers["access-control-allow-headers"] == "authorization,content-type,x-stainless-os"
        body = json.dumps({"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2,
                           "stream": True}).encode()
        status, headers, _ = _request(d, "POST", "/v1/chat/completions", {
            "Origin": "https://other.example", "Authorization": "Bearer k", "Content-Type": "application/json"},
            body)
        assert status == 200 and headers["access-control-allow-origin"] == "https://other.example"
        status, headers, _ = _request(d, "GET", "/v1/models", {"Origin": "https://evil.example",
                                                               "Authorization": "Bearer k"})
        assert status == 200 and "access-control-allow-origin" not in headers
    finally:
        d.kill()
