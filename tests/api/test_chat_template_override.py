"""`flared run --chat-template`: the operator's chat template in place of the core's (vLLM's --chat-template,
llama.cpp's --chat-template-file), given as a file or as the template text itself."""

from __future__ import annotations

import json
import subprocess
import sys
import urllib.request

import pytest
from flared_testing.daemon import Daemon

# ChatML with thinking always off: the tool model then answers "It is sunny in Paris." (tests/api/conftest.py)
PLAIN = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
         "{% if add_generation_prompt %}<|im_start|>assistant\n<think>\n\n</think>\n\n{% endif %}")
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


def _post(daemon, path: str, body: dict) -> dict:
    req = urllib.request.Request(daemon.base + path, data=json.dumps(body).encode(),
                                 headers={"content-type": "application/json"})
    with urllib.request.urlopen(req, timeout=60) as resp:
        return json.loads(resp.read())


@pytest.mark.parametrize("as_file", [True, False])
def test_the_served_template_replaces_the_core_s(tool_core, tmp_path, as_file):
    if as_file:
        path = tmp_path / "plain.jinja"
        path.write_text(PLAIN)
        value = str(path)
    else:
        value = PLAIN
    d = Daemon(tool_core, tmp_path, "--chat-template", value)
    try:
        rendered = _post(d, "/apply-template", {"messages": ASK})["prompt"]
        assert rendered == ("<|im_start|>user\nWhat is the weather in Paris?<|im_end|>\n"
                            "<|im_start|>assistant\n<think>\n\n</think>\n\n")
        # thinking is off in this template whatever the request asks: the plain answer
        out = _post(d, "/v1/chat/completions", {"model": "tiny", "messages": ASK, "temperature": 0, "max_tokens": 8})
        assert out["choices"][0]["message"]["content"] == "It is sunny in Paris."
        with urllib.request.urlopen(d.base + "/props", timeout=30) as resp:
            assert json.loads(resp.read())["chat_template"] == PLAIN
    finally:
        d.kill()


def test_a_value_that_is_neither_file_nor_template_stops_the_start(tool_core, tmp_path):
    cmd = [sys.executable, "-m", "flared.cli.daemon", "run", str(tool_core), "--port", "0", "--no-admin-socket",
           "--no-dashboard", "--chat-template", str(tmp_path / "missing.jinja")]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and "neither a file nor a Jinja template" in done.stderr  # a config error
    bad = tmp_path / "bad.jinja"
    bad.write_text("{% for m in messages %}")
    cmd[-1] = str(bad)
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert done.returncode == 1 and "does not compile" in done.stderr  # found loading the frontend
