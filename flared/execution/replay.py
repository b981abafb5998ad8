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


class _Shared:
    """What the worker thread touches. The thread holds this, not the worker, so an unclosed worker can be
    collected and its destructor can drain."""

    def __init__(self, cuda, device, execs, stream_ptr):
        self.cuda = cuda
        self.device = device
        self.execs = execs
        self.stream_ptr = stream_ptr
        self.lock = threading.Lock()
        self.cond = threading.Condition(self.lock)
        self.commands: collections.deque[tuple[int, int, int]] = collections.deque()
        self.completions: collections.deque[ReplayCompletion] = collections.deque()
        self.running = 0
        self.closing = False
        self.failure: str | None = None

    def busy(self) -> int:
        return len(self.commands) + len(self.completions) + self.running


def _worker_main(sh: _Shared) -> None:
    cuda = sh.cuda
    try:
        cuda.set_device(sh.device)
    except ExecutionError as exc:
        sh.failure = str(exc)
    while True:
        with sh.cond:
            while not sh.commands and not sh.closing:
                sh.cond.wait()
            if not sh.commands:
                return
            ticket, index, reps = sh.commands.popleft()
            sh.running = 1
        started = time.perf_counter_ns()
        if sh.failure is None:
            try:
                for _ in range(reps):
                    cuda.graph_launch(sh.execs[index], sh.stream_ptr)
                cuda.stream_synchronize(sh.stream_ptr)
            except ExecutionError as exc:
                sh.failure = str(exc)  # stops every later launch
        done = ReplayCompletion(ticket, index, reps, time.perf_counter_ns() - started, sh.failure)
        with sh.cond:
            sh.running = 0
            sh.completions.append(done)
            sh.cond.notify_all()


class GraphReplayWorker:
    def __init__(self, owner, device: int, graph_execs, buffers, *, queue_capacity: int = 8, stream_ptr: int):
        from flared.execution import cuda

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
        self._closed = False
        self._owner = owner
        self.queue_capacity = queue_capacity
        self._next_ticket = 1
        self._sh = _Shared(cuda, device, execs, stream_ptr)
        self._thread = threading.Thread(target=_worker_main, args=(self._sh,), name="flared-replay", daemon=True)
        self._thread.start()

    @property
    def outstanding(self) -> int:
        """Accepted submissions whose completion has not been polled."""
        with self._sh.lock:
            return self._sh.busy()

    def submit(self, graph_index: int, repetitions: int = 1) -> int:
        sh = self._sh
        if not 0 <= graph_index < len(sh.execs):
            raise ExecutionError(f"graph index {graph_index} outside 0..{len(sh.execs) - 1}", ErrorKind.EXECUTION)
        if repetitions < 1:
            raise ExecutionError("repetitions must be >= 1", ErrorKind.EXECUTION)
        with sh.cond:
            if sh.closing:
                raise ExecutionError("the replay worker is closed", ErrorKind.EXECUTION)
            if sh.busy() >= self.queue_capacity:
                raise ExecutionError(f"replay queue full ({self.queue_capacity}); poll completions first",
                                     ErrorKind.MODEL_CAPACITY)
            ticket = self._next_ticket
            self._next_ticket += 1
            sh.commands.append((ticket, graph_index, repetitions))
            sh.cond.notify_all()
            return ticket

    def poll(self, timeout_ms: int = 0) -> ReplayCompletion | None:
        sh = self._sh
        deadline = time.monotonic() + timeout_ms / 1000
        with sh.cond:
            while not sh.completions:
                left = deadline - time.monotonic()
                if left <= 0:
                    return None
                sh.cond.wait(left)  # the GIL is released while waiting
            return sh.completions.popleft()

    def close(self) -> None:
        """Reject new work, run the queued work, drain, join, release the owner. Idempotent."""
        sh = self._sh
        with sh.cond:
            if self._closed:
                return
            self._closed = True
            sh.closing = True
            sh.cond.notify_all()
        self._thread.join()
        try:
            sh.cuda.stream_synchronize(sh.stream_ptr)
        except ExecutionError as exc:
            LEAKED_OWNERS.append(self._owner)  # the device may still use it: never free
            self._owner = None
            raise ExecutionError(f"replay drain failed, owner retained: {exc}", ErrorKind.DRAIN) from exc
        self._owner = None
        if sh.failure is not None:
            raise ExecutionError(f"a replay launch failed: {sh.failure}", ErrorKind.DEVICE)

    @property
    def owner_released(self) -> bool:
        return self._closed and self._owner is None

    def __del__(self):
        try:
            if not getattr(self, "_closed", True):
                self.close()
        except Exception:  # noqa: BLE001 - a destructor must not raise; on a failed drain the owner stays retained
            pass
