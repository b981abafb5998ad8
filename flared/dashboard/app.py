"""The curses loop: poll a feed, draw the model's lines, map keys.

Rules:
- The terminal stays in cbreak mode (never raw), so Ctrl-C still raises
  SIGINT: in ``flared run`` the server's own handler starts the normal
  shutdown; in ``flarectl top`` it just quits.
- The loop never blocks the server: in process it runs on its own thread and
  only reads the feed; remotely it is a separate process.
- While the in-process dashboard owns the terminal, log records are held in
  memory and written to stderr when it ends, so the screen is not torn and
  no line is lost.
"""

from __future__ import annotations

import curses
import logging
import os
import threading
import time

from flared.dashboard.view import DashboardModel

POLL_INTERVAL_S = 0.5
KEY_POLL_MS = 100

_KEYS = {curses.KEY_LEFT: "left", curses.KEY_RIGHT: "right", 9: "tab", curses.KEY_UP: "up",
         curses.KEY_DOWN: "down"}


def run_curses(poll, stop: threading.Event, *, local: bool) -> None:
    """Draw until ``stop`` is set or the user presses q. ``poll(since)`` returns a feed dict."""
    curses.wrapper(lambda scr: _loop(scr, poll, stop, local))


def _loop(scr, poll, stop: threading.Event, local: bool) -> None:
    curses.curs_set(0)
    scr.timeout(KEY_POLL_MS)
    model = DashboardModel()
    model._local = local
    next_poll = 0.0
    dirty = True
    while not stop.is_set():
        now = time.monotonic()
        if now >= next_poll:
            try:
                model.update(poll(model.next_seq))
            except Exception as e:  # noqa: BLE001 - a daemon gone away ends a remote dashboard
                if not local:
                    raise DashboardSourceError(str(e)) from e
            next_poll = now + POLL_INTERVAL_S
            dirty = True
        if dirty:
            _draw(scr, model)
            dirty = False
        ch = scr.getch()
        if ch == -1:
            continue
        if ch in (ord("q"), ord("Q")):
            return
        if ch == curses.KEY_RESIZE:
            dirty = True
            continue
        name = _KEYS.get(ch)
        if name is not None:
            model.key(name)
            dirty = True


def _draw(scr, model: DashboardModel) -> None:
    _follow_terminal_size(scr)
    height, width = scr.getmaxyx()
    scr.erase()
    for y, line in enumerate(model.render(width, height)):
        try:
            # The bottom-right cell cannot be written without scrolling: leave it.
            scr.addstr(y, 0, line[:width - 1] if y == height - 1 else line)
        except curses.error:
            pass
    scr.refresh()


def _follow_terminal_size(scr) -> None:
    # curses learns a new size from SIGWINCH, which reaches only the main
    # thread's handlers, and a terminal may still be 80x24 when initscr runs
    # (a fresh tmux pane): ask the tty itself on every draw.
    try:
        size = os.get_terminal_size(1)
    except OSError:
        return
    if (size.lines, size.columns) != scr.getmaxyx():
        curses.resizeterm(size.lines, size.columns)


class DashboardSourceError(RuntimeError):
    """The feed could not be read (daemon gone)."""


class _HeldLogs(logging.Handler):
    def __init__(self):
        super().__init__()
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


class InProcessDashboard:
    """``flared run``'s dashboard: a thread drawing a TelemetryFeed of this session."""

    def __init__(self, feed):
        self._feed = feed
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._held = _HeldLogs()
        self._saved: list[logging.Handler] = []

    def start(self) -> None:
        if not os.isatty(1) and os.isatty(2):
            # curses draws on stdout; the daemon prints nothing there, and the
            # dashboard belongs on the terminal that stderr is.
            os.dup2(2, 1)
        root = logging.getLogger()
        self._saved = list(root.handlers)
        for h in self._saved:
            root.removeHandler(h)
        root.addHandler(self._held)
        self._thread = threading.Thread(target=self._run, name="flared-dashboard", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            run_curses(self._feed.poll, self._stop, local=True)
        except Exception:  # noqa: BLE001 - a broken terminal must not take the server down
            logging.getLogger("flared.dashboard").exception("dashboard failed; continuing without it")
        finally:
            self._restore_logs()
            self._feed.disable()

    def _restore_logs(self) -> None:
        root = logging.getLogger()
        if self._held not in root.handlers:
            return
        root.removeHandler(self._held)
        for h in self._saved:
            root.addHandler(h)
        for record in self._held.records:
            for h in self._saved:
                if record.levelno >= h.level:
                    h.handle(record)
        self._held.records.clear()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(5.0)
