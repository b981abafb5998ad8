"""GraphReplayWorker: the raw-replay qualification surface.

A worker thread launches registered CUDA graph executables (``cudaGraphExec_t``
handles from ``torch.cuda.CUDAGraph.raw_cuda_graph_exec()``) through CuPy on
one stream; the caller submits ``(graph_index, repetitions)`` and polls
completions:

    worker = GraphReplayWorker(owner, device, graph_execs, buffers, queue_capacity=8)
    ticket = worker.submit(graph_index, repetitions=1)
    completion = worker.poll(timeout_ms=0)      # ReplayCompletion | None
    worker.outstanding                          # accepted, completion not consumed
    worker.close()                              # idempotent

Rules:
- ``owner`` is retained until close() has drained the stream: it must keep
  alive every graph, captured tensor and pool the executables use. If the
  drain cannot be confirmed, the owner is kept forever (``LEAKED_OWNERS``)
  rather than freeing storage the device may still touch.
- Registration checks the buffer spans (positive sizes, no overlap) and that
  executable handles are non-zero and unique; it cannot prove the addresses
  are live.
- One submission launches its graph ``repetitions`` times, synchronises the
  stream, then emits its completion. Submissions run in order on one stream,
  so graphs sharing pool scratch never overlap.
- Pending commands and unconsumed completions share ``queue_capacity``: a
  submission beyond it raises (MODEL_CAPACITY) until a completion is polled.
- A launch failure stops later launches; it is reported on that and every
  later completion and by close().
- close() rejects new submissions, runs the queued ones, synchronises, joins
  the thread, then drops the owner. An unclosed worker's destructor tries
  the same.
"""

from __future__ import annotations

import collections
import threading
import time
from dataclasses import dataclass

from flared.errors import ErrorKind, ExecutionError

LEAKED_OWNERS: list[object] = []


@dataclass(frozen=True)
class ReplayCompletion:
    ticket: int
    graph_index: int
    repetitions: int
    host_ns: int  # launch-to-synchronised wall time on the worker thread
    error: str | None = None


class GraphReplayWorker:
    def __init__(self, owner, device: int, graph_execs, buffers, *, queue_capacity: int = 8, stream_ptr: int):
        from flared.execution import cuda

        self._cuda = cuda
        execs = [int(g) for g in graph_execs]
        if not execs or any(g == 0 for g in execs):
            raise ExecutionError("graph executables must be non-null handles", ErrorKind.EXECUTION)
        if len(set(execs)) != len(execs):
            raise ExecutionError("graph executable handles repeat", ErrorKind.EXECUTION)
        spans = sorted((int(a), int(n)) for a, n in buffers)
        for (a, n), nxt in zip(spans, spans[1:] + [None]):
            if a <= 0 or n <= 0:
                raise ExecutionError(f"buffer span ({a:#x}, {n}) is empty or null", ErrorKind.EXECUTION)
            if nxt is not None and a + n > nxt[0]:
                raise ExecutionError(f"buffer spans ({a:#x}, {n}) and ({nxt[0]:#x}, {nxt[1]}) overlap",
                                     ErrorKind.EXECUTION)
        if queue_capacity <= 0:
            raise ExecutionError("queue_capacity must be positive", ErrorKind.EXECUTION)
        self._owner = owner
        self._device = device
        self._execs = execs
        self._stream_ptr = stream_ptr
        self.queue_capacity = queue_capacity
        self._lock = threading.Lock()
        self._cond = threading.Condition(self._lock)
        self._commands: collections.deque[tuple[int, int, int]] = collections.deque()
        self._completions: collections.deque[ReplayCompletion] = collections.deque()
        self._next_ticket = 1
        self._closing = False
        self._closed = False
        self._failure: str | None = None
        self._thread = threading.Thread(target=self._main, name="flared-replay", daemon=True)
        self._thread.start()

    @property
    def outstanding(self) -> int:
        with self._lock:
            return len(self._commands) + len(self._completions) + self._running

    _running = 0

    def submit(self, graph_index: int, repetitions: int = 1) -> int:
        if not 0 <= graph_index < len(self._execs):
            raise ExecutionError(f"graph index {graph_index} outside 0..{len(self._execs) - 1}", ErrorKind.EXECUTION)
        if repetitions < 1:
            raise ExecutionError("repetitions must be >= 1", ErrorKind.EXECUTION)
        with self._cond:
            if self._closing:
                raise ExecutionError("the replay worker is closed", ErrorKind.EXECUTION)
            if len(self._commands) + len(self._completions) + self._running >= self.queue_capacity:
                raise ExecutionError(f"replay queue full ({self.queue_capacity}); poll completions first",
                                     ErrorKind.MODEL_CAPACITY)
            ticket = self._next_ticket
            self._next_ticket += 1
            self._commands.append((ticket, graph_index, repetitions))
            self._cond.notify_all()
            return ticket

    def poll(self, timeout_ms: int = 0) -> ReplayCompletion | None:
        deadline = time.monotonic() + timeout_ms / 1000
        with self._cond:
            while not self._completions:
                left = deadline - time.monotonic()
                if left <= 0:
                    return None
                self._cond.wait(left)  # releases the lock; the GIL is released while waiting
            return self._completions.popleft()

    def _main(self) -> None:
        cuda = self._cuda
        try:
            cuda.set_device(self._device)
        except ExecutionError as exc:
            self._failure = str(exc)
        while True:
            with self._cond:
                while not self._commands and not self._closing:
                    self._cond.wait()
                if not self._commands:
                    return
                ticket, index, reps = self._commands.popleft()
                self._running = 1
            started = time.perf_counter_ns()
            if self._failure is None:
                try:
                    for _ in range(reps):
                        cuda.graph_launch(self._execs[index], self._stream_ptr)
                    cuda.stream_synchronize(self._stream_ptr)
                except ExecutionError as exc:
                    self._failure = str(exc)
            done = ReplayCompletion(ticket, index, reps, time.perf_counter_ns() - started, self._failure)
            with self._cond:
                self._running = 0
                self._completions.append(done)
                self._cond.notify_all()

    def close(self) -> None:
        """Reject new work, run the queued work, drain, join, release the owner. Idempotent."""
        with self._cond:
            if self._closed:
                return
            self._closing = True
            self._cond.notify_all()
        self._thread.join()
        self._closed = True
        try:
            self._cuda.stream_synchronize(self._stream_ptr)
        except ExecutionError as exc:
            LEAKED_OWNERS.append(self._owner)  # the device may still use it: never free
            self._owner = None
            raise ExecutionError(f"replay drain failed, owner retained: {exc}", ErrorKind.DRAIN) from exc
        self._owner = None
        if self._failure is not None:
            raise ExecutionError(f"a replay launch failed: {self._failure}", ErrorKind.DEVICE)

    @property
    def owner_released(self) -> bool:
        return self._closed and self._owner is None

    def __del__(self):
        try:
            if not getattr(self, "_closed", True):
                self.close()
        except Exception:  # noqa: BLE001 - a destructor must not raise; the owner stays retained on failure
            pass
