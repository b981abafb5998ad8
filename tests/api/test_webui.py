"""The chat page at / (flared.server.webui): served, public, locked down; its request code (chat.js's parseSSE and
streamChat) run under Node against a daemon with an API key, where Node is installed."""

from __future__ import annotations

import http.client
import json
import shutil
import subprocess
from pathlib import Path

import pytest
from flared_testing.daemon import Daemon

import flared.server.webui

CHAT_JS = Path(flared.server.webui.__file__).with_name("chat.js")


def _get(daemon, path: str, headers: dict | None = None):
    conn = http.client.HTTPConnection("127.0.0.1", daemon.port, timeout=30)
    try:
        conn.request("GET", path, headers=headers or {})
        resp = conn.getresponse()
        return resp.status, {k.lower(): v for k, v in resp.getheaders()}, resp.read()
    finally:
        conn.close()


@pytest.fixture(scope="module")
def keyed(tool_core, tmp_path_factory):
    d = Daemon(tool_core, tmp_path_factory.mktemp("webui"), "--api-key", "k")
    yield d
    d.kill()


BROWSER = {"Accept": "text/html,application/xhtml+xml,application/xml;q=0.9,*/*;q=0.8"}


def test_the_page_and_its_script_are_served_without_a_key(keyed):
    status, headers, body = _get(keyed, "/", BROWSER)
    assert status == 200 and headers["content-type"].startswith("text/html")
    assert _get(keyed, "/ui")[2] == body
    assert _get(keyed, "/")[2] == b"Ollama is running"  # what Ollama's clients probe for
    assert b'<script src="/ui/chat.js"></script>' in body and b"<script>" not in body  # no inline script
    assert "script-src" not in headers["content-security-policy"]  # default-src 'self' covers scripts
    assert "default-src 'self'" in headers["content-security-policy"] and headers["x-content-type-options"] == "nosniff"
    status, headers, body = _get(keyed, "/ui/chat.js")
    assert status == 200 and headers["content-type"].startswith("text/javascript") and b"streamChat" in body
    assert _get(keyed, "/v1/models")[0] == 401  # the API itself still needs the key


def test_no_webui_serves_no_page(tool_core, tmp_path):
    d = Daemon(tool_core, tmp_path, "--no-webui")
    try:
        assert _get(d, "/", BROWSER)[2] == b"Ollama is running"
        assert _get(d, "/ui")[0] == 404 and _get(d, "/ui/chat.js")[0] == 404
    finally:
        d.kill()


NODE_SCRIPT = r"""
const { parseSSE, streamChat } = require(process.argv[2]);
const base = process.argv[3];
(async () => {
  const out = {};
  // events split anywhere, CRLF or LF, comments, multi-line data
  let [ev, rest] = parseSSE('data: {"a":1}\r\n\r\n: ping\n\ndata: x\ndata: y\n\ndata: par');
  out.parsed = [ev, rest];
  [ev, rest] = parseSSE(rest + 'tial\n\n');
  out.parsed2 = [ev, rest];
  let content = "", reasoning = "";
  const ask = [{ role: "user", content: "What is the weather in Paris?" }];
  out.plain = await streamChat({ base, apiKey: "k", model: "tiny", messages: ask, temperature: 0, maxTokens: 40 },
                               (c, r) => { content += c; reasoning += r; });
  out.content = content; out.reasoning = reasoning;
  try {
    await streamChat({ base, apiKey: "wrong", model: "tiny", messages: ask }, () => {});
  } catch (e) { out.unauthorized = e.message; }
  const stop = new AbortController();
  let pieces = 0;
  try {
    await streamChat({ base, apiKey: "k", model: "tiny", maxTokens: 500, signal: stop.signal,
                       messages: [{ role: "user", content: "Sing" }, { role: "assistant", content: "la la" }] },
                     () => { if (++pieces === 3) stop.abort(); });
  } catch (e) { out.aborted = e.name; }
  out.pieces = pieces;
  console.log(JSON.stringify(out));
})().catch((e) => { console.error(e); process.exit(1); });
"""


@pytest.mark.skipif(shutil.which("node") is None, reason="Node.js is not installed")
def test_chat_js_streams_a_chat_under_node(keyed, tmp_path):
    script = tmp_path / "run.js"
    script.write_text(NODE_SCRIPT)
    done = subprocess.run(["node", str(script), str(CHAT_JS), keyed.base], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr
    out = json.loads(done.stdout)
    assert out["parsed"] == [['{"a":1}', "x\ny"], "data: par"] and out["parsed2"] == [["partial"], ""]
    # thinking on (the template's default): the reasoning streams apart from the answer
    # thinking on (the template's default): the reasoning streams apart from the answer; without tools offered the
    # model's tool-call text is plain content
    assert out["reasoning"] == "Let me check the weather."
    assert out["content"] == '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>'
    assert out["plain"]["finish"] == "stop" and out["plain"]["usage"]["completion_tokens"] == 9
    assert out["unauthorized"].startswith("401")
    assert out["aborted"] == "AbortError" and out["pieces"] == 3


@pytest.mark.skipif(shutil.which("node") is None, reason="Node.js is not installed")
def test_the_attach_button_offers_what_the_model_takes(tmp_path):
    """chat.js's attachKinds under Node: the button's label and the file types for images, videos, audio, and a
    model of all three (Gemma 4)."""
    script = tmp_path / "kinds.js"
    script.write_text("const { attachKinds } = require(process.argv[2]);\n"
                      "console.log(JSON.stringify(JSON.parse(process.argv[3]).map(attachKinds)));\n")
    cases = [{}, {"vision": True}, {"vision": True, "video": True}, {"audio": True},
             {"vision": True, "video": True, "audio": True}]
    done = subprocess.run(["node", str(script), str(CHAT_JS), json.dumps(cases)], capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 0, done.stderr
    got = json.loads(done.stdout)
    assert [k["show"] for k in got] == [False, True, True, True, True]
    assert [k["label"] for k in got[1:]] == ["Image", "Image/video", "Audio", "Image/video/audio"]
    assert got[3]["accept"].split(",")[0] == "audio/wav" and "video/" not in got[1]["accept"]
    every = got[4]["accept"].split(",")
    assert {"image/png", "video/mp4", "audio/wav", "audio/mpeg"} <= set(every), every
