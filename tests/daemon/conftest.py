"""A real `flared run` subprocess on 127.0.0.1, waited for by its port file and /health."""

from __future__ import annotations

import http.client
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest


class Daemon:
    def __init__(self, core: Path, tmp: Path, *args: str, env: dict | None = None):
        self.port_file = tmp / f"port-{time.monotonic_ns()}"
        self.log_path = tmp / f"daemon-{time.monotonic_ns()}.log"
        self._log = open(self.log_path, "wb")
        cmd = [sys.executable, "-m", "flared.cli.daemon", "run", str(core), "--port", "0",
               "--port-file", str(self.port_file), "--threads", "1", "--served-name", "tiny", *args]
        self.proc = subprocess.Popen(cmd, stdout=self._log, stderr=subprocess.STDOUT,
                                     env={**os.environ, **(env or {})})
        self.port = self._wait_port()
        self.base = f"http://127.0.0.1:{self.port}"

    def _wait_port(self, timeout_s: float = 120.0) -> int:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise AssertionError(f"daemon exited with {self.proc.returncode}:\n{self.log()}")
            try:
                text = self.port_file.read_text()
                if text.endswith("\n"):
                    return int(text)
            except FileNotFoundError:
                pass
            time.sleep(0.02)  # polling a file the daemon writes once it listens
        raise AssertionError(f"daemon did not start:\n{self.log()}")

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def request(self, method: str, path: str, body=None, headers=None, raw: bytes | None = None):
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=120)
        try:
            data = raw if raw is not None else (json.dumps(body).encode() if body is not None else None)
            conn.request(method, path, body=data, headers={"content-type": "application/json", **(headers or {})})
            resp = conn.getresponse()
            payload = resp.read()
            try:
                parsed = json.loads(payload)
            except ValueError:
                parsed = payload
            return resp.status, parsed
        finally:
            conn.close()

    def stop(self, sig=signal.SIGTERM, timeout_s: float = 60.0) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
        try:
            return self.proc.wait(timeout_s)
        finally:
            self._log.close()

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        self._log.close()


@pytest.fixture
def start_daemon(tmp_path):
    started: list[Daemon] = []

    def start(core: Path, *args: str, **kw) -> Daemon:
        d = Daemon(core, tmp_path, *args, **kw)
        started.append(d)
        return d

    yield start
    for d in started:
        d.kill()


@pytest.fixture(scope="session")
def daemon_cls():
    """The Daemon class, for module-scoped daemons (conftest modules are not importable)."""
    return Daemon
