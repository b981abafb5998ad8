"""Dashboard telemetry: the model thread's completion buffer and the feed
that the dashboard (in process, or ``flarectl top`` over the admin socket)
polls.

Rules:
- Telemetry exists only while a dashboard runs: ``TelemetryFeed`` installs a
  ``CompletionBuffer`` as ``ModelRuntime.telemetry`` on its first poll and
  removes it after ``IDLE_DISABLE_S`` without polls; otherwise the model
  thread pays one ``is not None`` test per step.
- The model thread never waits: ``record()`` takes the buffer's lock without
  blocking; contention or a full buffer (1024 completions between two
  drains) drops the completion and counts it in ``dropped``.
- The feed retains at most 16384 completions and 128 request rows; older
  entries fall off the front and the feed says so (``truncated``).
- Request rows are sampled on demand, at most every 500 ms; a retired
  request's row stays for as long as the history window shows it.
- Nothing here holds request text or token ids: kinds, capacities, counts
  and times only.
"""

from __future__ import annotations

import collections
import threading
import time

import numpy as np

BUFFER_COMPLETIONS = 1024
RETAINED_COMPLETIONS = 16384
RETAINED_REQUEST_ROWS = 128
REQUEST_SAMPLE_INTERVAL_NS = 500_000_000
# A retired row stays while the 10-second history still covers it.
HISTORY_WINDOW_NS = 10_000_000_000
IDLE_DISABLE_S = 10.0

# Columns of one recorded completion.
# C_ESTIMATE_NS is the scheduler's duration estimate frozen when the graph
# was planned (-1 or 0: indeterminate).
C_DONE_NS, C_KIND, C_BATCH, C_TOKENS, C_REQUESTS, C_DURATION_NS, C_ESTIMATE_NS = range(7)
# Participants kept per completion (the scheduler's slot limit).
MAX_PARTICIPANTS = 64


class CompletionBuffer:
    """Preallocated 1024-completion buffer written by the model thread.

    Each completion keeps its participants' request handles, so request rows
    can show which graphs served them."""

    def __init__(self, capacity: int = BUFFER_COMPLETIONS):
        self._rows = np.zeros((capacity, 7), dtype=np.int64)
        self._handles = np.zeros((capacity, MAX_PARTICIPANTS), dtype=np.int64)
        self._num_handles = np.zeros(capacity, dtype=np.int32)
        self._count = 0
        self._lock = threading.Lock()
        self.dropped = 0  # written by the model thread only

    def record(self, done_ns: int, kind: int, batch: int, tokens: int, requests: int, duration_ns: int,
               handles=(), estimate_ns: int = -1) -> None:
        """Model thread: never blocks."""
        if not self._lock.acquire(blocking=False):
            self.dropped += 1
            return
        try:
            if self._count >= self._rows.shape[0]:
                self.dropped += 1
                return
            self._rows[self._count] = (done_ns, kind, batch, tokens, requests, duration_ns, estimate_ns)
            n = min(len(handles), MAX_PARTICIPANTS)
            if n:
                self._handles[self._count, :n] = handles[:n]
            self._num_handles[self._count] = n
            self._count += 1
        finally:
            self._lock.release()

    def drain(self) -> tuple[np.ndarray, list[list[int]]]:
        """Reader: the completions recorded since the last drain, oldest
        first, and each one's participant handles."""
        with self._lock:
            n = self._count
            rows = self._rows[:n].copy()
            handles = self._handles[:n].copy()
            counts = self._num_handles[:n].copy()
            self._count = 0
        return rows, [handles[i, :counts[i]].tolist() for i in range(n)]


class TelemetryFeed:
    """Retained completions and request rows, polled by a dashboard.

    ``poll(since)`` returns the completions with sequence number > since, the
    latest request-row sample and the session snapshot, as plain JSON data.
    Called from one thread at a time (the event loop for the admin socket,
    the dashboard thread in process)."""

    def __init__(self, runtime, snapshot, *, idle_disable_s: float = IDLE_DISABLE_S):
        self._runtime = runtime
        self._idle_disable_s = idle_disable_s
        self._snapshot = snapshot
        self._buffer: CompletionBuffer | None = None
        self._completions: collections.deque[tuple] = collections.deque(maxlen=RETAINED_COMPLETIONS)
        self._next_seq = 1
        self._rows: dict[tuple[int, int], dict] = {}
        self._sample_ns = 0
        self._last_poll_s = 0.0
        self._timer: threading.Timer | None = None
        self._lock = threading.Lock()

    @property
    def enabled(self) -> bool:
        return self._buffer is not None

    def _enable(self) -> None:
        if self._buffer is None:
            self._buffer = CompletionBuffer()
            self._runtime.telemetry = self._buffer

    def disable(self) -> None:
        with self._lock:
            if self._buffer is not None and self._runtime.telemetry is self._buffer:
                self._runtime.telemetry = None
            self._buffer = None
            if self._timer is not None:
                self._timer.cancel()
                self._timer = None

    def _check_idle(self) -> None:
        """Timer thread: disable telemetry once polls stopped, else look again later."""
        with self._lock:
            self._timer = None
            idle_s = time.monotonic() - self._last_poll_s
            if idle_s < self._idle_disable_s:
                self._arm_timer_locked(self._idle_disable_s - idle_s)
                return
        self.disable()

    def _arm_timer_locked(self, delay_s: float) -> None:
        # One timer per feed at a time; the caller holds self._lock.
        if self._timer is None:
            self._timer = threading.Timer(delay_s, self._check_idle)
            self._timer.daemon = True
            self._timer.start()

    def poll(self, since: int = 0, *, now_ns: int | None = None) -> dict:
        with self._lock:
            self._last_poll_s = time.monotonic()
            self._enable()
            self._arm_timer_locked(self._idle_disable_s)
        now_ns = time.monotonic_ns() if now_ns is None else now_ns
        truncated = self._take_completions()
        if now_ns - self._sample_ns >= REQUEST_SAMPLE_INTERVAL_NS:
            self._sample_rows(now_ns)
        completions = [c for c in self._completions if c[0] > since]
        snap = self._snapshot()
        snap = snap.to_dict() if hasattr(snap, "to_dict") else snap
        buffer = self._buffer
        return {
            "now_ns": now_ns,
            "sample_ns": self._sample_ns,
            "next_seq": self._next_seq,
            # [seq, done_ns, kind, batch, tokens, requests, duration_ns, estimate_ns, [handles]]
            "completions": completions,
            "truncated": truncated or (bool(self._completions) and self._completions[0][0] > since + 1
                                       and since > 0),
            "requests": sorted(self._rows.values(), key=lambda r: (r["retired"], r["slot"], r["generation"])),
            "dropped": buffer.dropped if buffer is not None else 0,
            "snapshot": snap,
        }

    def _take_completions(self) -> bool:
        buffer = self._buffer
        if buffer is None:
            return False
        rows, handles = buffer.drain()
        overflow = len(self._completions) + len(rows) > RETAINED_COMPLETIONS
        for row, hs in zip(rows.tolist(), handles):
            self._completions.append((self._next_seq, *row, hs))
            self._next_seq += 1
        return overflow

    def _sample_rows(self, now_ns: int) -> None:
        self._sample_ns = now_ns
        seen = set()
        for r in self._runtime.request_rows():
            key = (r["slot"], r["generation"])
            seen.add(key)
            self._rows[key] = {**r, "retired": False, "retired_ns": 0}
        for key, row in list(self._rows.items()):
            if key in seen:
                continue
            if not row["retired"]:
                row["retired"] = True
                row["retired_ns"] = now_ns
            elif now_ns - row["retired_ns"] > HISTORY_WINDOW_NS:
                del self._rows[key]
        if len(self._rows) > RETAINED_REQUEST_ROWS:
            # Oldest retired first, then oldest arrivals.
            order = sorted(self._rows, key=lambda k: (not self._rows[k]["retired"], self._rows[k]["arrival_ns"]))
            for key in order[:len(self._rows) - RETAINED_REQUEST_ROWS]:
                del self._rows[key]
