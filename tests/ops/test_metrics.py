"""/metrics on a live daemon: every documented series, counters that move, promtool."""

from __future__ import annotations

import json
import re
import shutil
import socket
import subprocess
import time
from pathlib import Path

import pytest
from flared_testing.rawhttp import read_until_first_token
from prometheus_client.parser import text_string_to_metric_families

REPO = Path(__file__).resolve().parents[2]

MSGS = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Name a colour."}]


def documented_series() -> set[str]:
    text = (REPO / "docs" / "metrics.md").read_text()
    return set(re.findall(r"^\| `(flare_[a-z_]+)", text, flags=re.M))


def scrape(daemon) -> dict[str, list]:
    """name -> samples; counters keyed by their base name (the parser drops _total)."""
    status, body = daemon.request("GET", "/metrics")
    assert status == 200
    families = {}
    for fam in text_string_to_metric_families(body.decode()):
        families[fam.name] = fam.samples
    return families


def value(families, name: str, **labels) -> float:
    base = re.sub(r"_(total|count|sum)$", "", name)
    for s in families[base]:
        if s.name in (name, base) and all(s.labels.get(k) == v for k, v in labels.items()):
            return s.value
    raise KeyError((name, labels))


def wait_for(daemon, pred, timeout_s: float = 30.0):
    deadline = time.monotonic() + timeout_s
    while True:
        fams = scrape(daemon)
        if pred(fams):
            return fams
        assert time.monotonic() < deadline, "condition not reached"
        time.sleep(0.02)  # re-scrape: the model thread updates counters asynchronously


def test_every_documented_series_is_exposed(ops_daemon):
    fams = scrape(ops_daemon)
    documented = documented_series()
    assert len(documented) >= 30
    exposed = set()
    for name, samples in fams.items():
        exposed.add(name)
        exposed.update(s.name for s in samples)
    missing = {n for n in documented if n not in exposed and n.removesuffix("_total") not in exposed}
    assert not missing, missing
    # ...and nothing undocumented (histogram parts aside).
    undocumented = {n for n in fams if n + "_total" not in documented and n not in documented
                    and not n.endswith("_created")}
    assert not undocumented, undocumented
    # No request label anywhere: labels come from closed sets (dtype: the KV cache's element type; quantization: how
    # the weights are kept).
    for samples in fams.values():
        for s in samples:
            assert set(s.labels) <= {"kind", "state", "le", "dtype", "quantization"}, s
    (kv,) = fams["flare_kv_cache_bytes"]
    assert kv.labels["dtype"] in ("float32", "bfloat16") and kv.value > 0
    (weights,) = fams["flare_weight_bytes"]
    assert weights.labels["quantization"] in ("float32", "bfloat16") and weights.value > 0


def test_counters_move_with_traffic(ops_daemon):
    before = scrape(ops_daemon)
    hits0 = value(before, "flare_prefix_hits_total")
    done0 = value(before, "flare_model_requests_completed_total")
    # The same conversation twice: the second reuses the first's prefix.
    for _ in range(2):
        status, body = ops_daemon.chat(MSGS, max_tokens=4, temperature=0)
        assert status == 200, body
    after = wait_for(ops_daemon, lambda f: value(f, "flare_model_requests_completed_total") >= done0 + 2)
    assert value(after, "flare_prefix_hits_total") >= hits0 + 1
    assert value(after, "flare_prefix_reused_tokens_total") > value(before, "flare_prefix_reused_tokens_total")
    assert value(after, "flare_model_requests_admitted_total") >= value(before, "flare_model_requests_admitted_total") + 2
    assert value(after, "flare_generation_tokens_total") >= value(before, "flare_generation_tokens_total") + 8
    assert value(after, "flare_graph_launches_total", kind="decode") > value(before, "flare_graph_launches_total",
                                                                              kind="decode")
    assert value(after, "flare_time_to_first_token_seconds_count") >= value(
        before, "flare_time_to_first_token_seconds_count") + 2
    assert value(after, "flare_request_generation_tokens_sum") >= value(
        before, "flare_request_generation_tokens_sum") + 8
    assert value(after, "flare_request_slots", state="free") + value(after, "flare_request_slots", state="live") \
        + value(after, "flare_request_slots", state="retiring") == 4  # the tiny core's concurrency
    assert value(after, "flare_listener_uptime_seconds") > 0


def _stream_then_disconnect(daemon) -> None:
    body = json.dumps({"model": "tiny", "messages": MSGS, "max_tokens": 200, "ignore_eos": True,
                       "stream": True}).encode()
    sock = socket.create_connection(("127.0.0.1", daemon.port))
    sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
                 b"content-length: %d\r\n\r\n" % len(body) + body)
    read_until_first_token(sock)
    sock.close()


def test_disconnect_counts_a_cancellation(ops_daemon):
    # On a loaded 2-core box the 200-token answer can occasionally finish
    # before the server notices the close; that run is a plain completion, so
    # try again (each attempt waits for the model to account for the request).
    for _ in range(3):
        fams = scrape(ops_daemon)
        cancelled0 = value(fams, "flare_model_requests_cancelled_total")
        admitted0 = value(fams, "flare_model_requests_admitted_total")
        _stream_then_disconnect(ops_daemon)
        fams = wait_for(ops_daemon, lambda f: value(f, "flare_model_requests_cancelled_total")
                        + value(f, "flare_model_requests_completed_total")
                        >= value(f, "flare_model_requests_admitted_total") >= admitted0 + 1)
        if value(fams, "flare_model_requests_cancelled_total") >= cancelled0 + 1:
            return
    raise AssertionError("three disconnects, no cancellation counted")


@pytest.mark.skipif(shutil.which("promtool") is None, reason="promtool not installed (apt-get install prometheus)")
def test_promtool_accepts_a_live_scrape(ops_daemon):
    status, body = ops_daemon.request("GET", "/metrics")
    assert status == 200
    res = subprocess.run(["promtool", "check", "metrics"], input=body, capture_output=True, timeout=60)
    assert res.returncode == 0 and not res.stdout.strip() and not res.stderr.strip(), (res.stdout, res.stderr)
