"""Multi-sequence prefill graphs on the CPU side: manifest shapes, graph choice, the shapes the scheduler
gets, and packing a real scheduler's multi-sequence plan into the graph inputs (no GPU needed)."""

import hashlib

import numpy as np
import pytest

from flared.errors import ErrorKind, ExecutionError
from flared.execution.graphs import ExecutionManifest, default_prefill_batch_shapes, pack_prefill
from flared.scheduler import GraphKind, PolicyConfig, RequestScheduler, SchedulerConfig

PAGE = 16
SCRATCH_SLOT = 128 * PAGE


def manifest(batch_shapes=((2, 128), (4, 128)), **kw):
    args = dict(decode_batch_sizes=(1, 2, 4), prefill_token_sizes=(64, 128), max_pages_per_sequence=32,
                prefill_batch_shapes=batch_shapes)
    args.update(kw)
    m = ExecutionManifest.build(**args)
    m.validate()
    return m


def scheduler(m, concurrency=4):
    return RequestScheduler(SchedulerConfig(
        model_identity=hashlib.sha256(b"prefill-batches").digest(), max_live_requests=concurrency, num_pages=128,
        num_snapshots=16, page_tokens=PAGE, context_capacity=512, prefill_chunk_size=128,
        graph_shapes=m.scheduler_graph_shapes(concurrency)), PolicyConfig())


def test_default_batch_shapes_are_powers_of_two_within_concurrency_and_chunk():
    sizes = tuple(64 << i for i in range(6))  # 64 .. 2048
    shapes = default_prefill_batch_shapes(64, sizes)
    assert {b for b, _ in shapes} == {2, 4, 8, 16}
    assert all(t in sizes and t >= 128 and t >= 32 * b for b, t in shapes)
    assert (16, 2048) in shapes and (2, 128) in shapes and (16, 256) not in shapes
    assert len(shapes) == 17
    assert {b for b, _ in default_prefill_batch_shapes(3, sizes)} == {2}
    assert default_prefill_batch_shapes(1, sizes) == ()
    assert default_prefill_batch_shapes(64, (64,)) == ()
    # a larger cap: a cohort of 64 short prompts in one 8,192-token graph
    wide = default_prefill_batch_shapes(64, sizes + (4096, 8192), max_batch=64)
    assert (64, 8192) in wide and (32, 1024) in wide and (64, 1024) not in wide
    assert max(b for b, _ in wide) == 64 and len(wide) == 32


def test_layout_covers_the_largest_prefill_batch():
    m = manifest(batch_shapes=((2, 128), (8, 128)))
    assert m.max_batch == 8  # decode stops at 4; the prefill batch sets the per-sequence spans
    assert m.span("chunk_meta").shape == (8, 2)
    assert m.span("logit_rows").shape == (8,)
    assert m.span("block_tables").shape == (8, 32)
    assert m.prefill_shapes == ((1, 64), (1, 128), (2, 128), (8, 128))


@pytest.mark.parametrize("shapes, message", [
    (((1, 128),), "batch >= 2"),
    (((4, 2),), "at least one token"),
    (((2, 128), (2, 128)), "repeat"),
    (((2, 256),), "exceed"),
])
def test_validate_refuses_bad_batch_shapes(shapes, message):
    m = ExecutionManifest.build(decode_batch_sizes=(1, 2), prefill_token_sizes=(64, 128), max_pages_per_sequence=8)
    import dataclasses

    with pytest.raises(ExecutionError, match=message):
        dataclasses.replace(m, prefill_batch_shapes=shapes).validate()


def test_pick_takes_the_smallest_covering_graph():
    m = manifest()
    assert m.pick("prefill", 100) == ("prefill", 1, 128, True)
    assert m.pick("prefill", 64) == ("prefill", 1, 64, True)
    assert m.pick("prefill", 60, batch=2) == ("prefill", 2, 128, True)
    assert m.pick("prefill", 128, batch=3) == ("prefill", 4, 128, True)
    assert m.pick("decode", 3, False) == ("decode", 4, 4, False)
    for size, batch in ((129, 1), (10, 5)):
        with pytest.raises(ExecutionError) as e:
            m.pick("prefill", size, batch=batch)
        assert e.value.kind == ErrorKind.MODEL_CAPACITY


def test_scheduler_gets_exactly_the_captured_graph_shapes():
    m = manifest()
    shapes = SchedulerConfig(model_identity=bytes(32), max_live_requests=4, num_pages=8, num_snapshots=4,
                             page_tokens=PAGE, context_capacity=512, prefill_chunk_size=128,
                             graph_shapes=m.scheduler_graph_shapes(4)).graph_shapes
    prefill = sorted((b, t) for k, b, t in shapes if k == GraphKind.PREFILL)
    decode = sorted((b, t) for k, b, t in shapes if k == GraphKind.DECODE)
    assert prefill == [(1, 64), (1, 128), (2, 128), (4, 128)]
    assert decode == [(1, 1), (2, 2), (4, 4)]
    # The kinds run without a graph keep their default shapes.
    assert {k for k, _, _ in shapes} >= {GraphKind.RESTORE, GraphKind.SNAPSHOT, GraphKind.RESUME_SAMPLING}


def first_prefill_plan(with_scheduler=False):
    """Four fresh prompts (100, 10, 1, 40 tokens): the scheduler packs them into one (4, 128) prefill, the
    last one's chunk cut at the capacity (17 of 40 tokens, no sample)."""
    m = manifest()
    sched = scheduler(m)
    prompts = [list(range(5, 105)), list(range(200, 210)), [7], list(range(300, 340))]
    for p in prompts:
        sched.admit(p, 8, 1)
    plan = sched.plan(2)
    tables = [sched.block_table(int(h)) for h in plan.handles]
    if with_scheduler:
        return m, plan, tables, prompts, sched
    return m, plan, tables, prompts


def test_a_multi_sequence_plan_packs_back_to_back():
    m, plan, tables, prompts = first_prefill_plan()
    assert plan.kind == GraphKind.PREFILL and plan.num_participants == 4
    counts = [int(c) for c in plan.num_tokens]
    assert counts == [100, 10, 1, 17] and list(plan.sample) == [1, 1, 1, 0]
    key = m.pick("prefill", sum(counts), batch=4)
    assert key == ("prefill", 4, 128, True)
    v = m.host_views(np.zeros(m.total_bytes, dtype=np.uint8))
    used = pack_prefill(v, plan, tables, page_tokens=PAGE, scratch_slot=SCRATCH_SLOT, batch_capacity=4,
                        token_capacity=128)
    assert used == 4
    chunks = [prompts[0], prompts[1], prompts[2], prompts[3][:17]]
    assert v["token_ids"][:128].tolist() == [t for c in chunks for t in c]
    positions = [p for c in counts for p in range(c)]
    assert v["positions"][:128].tolist() == positions
    seq = np.repeat(np.arange(4), counts)
    want_slots = [int(tables[s][p // PAGE]) * PAGE + p % PAGE for s, p in zip(seq, positions)]
    assert v["slot_ids"][:128].tolist() == want_slots
    assert len(set(want_slots)) == 128  # every row writes its own K/V slot
    assert v["chunk_meta"][:4].tolist() == [[0, 100], [0, 10], [0, 1], [0, 17]]
    assert v["logit_rows"][:4].tolist() == [99, 109, 110, 127]
    assert v["state_rows"][:4].tolist() == [int(r) for r in plan.state_rows]
    for i, table in enumerate(tables):
        pages = -(-counts[i] // PAGE)
        assert v["block_tables"][i, :pages].tolist() == list(table[:pages])


def test_padding_sequences_and_rows_are_harmless():
    """Packed into a bigger graph: rows past the tokens write the scratch slot; sequences past the
    participants own no rows (meta 0, 0), sample into the scratch state row 0 from row 0."""
    _, plan, tables, _ = first_prefill_plan()
    big = manifest(batch_shapes=((8, 256),), prefill_token_sizes=(64, 256))
    v = big.host_views(np.full(big.total_bytes, 0xAB, dtype=np.uint8))  # stale bytes everywhere
    pack_prefill(v, plan, tables, page_tokens=PAGE, scratch_slot=SCRATCH_SLOT, batch_capacity=8, token_capacity=256)
    assert (v["slot_ids"][128:256] == SCRATCH_SLOT).all()
    assert (v["token_ids"][128:256] == 0).all() and (v["positions"][128:256] == 0).all()
    assert (v["chunk_meta"][4:8] == 0).all()
    assert (v["state_rows"][4:8] == 0).all() and (v["logit_rows"][4:8] == 0).all()
    with pytest.raises(ExecutionError, match="does not fit"):
        pack_prefill(v, plan, tables, page_tokens=PAGE, scratch_slot=SCRATCH_SLOT, batch_capacity=2,
                     token_capacity=256)


def test_a_continued_chunk_starts_at_its_cached_prefix():
    """The cut prompt's next chunk: positions and chunk meta start after its cached 17 tokens."""
    from flared.scheduler import plan_records

    m, plan, _, prompts, sched = first_prefill_plan(with_scheduler=True)
    sched.commit(plan, 1)
    n = plan.num_participants
    sched.complete(1, plan_records(plan, np.where(np.asarray(plan.sample) > 0, 11, -1)), 1_000_000, 3)
    for now in range(4, 40):
        nxt = sched.plan(now)
        if nxt is None or nxt.kind == GraphKind.PREFILL:
            break
        sched.commit(nxt, now)
        sched.complete(now, plan_records(nxt, np.full(nxt.num_participants, 11)), 1_000_000, now)
    assert n == 4 and nxt is not None and nxt.kind == GraphKind.PREFILL
    i = [int(h) for h in nxt.handles].index(int(plan.handles[3]))
    assert int(nxt.token_starts[i]) == 17 and int(nxt.num_tokens[i]) == 23 and nxt.sample[i] == 1
    tables = [sched.block_table(int(h)) for h in nxt.handles]
    key = m.pick("prefill", int(np.sum(nxt.num_tokens)), batch=nxt.num_participants)
    v = m.host_views(np.zeros(m.total_bytes, dtype=np.uint8))
    pack_prefill(v, nxt, tables, page_tokens=PAGE, scratch_slot=SCRATCH_SLOT, batch_capacity=key[1],
                 token_capacity=key[2])
    row = int(nxt.token_offsets[i])
    assert v["positions"][row:row + 23].tolist() == list(range(17, 40))
    assert v["chunk_meta"][i].tolist() == [17, 23]
    assert v["token_ids"][row:row + 23].tolist() == prompts[3][17:]
    assert v["logit_rows"][i] == row + 22


def test_each_token_row_gets_its_sequences_lora_adapter():
    """Per-request LoRA: pack_prefill writes each participant's adapter to all of its token rows (padding rows: 0,
    the base weights); without adapters the span is left alone (a decoder without adapters never reads it)."""
    _, plan, tables, _ = first_prefill_plan()
    big = manifest(batch_shapes=((8, 256),), prefill_token_sizes=(64, 256))
    v = big.host_views(np.full(big.total_bytes, 0xAB, dtype=np.uint8))  # stale bytes everywhere
    stale = v["lora_ids"].copy()
    pack_prefill(v, plan, tables, page_tokens=PAGE, scratch_slot=SCRATCH_SLOT, batch_capacity=8, token_capacity=256)
    assert np.array_equal(v["lora_ids"], stale)
    pack_prefill(v, plan, tables, page_tokens=PAGE, scratch_slot=SCRATCH_SLOT, batch_capacity=8, token_capacity=256,
                 adapters=[2, 0, 1, 2])
    assert v["lora_ids"][:128].tolist() == [2] * 100 + [0] * 10 + [1] + [2] * 17
    assert (v["lora_ids"][128:256] == 0).all()
    assert v["lora_ids"].dtype == np.int32
    # one id per token row, as token_ids; the decode spans hold one per decode row
    assert big.span("lora_ids").shape == big.span("token_ids").shape == (256,)
    assert big.span("decode_lora_ids").shape == big.span("decode_token_ids").shape == (4,)


def test_a_decode_plan_packs_into_the_decode_spans():
    """pack_decode (the GraphExecutor's decode packing): row i is participant i's token at its next position,
    writing the slot its block table maps, with its adapter in lora_ids; rows up to the graph's capacity are
    padding (scratch slot, state row 0, context 0, the base weights). Nothing outside the decode spans moves."""
    from flared.execution.graphs import DECODE_FIELDS, pack_decode
    from flared.scheduler import plan_records

    _, plan, _, prompts, sched = first_prefill_plan(with_scheduler=True)
    sched.commit(plan, 1)
    sched.complete(1, plan_records(plan, np.where(np.asarray(plan.sample) > 0, 11, -1)), 1_000_000, 3)
    for now in range(4, 40):  # the cut prompt's next chunk comes first
        dec = sched.plan(now)
        if dec is None or dec.kind == GraphKind.DECODE:
            break
        sched.commit(dec, now)
        sched.complete(now, plan_records(dec, np.full(dec.num_participants, 11)), 1_000_000, now)
    assert dec is not None and dec.kind == GraphKind.DECODE and dec.num_participants == 4
    n = dec.num_participants
    tables = [sched.block_table(int(h)) for h in dec.handles]
    starts = [int(s) for s in dec.token_starts]
    assert starts == [len(prompts[[int(h) for h in plan.handles].index(int(h))]) for h in dec.handles]
    m = manifest(decode_batch_sizes=(1, 2, 4, 8))  # a decode graph of 8 rows: 4 padding rows
    v = m.host_views(np.full(m.total_bytes, 0xAB, dtype=np.uint8))  # stale bytes everywhere
    before = {name: v[name].copy() for name in v if name not in DECODE_FIELDS}
    pack_decode(v, dec, tables, page_tokens=PAGE, scratch_slot=SCRATCH_SLOT, capacity=8, adapters=[1, 0, 3, 1])
    pad = [0] * 4
    assert v["decode_token_ids"].tolist() == [int(dec.token_ids[int(o)]) for o in dec.token_offsets[:n]] + pad
    assert v["decode_positions"].tolist() == starts + pad
    want_slots = [int(tables[i][p // PAGE]) * PAGE + p % PAGE for i, p in enumerate(starts)]
    assert v["decode_slot_ids"].tolist() == want_slots + [SCRATCH_SLOT] * 4
    assert v["decode_state_rows"].tolist() == [int(r) for r in dec.state_rows] + pad
    assert v["decode_context_lens"].tolist() == [p + 1 for p in starts] + pad
    assert v["decode_lora_ids"].tolist() == [1, 0, 3, 1] + pad
    for i, p in enumerate(starts):
        assert v["decode_block_tables"][i, :p // PAGE + 1].tolist() == list(tables[i][:p // PAGE + 1])
    assert all(np.array_equal(v[name], before[name]) for name in before)
    offset, nbytes = m.decode_upload(8)  # the step's one upload carries the adapters too
    lora = m.span("decode_lora_ids")
    assert offset <= lora.offset_bytes and lora.offset_bytes + lora.nbytes <= offset + nbytes
    stale = v["decode_lora_ids"].copy()
    pack_decode(v, dec, tables, page_tokens=PAGE, scratch_slot=SCRATCH_SLOT, capacity=8)  # no adapters: left alone
    assert np.array_equal(v["decode_lora_ids"], stale)
    with pytest.raises(ExecutionError, match="does not fit"):
        pack_decode(v, dec, tables, page_tokens=PAGE, scratch_slot=SCRATCH_SLOT, capacity=2)


def test_speculative_batch_sizes_hold_every_live_requests_drafts_up_to_64():
    from flared.execution.graphs import speculative_batch_sizes

    assert speculative_batch_sizes(4, 0) == ()
    assert speculative_batch_sizes(1, 4) == (2, 4, 8)  # 1 x (1 + 4) = 5 rows
    assert speculative_batch_sizes(4, 4) == (2, 4, 8, 16, 32)
    assert speculative_batch_sizes(64, 8) == (2, 4, 8, 16, 32, 64)
    assert speculative_batch_sizes(1, 1) == (2,)


def test_a_speculative_plan_packs_as_a_decode_row_per_fed_token():
    """speculative_rows + pack_decode (the GraphExecutor's speculative step): a request's last token and drafts
    are rows at consecutive positions, each writing the slot its block table maps there with context up to
    itself, on the scratch state row 0; a request without drafts is one row on its own state row."""
    from flared.execution.graphs import pack_decode, speculative_rows
    from flared.scheduler import plan_records

    m = manifest(decode_batch_sizes=(1, 2, 4, 8))
    s = RequestScheduler(SchedulerConfig(
        model_identity=hashlib.sha256(b"spec-rows").digest(), max_live_requests=4, num_pages=128,
        num_snapshots=16, page_tokens=PAGE, context_capacity=512, prefill_chunk_size=128,
        graph_shapes=m.scheduler_graph_shapes(4), speculative_tokens=3, speculative_max_rows=8), PolicyConfig())
    # the first prompt repeats (drafts 9 after "5 6 7 8"), ending one token before a page ends; the second never
    # speculates
    prompts = [[1] * 7 + [5, 6, 7, 8, 9, 5, 6, 7], [2, 3, 4]]
    handles = [s.admit(p, 20, 1, speculate=i == 0) for i, p in enumerate(prompts)]
    now = 2
    while not all(s.request(h).num_generated_tokens for h in handles):
        plan = s.plan(now)
        s.commit(plan, s.last_committed_fence + 1)
        s.complete(s.last_committed_fence, plan_records(plan, np.where(np.asarray(plan.sample) > 0, 8, -1)),
                   1000, now)
        now += 1
    plan = s.plan(now)
    assert plan.kind == GraphKind.SPECULATIVE and list(plan.num_tokens) == [2, 1]
    rows, part = speculative_rows(plan)
    assert part.tolist() == [0, 0, 1] and rows.num_participants == 3
    assert rows.depths.tolist() == [0, 1, 0]  # the last token, the draft; the other participant's last token
    tables = [s.block_table(int(h)) for h in plan.handles]
    v = m.host_views(np.full(m.total_bytes, 0xAB, dtype=np.uint8))
    pack_decode(v, rows, [tables[i] for i in part], page_tokens=PAGE, scratch_slot=SCRATCH_SLOT, capacity=4)
    assert v["decode_token_ids"][:4].tolist() == [8, 9, 8, 0]
    assert v["decode_positions"][:4].tolist() == [15, 16, 3, 0]  # the draft at 16 opens the first prompt's second page
    assert v["decode_context_lens"][:4].tolist() == [16, 17, 4, 0]
    assert v["decode_state_rows"][:4].tolist() == [0, 0, int(plan.state_rows[1]), 0]
    want = [int(tables[0][0]) * PAGE + 15, int(tables[0][1]) * PAGE, int(tables[1][0]) * PAGE + 3, SCRATCH_SLOT]
    assert v["decode_slot_ids"][:4].tolist() == want
    assert v["decode_block_tables"][1, :2].tolist() == list(tables[0][:2])
