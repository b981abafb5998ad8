"""flarectl against a live daemon over its admin socket."""

from __future__ import annotations

import json
import os
import socket
import stat

MSGS = [{"role": "user", "content": "Say hello."}]


def test_admin_socket_is_private(ops_daemon):
    mode = os.stat(ops_daemon.admin_socket).st_mode
    assert stat.S_ISSOCK(mode)
    assert stat.S_IMODE(mode) == 0o600


def test_status_json_is_the_session_snapshot(ops_daemon):
    res = ops_daemon.ctl("status", "--json")
    assert res.returncode == 0, res.stderr
    lines = res.stdout.strip().splitlines()
    assert len(lines) == 1
    snap = json.loads(lines[0])
    assert snap["model"] and isinstance(snap["session_id"], int) and snap["sample_monotonic_ns"] > 0
    assert snap["pid"] == ops_daemon.proc.pid
    assert snap["listen"] == f"http://127.0.0.1:{ops_daemon.port}"
    assert snap["http"]["paused"] is False and snap["health"]["ok"] is True
    assert snap["runtime"]["total_pages"] > 0 and "prefix_hits" in snap["runtime"]["counters"]
    human = ops_daemon.ctl("status")
    assert human.returncode == 0 and "state:" in human.stdout and "serving" in human.stdout


def test_models(ops_daemon):
    res = ops_daemon.ctl("models", "--json")
    assert res.returncode == 0, res.stderr
    body = json.loads(res.stdout)
    assert "tiny" in body["served_names"] and body["capacities"]["concurrency"] == 4
    assert body["lora_adapters"] == []  # none merged (tests/model/test_lora.py serves one)
    assert body["kv_cache"]["dtype"] in ("float32", "bfloat16") and body["kv_cache"]["bytes"] > 0
    assert body["kv_cache"]["pages"] == body["capacities"]["kv_pages"]  # a float8 cache would hold more
    human = ops_daemon.ctl("models").stdout
    assert "tiny" in human and f"kv cache:    {body['kv_cache']['dtype']}" in human


def test_pause_gives_503_drain_waits_resume_reopens(ops_daemon):
    # A streaming response admitted before the pause must still finish.
    body = json.dumps({"model": "tiny", "messages": MSGS, "max_tokens": 64, "ignore_eos": True,
                       "stream": True}).encode()
    sock = socket.create_connection(("127.0.0.1", ops_daemon.port))
    sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
                 b"content-length: %d\r\n\r\n" % len(body) + body)
    got = b""
    while b"200 OK" not in got:
        got += sock.recv(65536)

    res = ops_daemon.ctl("pause")
    assert res.returncode == 0 and "paused" in res.stdout, res.stderr
    status, err = ops_daemon.chat(MSGS, max_tokens=2)
    assert status == 503, err
    assert err["error"]["type"] == "unavailable"
    assert ops_daemon.request("GET", "/health")[0] == 200  # paused is not unhealthy

    res = ops_daemon.ctl("drain", "--timeout", "60", "--json")
    assert res.returncode == 0, (res.stdout, res.stderr)
    drained = json.loads(res.stdout)
    assert drained["drained"] is True and drained["http"]["permits_in_use"] == 0 and drained["http"]["paused"]
    while not got.endswith(b"0\r\n\r\n"):  # the admitted stream ran to its end
        chunk = sock.recv(65536)
        assert chunk
        got += chunk
    sock.close()
    assert b"data: [DONE]" in got

    res = ops_daemon.ctl("resume")
    assert res.returncode == 0 and "resumed" in res.stdout, res.stderr
    status, ok = ops_daemon.chat(MSGS, max_tokens=2)
    assert status == 200, ok


def test_metrics_over_the_admin_socket(ops_daemon):
    res = ops_daemon.ctl("metrics")
    assert res.returncode == 0
    assert "# TYPE flare_model_requests_admitted_total counter" in res.stdout
    assert "flare_listener_uptime_seconds" in res.stdout


def test_daemon_not_running_is_a_clear_error(tmp_path, run_flarectl):
    for cmd in ("status", "pause", "drain", "metrics", "top"):
        res = run_flarectl(cmd, "--admin-socket", str(tmp_path / "nobody.sock"))
        assert res.returncode == 3, (cmd, res)
        assert "flared is not running" in res.stderr and "nobody.sock" in res.stderr
        assert "Traceback" not in res.stderr


def test_admin_socket_group_mode(tmp_path):
    import grp

    from flared.runtime.session import bind_admin_socket

    group = grp.getgrgid(os.getgid()).gr_name
    sock = bind_admin_socket(tmp_path / "run" / "admin.sock", group=group)
    try:
        st = os.stat(tmp_path / "run" / "admin.sock")
        assert stat.S_IMODE(st.st_mode) == 0o660 and st.st_gid == os.getgid()
        assert stat.S_IMODE(os.stat(tmp_path / "run").st_mode) == 0o700
        # A live socket is never taken over by a second daemon.
        try:
            bind_admin_socket(tmp_path / "run" / "admin.sock")
        except OSError as e:
            assert "in use" in str(e)
        else:
            raise AssertionError("a second bind succeeded")
    finally:
        sock.close()
    # Once nobody listens, the stale file is replaced.
    bind_admin_socket(tmp_path / "run" / "admin.sock").close()


def test_explicit_admin_socket_in_use_is_an_error(ops_daemon, tiny_core, tmp_path):
    import subprocess
    import sys

    res = subprocess.run([sys.executable, "-m", "flared.cli.daemon", "run", str(tiny_core), "--port", "0",
                          "--threads", "1", "--no-dashboard", "--admin-socket", str(ops_daemon.admin_socket)],
                         capture_output=True, text=True, timeout=120)
    assert res.returncode == 1
    assert "in use by another running daemon" in res.stderr and "Traceback" not in res.stderr
    # The running daemon still owns its socket.
    assert ops_daemon.ctl("status").returncode == 0
