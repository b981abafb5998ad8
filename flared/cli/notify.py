"""systemd's notify protocol, written by hand: one datagram per message.

Under ``Type=notify`` systemd sets $NOTIFY_SOCKET (a path, or ``@name`` in
the abstract namespace) and reads newline-separated ``KEY=VALUE`` datagrams:
STATUS= (shown by ``systemctl status``), EXTEND_TIMEOUT_USEC= (keeps a long
load from hitting TimeoutStartSec), READY=1, WATCHDOG=1, STOPPING=1. With
$WATCHDOG_USEC set, the service must send WATCHDOG=1 more often than that or
be killed and restarted. Without $NOTIFY_SOCKET every call is a no-op, so the
daemon runs unchanged outside systemd.

Only the CLI reads the environment; this module gets it passed in.
"""

from __future__ import annotations

import os
import socket


class Notifier:
    def __init__(self, env: dict | None = None):
        env = os.environ if env is None else env
        address = env.get("NOTIFY_SOCKET") or None
        if address and address.startswith("@"):
            address = "\0" + address[1:]  # abstract namespace
        self._address = address
        self._sock: socket.socket | None = None
        if address:
            self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC)
        # The watchdog interval applies to us only when systemd named our pid
        # (or named none).
        usec = env.get("WATCHDOG_USEC")
        pid = env.get("WATCHDOG_PID")
        self.watchdog_usec = int(usec) if usec and usec.isdigit() and (not pid or pid == str(os.getpid())) else 0

    @property
    def enabled(self) -> bool:
        return self._sock is not None

    def send(self, **fields) -> bool:
        """Send KEY=VALUE lines (keyword names are upper-cased); False when not under systemd or on error."""
        if self._sock is None:
            return False
        text = "\n".join(f"{k.upper()}={_one_line(v)}" for k, v in fields.items())
        try:
            self._sock.sendto(text.encode("utf-8", "replace"), self._address)
        except OSError:
            return False  # systemd gone or the socket full: notification is best effort
        return True

    def status(self, text: str, *, extend_timeout_s: float | None = None) -> bool:
        if extend_timeout_s is not None:
            return self.send(status=text, extend_timeout_usec=int(extend_timeout_s * 1e6))
        return self.send(status=text)

    def ready(self, status: str) -> bool:
        return self.send(ready=1, status=status)

    def watchdog(self) -> bool:
        return self.send(watchdog=1)

    def stopping(self, status: str) -> bool:
        return self.send(stopping=1, status=status)

    def close(self) -> None:
        if self._sock is not None:
            self._sock.close()
            self._sock = None


def _one_line(value) -> str:
    return str(value).replace("\n", " ")
