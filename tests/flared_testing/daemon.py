"""A real `flared run` subprocess on 127.0.0.1, waited for by its port file.

One class for every test folder that drives the daemon as a user would: it
starts `flared run CORE --port 0 --port-file F` (plus the caller's flags),
waits until the port file holds the bound port (the daemon writes it once it
listens), and offers plain HTTP calls, `flarectl` against its admin socket,
and a clean stop or a kill.
"""

from __future__ import annotations

import http.client
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path


def flarectl(*args: str, timeout_s: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "flared.cli.ctl", *args], capture_output=True, text=True,
                          timeout=timeout_s)


class Daemon:
    """``admin_socket``: serve the admin socket in ``tmp`` (else none)."""

    def __init__(self, core: Path, tmp: Path, *args: str, env: dict | None = None, stdio=None,
                 admin_socket: bool = False, served_name: str = "tiny"):
        stamp = time.monotonic_ns()
        self.port_file = tmp / f"port-{stamp}"
        self.log_path = tmp / f"daemon-{stamp}.log"
        self.admin_socket = tmp / f"admin-{stamp}.sock" if admin_socket else None
        self._log = open(self.log_path, "wb")
        cmd = [sys.executable, "-m", "flared.cli.daemon", "run", str(core), "--port", "0",
               "--port-file", str(self.port_file), "--threads", "1", "--served-name", served_name,
               "--no-dashboard", *args]
        cmd += ["--admin-socket", str(self.admin_socket)] if admin_socket else ["--no-admin-socket"]
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

    def request(self, method: str, path: str, body=None, headers=None, raw: bytes | None = None,
                timeout_s: float = 120):
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=timeout_s)
        try:
            data = raw if raw is not None else (json.dumps(body).encode() if body is not None else None)
            conn.request(method, path, body=data, headers={"content-type": "application/json", **(headers or {})})
            resp = conn.getresponse()
            payload = resp.read()
            try:
                return resp.status, json.loads(payload)
            except ValueError:
                return resp.status, payload
        finally:
            conn.close()

    def chat(self, messages, **kw):
        return self.request("POST", "/v1/chat/completions", {"model": "tiny", "messages": messages, **kw})

    def ctl(self, *args: str, timeout_s: float = 60) -> subprocess.CompletedProcess:
        assert self.admin_socket is not None, "start the daemon with admin_socket=True"
        return flarectl(*args, "--admin-socket", str(self.admin_socket), timeout_s=timeout_s)

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
