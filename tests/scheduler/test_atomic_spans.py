"""Atomic prompt spans (Gemma 3's images, whose tokens attend to each other both ways): no prefill chunk ends
inside one, whatever the chunk capacity and the other requests sharing the step."""

import pytest

from flared.errors import AdmissionError, ErrorKind

from flared.scheduler import GraphKind

from .helpers import Driver, make_scheduler, prompt


def _chunks(driver, handle):
    """(start, end) of each prefill chunk ``handle`` was fed, in order."""
    out = []
    for plan in driver.plans:
        for i, h in enumerate(plan.handles):
            if h == handle and plan.kind in (GraphKind.PREFILL, GraphKind.SCORED_PREFILL) and plan.num_tokens[i]:
                start = int(plan.token_starts[i])
                out.append((start, start + int(plan.num_tokens[i])))
    return out


def test_no_prefill_chunk_ends_inside_a_span():
    s = make_scheduler(prefill_chunk_size=64, num_pages=128)
    spans = [(50, 66), (120, 136), (190, 206)]
    h = s.admit(prompt(250), 4, 0, atomic_spans=spans)
    other = s.admit(prompt(100, seed=1), 4, 0)  # (shares the steps, taking part of their capacity)
    d = Driver(s)
    d.run()
    chunks = _chunks(d, h)
    assert chunks[0][0] == 0 and chunks[-1][1] == 250
    assert all(a[1] == b[0] for a, b in zip(chunks, chunks[1:]))  # (contiguous)
    for start, end in chunks:
        assert not any(a < end < b for a, b in spans), (chunks, spans)
    assert any(end == a for _, end in chunks for a, _ in spans)  # (a chunk did stop short before one)
    assert len(d.emitted[h]) == 4 and len(d.emitted[other]) == 4


def test_cut():
    s = make_scheduler(prefill_chunk_size=64)
    r = s.request(s.admit(prompt(100), 4, 0, atomic_spans=[(10, 20), (40, 50)]))
    assert [r.cut(n) for n in (5, 10, 15, 20, 45, 64)] == [5, 10, 10, 20, 40, 64]


def test_a_span_longer_than_the_prefill_chunk_is_refused():
    s = make_scheduler(prefill_chunk_size=64)
    with pytest.raises(AdmissionError, match="one prefill chunk") as e:
        s.admit(prompt(200), 4, 0, atomic_spans=[(10, 80)])
    assert e.value.kind is ErrorKind.VALIDATION
    with pytest.raises(AdmissionError, match="not inside the prompt"):
        s.admit(prompt(20), 4, 0, atomic_spans=[(10, 30)])
    s.check_integrity()
