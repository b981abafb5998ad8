"""Dashboard model and text rendering, free of curses so tests can read it.

``DashboardModel.update(feed)`` folds one ``TelemetryFeed.poll`` answer into
the retained state (the client side of ``flarectl top`` keeps its own copy of
the retained completions); ``render(width, height)`` returns the screen as
lines for the current pane:

- overview: throughput (prefill and generation tokens/s over the last poll
  interval), speculative figures, active/queued, completed/failed, reused
  tokens, cached/free pages, uptime;
- scheduler: one row per graph shape seen in the last two seconds (calls,
  mean and share of graph time; max ms and requests per call when wide;
  untimed counts), then request rows (slot.generation, phase, gap ms; at
  >= 100 columns prompt consumed/length, output, out ms, bursts, and a
  10-second history strip: each cell is the latest completion that served
  the request in its interval — P prefill, D decode, S speculative, V
  vision; another kind, lower-case, only in a cell with none of those).
"""

from __future__ import annotations

import collections
import dataclasses

from flared.dashboard.telemetry import RETAINED_COMPLETIONS

PANES = ("overview", "scheduler")
GRAPH_WINDOW_NS = 2_000_000_000
WIDE_COLUMNS = 100
HISTORY_NS = 10_000_000_000
MAX_HISTORY_CELLS = 40
_PRIMARY_MARKS = {"prefill": "P", "scored_prefill": "P", "decode": "D", "speculative": "S", "vision": "V"}
_OTHER_MARKS = {"initialize": "i", "restore": "r", "snapshot": "s", "resume_sampling": "u", "mixed": "m"}

# GraphKind values as the scheduler numbers them; names for display.
_KIND_NAMES = {0: "initialize", 1: "restore", 2: "snapshot", 3: "prefill", 4: "scored_prefill",
               5: "resume", 6: "decode", 7: "speculative", 8: "vision", 9: "mixed"}


def _kind_names() -> dict[int, str]:
    try:
        from flared.scheduler import GraphKind
    except ImportError:  # pragma: no cover - the scheduler is part of the package
        return _KIND_NAMES
    return {int(k): k.name.lower() for k in GraphKind}


@dataclasses.dataclass
class GraphRow:
    label: str
    calls: int
    mean_ms: float | None
    max_ms: float | None
    share: float
    requests_per_call: float
    untimed: int


class DashboardModel:
    def __init__(self):
        self.pane = 0
        self.scroll = 0
        self.completions: collections.deque = collections.deque(maxlen=RETAINED_COMPLETIONS)
        self.next_seq = 0
        self.truncated = False
        self.feed: dict | None = None
        self._prev: tuple[int, int, int] | None = None  # (now_ns, prompt tokens, generated tokens)
        self.prefill_tps = 0.0
        self.generation_tps = 0.0
        self._kinds = _kind_names()

    # -- input ---------------------------------------------------------------------------------

    def key(self, name: str) -> None:
        """'left', 'right', 'tab', 'up', 'down' (others are ignored)."""
        if name in ("left", "right", "tab"):
            self.pane = (self.pane + (-1 if name == "left" else 1)) % len(PANES)
            self.scroll = 0
        elif name == "up":
            self.scroll = max(0, self.scroll - 1)
        elif name == "down":
            n = len(self.feed["requests"]) if self.feed else 0
            self.scroll = min(max(0, n - 1), self.scroll + 1)

    def update(self, feed: dict) -> None:
        for c in feed["completions"]:
            if c[0] > self.next_seq:
                if len(self.completions) == self.completions.maxlen:
                    self.truncated = True
                self.completions.append(tuple(c))
                self.next_seq = c[0]
        if feed.get("truncated"):
            self.truncated = True
        rt = feed["snapshot"]["runtime"]
        now = feed["now_ns"]
        cur = (now, rt.get("prompt_tokens", 0), rt.get("generated_tokens", 0))
        if self._prev is not None and now > self._prev[0]:
            dt = (now - self._prev[0]) / 1e9
            self.prefill_tps = (cur[1] - self._prev[1]) / dt
            self.generation_tps = (cur[2] - self._prev[2]) / dt
        self._prev = cur
        self.feed = feed

    # -- aggregation ---------------------------------------------------------------------------

    def graph_rows(self) -> list[GraphRow]:
        if self.feed is None:
            return []
        start = self.feed["now_ns"] - GRAPH_WINDOW_NS
        groups: dict[tuple[int, int, int], list[tuple]] = {}
        for c in self.completions:
            if c[1] >= start:
                groups.setdefault((c[2], c[3], c[4]), []).append(c)
        total_ns = sum(c[6] for rows in groups.values() for c in rows if c[6] > 0)
        out = []
        for (kind, batch, tokens), rows in sorted(groups.items()):
            timed = [c[6] for c in rows if c[6] > 0]
            out.append(GraphRow(
                label=self._label(kind, batch, tokens), calls=len(rows),
                mean_ms=sum(timed) / len(timed) / 1e6 if timed else None,
                max_ms=max(timed) / 1e6 if timed else None,
                share=sum(timed) / total_ns if total_ns else 0.0,
                requests_per_call=sum(c[5] for c in rows) / len(rows),
                untimed=len(rows) - len(timed)))
        return out

    def _label(self, kind: int, batch: int, tokens: int) -> str:
        name = self._kinds.get(kind, str(kind))
        if name == "speculative":
            return f"{name} b{batch} w{tokens}"
        if name == "mixed":
            return f"{name} b{batch} p{tokens}"
        return f"{name} b{batch} t{tokens}"

    # -- rendering -----------------------------------------------------------------------------

    def render(self, width: int, height: int) -> list[str]:
        if self.feed is None:
            lines = ["flared dashboard: waiting for the first sample..."]
        else:
            lines = self._header(width)
            budget = height - 1 - len(lines)  # rows left above the footer
            lines += self._overview(width) if PANES[self.pane] == "overview" else self._scheduler(width, budget)
        lines = lines[:max(0, height - 1)]
        lines += [""] * (max(0, height - 1) - len(lines))
        lines.append("Tab/<-/->: pane  Up/Down: scroll  q: quit  Ctrl-C: stop the server" if self._local
                     else "Tab/<-/->: pane  Up/Down: scroll  q/Ctrl-C: quit")
        return [ln[:width].ljust(width) if width > 0 else "" for ln in lines]

    _local = True

    def _header(self, width: int) -> list[str]:
        f = self.feed
        snap = f["snapshot"]
        tabs = "  ".join(f"[{p}]" if i == self.pane else f" {p} " for i, p in enumerate(PANES))
        paused = "  PAUSED" if snap["http"]["paused"] else ""
        return [f"flared  {snap['model']}  session {snap['session_id']}  up {snap['http']['uptime_s']:.0f}s"
                f"{paused}   {tabs}",
                f"dropped updates {f['dropped']}" + ("  history truncated" if self.truncated else ""), ""]

    def _overview(self, width: int) -> list[str]:
        snap = self.feed["snapshot"]
        rt, http = snap["runtime"], snap["http"]
        c = rt.get("counters", {})
        queued = rt.get("pending_requests", rt.get("pending", 0))
        rows = [
            ("prefill throughput", f"{self.prefill_tps:,.1f} tok/s"),
            ("generation throughput", f"{self.generation_tps:,.1f} tok/s"),
            ("drafter steps", str(c.get("drafter_steps", 0))),
            ("verification steps", str(c.get("launches_speculative", 0))),
            # accepted drafts per request round offered one; drafts offered per generation round (drafter steps:
            # a draft model's forwards; prompt lookup's copy-only proposals take none)
            ("acceptance length", _ratio(c.get("speculative_accepted", 0), c.get("speculative_rounds", 0))),
            ("depth", _ratio(c.get("speculative_drafted", 0), c.get("generation_rounds", 0))
             if c.get("speculative_rounds", 0) else "—"),
            ("active / queued", f"{rt.get('live_slots', 0)} / {queued}"),
            ("completed / failed", f"{c.get('finished', 0)} / {rt.get('failed_requests', 0)}"),
            ("cancelled", str(c.get("cancelled", 0))),
            ("reused tokens", str(c.get("prefix_reused_tokens", 0))),
            ("prefix hits / lookups", f"{c.get('prefix_hits', 0)} / {c.get('prefix_lookups', 0)}"),
            ("cached / free pages", f"{rt.get('total_pages', 0) - rt.get('free_pages', 0)} / {rt.get('free_pages', 0)}"),
            ("prompt / generated tokens", f"{rt.get('prompt_tokens', 0)} / {rt.get('generated_tokens', 0)}"),
            ("http in flight", f"{http['permits_in_use']} / {http['permits']}"),
            ("frontend busy", f"{http['frontend_busy']} / {http['frontend_workers']}"),
            ("model steps", str(rt.get("steps", 0))),
        ]
        return [f"  {k:<28}{v}" for k, v in rows]

    def _scheduler(self, width: int, budget: int) -> list[str]:
        wide = width >= WIDE_COLUMNS
        lines = ["Graphs (last 2 s)"]
        head = f"  {'graph':<26}{'calls':>7}{'mean ms':>10}{'share':>8}"
        if wide:
            head += f"{'max ms':>10}{'req/call':>10}"
        head += f"{'untimed':>9}"
        lines.append(head)
        graphs = self.graph_rows()
        for g in graphs:
            ln = f"  {g.label:<26}{g.calls:>7}{_ms(g.mean_ms):>10}{g.share * 100:>7.1f}%"
            if wide:
                ln += f"{_ms(g.max_ms):>10}{g.requests_per_call:>10.1f}"
            ln += f"{g.untimed:>9}"
            lines.append(ln)
        if not graphs:
            lines.append("  (no graph completions in the last 2 s)")
        if self.completions:
            last = self.completions[-1]
            est = last[7] if len(last) > 8 else -1
            lines.append(f"  last submitted: {self._label(last[2], last[3], last[4])}, estimate "
                         f"{_ms(est / 1e6) if est > 0 else '?'} ms, took {_ms(last[6] / 1e6) if last[6] > 0 else '?'} ms")
        f = self.feed
        age_ms = (f["now_ns"] - f["sample_ns"]) / 1e6 if f["sample_ns"] else 0.0
        lines += ["", f"Requests (sample age {age_ms:.0f} ms)"]
        head = f"  {'request':<12}{'phase':<16}{'gap ms':>9}"
        cells = 0
        if wide:
            head += f"{'prompt':>14}{'output':>8}{'out ms':>9}{'bursts':>8}"
            cells = min(MAX_HISTORY_CELLS, width - len(head) - 3)
            if cells >= 5:
                head += f"  {'history ' + str(HISTORY_NS // 10**9) + ' s':<{cells}}"
            else:
                cells = 0
        lines.append(head)
        reqs = f["requests"]
        served = self._served_by(f["now_ns"]) if cells else {}
        room = max(1, budget - len(lines) - 1)  # one row kept for the scroll indicator
        for r in reqs[self.scroll:self.scroll + room]:
            since = r["last_progress_ns"] or r["arrival_ns"]
            gap = (f["sample_ns"] - since) / 1e6 if since else 0.0
            phase = "retired" if r["retired"] else r["phase"].lower()
            ln = f"  {str(r['slot']) + '.' + str(r['generation']):<12}{phase:<16}{gap:>9.0f}"
            if wide:
                out_ms = "—" if not r["last_output_ns"] else f"{(f['sample_ns'] - r['last_output_ns']) / 1e6:.0f}"
                # The scheduler's computed count runs on into the output: cap it at the prompt.
                consumed = min(r["prompt_consumed"], r["prompt_len"])
                ln += (f"{consumed:>7}/{r['prompt_len']:<6}{r['output']:>8}{out_ms:>9}"
                       f"{r['bursts']:>8}")
                if cells:
                    ln += "  " + self._history(served.get(r["handle"], ()), f["now_ns"], cells)
            lines.append(ln)
        if not reqs:
            lines.append("  (no requests)")
        elif len(reqs) > room:
            lines.append(f"  rows {self.scroll + 1}-{min(len(reqs), self.scroll + room)} of {len(reqs)}")
        return lines


    def _served_by(self, now_ns: int) -> dict[int, list[tuple[int, str]]]:
        """handle -> [(done_ns, kind name)] over the history window, oldest first."""
        start = now_ns - HISTORY_NS
        out: dict[int, list[tuple[int, str]]] = {}
        for c in self.completions:
            if c[1] < start or len(c) < 9:
                continue
            name = self._kinds.get(c[2], "")
            for h in c[8]:
                out.setdefault(h, []).append((c[1], name))
        return out

    @staticmethod
    def _history(events, now_ns: int, cells: int) -> str:
        start = now_ns - HISTORY_NS
        cell_ns = HISTORY_NS / cells
        primary = [""] * cells
        other = [""] * cells
        for done_ns, name in events:  # oldest first: later events overwrite
            i = min(cells - 1, int((done_ns - start) / cell_ns))
            if i < 0:
                continue
            if name in _PRIMARY_MARKS:
                primary[i] = _PRIMARY_MARKS[name]
            else:
                other[i] = _OTHER_MARKS.get(name, "?")
        return "".join(p or o or "." for p, o in zip(primary, other))


def _ms(v: float | None) -> str:
    return "—" if v is None else f"{v:.2f}"


def _ratio(num: int, den: int) -> str:
    return "—" if not den else f"{num / den:.2f}"
