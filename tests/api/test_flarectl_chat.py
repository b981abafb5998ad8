"""`flarectl chat`, the terminal chat client (flared.cli.chat), driven through a pipe against the tool model's
daemon: with thinking off it answers "It is sunny in Paris." (tests/api/conftest.py)."""

from __future__ import annotations

import subprocess
import sys

ANSWER = "It is sunny in Paris."


def _chat(daemon, stdin: str, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "flared.cli.ctl", "chat", "--url", daemon.base, *args],
                          input=stdin, capture_output=True, text=True, timeout=120)


def test_a_scripted_conversation(daemon):
    script = "\n".join([
        "What is the weather in Paris?",
        "",  # empty lines are skipped
        "/set temperature 0",
        "/show",
        '"""', "What is the weather", "in Paris?", '"""',
        "/clear",
        "/system Be brief.",
        "What is the weather in Paris?",
        "/nonsense",
        "/bye",
        "never sent",
    ]) + "\n"
    done = _chat(daemon, script, "--model", "tiny", "--no-think", "--temperature", "0")
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert lines.count(ANSWER) == 3 and "(conversation cleared)" in lines and "(system prompt set)" in lines
    assert "(temperature = 0)" in lines
    assert any(line.startswith("model tiny;") and "2 messages" in line for line in lines)  # one exchange so far
    assert "unknown command /nonsense" in done.stderr and "never sent" not in done.stdout


def test_the_model_is_found_and_errors_are_reported(daemon):
    done = _chat(daemon, "What is the weather in Paris?\n", "--no-think", "--temperature", "0")
    assert done.returncode == 0 and done.stdout.strip() == ANSWER  # the first model the server lists
    bad = _chat(daemon, "hi\n", "--model", "tiny", "--max-tokens", "100000")
    assert bad.returncode == 1 and "error: 400" in bad.stderr and "context" in bad.stderr
    gone = _chat(daemon, "hi\n", "--url", "http://127.0.0.1:9")  # nothing listens there
    assert gone.returncode == 1 and "cannot reach" in gone.stderr
