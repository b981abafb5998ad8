"""Frame/fence bookkeeping of the two-frame executor (flared._fast.frames), on the CPU.

The rules under test are the executor's window rules: two frames; ordinary
decodes share the window; any other step needs it empty; a grammar step
needs it empty and blocks everything until consumed; completions are
consumed oldest first; a failed submission poisons; completion records are
one per physical slot and are joined with the device's tokens in
participant order.
"""

import numpy as np
import pytest

from flared._fast.frames import DRAINING, EXCLUSIVE, FRAMES, META_FIELDS, WINDOW, CompletionTable, FrameRing
from flared.errors import ErrorKind, ExecutionError


def submit(ring, klass):
    frame = ring.acquire(klass)
    if frame < 0:
        return frame, None
    return frame, ring.submitted(frame)


def test_two_decodes_share_the_window_and_a_third_gets_backpressure():
    ring = FrameRing()
    f1, fence1 = submit(ring, WINDOW)
    f2, fence2 = submit(ring, WINDOW)
    assert (f1, f2) == (0, 1) and (fence1, fence2) == (1, 2)
    assert ring.outstanding == 2
    assert ring.acquire(WINDOW) == -1
    assert ring.oldest() == f1
    assert ring.release(f1) == fence1
    f3, fence3 = submit(ring, WINDOW)
    assert f3 == f1 and fence3 == 3
    assert ring.oldest() == f2  # fence order, not frame order


def test_completions_are_consumed_in_fence_order():
    ring = FrameRing()
    f1, _ = submit(ring, WINDOW)
    f2, _ = submit(ring, WINDOW)
    with pytest.raises(ExecutionError, match="out of order"):
        ring.release(f2)
    ring.release(f1)
    ring.release(f2)
    assert ring.outstanding == 0 and ring.last_consumed_fence == 2
    with pytest.raises(ExecutionError):
        ring.release(f1)


def test_a_draining_step_needs_an_empty_window_and_holds_it():
    ring = FrameRing()
    f1, _ = submit(ring, WINDOW)
    assert ring.acquire(DRAINING) == -1
    ring.release(f1)
    f2, _ = submit(ring, DRAINING)
    assert f2 >= 0
    assert ring.acquire(WINDOW) == -1  # nothing joins a draining step
    assert ring.acquire(DRAINING) == -1
    ring.release(f2)
    assert ring.acquire(WINDOW) >= 0


def test_a_grammar_step_needs_an_empty_window_and_blocks_until_consumed():
    ring = FrameRing()
    f1, _ = submit(ring, WINDOW)
    assert ring.acquire(EXCLUSIVE) == -1
    ring.release(f1)
    g, _ = submit(ring, EXCLUSIVE)
    for klass in (WINDOW, DRAINING, EXCLUSIVE):
        assert ring.acquire(klass) == -1
    ring.release(g)
    assert ring.acquire(EXCLUSIVE) >= 0


def test_packing_frame_must_be_finished_or_abandoned():
    ring = FrameRing()
    f = ring.acquire(WINDOW)
    with pytest.raises(ExecutionError, match="being packed"):
        ring.acquire(WINDOW)
    ring.abandon(f)
    assert ring.outstanding == 0
    assert ring.next_fence == 1  # an abandoned frame used no fence


def test_poison_refuses_new_steps_but_in_flight_frames_can_drain():
    ring = FrameRing()
    f1, fence1 = submit(ring, WINDOW)
    packing = ring.acquire(WINDOW)
    ring.poison("cudaGraphLaunch failed (status 700)")
    assert ring.poisoned and "status 700" in ring.poison_reason
    assert ring.state(packing) == 0  # the frame that never reached the device is free again
    with pytest.raises(ExecutionError) as e:
        ring.acquire(WINDOW)
    assert e.value.kind == ErrorKind.POISONED
    assert ring.release(f1) == fence1


def test_frames_constant():
    assert FRAMES == 2 and META_FIELDS == 16


def test_records_are_per_physical_slot_and_parse_in_participant_order():
    table = CompletionTable(8)
    assert table.records.shape == (2, 8, META_FIELDS + 1)
    # Participants in plan order live in slots 5, 1, 6.
    table.write(1, 7, np.array([5, 1, 6], dtype=np.int64), np.array([261, 513, 1030], dtype=np.int64),
                np.array([10, 20, 30], dtype=np.int64), np.array([1, 2, 3], dtype=np.int64),
                np.array([1, 0, 1], dtype=np.uint8))
    assert table.records[1, :, 0].tolist() == [0, 1, 0, 0, 0, 1, 1, 0]
    handles, consumed, generated, tokens = table.parse(1, 7, np.array([42, 99, 43], dtype=np.int64))
    assert handles.tolist() == [261, 513, 1030]
    assert consumed.tolist() == [10, 20, 30]
    assert generated.tolist() == [1, 2, 3]
    assert tokens.tolist() == [42, -1, 43]  # participant 1 sampled nothing: its device token is ignored
    assert table.records[1, 5, META_FIELDS] == 42


def test_records_check_fence_slots_and_duplicates():
    table = CompletionTable(4)
    one = np.array([1], dtype=np.int64)
    table.write(0, 3, np.array([2], dtype=np.int64), one, one, one, np.array([1], dtype=np.uint8))
    with pytest.raises(ExecutionError, match="fence"):
        table.parse(0, 4, one)
    with pytest.raises(ExecutionError, match="outside"):
        table.write(0, 3, np.array([4], dtype=np.int64), one, one, one, np.array([1], dtype=np.uint8))
    two = np.array([1, 1], dtype=np.int64)
    with pytest.raises(ExecutionError, match="twice"):
        table.write(0, 3, two, two, two, two, np.array([1, 1], dtype=np.uint8))
    # The other frame's records are untouched by writes to frame 0.
    assert not table.records[1, :, 0].any()


def test_records_accept_read_only_plan_arrays():
    """ScheduledPlan arrays are read-only; writing records must not need a writable buffer."""
    arrays = [np.array([3], dtype=np.int64) for _ in range(4)]
    sample = np.array([1], dtype=np.uint8)
    for a in arrays + [sample]:
        a.setflags(write=False)
    table = CompletionTable(4)
    table.write(0, 1, *arrays, sample)
    tokens = np.array([9], dtype=np.int64)
    tokens.setflags(write=False)
    assert table.parse(0, 1, tokens)[3].tolist() == [9]
