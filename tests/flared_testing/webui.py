"""The chat page's request code (flared/server/webui/chat.js) run under Node, as the page runs it."""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import pytest

NODE_SCRIPT = r"""
const { streamChat, userContent, mediaPart } = require(process.argv[2]);
(async () => {
  let content = "";
  const messages = [{ role: "user", content: userContent(process.argv[5], [process.argv[4]]) }];
  const done = await streamChat({ base: process.argv[3], model: "tiny", messages, temperature: 0, maxTokens: 6 },
                                (c) => { content += c; });
  console.log(JSON.stringify({ content, usage: done.usage, text: userContent("only text", []),
                               mp3: mediaPart("data:audio/mpeg;base64,AAAA"),
                               mp4: mediaPart("data:video/mp4;base64,AAAA") }));
})().catch((e) => { console.error(e); process.exit(1); });
"""


def ask_through_chat_js(daemon, attachment_url: str, text: str, tmp_path) -> dict:
    """One user turn of the attachment (a data URL: image, audio or video) and ``text``, streamed through chat.js's
    userContent and streamChat: {content, usage, text (a text-only turn's content), mp3 and mp4 (an MP3's and an
    MP4's data URL's parts)}. Skips where Node.js is not installed."""
    import flared.server.webui

    if shutil.which("node") is None:
        pytest.skip("Node.js is not installed")
    chat_js = Path(flared.server.webui.__file__).with_name("chat.js")
    script = tmp_path / "run.js"
    script.write_text(NODE_SCRIPT)
    done = subprocess.run(["node", str(script), str(chat_js), daemon.base, attachment_url, text],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)
