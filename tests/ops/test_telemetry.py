"""Dashboard telemetry: the model thread's buffer never blocks; the feed's retention limits; the view."""

from __future__ import annotations

import threading

from flared.dashboard.telemetry import BUFFER_COMPLETIONS, CompletionBuffer, TelemetryFeed
from flared.dashboard.view import DashboardModel


def test_full_buffer_and_contention_drop_and_count():
    buf = CompletionBuffer()
    for i in range(BUFFER_COMPLETIONS + 5):
        buf.record(i, 6, 4, 4, 3, 1000)
    assert buf.dropped == 5
    rows, handles = buf.drain()
    assert handles[0] == []  # recorded without participants
    assert rows.shape == (BUFFER_COMPLETIONS, 7) and rows[0, 0] == 0 and rows[-1, 0] == BUFFER_COMPLETIONS - 1
    # A reader holding the lock: the writer drops instead of waiting.
    held = threading.Event()
    release = threading.Event()

    def reader():
        with buf._lock:
            held.set()
            release.wait(10)
    t = threading.Thread(target=reader)
    t.start()
    held.wait(10)
    buf.record(1, 6, 1, 1, 1, 1)
    release.set()
    t.join()
    assert buf.dropped == 6 and len(buf.drain()[0]) == 0


class _Runtime:
    """The two attributes the feed uses: the telemetry hook and request rows."""

    def __init__(self):
        self.telemetry = None
        self.rows = []

    def request_rows(self):
        return list(self.rows)


def _snapshot():
    return {"session_id": 1, "model": "m", "runtime": {"prompt_tokens": 0, "generated_tokens": 0, "counters": {}},
            "http": {"paused": False, "uptime_s": 1.0, "permits_in_use": 0, "permits": 4, "frontend_busy": 0,
                     "frontend_workers": 1}}


def _row(slot, gen):
    return {"handle": slot + (gen << 8), "slot": slot, "generation": gen, "phase": "DECODE", "arrival_ns": 1,
            "last_progress_ns": 2, "prompt_consumed": 5, "prompt_len": 5, "output": 3, "last_output_ns": 2,
            "bursts": 3}


def test_feed_enables_telemetry_only_while_polled_and_keeps_retired_rows():
    rt = _Runtime()
    feed = TelemetryFeed(rt, _snapshot)
    assert rt.telemetry is None
    rt.rows = [_row(0, 1)]
    first = feed.poll(0, now_ns=10**9)
    assert rt.telemetry is not None and first["requests"][0]["retired"] is False
    rt.telemetry.record(10**9 + 1, 6, 4, 4, 2, 2_000_000)
    rt.rows = []
    second = feed.poll(first["next_seq"] - 1, now_ns=2 * 10**9)
    assert [c[0] for c in second["completions"]] == [1]
    assert second["requests"][0]["retired"] is True  # still shown while its history lasts
    third = feed.poll(second["next_seq"] - 1, now_ns=13 * 10**9)
    assert third["completions"] == [] and third["requests"] == []
    feed.disable()
    assert rt.telemetry is None


def test_view_renders_both_panes_narrow_and_wide():
    rt = _Runtime()
    feed = TelemetryFeed(rt, _snapshot)
    rt.rows = [_row(s, s + 1) for s in range(10)]
    model = DashboardModel()
    model.update(feed.poll(0, now_ns=10**9))
    rt.telemetry.record(10**9 + 5, 6, 4, 4, 3, 2_000_000, estimate_ns=1_500_000)
    rt.telemetry.record(10**9 + 6, 6, 4, 4, 4, 0)  # untimed
    model.update(feed.poll(model.next_seq, now_ns=10**9 + 10))
    overview = "\n".join(model.render(80, 30))
    assert "generation throughput" in overview and "cached / free pages" in overview
    model.key("tab")
    wide = model.render(120, 20)
    assert all(len(line) == 120 for line in wide)
    text = "\n".join(wide)
    assert "decode b4 t4" in text and "req/call" in text and "bursts" in text
    row = next(line for line in wide if "decode b4 t4" in line).split()
    # 2 calls; mean, share and max over the timed one only; 3.5 requests per call; 1 untimed.
    assert row == ["decode", "b4", "t4", "2", "2.00", "100.0%", "2.00", "3.5", "1"]
    # The newest completion was untimed and had no estimate.
    assert "last submitted: decode b4 t4, estimate ? ms, took ? ms" in text
    narrow = "\n".join(model.render(80, 20))
    assert "req/call" not in narrow and "bursts" not in narrow
    assert "rows 1-" in narrow
    model.key("down")
    assert "rows 2-" in "\n".join(model.render(80, 20))
    model.key("left")
    assert "[overview]" in model.render(80, 20)[0]


def test_telemetry_turns_itself_off_when_polling_stops():
    import time

    rt = _Runtime()
    feed = TelemetryFeed(rt, _snapshot, idle_disable_s=0.05)
    feed.poll(0)
    assert rt.telemetry is not None
    deadline = time.monotonic() + 10
    while rt.telemetry is not None:
        assert time.monotonic() < deadline
        time.sleep(0.01)  # the feed's idle timer runs on its own thread
    feed.poll(0)  # a new poll turns it back on
    assert rt.telemetry is not None
    feed.disable()


def test_request_history_strip_marks_the_graphs_that_served_it():
    rt = _Runtime()
    feed = TelemetryFeed(rt, _snapshot)
    rt.rows = [_row(0, 1), _row(1, 2)]
    h0, h1 = rt.rows[0]["handle"], rt.rows[1]["handle"]
    model = DashboardModel()
    now = 20 * 10**9
    model.update(feed.poll(0, now_ns=now - 10**9))
    # GraphKind numbering: 2 snapshot, 3 prefill, 6 decode.
    rt.telemetry.record(now - 9_900_000_000, 3, 1, 64, 1, 1000, [h0])    # first cell: prefill
    rt.telemetry.record(now - 9_800_000_000, 2, 1, 0, 1, 1000, [h0])     # same cell: snapshot hidden by P
    rt.telemetry.record(now - 5_100_000_000, 2, 1, 0, 1, 1000, [h0])     # a cell with only a snapshot
    rt.telemetry.record(now - 100_000_000, 6, 2, 2, 2, 1000, [h0, h1])   # last cell: decode, both
    model.update(feed.poll(model.next_seq, now_ns=now))
    model.key("tab")
    lines = model.render(120, 20)
    head = next(ln for ln in lines if "history 10 s" in ln)
    start = head.index("history 10 s")
    r0 = next(ln for ln in lines if ln.startswith("  0.1 "))
    r1 = next(ln for ln in lines if ln.startswith("  1.2 "))
    strip0 = r0[start:].rstrip()
    strip1 = r1[start:].rstrip()
    assert strip0[0] == "P" and strip0[-1] == "D" and "s" in strip0[1:-1]
    assert set(strip1[:-1]) == {"."} and strip1[-1] == "D"
    assert len(strip0) == len(strip1) >= 5


def test_overview_shows_speculative_figures_once_there_are_drafts():
    """Acceptance length = drafts kept per request round offered one; depth = drafts fed per generation round; — before
    the first draft; verification steps count speculative steps (prompt lookup has no drafter steps)."""
    def overview(counters):
        snap = _snapshot()
        snap["runtime"]["counters"] = counters
        rt = _Runtime()
        model = DashboardModel()
        model.update(TelemetryFeed(rt, lambda: snap).poll(0, now_ns=10**9))
        lines = model.render(100, 30)
        return {k: line.split()[-1] for line in lines for k in ("acceptance", "depth", "verification", "drafter")
                if line.strip().startswith(k)}

    assert overview({}) == {"drafter": "0", "verification": "0", "acceptance": "—", "depth": "—"}
    got = overview({"launches_speculative": 5, "speculative_drafted": 12, "speculative_accepted": 9,
                    "speculative_rounds": 6, "generation_rounds": 24})
    assert got == {"drafter": "0", "verification": "5", "acceptance": "1.50", "depth": "0.50"}
