"""Hostile JSON bodies on every route docs/openapi.json lists: each route's valid example, then mutated
(wrong types, huge numbers, deep nesting, invalid UTF-8, enormous strings, missing or unknown fields).

The daemon answers 2xx when the mutation is still valid, else a 4xx with a JSON error; never a 5xx,
never a hang, and it keeps serving."""

from __future__ import annotations

import json
import os
import socket
from pathlib import Path

from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

SLOW = os.environ.get("FLARED_SLOW_TESTS") == "1"
FUZZ = settings(max_examples=int(os.environ.get("FLARED_FUZZ_EXAMPLES", 800 if SLOW else 120)), deadline=None, derandomize=True, database=None,
                suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
OPENAPI = json.loads((Path(__file__).resolve().parents[2] / "docs" / "openapi.json").read_text())


def _resolve(schema: dict) -> dict:
    while "$ref" in schema:
        name = schema["$ref"].rsplit("/", 1)[1]
        schema = OPENAPI["components"]["schemas"][name]
    return schema


def _json_routes() -> list[tuple[str, dict, dict]]:
    """(path, example body, resolved schema) for every route with a JSON request body."""
    out = []
    for path, item in OPENAPI["paths"].items():
        for method, op in item.items():
            if method == "post" and "application/json" in op.get("requestBody", {}).get("content", {}):
                content = op["requestBody"]["content"]["application/json"]
                example = dict(content["example"])
                example["model"] = "tiny"  # the test daemon's served name
                out.append((path, example, _resolve(content["schema"])))
    return out


ROUTES = _json_routes()

scalars = st.one_of(
    st.none(), st.booleans(), st.integers(min_value=-(2 ** 70), max_value=2 ** 70),
    st.floats(allow_nan=False, allow_infinity=False), st.text(max_size=20),
    st.sampled_from(["", "\u0000", "\ud800", "\U0001f600" * 50, "x" * 100_000, -1, 0, 2 ** 31, 2 ** 63, 1e308]))
values = st.recursive(scalars, lambda inner: st.one_of(st.lists(inner, max_size=4),
                                                       st.dictionaries(st.text(max_size=8), inner, max_size=4)),
                      max_leaves=10)


@st.composite
def hostile_bodies(draw) -> tuple[str, bytes]:
    path, example, schema = draw(st.sampled_from(ROUTES))
    body = dict(example)
    fields = sorted(schema.get("properties", {}))
    kind = draw(st.sampled_from(["set", "set", "set", "drop", "extra", "raw"]))
    if kind == "set":
        body[draw(st.sampled_from(fields))] = draw(values)
    elif kind == "drop":
        body.pop(draw(st.sampled_from(sorted(body))))
    elif kind == "extra":
        body[draw(st.text(min_size=1, max_size=12))] = draw(values)
    text = json.dumps(body, ensure_ascii=draw(st.booleans())).encode("utf-8", "surrogatepass")
    if kind == "raw":
        field = draw(st.sampled_from(fields))
        raw = draw(st.sampled_from([
            b"[" * 100_000 + b"]" * 100_000,  # nesting far past any recursion limit
            b'{"a":' * 50_000 + b"1" + b"}" * 50_000,
            b"[" * 900 + b"]" * 900,  # just under the decoder's limit: our own code must cope
            b'{"type":"object","properties":' * 400 + b"{}" + b"}" * 400,
            b"1e999", b"-1e999", b"NaN", b"Infinity", b"123456789012345678901234567890",
            b'"\xff\xfe\xc3\x28"',  # invalid UTF-8 inside a string
            b'"\\ud800\\udc00\\ud800"',  # a lone surrogate escape
        ]))
        text = text[:-1] + b', "' + field.encode() + b'": ' + raw + b"}"
        if draw(st.booleans()):
            text = text[: draw(st.integers(min_value=1, max_value=len(text)))]  # truncated document
    return path, text


def _post(port: int, path: str, data: bytes, read_response):
    with socket.create_connection(("127.0.0.1", port)) as s:
        s.sendall(b"POST " + path.encode() + b" HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                  b"Connection: close\r\nContent-Length: %d\r\n\r\n" % len(data) + data)
        return read_response(s, 120.0)


# Routes whose example cannot succeed on the test daemon: path -> (status, what the error body says).
EXPECTED_REFUSALS = {
    # fill-in-the-middle tokens, which the test model lacks
    "/infill": (400, b"fill-in-the-middle"),
    # relevance judgments need single "yes" and "no" tokens the test model's vocabulary lacks
    **dict.fromkeys(("/v1/rerank", "/rerank", "/v1/score"), (400, b"no single token for 'yes' and 'no'")),
    # a batch names an uploaded file (tests/api/test_batches.py runs them): the example's is not there
    "/v1/batches": (404, b"no file"),
    # runtime LoRA loading is off on the test daemon (tests/model/test_lora.py turns it on)
    **dict.fromkeys(("/v1/load_lora_adapter", "/v1/unload_lora_adapter"), (400, b"--allow-runtime-lora-updating")),
    # Ollama's model management, which one prepared model does not do
    **dict.fromkeys(("/api/create", "/api/copy", "/api/push"), (400, b"not supported")),
}


def test_every_json_route_answers_its_example(raw_http):
    for path, example, _ in ROUTES:
        got = _post(raw_http.daemon.port, path, json.dumps(example).encode(), raw_http.read_response)
        status, says = EXPECTED_REFUSALS.get(path, (200, b""))
        assert got is not None and got[0] == status and says in got[2], (path, got)


@FUZZ
@given(case=hostile_bodies())
def test_mutated_bodies_get_2xx_or_a_json_4xx(raw_http, case):
    path, data = case
    got = _post(raw_http.daemon.port, path, data, raw_http.read_response)
    assert got is not None, (path, data[:200], raw_http.daemon.log()[-2000:])
    status, headers, payload = got
    event(f"status {status}")
    if status >= 300:
        raw_http.assert_error_shape(status, headers, payload)
    raw_http.assert_serving()


def test_regressions_deep_nesting_and_lone_surrogates_are_400(raw_http):
    """Both were 500s: RecursionError in the decoder; the tokenizer failing on an unpaired surrogate."""
    cases = [
        ("/v1/chat/completions", b'{"model": "tiny", "messages": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"),
        ("/v1/messages/count_tokens", b'{"model": "tiny", "messages": [{"role": "user", "content": "hi"}], '
                                      b'"system": "\\ud800"}'),
        ("/v1/chat/completions", b'{"model": "tiny", "messages": [{"role": "user", "content": "a\\udfffb"}]}'),
    ]
    for path, data in cases:
        got = _post(raw_http.daemon.port, path, data, raw_http.read_response)
        assert got is not None and got[0] == 400, (path, got)
        raw_http.assert_error_shape(*got)
    # A proper pair still decodes to one character and is served.
    ok = b'{"model": "tiny", "messages": [{"role": "user", "content": "\\ud83d\\ude00"}], "max_tokens": 2}'
    got = _post(raw_http.daemon.port, "/v1/chat/completions", ok, raw_http.read_response)
    assert got is not None and got[0] == 200, got
