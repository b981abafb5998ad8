"""Admission, plan/commit/complete and retirement with exact ids."""

import numpy as np
import pytest

from flared.errors import AdmissionError, ErrorKind, ExecutionError
from flared.scheduler import CompletionRecords, GraphKind, RequestPhase, handle_generation, handle_slot

from .helpers import MS, Driver, cost_ns, make_scheduler, prompt, records_for


def test_admission_allocates_the_worst_case_block_table_and_endpoint_snapshots():
    s = make_scheduler()
    h = s.admit(prompt(150), 10, 0, message_boundaries=[40, 100])
    r = s.request(h)
    assert (handle_slot(h), handle_generation(h), r.state_row) == (0, 1, 1)
    # ceil((150 + 10) / 16) = 10 pages, first pages off the free stack.
    assert list(s.block_table(h)) == list(range(10))
    # Costs unknown: only the anchor (last message boundary) is captured.
    assert (r.endpoints, r.endpoint_snapshots) == ([100], [0])
    assert r.phase_name == "PREFILL"
    h2 = s.admit(prompt(20, seed=1), 4, 0)
    assert (handle_slot(h2), handle_generation(h2)) == (1, 2)
    assert list(s.block_table(h2)) == [10, 11]
    assert s.request(h2).endpoints == [20]  # no boundary: the prompt end
    s.check_integrity()


def test_admission_rejections_carry_their_kind():
    s = make_scheduler(max_live_requests=1, num_pages=8)
    with pytest.raises(AdmissionError) as e:
        s.admit(prompt(1000), 100, 0)
    assert e.value.kind is ErrorKind.CONTEXT_LENGTH
    with pytest.raises(AdmissionError) as e:
        s.admit(prompt(200), 10, 0)  # 14 pages > 8
    assert e.value.kind is ErrorKind.MODEL_CAPACITY
    s.admit(prompt(20), 4, 0)
    with pytest.raises(AdmissionError) as e:
        s.admit(prompt(20), 4, 0)
    assert e.value.kind is ErrorKind.MODEL_CAPACITY
    with pytest.raises(AdmissionError):
        s.admit([], 4, 0)
    s.check_integrity()


def test_one_request_runs_prefill_to_its_checkpoint_prefill_decode_with_exact_inputs():
    s = make_scheduler()
    h = s.admit(prompt(150), 3, 0, message_boundaries=[40, 100])
    d = Driver(s)
    p = d.step()
    # Unmeasured: the largest useful capacity is explored first; it stops at the anchor.
    assert (p.kind, p.batch_capacity, p.token_capacity) == (GraphKind.PREFILL, 1, 128)
    assert list(p.token_starts) == [0] and list(p.num_tokens) == [100] and list(p.sample) == [0]
    assert list(p.tokens(0)) == list(prompt(150)[:100])
    assert (p.first_blocks[0], list(p.pages(0))) == (0, [0, 1, 2, 3, 4, 5, 6])
    # The chunk ends at the anchor, so the same frame copies its checkpoint after the forward:
    # snapshot 0 <- state row 1, partial page 6 holding 100 % 16 = 4 tokens; published at completion,
    # and the copies' own time measures the one-row snapshot shape.
    assert p.copies.tolist() == [[0, 1, 6, 4]]
    assert d.last_result.published == [0]
    assert s.timings.estimate((int(GraphKind.SNAPSHOT), 1, 0), d.now_ns) == (210_000, "fresh")
    assert s.timings.estimate((int(GraphKind.PREFILL), 1, 128), d.now_ns)[0] == 2 * MS + 20_000 * 128
    c = s.cache.get(0)
    assert (c.num_tokens, list(c.page_ids), c.snapshot_id, c.direct_pins) == (100, [0, 1, 2, 3, 4, 5], 0, 1)
    assert s.request(h).num_shared_pages == 6
    p = d.step()
    # 50 tokens left: the 64-token graph, because 128 would do the same work.
    assert (p.kind, p.token_capacity, list(p.num_tokens), list(p.sample)) == (GraphKind.PREFILL, 64, [50], [1])
    assert (p.first_blocks[0], list(p.pages(0))) == (6, [6, 7, 8, 9])
    first = d.emitted[h][0]
    p = d.step()
    assert (p.kind, list(p.token_starts), list(p.tokens(0))) == (GraphKind.DECODE, [150], [first])
    assert list(p.pages(0)) == [9]
    d.step()
    assert d.last_result.finished == [h] and d.last_result.retired == []
    assert len(d.emitted[h]) == 3
    # Decode earned 5% of its measured time, more than a measured snapshot
    # costs: the terminal state (150 prompt + 2 fed outputs) is captured.
    r = s.request(h)
    assert (r.phase_name, r.terminal_tokens, r.terminal_snapshot) == ("TERMINAL", 152, 1)
    p = d.step()
    assert p.kind == GraphKind.SNAPSHOT and p.copies.tolist() == [[1, 1, 9, 8]]
    assert d.last_result.published == [1] and d.last_result.retired == [h]
    c = s.cache.get(1)
    assert (c.parent_id, c.num_tokens, list(c.page_ids), c.snapshot_id) == (0, 152, [6, 7, 8], 1)
    assert s.num_live == 0 and s.pages.num_used == 9  # checkpoint pages stay cached, page 9 is free
    assert s.cache.get(0).total_pins == 0
    assert s.plan(d.now_ns) is None


def test_second_request_restores_the_shared_prefix_and_full_hits_resume_sampling():
    s = make_scheduler()
    shared = prompt(150)
    h1 = s.admit(shared, 2, 0, message_boundaries=[100])
    d = Driver(s)
    d.run()
    # Same first 100 tokens, different tail: restore from checkpoint 0.
    other = np.concatenate([shared[:100], prompt(30, seed=9)])
    h2 = s.admit(other, 2, d.now_ns)
    r2 = s.request(h2)
    assert (r2.reused_tokens, r2.num_shared_pages, r2.phase_name) == (100, 6, "RESTORE")
    assert list(s.block_table(h2))[:6] == [0, 1, 2, 3, 4, 5]
    p = d.step()
    assert p.kind == GraphKind.RESTORE
    partial_page = int(s.block_table(h2)[6])
    assert p.copies.tolist() == [[0, r2.state_row, partial_page, 4]]
    assert list(p.pages(0)) == list(s.block_table(h2)[:7])
    p = d.step()
    assert p.kind == GraphKind.PREFILL and list(p.token_starts) == [100] and list(p.num_tokens) == [30]
    d.run()
    # Published: request 1 at its anchor (100) and terminal state (151),
    # request 2 at its prompt end (130) and terminal state (131).
    assert sorted(s.cache.get(i).num_tokens for i in range(4)) == [100, 130, 131, 151]
    # A third identical prompt is a full hit at 130 (lookup stops at the prompt end).
    h3 = s.admit(other, 2, d.now_ns)
    assert s.request(h3).reused_tokens == 130
    kinds = []
    while (p := d.step()) is not None:
        kinds.append(p.kind)
    assert kinds[:3] == [GraphKind.RESTORE, GraphKind.RESUME_SAMPLING, GraphKind.DECODE]
    assert s.counters["prefix_hits"] == 2 and s.counters["prefix_reused_tokens"] == 230


def test_plan_validity_unrelated_admission_keeps_it_participant_change_breaks_it():
    s = make_scheduler()
    h = s.admit(prompt(40), 4, 0)
    p = s.plan(0)
    s.admit(prompt(30, seed=3), 4, 0)
    s.commit(p, 1)  # still valid
    s.complete(1, records_for(p), MS, MS)
    p2 = s.plan(MS)
    s.cancel(h) if p2.handles[0] == h else s.cancel(int(p2.handles[0]))
    with pytest.raises(ExecutionError, match="stale"):
        s.commit(p2, 2)
    p3 = s.plan(MS)
    s.commit(p3, 2)
    with pytest.raises(ExecutionError, match="already committed"):
        s.commit(p3, 3)
    other = make_scheduler()
    other.admit(prompt(10), 1, 0)
    with pytest.raises(ExecutionError, match="another scheduler"):
        s.commit(other.plan(0), 3)
    s.check_integrity()


def test_complete_validates_every_record_before_mutating():
    s = make_scheduler()
    h = s.admit(prompt(40), 4, 0)
    p = s.plan(0)
    s.commit(p, 5)
    good = records_for(p)
    bad_consumed = CompletionRecords(good.handles, good.consumed_tokens + 1, good.generated_tokens, good.token_ids)
    bad_handle = CompletionRecords(good.handles + 256, good.consumed_tokens, good.generated_tokens, good.token_ids)
    no_token = CompletionRecords(good.handles, good.consumed_tokens, good.generated_tokens, good.token_ids * 0 - 1)
    for bad, match in ((bad_consumed, "consumed"), (bad_handle, "handle"), (no_token, "sampled no token")):
        with pytest.raises(ExecutionError, match=match):
            s.complete(5, bad, MS, MS)
        assert s.request(h).num_computed_tokens == 0 and s.num_inflight == 1
    with pytest.raises(ExecutionError, match="expected 5"):
        s.complete(4, good, MS, MS)
    s.complete(5, good, MS, MS)
    assert s.request(h).num_computed_tokens == 40
    s.check_integrity()


def test_cancel_keeps_ownership_until_the_final_fence_completes():
    s = make_scheduler()
    h = s.admit(prompt(40), 4, 0)
    used_before = s.pages.num_used
    p = s.plan(0)
    s.commit(p, 1)
    assert s.cancel(h) == []  # in flight: nothing released yet
    assert s.pages.num_used == used_before and s.num_live == 1
    assert s.plan(0) is None
    s.check_integrity()
    result = s.complete(1, records_for(p), MS, MS)
    assert result.retired == [h] and result.emitted == []
    assert s.pages.num_used == 0 and s.snapshots.num_used == 0 and s.num_live == 0
    with pytest.raises(ExecutionError):
        s.request(h)
    # The slot is reused with a new generation; the old handle stays dead.
    h2 = s.admit(prompt(10), 1, MS)
    assert handle_slot(h2) == handle_slot(h) and h2 != h
    s.check_integrity()


def test_decode_pipelines_two_steps_and_finish_drops_the_late_token():
    s = make_scheduler()
    h = s.admit(prompt(20), 10, 0)
    d = Driver(s)
    d.until_decoding(h)
    d.step()  # measure decode b=1
    p1 = s.plan(d.now_ns)
    s.commit(p1, 100)
    p2 = s.plan(d.now_ns)
    assert p2.kind == GraphKind.DECODE and list(p2.tokens(0)) == [-1]  # input is p1's output
    assert p2.token_starts[0] == p1.token_starts[0] + 1
    s.commit(p2, 101)
    assert s.plan(d.now_ns) is None  # two frames in flight
    s.complete(100, records_for(p1), 2 * MS, d.now_ns + 2 * MS)
    assert s.finish(h, d.now_ns + 2 * MS) == []  # p2 still reads the slot
    result = s.complete(101, records_for(p2), 2 * MS, d.now_ns + 4 * MS)
    assert result.emitted == [] and result.retired == []
    # Terminal state: 20 prompt tokens + 3 fed outputs (p2 fed the third);
    # p2's own sample is past the stop: recorded, never emitted.
    r = s.request(h)
    assert (r.phase_name, r.terminal_tokens, len(r.output_tokens)) == ("TERMINAL", 23, 4)
    d.now_ns += 4 * MS
    d.fence = 101
    assert d.step().kind == GraphKind.SNAPSHOT
    assert d.last_result.retired == [h]
    assert s.cache.get(d.last_result.published[0]).num_tokens == 23
    s.check_integrity()


def test_release_after_shutdown_returns_every_resource():
    s = make_scheduler()
    handles = [s.admit(prompt(30, seed=i), 4, 0) for i in range(3)]
    p = s.plan(0)
    s.commit(p, 1)
    released = s.release_after_shutdown()
    assert sorted(released) == sorted(handles)
    assert s.num_live == 0 and s.num_inflight == 0 and s.pages.num_used == 0
    s.check_integrity()


def test_admission_evicts_lru_cache_leaves_for_pages():
    s = make_scheduler(num_pages=12, num_snapshots=4)
    d = Driver(s)
    a = s.admit(prompt(40, seed=1), 1, 0)  # 3 pages, checkpoint at 40 owns 2
    d.run()
    b = s.admit(prompt(40, seed=2), 1, d.now_ns)
    d.run()
    assert s.cache.num_checkpoints == 2 and s.pages.num_used == 4
    # 10 pages needed, 8 free: evict the least recently used leaf (checkpoint 0).
    s.admit(prompt(150, seed=3), 1, d.now_ns)
    assert s.cache.get(0) is None and s.cache.get(1) is not None
    assert s.counters["evictions"] == 1
    s.check_integrity()


def test_conditioning_enters_the_prefix_key_of_admitted_requests():
    s = make_scheduler()
    image_a, image_b = b"\x01" * 32, b"\x02" * 32
    tokens = prompt(60)
    d = Driver(s)
    s.admit(tokens, 1, 0, message_boundaries=[40], conditioning=[(10, image_a)])
    d.run()
    # Same tokens and image: the checkpoint at 40 is reused.
    h = s.admit(tokens, 1, d.now_ns, conditioning=[(10, image_a)])
    assert s.request(h).reused_tokens == 40
    s.cancel(h)
    # Another image at 10, or the same image elsewhere: no reuse past it.
    for events in ([(10, image_b)], [(11, image_a)]):
        h = s.admit(tokens, 1, d.now_ns, conditioning=events)
        assert s.request(h).reused_tokens == 0
        s.cancel(h)
    s.check_integrity()


def test_scored_prefill_and_state_initialization_phases():
    s = make_scheduler(initialize_state=True)
    d = Driver(s)
    fresh = s.admit(prompt(20, seed=4), 1, 0)
    kinds = [d.step().kind for _ in range(2)]
    assert kinds == [GraphKind.INITIALIZE, GraphKind.PREFILL]
    d.run()
    # Scoring needs logits at every prompt position: no reuse, scored prefill.
    scored = s.admit(prompt(20, seed=4), 1, d.now_ns, score_prompt=True)
    assert s.request(scored).reused_tokens == 0
    kinds = [p.kind for p in iter(d.step, None)]
    assert kinds[:2] == [GraphKind.INITIALIZE, GraphKind.SCORED_PREFILL]
    assert s.counters["launches_scored_prefill"] == 1 and fresh != scored
    s.check_integrity()


def test_duplicate_publication_keeps_the_live_request_on_its_own_pages():
    s = make_scheduler(num_snapshots=4)
    tokens = prompt(40)
    d = Driver(s)
    a = s.admit(tokens, 2, 0)
    b = s.admit(tokens, 2, 0)  # admitted together: neither can reuse the other
    assert (list(s.block_table(a)), list(s.block_table(b))) == ([0, 1, 2], [3, 4, 5])
    kinds = [(p.kind, int(p.handles[0]), d.last_result.published) for p in iter(d.step, None)]
    # a's prefill copies its prompt-end checkpoint in the same frame (published 0), then a decodes and
    # its terminal state is captured (1).
    assert kinds[:3] == [(GraphKind.PREFILL, a, [0]), (GraphKind.DECODE, a, []), (GraphKind.SNAPSHOT, a, [1])]
    # b's prompt-end checkpoint duplicates checkpoint 0: EXISTING, its snapshot
    # row is freed at once and b keeps pages 3, 4 (never remapped to 0, 1).
    assert (GraphKind.PREFILL, b, []) in kinds and s.counters["duplicate_publications"] == 1
    c0 = s.cache.get(0)
    assert (c0.num_tokens, list(c0.page_ids), c0.snapshot_id) == (40, [0, 1], 0)
    # b's terminal state (its own sampled token at 40) hangs off the root on its own pages.
    c2 = s.cache.get(2)
    assert (c2.parent_id, c2.num_tokens, list(c2.page_ids), c2.snapshot_id) == (-1, 41, [3, 4], 1)
    assert s.snapshots.num_used == s.cache.num_cached_snapshots == 3
    s.check_integrity()


class _Pipeline:
    """One request decoding (decode b=1 measured) and a hand-driven two-frame window over it."""

    def __init__(self):
        self.s = s = make_scheduler()
        a = s.admit(prompt(20), 200, 0)
        self.d = Driver(s)
        self.d.until_decoding(a)
        self.d.step()  # measure decode b=1
        self.fence = self.d.fence
        self.inflight = []

    def stack(self):
        p = self.s.plan(self.d.now_ns)
        if p is not None:
            self.fence += 1
            self.s.commit(p, self.fence)
            self.inflight.append((self.fence, p))
        return p

    def complete_oldest(self, now_ns=None):
        """Each frame takes exactly its estimate unless ``now_ns`` says when it completes."""
        f, p = self.inflight.pop(0)
        self.d.now_ns = self.d.now_ns + cost_ns(p) if now_ns is None else now_ns
        self.s.complete(f, records_for(p), cost_ns(p), self.d.now_ns)


def test_stacked_decode_frames_do_not_starve_waiting_prefill():
    """A pipeline of decode frames that all finish on time keeps the window occupied; a request that needs
    an empty window (here its prefill) must get it as soon as the policy prefers it to another decode
    (planning behind a frame in flight weighs every kind), instead of waiting for every decoding request
    to finish."""
    w = _Pipeline()
    s, d = w.s, w.d
    assert w.stack().kind == GraphKind.DECODE
    b = s.admit(prompt(30, seed=1), 4, d.now_ns)  # arrives while the decode pipeline runs
    stacked = 0
    while w.stack() is not None:
        assert w.inflight[-1][1].kind == GraphKind.DECODE
        stacked += 1
        assert stacked < 10, "decode frames kept stacking while the prefill waited"
        w.complete_oldest()
    assert stacked <= 2  # within one frame's estimate of waiting the pipeline may keep going
    while w.inflight:
        w.complete_oldest()
    p = s.plan(d.now_ns)
    assert p.kind == GraphKind.PREFILL and list(p.handles) == [b]
    s.check_integrity()


def test_a_stacked_frame_is_late_only_past_the_end_of_the_frame_it_queued_behind():
    """A decode frame stacked behind another starts when that one ends, so its expected finish counts from
    there: when the first completes on time, the second is not late and a third may stack behind it."""
    w = _Pipeline()
    first, second = w.stack(), w.stack()
    assert first.kind == second.kind == GraphKind.DECODE
    assert second.expected_finish_ns == first.expected_finish_ns + second.estimated_duration_ns
    # The first ends on time; the host completes it a little later. The second is not late.
    w.complete_oldest(now_ns=first.expected_finish_ns + 100_000)
    third = w.stack()
    assert third is not None and third.kind == GraphKind.DECODE
    # The second ran so long that the third's expected finish passed: the head is late, nothing stacks.
    w.complete_oldest(now_ns=third.expected_finish_ns + 1)
    assert w.s.plan(w.d.now_ns) is None
    w.s.check_integrity()


@pytest.mark.parametrize("warm", [True, False])
def test_the_two_frame_loop_keeps_its_pipeline(warm):
    """64 streams on the simulated two-frame loop (tools/simulate_window.py: the real scheduler and drive,
    H200 step durations). Measured shapes (a warm drive first, as bench_gpu): the window must not drain
    after every pair of frames (it did: a stacked frame looked late as soon as the one ahead completed).
    Cold shapes: work the policy keeps putting off must not turn pipelining off for everyone (it did: the
    window drained before ~85% of the decode steps). A lone late row's one-row steps at the end may drain
    (its 0.44 ms steps are shorter than the loop's host time per step); the wide cohort's must not."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tools"))
    import simulate_window

    r = simulate_window.simulate("135m", 64, 128, 96, 0.1, seed=0, warm=warm)
    assert r["steps"]["DECODE"] >= 95
    wide = sum(count for rows, count in r["rows"].items() if rows >= 32)
    wide_drained = sum(count for rows, count in r["drained_rows"].items() if rows >= 32)
    assert wide >= 80 and wide_drained <= 0.1 * wide, r
