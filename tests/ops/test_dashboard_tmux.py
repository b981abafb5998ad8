"""The terminal dashboard in a real terminal: tmux runs `flared run` (stderr
is its pane) and `flarectl top`; send-keys switches panes and scrolls;
capture-pane reads the screen."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import threading
import time
import urllib.request

import pytest

pytestmark = pytest.mark.skipif(shutil.which("tmux") is None, reason="tmux not installed (apt-get install tmux)")


class Tmux:
    def __init__(self, name: str):
        self.socket = f"flared-ops-{os.getpid()}-{name}"

    def __call__(self, *args: str) -> str:
        return subprocess.run(["tmux", "-L", self.socket, *args], check=True, capture_output=True, text=True,
                              timeout=30).stdout

    def screen(self, target: str) -> str:
        return self("capture-pane", "-p", "-t", target)

    def wait_screen(self, target: str, *needles: str, timeout_s: float = 60.0) -> str:
        deadline = time.monotonic() + timeout_s
        while True:
            text = self.screen(target)
            if all(n in text for n in needles):
                return text
            if time.monotonic() > deadline:
                raise AssertionError(f"{needles} not on screen:\n{text}")
            time.sleep(0.05)  # the dashboard redraws every 500 ms; re-read the pane

    def kill(self) -> None:
        subprocess.run(["tmux", "-L", self.socket, "kill-server"], capture_output=True, timeout=30)


def _chat(port: int, n: int, max_tokens: int = 96) -> None:
    body = json.dumps({"model": "tiny", "messages": [{"role": "user", "content": f"Count to {n}."}],
                       "max_tokens": max_tokens, "ignore_eos": True}).encode()
    req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/chat/completions", data=body,
                                 headers={"content-type": "application/json"})
    with urllib.request.urlopen(req, timeout=120) as resp:
        assert resp.status == 200


def test_dashboard_panes_scroll_and_top(default_core, tmp_path):
    # The embedded model, not the tiny one: request rows come from a 500 ms
    # state sample, and the tiny model can finish a request between two samples
    # on a fast machine, leaving too few rows to scroll.
    port_file, admin = tmp_path / "port", tmp_path / "admin.sock"
    done = tmp_path / "exit-code"
    tmux = Tmux("dash")
    daemon = (f"{sys.executable} -m flared.cli.daemon run {default_core} --port 0 --port-file {port_file} "
              f"--threads 1 --served-name tiny --admin-socket {admin}; echo $? > {done}; sleep 600")
    try:
        tmux("new-session", "-d", "-s", "d", "-x", "120", "-y", "18", daemon)
        deadline = time.monotonic() + 120
        while not (port_file.exists() and port_file.read_text().endswith("\n")):
            assert time.monotonic() < deadline and not done.exists(), tmux.screen("d")
            time.sleep(0.05)  # the daemon writes the port file once it listens
        port = int(port_file.read_text())
        tmux.wait_screen("d", "[overview]", "generation throughput")

        workers = [threading.Thread(target=_chat, args=(port, i)) for i in range(16)]
        for w in workers:
            w.start()
        for w in workers:
            w.join(120)
        overview = tmux.wait_screen("d", "completed / failed          16 / 0")
        assert "reused tokens" in overview and "cached / free pages" in overview
        assert "dropped updates 0" in overview

        # A second wave while the scheduler pane is read: its live and just-retired requests are more rows
        # than fit whenever the pane is looked at (the first wave's retired rows leave after their 10 s of
        # history, which a slow machine can spend before the pane is shown).
        second = [threading.Thread(target=_chat, args=(port, i, 48)) for i in range(16, 32)]
        for w in second:
            w.start()
        tmux("send-keys", "-t", "d", "Tab")
        # finished requests stay while their history lasts ("retired"); more rows than fit: a scroll indicator
        sched = tmux.wait_screen("d", "[scheduler]", "Graphs (last 2 s)", "Requests (sample age", "retired",
                                 "rows 1-", timeout_s=120)
        # Wide terminal: graph rows with max ms and req/call, request rows with prompt/output/bursts.
        assert "req/call" in sched and "bursts" in sched, sched
        assert "decode b" in sched, sched
        tmux("send-keys", "-t", "d", "Down")
        tmux.wait_screen("d", "rows 2-")  # scrolled one row (the rows themselves change as the wave runs)
        tmux("send-keys", "-t", "d", "Left")
        tmux.wait_screen("d", "[overview]")
        for w in second:
            w.join(120)

        # flarectl top: the same dashboard over the admin socket.
        tmux("new-window", "-d", "-t", "d", "-n", "top",
             f"{sys.executable} -m flared.cli.ctl top --admin-socket {admin}; sleep 600")
        tmux.wait_screen("d:top", "[overview]", "completed / failed          32 / 0")
        tmux("send-keys", "-t", "d:top", "Right")
        tmux.wait_screen("d:top", "[scheduler]", "Requests (sample age")
        tmux("send-keys", "-t", "d:top", "q")
        # Ctrl-C in the daemon's terminal is the normal shutdown: exit 0, logs replayed.
        tmux("send-keys", "-t", "d:0", "C-c")
        deadline = time.monotonic() + 60
        while not done.exists() or not done.read_text().strip():
            assert time.monotonic() < deadline, tmux.screen("d:0")
            time.sleep(0.05)  # the shell writes the exit code when flared returns
        assert done.read_text().strip() == "0"
        tail = tmux.wait_screen("d:0", "shutting down")
        assert "listening on http://127.0.0.1" in tail
    finally:
        tmux.kill()
