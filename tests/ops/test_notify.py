"""sd_notify against a real Unix datagram socket the test binds (as systemd would)."""

from __future__ import annotations

import signal
import socket
import time


def _receive_until(sock: socket.socket, want: str, messages: list[str], timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not any(want in m.split("\n") for m in messages):
        sock.settimeout(max(0.01, deadline - time.monotonic()))
        try:
            messages.append(sock.recv(4096).decode())
        except socket.timeout:
            raise AssertionError(f"no {want} in {messages}") from None


def test_ready_status_watchdog_stopping_in_order(tiny_core, tmp_path, ops_daemon_cls):
    path = tmp_path / "notify.sock"
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind(str(path))
    messages: list[str] = []
    daemon = ops_daemon_cls(tiny_core, tmp_path, env={"NOTIFY_SOCKET": str(path), "WATCHDOG_USEC": "200000"})
    try:
        _receive_until(sock, "READY=1", messages)
        _receive_until(sock, "WATCHDOG=1", messages)
        assert daemon.stop(signal.SIGTERM) == 0
        _receive_until(sock, "STOPPING=1", messages)
    finally:
        daemon.kill()
        sock.close()
    fields = [dict(line.split("=", 1) for line in m.split("\n")) for m in messages]
    ready = next(i for i, f in enumerate(fields) if f.get("READY") == "1")
    stopping = next(i for i, f in enumerate(fields) if f.get("STOPPING") == "1")
    watchdog = [i for i, f in enumerate(fields) if f.get("WATCHDOG") == "1"]
    statuses = [f["STATUS"] for f in fields[:ready] if "STATUS" in f]
    # Startup stages as STATUS=, each extending the start timeout, before READY.
    assert statuses and statuses[0].startswith("opening core")
    assert any(s.startswith("loading weights") for s in statuses)
    assert all("EXTEND_TIMEOUT_USEC" in f for f in fields[:ready])
    assert "serving" in fields[ready]["STATUS"]
    # The watchdog is fed only between READY and STOPPING.
    assert watchdog and ready < watchdog[0] and watchdog[-1] < stopping
    assert stopping == len(fields) - 1


def test_no_notify_socket_means_no_messages(tiny_core, tmp_path):
    from flared.cli.notify import Notifier

    n = Notifier({})
    assert not n.enabled and not n.ready("x") and n.watchdog_usec == 0
    # A watchdog meant for another pid is not ours.
    assert Notifier({"WATCHDOG_USEC": "1000", "WATCHDOG_PID": "1"}).watchdog_usec == 0


def test_a_source_exported_at_start_tells_systemd_and_extends_the_timeout(tiny_hf_llama, tmp_path, ops_daemon_cls):
    """`flared run model-dir` (a checkpoint served directly) exports it before the startup stages: systemd hears
    that as STATUS= with EXTEND_TIMEOUT_USEC=, so a large model's export is not killed by TimeoutStartSec."""
    path = tmp_path / "notify.sock"
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind(str(path))
    messages: list[str] = []
    daemon = ops_daemon_cls(tiny_hf_llama, tmp_path, "--cache-dir", str(tmp_path / "cache"), "--dtype", "float32",
                            env={"NOTIFY_SOCKET": str(path)})
    try:
        _receive_until(sock, "READY=1", messages)
    finally:
        daemon.kill()
        sock.close()
    fields = [dict(line.split("=", 1) for line in m.split("\n")) for m in messages]
    assert fields[0]["STATUS"].startswith(f"exporting {tiny_hf_llama.name} into the cache")
    assert int(fields[0]["EXTEND_TIMEOUT_USEC"]) >= 60 * 10**6
    assert fields[1]["STATUS"].startswith("opening core")
