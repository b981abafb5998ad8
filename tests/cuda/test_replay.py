"""GraphReplayWorker: real torch graphs launched through CuPy from the worker thread."""

import gc
import weakref

import pytest

torch = pytest.importorskip("torch")


class Owner:
    """Keeps the graphs and their captured tensors alive, as the reference requires."""

    def __init__(self):
        self.stream = torch.cuda.Stream()
        self.x = torch.zeros(1024, device="cuda")
        self.counter = torch.zeros(4096, device="cuda")
        self.y = torch.zeros(1024, device="cuda")
        pool = torch.cuda.graph_pool_handle()
        self.graphs = []
        with torch.cuda.stream(self.stream):
            self.y.copy_(self.x * 2 + 1)
            self.counter.add_(1)
            torch.cuda.synchronize()
            for body in (lambda: self.counter.add_(1), lambda: self.y.copy_(self.x * 2 + 1)):
                g = torch.cuda.CUDAGraph()
                with torch.cuda.graph(g, pool=pool, stream=self.stream):
                    body()
                self.graphs.append(g)
        self.counter.zero_()
        torch.cuda.synchronize()

    def worker(self, **kw):
        from flared.execution.replay import GraphReplayWorker

        execs = [g.raw_cuda_graph_exec() for g in self.graphs]
        spans = [(t.data_ptr(), t.numel() * 4) for t in (self.x, self.y, self.counter)]
        return GraphReplayWorker(self, torch.cuda.current_device(), execs, spans,
                                 stream_ptr=self.stream.cuda_stream, **kw)


def test_repetitions_inputs_between_completions_and_capacities():
    owner = Owner()
    w = owner.worker()
    try:
        t = w.submit(0, repetitions=5)
        c = w.poll(timeout_ms=10_000)
        assert c.ticket == t and c.repetitions == 5 and c.error is None
        assert torch.equal(owner.counter, torch.full_like(owner.counter, 5))
        for value in (1.0, -3.5):
            owner.x.fill_(value)
            torch.cuda.synchronize()
            w.submit(1)
            assert w.poll(timeout_ms=10_000).error is None
            assert torch.equal(owner.y, torch.full_like(owner.y, 2 * value + 1))
        assert w.outstanding == 0
    finally:
        w.close()


def test_capacity_counts_unconsumed_completions():
    from flared.errors import ErrorKind, ExecutionError

    owner = Owner()
    w = owner.worker(queue_capacity=2)
    try:
        w.submit(0)
        w.submit(0)
        with pytest.raises(ExecutionError) as e:
            w.submit(0)
        assert e.value.kind == ErrorKind.MODEL_CAPACITY
        assert w.poll(timeout_ms=10_000) is not None
        w.submit(0)
        assert w.poll(timeout_ms=10_000) and w.poll(timeout_ms=10_000)
        assert w.poll(timeout_ms=0) is None
    finally:
        w.close()


def test_registration_checks():
    from flared.errors import ExecutionError
    from flared.execution.replay import GraphReplayWorker

    owner = Owner()
    g = owner.graphs[0].raw_cuda_graph_exec()
    with pytest.raises(ExecutionError, match="repeat"):
        GraphReplayWorker(owner, 0, [g, g], [], stream_ptr=owner.stream.cuda_stream)
    with pytest.raises(ExecutionError, match="overlap"):
        GraphReplayWorker(owner, 0, [g], [(owner.x.data_ptr(), 8192), (owner.x.data_ptr() + 4096, 16)],
                          stream_ptr=owner.stream.cuda_stream)
    with pytest.raises(ExecutionError, match="non-null"):
        GraphReplayWorker(owner, 0, [0], [], stream_ptr=owner.stream.cuda_stream)


def test_close_runs_queued_work_then_releases_the_owner_idempotently():
    owner = Owner()
    ref = weakref.ref(owner)
    w = owner.worker()
    counter = owner.counter
    for _ in range(3):
        w.submit(0, repetitions=10)
    del owner
    gc.collect()
    assert ref() is not None  # retained by the worker while work is queued
    w.close()
    w.close()
    gc.collect()
    assert w.owner_released and ref() is None
    assert torch.equal(counter, torch.full_like(counter, 30))
    from flared.errors import ExecutionError

    with pytest.raises(ExecutionError, match="closed"):
        w.submit(0)


def test_destructor_drains_an_unclosed_worker():
    owner = Owner()
    ref = weakref.ref(owner)
    counter = owner.counter
    w = owner.worker()
    w.submit(0, repetitions=7)
    del owner, w
    gc.collect()
    assert ref() is None
    assert torch.equal(counter, torch.full_like(counter, 7))
