"""Graph inputs layout, its validation, and the captured CUDA graphs of one core.

``ExecutionManifest`` names every static input as a byte span of one device
buffer (and of each pinned input frame, which has the same layout), and the
graph capacities to capture. ``validate()`` checks it completely before
anything is allocated: capacities positive and ordered, unique names, spans
aligned, in bounds, non-overlapping, and each span's bytes equal to its
shape times its dtype's size.

``GraphSet`` allocates the device input buffer, hands its views to the
decoder as ``StaticInputs``, warms every shape eagerly (Triton compiles,
cuBLAS picks kernels), then captures: prefill graphs for each (batch, token)
capacity (one sequence per graph at every token capacity, and the
multi-sequence shapes whose chunks are packed back to back) and decode
graphs for each batch capacity (greedy, full and temperature-only sampling), largest first,
all in one graph memory pool, on the model stream.
``launch(key, stream)`` replays through CuPy's ``cudaGraphLaunch``.

Rules:
- The span order is fixed by ``INPUT_FIELDS``; the executor uploads only
  the byte ranges a step changed and the rest keeps its device value.
- Decode graphs exist twice, one per device copy ("region") of the decode
  spans: region 0 in the input buffer, region 1 in ``decode_region_b``. The
  executor gives each of its two frames one region, so a step's upload never
  writes inputs that the step still running reads.
- Capture happens once at load; a capture failure is an ExecutionError and
  the core does not become ready.
"""

from __future__ import annotations

import contextlib
import gc
from dataclasses import dataclass

import numpy as np

from flared._fast.scheduler import SPECULATIVE_MAX_TOKENS
from flared.errors import ErrorKind, ExecutionError
from flared.model.kernels import FULL, GREEDY, TEMPERATURE

SPAN_ALIGN_BYTES = 256

# (name, dtype, shape in terms of T = max tokens, B = max batch, P = max pages per sequence)
_SHARED_FIELDS: tuple[tuple[str, str, tuple[str, ...]], ...] = (
    ("token_ids", "int64", ("T",)),
    ("positions", "int64", ("T",)),
    ("slot_ids", "int64", ("T",)),
    ("state_rows", "int64", ("B",)),
    ("block_tables", "int32", ("B", "P")),
    ("context_lens", "int32", ("B",)),
    ("chunk_meta", "int32", ("B", "2")),  # prefill: (num_cached_tokens, num_new_tokens) per sequence
    ("logit_rows", "int64", ("B",)),  # prefill: each sequence's last row (its logits are sampled)
    ("temperature", "float32", ("B",)),
    ("top_k", "int32", ("B",)),
    ("top_p", "float32", ("B",)),
    ("min_p_log", "float32", ("B",)),  # kernels.min_p_log_threshold: -inf = no min-p
    # 1: the row follows llama.cpp's default sampler chain (its filters judge the unscaled logits, top-p before
    # min-p; kernels.sampling.sample_full's ``chain``); 0: vLLM's order
    ("chain", "int32", ("B",)),
    # the Sampler slot whose bias and penalty tables shape the row before its draw (kernels.sampling); -1: none
    ("shape_slot", "int32", ("B",)),
    ("seeds", "int64", ("B",)),
    ("steps", "int64", ("B",)),
    # per-request LoRA adapter of each token row (a request's ``lora``: 0 = the base weights); read only by a
    # decoder with adapters (PagedCudaDecoder.lora)
    ("lora_ids", "int32", ("T",)),
)
# A decode step's inputs get their own spans ("decode_" + the field, one row per decode row: D = the largest
# decode batch), back to back with the block tables last, so one copy from the pinned frame carries a whole
# step (ExecutionManifest.decode_upload) instead of one per field, each of which cost the GPU microseconds at
# batch 1.
_DECODE_ORDER = ("token_ids", "positions", "slot_ids", "state_rows", "context_lens", "temperature", "top_k",
                 "top_p", "min_p_log", "chain", "shape_slot", "seeds", "steps", "lora_ids", "block_tables")
_BY_NAME = {name: (dtype, shape) for name, dtype, shape in _SHARED_FIELDS}
INPUT_FIELDS: tuple[tuple[str, str, tuple[str, ...]], ...] = _SHARED_FIELDS + tuple(
    ("decode_" + name, _BY_NAME[name][0], ("D",) + _BY_NAME[name][1][1:]) for name in _DECODE_ORDER)
DECODE_FIELDS = tuple(f[0] for f in INPUT_FIELDS if f[0].startswith("decode_"))


# Multi-sequence prefill graphs (default_prefill_batch_shapes): batches of 2..PREFILL_MAX_BATCH sequences
# (powers of two), at the one-sequence token capacities from PREFILL_BATCH_MIN_TOKENS up, with at least
# PREFILL_MIN_TOKENS_PER_SEQUENCE tokens per sequence of the batch.
PREFILL_MAX_BATCH = 16
PREFILL_BATCH_MIN_TOKENS = 128
PREFILL_MIN_TOKENS_PER_SEQUENCE = 32


def default_prefill_batch_shapes(concurrency: int, prefill_token_sizes,
                                 max_batch: int = PREFILL_MAX_BATCH) -> tuple[tuple[int, int], ...]:
    """(batch, tokens) capacities of the multi-sequence prefill graphs a core captures by default.

    Batching prompts pays most where a prefill step is bound by reading the weights (a few hundred tokens
    on a large model: one pass serves every prompt of the cohort); at the chunk size it saves the per-step
    overhead of many small chunks. The count stays small: each graph is one more capture at load (the
    graphs share one memory pool, which the largest sizes): at concurrency 64 and chunk 2048, 17 graphs.
    ``max_batch``: the most sequences a graph takes."""
    shapes = []
    b = 2
    while b <= min(concurrency, max_batch):
        for t in sorted(set(int(t) for t in prefill_token_sizes)):
            if t >= max(PREFILL_BATCH_MIN_TOKENS, PREFILL_MIN_TOKENS_PER_SEQUENCE * b):
                shapes.append((b, t))
        b *= 2
    return tuple(shapes)


def speculative_batch_sizes(concurrency: int, draft_tokens: int) -> tuple[int, ...]:
    """Row capacities of the speculative decode graphs ("decode_spec") an executor captures where requests feed up
    to ``draft_tokens`` drafts a step: powers of two from 2 up to the first that holds every live request's last
    token and drafts, at most the scheduler's SPECULATIVE_MAX_TOKENS (a step's tokens in all); () without drafts."""
    if draft_tokens <= 0:
        return ()
    most = min(SPECULATIVE_MAX_TOKENS, concurrency * (1 + draft_tokens))
    sizes = [2]
    while sizes[-1] < most:
        sizes.append(sizes[-1] * 2)
    return tuple(sizes)


@dataclass(frozen=True)
class Span:
    name: str
    dtype: str
    shape: tuple[int, ...]
    offset_bytes: int
    nbytes: int


@dataclass(frozen=True)
class ExecutionManifest:
    decode_batch_sizes: tuple[int, ...]
    prefill_token_sizes: tuple[int, ...]  # one-sequence prefill graphs (batch capacity 1)
    max_pages_per_sequence: int
    spans: tuple[Span, ...]
    total_bytes: int
    # Multi-sequence prefill graphs: (batch capacity >= 2, token capacity = total new tokens of the cohort).
    prefill_batch_shapes: tuple[tuple[int, int], ...] = ()

    @classmethod
    def build(cls, *, decode_batch_sizes, prefill_token_sizes, max_pages_per_sequence: int,
              prefill_batch_shapes=()) -> ExecutionManifest:
        decode_batch_sizes = tuple(sorted(int(b) for b in decode_batch_sizes))
        prefill_token_sizes = tuple(sorted(int(t) for t in prefill_token_sizes))
        prefill_batch_shapes = tuple(sorted((int(b), int(t)) for b, t in prefill_batch_shapes))
        max_batch = max(max(decode_batch_sizes, default=1), max((b for b, _ in prefill_batch_shapes), default=1))
        max_tokens = max(max(prefill_token_sizes, default=1), max((t for _, t in prefill_batch_shapes), default=1),
                         max_batch)
        dims = {"T": max_tokens, "B": max_batch, "D": max(decode_batch_sizes, default=1), "P": max_pages_per_sequence,
                "1": 1, "2": 2}
        spans = []
        offset = 0
        for name, dtype, shape_names in INPUT_FIELDS:
            shape = tuple(dims[s] for s in shape_names)
            nbytes = int(np.prod(shape)) * np.dtype(dtype).itemsize
            spans.append(Span(name, dtype, shape, offset, nbytes))
            offset += -(-nbytes // SPAN_ALIGN_BYTES) * SPAN_ALIGN_BYTES
        return cls(decode_batch_sizes, prefill_token_sizes, max_pages_per_sequence, tuple(spans), offset,
                   prefill_batch_shapes)

    @property
    def prefill_shapes(self) -> tuple[tuple[int, int], ...]:
        """Every prefill graph as (batch capacity, token capacity), batch 1 included, ordered."""
        return tuple(sorted([(1, t) for t in self.prefill_token_sizes] + list(self.prefill_batch_shapes)))

    @property
    def max_batch(self) -> int:
        return max(max(self.decode_batch_sizes), max((b for b, _ in self.prefill_batch_shapes), default=1))

    @property
    def max_tokens(self) -> int:
        return max(max((t for _, t in self.prefill_shapes), default=1), self.max_batch)

    def pick(self, kind: str, size: int, full_sampling: bool = True, *, batch: int = 1) -> tuple[str, int, int, bool]:
        """Key of the smallest graph that holds a step: a decode of ``size`` rows, or a prefill of ``size``
        new tokens over ``batch`` sequences (fewest token rows first, then fewest sequences)."""
        if kind == "decode":
            for cap in self.decode_batch_sizes:
                if cap >= size:
                    return graph_key(kind, cap, cap, full_sampling)
            raise ExecutionError(f"no decode graph holds {size} (captured: {self.decode_batch_sizes})",
                                 ErrorKind.MODEL_CAPACITY)
        shapes = self.prefill_shapes
        fits = [(t, b) for b, t in shapes if b >= batch and t >= size]
        if not fits:
            raise ExecutionError(f"no prefill graph holds {batch} sequences of {size} tokens (captured: {shapes})",
                                 ErrorKind.MODEL_CAPACITY)
        tokens, b = min(fits)
        return graph_key(kind, b, tokens, True)

    def pick_decode(self, rows: int, full_sampling: bool, longest_context: int, *, mega_rows: int,
                    mega_max_context: int, adapters: bool = False) -> tuple[str, int, int, bool]:
        """The decode graph for ``rows`` rows: the megakernel's (kind "decode_mega", captured for capacities up
        to ``mega_rows``) while the step's longest context is at most ``mega_max_context``, else the plain one.
        The megakernel's attention gives each (row, head) one block, so long contexts run slower there than in
        the split-context kernels of the plain graphs. ``adapters``: some row of the step names a per-request
        LoRA adapter, so it takes the graph that adds the adapter terms (kind "decode_lora", the layered forward;
        a decoder with adapters captures it beside the others, which the steps without an adapter row keep)."""
        key = self.pick("decode", rows, full_sampling)
        if adapters:  # captured greedy and FULL only
            return graph_key("decode_lora", key[1], key[2], FULL if key[3] else GREEDY)
        if key[1] <= mega_rows and longest_context <= mega_max_context:
            return graph_key("decode_mega", key[1], key[2], key[3])
        return key

    def scheduler_graph_shapes(self, concurrency: int) -> tuple[tuple[int, int, int], ...]:
        """The (kind, batch_capacity, token_capacity) triples for ``SchedulerConfig.graph_shapes``: the decode
        and prefill graphs captured from this manifest, and the default shapes of the kinds that run
        without a graph (flared.scheduler.config.default_graph_shapes), so the scheduler plans exactly
        the shapes the executor can launch."""
        from flared.scheduler import GraphKind, default_graph_shapes

        graph_kinds = (int(GraphKind.DECODE), int(GraphKind.PREFILL))
        chunk = max(t for _, t in self.prefill_shapes)
        shapes = [s for s in default_graph_shapes(concurrency, chunk) if s[0] not in graph_kinds]
        shapes += [(int(GraphKind.DECODE), b, b) for b in self.decode_batch_sizes]
        shapes += [(int(GraphKind.PREFILL), b, t) for b, t in self.prefill_shapes]
        return tuple(shapes)

    def decode_upload(self, capacity: int) -> tuple[int, int]:
        """(byte offset, byte count) of the one copy that carries a decode step of ``capacity`` rows: every
        decode span (rows past ``capacity`` come along; no graph of this capacity reads them), the block
        tables only up to ``capacity`` rows."""
        first = self.span(DECODE_FIELDS[0])
        tables = self.span("decode_block_tables")
        end = tables.offset_bytes + capacity * (tables.nbytes // tables.shape[0])
        return first.offset_bytes, end - first.offset_bytes

    def span(self, name: str) -> Span:
        for s in self.spans:
            if s.name == name:
                return s
        raise KeyError(name)

    def validate(self) -> None:
        def bad(what: str) -> ExecutionError:
            return ExecutionError(f"execution manifest: {what}", ErrorKind.EXECUTION)

        if not self.decode_batch_sizes or any(b <= 0 for b in self.decode_batch_sizes):
            raise bad(f"decode batch sizes must be positive, got {self.decode_batch_sizes}")
        if any(t <= 0 for t in self.prefill_token_sizes):
            raise bad(f"prefill token sizes must be positive, got {self.prefill_token_sizes}")
        for sizes, what in ((self.decode_batch_sizes, "decode batch"), (self.prefill_token_sizes, "prefill token")):
            if len(set(sizes)) != len(sizes):
                raise bad(f"{what} sizes repeat: {sizes}")
        for b, t in self.prefill_batch_shapes:
            if b < 2 or t < b:
                raise bad(f"prefill batch shape {(b, t)} needs batch >= 2 and at least one token per sequence")
        if len(set(self.prefill_batch_shapes)) != len(self.prefill_batch_shapes):
            raise bad(f"prefill batch shapes repeat: {self.prefill_batch_shapes}")
        if self.prefill_batch_shapes and not self.prefill_token_sizes:
            raise bad("prefill batch shapes need one-sequence prefill graphs too")
        if any(t > max(self.prefill_token_sizes) for _, t in self.prefill_batch_shapes):
            raise bad(f"prefill batch shapes {self.prefill_batch_shapes} exceed the largest prefill token size "
                      f"{max(self.prefill_token_sizes)} (the prefill chunk)")
        if self.max_pages_per_sequence <= 0:
            raise bad(f"max_pages_per_sequence must be positive, got {self.max_pages_per_sequence}")
        names = [s.name for s in self.spans]
        if len(set(names)) != len(names):
            raise bad(f"span names repeat: {names}")
        if set(names) != {f[0] for f in INPUT_FIELDS}:
            raise bad(f"spans {sorted(names)} are not the graph inputs {sorted(f[0] for f in INPUT_FIELDS)}")
        end = 0
        for s in sorted(self.spans, key=lambda s: s.offset_bytes):
            if s.offset_bytes % SPAN_ALIGN_BYTES:
                raise bad(f"span {s.name} at byte {s.offset_bytes} is not {SPAN_ALIGN_BYTES}-byte aligned")
            if s.offset_bytes < end:
                raise bad(f"span {s.name} at byte {s.offset_bytes} overlaps the span before it (ends at {end})")
            expected = int(np.prod(s.shape)) * np.dtype(s.dtype).itemsize
            if s.nbytes != expected:
                raise bad(f"span {s.name} holds {s.nbytes} bytes, its shape {s.shape} of {s.dtype} needs {expected}")
            end = s.offset_bytes + s.nbytes
        if end > self.total_bytes:
            raise bad(f"spans end at byte {end}, past the buffer's {self.total_bytes}")
        in_order = [s.name for s in sorted(self.spans, key=lambda s: s.offset_bytes)]
        if in_order[-len(DECODE_FIELDS):] != list(DECODE_FIELDS):
            raise bad("the decode spans must come last, in order, decode_block_tables last (one upload per step)")

    def host_views(self, buffer: np.ndarray) -> dict[str, np.ndarray]:
        """Typed numpy views of a uint8 buffer (a pinned frame) laid out like the device inputs."""
        if buffer.nbytes < self.total_bytes:
            raise ExecutionError(f"frame of {buffer.nbytes} bytes is smaller than the {self.total_bytes}-byte layout")
        return {s.name: buffer[s.offset_bytes:s.offset_bytes + s.nbytes].view(s.dtype).reshape(s.shape)
                for s in self.spans}


def pack_prefill(views: dict[str, np.ndarray], plan, block_tables, *, page_tokens: int, scratch_slot: int,
                 batch_capacity: int, token_capacity: int, adapters=None) -> int:
    """Write a prefill plan's graph inputs into host views of the manifest layout (a pinned frame).

    The participants' chunks go back to back in the token rows, in plan order (the plan's flat token_ids
    already are): rows ``token_offsets[i]:token_offsets[i+1]`` hold participant i's tokens at positions
    ``token_starts[i]..``, each writing its K/V to the slot its own block table maps. Per sequence:
    its block-table row i, ``chunk_meta[i] = (token_starts[i], num_tokens[i])``, ``logit_rows[i]`` = its
    last row, ``state_rows[i]``. Padding: rows past the tokens write the scratch slot; sequences past the
    participants get meta (0, 0), state row 0 (the scratch row) and logit row 0. ``adapters``: each
    participant's per-request LoRA adapter (its request's ``lora``), written to each of its token rows'
    ``lora_ids`` (padding rows 0, the base weights); None leaves that span alone (a decoder without adapters
    never reads it). Returns the block-table rows in use (the participants)."""
    P = page_tokens
    n = plan.num_participants
    starts = np.asarray(plan.token_starts, dtype=np.int64)
    counts = np.asarray(plan.num_tokens, dtype=np.int64)
    offsets = np.asarray(plan.token_offsets, dtype=np.int64)[:n + 1]
    total = int(offsets[n])
    if n > batch_capacity or total > token_capacity:
        raise ExecutionError(f"a prefill of {n} sequences and {total} tokens does not fit the graph "
                             f"({batch_capacity}, {token_capacity})", ErrorKind.MODEL_CAPACITY)
    v = views
    v["token_ids"][:total] = np.asarray(plan.token_ids, dtype=np.int64)[:total]
    v["token_ids"][total:token_capacity] = 0
    seq_of_row = np.repeat(np.arange(n), counts)
    pos = np.repeat(starts - offsets[:n], counts) + np.arange(total, dtype=np.int64)
    v["positions"][:total] = pos
    v["positions"][total:token_capacity] = 0
    tables = v["block_tables"]
    for i in range(n):
        pages_used = (int(starts[i]) + int(counts[i]) + P - 1) // P
        tables[i, :pages_used] = np.asarray(block_tables[i], dtype=np.int32)[:pages_used]
    v["slot_ids"][:total] = tables[seq_of_row, pos // P].astype(np.int64) * P + pos % P
    v["slot_ids"][total:token_capacity] = scratch_slot
    v["state_rows"][:n] = np.asarray(plan.state_rows, dtype=np.int64)
    v["state_rows"][n:batch_capacity] = 0
    meta = v["chunk_meta"]
    meta[:n, 0] = starts
    meta[:n, 1] = counts
    meta[n:batch_capacity] = 0
    v["logit_rows"][:n] = np.maximum(offsets[1:] - 1, 0)
    v["logit_rows"][n:batch_capacity] = 0
    if adapters is not None:
        v["lora_ids"][:total] = np.repeat(np.asarray(adapters, dtype=np.int32)[:n], counts)
        v["lora_ids"][total:token_capacity] = 0
    return n


def pack_decode(views: dict[str, np.ndarray], plan, block_tables, *, page_tokens: int, scratch_slot: int,
                capacity: int, adapters=None) -> None:
    """Write a decode plan's graph inputs into the decode spans (``decode_`` + the field) of host views of the
    manifest layout (a pinned frame), all but the sampling fields (the caller's, as for a prefill).

    Row i is participant i's one new token (the plan's; -1 = what its state row sampled last, read on the
    device) at position ``token_starts[i]``, writing its K/V to the slot its block table maps there, with
    context ``token_starts[i] + 1``; its block-table row holds the pages up to that position. ``adapters``:
    each participant's per-request LoRA adapter, into ``lora_ids`` (None leaves that span alone, as in
    ``pack_prefill``). Rows past the participants, up to ``capacity``: token 0 at position 0, the scratch slot,
    state row 0 (the scratch row), context 0, the base weights."""
    P = page_tokens
    n = plan.num_participants
    if n > capacity:
        raise ExecutionError(f"a decode of {n} rows does not fit the graph ({capacity})", ErrorKind.MODEL_CAPACITY)
    f = "decode_"
    v = views
    starts = np.asarray(plan.token_starts, dtype=np.int64)[:n]
    offsets = np.asarray(plan.token_offsets, dtype=np.int64)[:n]
    v[f + "token_ids"][:n] = np.asarray(plan.token_ids, dtype=np.int64)[offsets]
    v[f + "token_ids"][n:capacity] = 0
    v[f + "positions"][:n] = starts
    v[f + "positions"][n:capacity] = 0
    tables = v[f + "block_tables"]
    for i in range(n):
        pages_used = int(starts[i]) // P + 1
        tables[i, :pages_used] = block_tables[i][:pages_used]
    pages_of = tables[np.arange(n), starts // P].astype(np.int64)
    v[f + "slot_ids"][:n] = pages_of * P + starts % P
    v[f + "slot_ids"][n:capacity] = scratch_slot
    v[f + "state_rows"][:n] = np.asarray(plan.state_rows, dtype=np.int64)[:n]
    v[f + "state_rows"][n:capacity] = 0
    v[f + "context_lens"][:n] = starts + 1
    v[f + "context_lens"][n:capacity] = 0
    if adapters is not None:
        v[f + "lora_ids"][:n] = np.asarray(adapters, dtype=np.int32)[:n]
        v[f + "lora_ids"][n:capacity] = 0


@dataclass
class SpeculativeRows:
    """A speculative step laid out as decode rows, a row per fed token (what pack_decode reads of a plan)."""
    num_participants: int  # rows
    token_starts: np.ndarray  # each row's position
    token_offsets: np.ndarray  # 0, 1, ... (a token a row)
    token_ids: np.ndarray
    state_rows: np.ndarray
    sample: np.ndarray
    depths: np.ndarray  # each row's place among its participant's fed tokens (0: its last token, j: draft j)


def speculative_rows(plan) -> tuple[SpeculativeRows, np.ndarray]:
    """A SPECULATIVE plan as decode rows, and each row's participant: participant i's fed tokens (its last token,
    then its drafts) are rows token_offsets[i].. at consecutive positions from its start, each with the
    participant's sample flag. A participant with drafts gets the scratch state row 0 on every row (its state row
    takes the kept row's logits and token after the step); one without keeps its own."""
    n = plan.num_participants
    offsets = np.asarray(plan.token_offsets, dtype=np.int64)[:n + 1]
    widths = np.diff(offsets)
    part = np.repeat(np.arange(n), widths)
    depth = np.arange(len(part)) - offsets[part]
    state_rows = np.asarray(plan.state_rows, dtype=np.int64)[:n]
    rows = SpeculativeRows(num_participants=len(part),
                           token_starts=np.asarray(plan.token_starts, dtype=np.int64)[part] + depth,
                           token_offsets=np.arange(len(part) + 1, dtype=np.int64),
                           token_ids=np.asarray(plan.token_ids, dtype=np.int64)[:len(part)],
                           state_rows=np.where(widths[part] > 1, 0, state_rows[part]),
                           sample=np.asarray(plan.sample, dtype=np.uint8)[part], depths=depth)
    return rows, part


@contextlib.contextmanager
def collector_paused():
    """Around CUDA graph captures: a graph object destroyed while a capture is open (an unreachable executor's
    graphs, freed by the cyclic garbage collector at any allocation) invalidates that capture, so collect first and
    keep the collector off until the captures are done."""
    gc.collect()
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()


def time_graph_us(fn, stream, *, calls_per_graph: int = 1, replays: int = 20) -> float:
    """GPU microseconds per call of ``fn`` as a CUDA graph pays them (launch gaps included): ``fn`` runs
    once eagerly (Triton compiles and autotunes there, never inside a capture), is captured
    ``calls_per_graph`` times into one graph on ``stream`` (a torch.cuda.Stream), and the graph is
    replayed ``replays`` times between two events."""
    import torch

    with torch.cuda.stream(stream):
        fn()
        stream.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=stream):
            for _ in range(calls_per_graph):
                fn()
        graph.replay()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record(stream)
        for _ in range(replays):
            graph.replay()
        end.record(stream)
        end.synchronize()
    return start.elapsed_time(end) * 1e3 / (replays * calls_per_graph)


def graph_key(kind: str, batch: int, tokens: int, full_sampling: int = True) -> tuple[str, int, int, bool]:
    """(kind, batch capacity, token capacity, sampler); a decode graph has tokens == batch, a prefill graph always
    samples fully. The sampler is flared.model.kernels' GREEDY (0/False), FULL (1/True: temperature, top-k and
    top-p) or TEMPERATURE (2: temperature alone, no sort; plain and megakernel decode graphs)."""
    return (kind, batch, tokens, full_sampling)


class GraphSet:
    """Device inputs, the paged decoder and its captured graphs (CUDA only)."""

    def __init__(self, model, manifest: ExecutionManifest, *, num_pages: int, page_tokens: int,
                 num_state_rows: int, lora=None, spec_batch_sizes=(), kv_dtype=None,
                 samplers=(GREEDY, FULL, TEMPERATURE)):
        """``lora``: the per-request LoRA adapters (kernels/lora_rows.StackedLora) the decoder's graphs run for
        the rows that name one (``lora_ids``); None: none. ``spec_batch_sizes``: the row capacities of the
        speculative decode graphs (kind "decode_spec": a row per fed token, every row's K/V written before any row
        attends; speculative_batch_sizes), each of them also a decode capacity of ``manifest``; () = none.
        ``kv_dtype``: the KV pool's element type (PagedCudaDecoder's; None: the model's). ``samplers``: the decode
        graphs' sampler variants to capture (a draft model's greedy forwards need GREEDY alone)."""
        import torch

        from flared.model.kernels.paged_decoder import PagedCudaDecoder, StaticInputs

        manifest.validate()
        self.manifest = manifest
        self.device = model.device
        self.input_buffer = torch.zeros(manifest.total_bytes, dtype=torch.uint8, device=self.device)
        views = {}
        for s in manifest.spans:
            raw = self.input_buffer[s.offset_bytes:s.offset_bytes + s.nbytes]
            views[s.name] = raw.view(getattr(torch, s.dtype)).view(s.shape)
        self.inputs = StaticInputs(**{k: v for k, v in views.items() if k not in DECODE_FIELDS})
        # Decode graphs read the decode spans (one upload per step), under the same field names.
        self.decode_inputs = StaticInputs(**{k[len("decode_"):]: views[k] for k in DECODE_FIELDS},
                                          chunk_meta=None, logit_rows=None)
        # A second device copy of the decode spans (region 1; region 0 is input_buffer's own), and every decode
        # graph captured over each: the executor uploads a step's inputs into the region its frame owns on a side
        # stream while the step before still runs, so the model stream does not wait for the copy (~10 us a
        # step on the H200 at one row, where the step is the model stream's only work).
        first = manifest.span(DECODE_FIELDS[0]).offset_bytes
        tables = manifest.span("decode_block_tables")
        self.decode_span_offset = first
        self.decode_region_b = torch.zeros(tables.offset_bytes + tables.nbytes - first, dtype=torch.uint8,
                                           device=self.device)
        views_b = {}
        for s in manifest.spans:
            if s.name in DECODE_FIELDS:
                raw = self.decode_region_b[s.offset_bytes - first:s.offset_bytes - first + s.nbytes]
                views_b[s.name] = raw.view(getattr(torch, s.dtype)).view(s.shape)
        self.decode_inputs_b = StaticInputs(**{k[len("decode_"):]: views_b[k] for k in DECODE_FIELDS},
                                            chunk_meta=None, logit_rows=None)
        self.decoder = PagedCudaDecoder(model, self.inputs, decode_inputs=self.decode_inputs,
                                        num_pages=num_pages, page_tokens=page_tokens,
                                        num_state_rows=num_state_rows, max_batch=manifest.max_batch,
                                        max_tokens=manifest.max_tokens, lora=lora, kv_dtype=kv_dtype)
        self.graphs: dict[tuple[str, int, int, bool], torch.cuda.CUDAGraph] = {}
        self.graph_execs: dict[tuple[str, int, int, bool], int] = {}
        missing = set(spec_batch_sizes) - set(manifest.decode_batch_sizes)
        if missing:
            raise ValueError(f"speculative capacities {sorted(missing)} are not decode capacities of the manifest")
        self.spec_batch_sizes = tuple(sorted(spec_batch_sizes))
        self.samplers = tuple(samplers)
        # the decode graphs again, over decode_region_b (decode_execs(1))
        self.graphs_b: dict[tuple[str, int, int, bool], torch.cuda.CUDAGraph] = {}
        self.graph_execs_b: dict[tuple[str, int, int, bool], int] = {}
        self.capture_s = 0.0
        # Seconds of load each graph cost: its eager warm-up (Triton compiles the first time a variant
        # runs) plus its capture.
        self.key_seconds: dict[tuple[str, int, int, bool], float] = {}

    @property
    def input_ptr(self) -> int:
        return self.input_buffer.data_ptr()

    def decode_region_ptr(self, region: int) -> int:
        """Device address that region ``region`` (0 or 1) puts byte ``decode_span_offset`` of the manifest at: a
        decode span at manifest offset o lies at ``decode_region_ptr(region) + o - decode_span_offset``."""
        if region == 0:
            return self.input_ptr + self.decode_span_offset
        return self.decode_region_b.data_ptr()

    def decode_execs(self, region: int) -> dict[tuple[str, int, int, bool], int]:
        """The graphs whose decode steps read region ``region`` (prefill graphs: region 0's dict only)."""
        return self.graph_execs if region == 0 else self.graph_execs_b

    def _reset_inputs(self) -> None:
        """Inputs that make every shape valid to run: padding rows, scratch slots, an empty chunk."""
        for s in (self.inputs, self.decode_inputs, self.decode_inputs_b):
            s.token_ids.zero_()
            s.positions.zero_()
            s.slot_ids.fill_(self.decoder.scratch_slot)
            s.state_rows.zero_()
            s.block_tables.fill_(self.decoder.num_pages)  # the scratch page
            s.context_lens.zero_()
            if s.chunk_meta is not None:
                s.chunk_meta.zero_()
                s.logit_rows.zero_()
            s.temperature.zero_()
            s.top_k.zero_()
            s.top_p.fill_(1.0)
            s.min_p_log.fill_(float("-inf"))
            s.chain.zero_()
            s.shape_slot.fill_(-1)
            s.seeds.zero_()
            s.steps.zero_()
            s.lora_ids.zero_()

    def _run_eager(self, key) -> None:
        """Run graph ``key``'s work on the current stream."""
        kind, batch, tokens, full = key
        if kind == "decode":
            self.decoder.decode(batch, full, mega=False)
        elif kind == "decode_mega":
            self.decoder.decode(batch, full, mega=True)
        elif kind == "decode_lora":
            self.decoder.decode(batch, full, mega=False, adapters=True)
        elif kind == "decode_spec":  # a decoder with adapters runs their terms for the rows that name one
            self.decoder.decode(batch, full, mega=False, adapters=self.decoder.lora is not None, speculative=True)
        else:
            self.decoder.prefill(batch, tokens)

    def keys(self) -> list[tuple[str, int, int, bool]]:
        m = self.manifest
        keys = [graph_key("prefill", b, t) for b, t in m.prefill_shapes]
        for b in m.decode_batch_sizes:
            keys += [graph_key("decode", b, b, v) for v in self.samplers]
            # Batches the decode megakernel serves (after calibrate) get a second set of graphs; the executor
            # takes them while the step's longest context is short enough (see pick_decode).
            if b <= self.decoder.mega_max_rows:
                keys += [graph_key("decode_mega", b, b, v) for v in self.samplers]
            # With per-request LoRA adapters, a third pair adds their terms (the layered forward); steps with no
            # adapter row keep the graphs above, the fastest paths (pick_decode).
            if self.decoder.lora is not None:
                keys += [graph_key("decode_lora", b, b, v) for v in (GREEDY, FULL) if v in self.samplers]
        for b in self.spec_batch_sizes:
            keys += [graph_key("decode_spec", b, b, v) for v in (GREEDY, FULL) if v in self.samplers]
        # Largest first (token rows, then batch rows): later, smaller graphs reuse the pool's blocks.
        return sorted(keys, key=lambda k: (-k[2], -k[1], k[0], k[3]))

    def capture(self, stream) -> None:
        """Warm every shape, then capture all graphs on ``stream`` (a torch.cuda.Stream) in one pool."""
        import time

        import torch

        started = time.perf_counter()
        try:
            with collector_paused(), torch.inference_mode(), torch.cuda.stream(stream):
                self._reset_inputs()
                self.decoder.calibrate(stream)
                self._reset_inputs()
                keys = self.keys()
                for key in keys:
                    t = time.perf_counter()
                    self._run_eager(key)
                    stream.synchronize()
                    self.key_seconds[key] = time.perf_counter() - t
                pool = torch.cuda.graph_pool_handle()
                for key in keys:
                    t = time.perf_counter()
                    g = torch.cuda.CUDAGraph()
                    with torch.cuda.graph(g, pool=pool, stream=stream):
                        self._run_eager(key)
                    self.graphs[key] = g
                    self.graph_execs[key] = int(g.raw_cuda_graph_exec())
                    if key[0] != "prefill":  # again over region 1
                        region_a, self.decoder.decode_inputs = self.decoder.decode_inputs, self.decode_inputs_b
                        try:
                            g = torch.cuda.CUDAGraph()
                            with torch.cuda.graph(g, pool=pool, stream=stream):
                                self._run_eager(key)
                        finally:
                            self.decoder.decode_inputs = region_a
                        self.graphs_b[key] = g
                        self.graph_execs_b[key] = int(g.raw_cuda_graph_exec())
                    self.key_seconds[key] += time.perf_counter() - t
                stream.synchronize()
        except ExecutionError:
            raise
        except Exception as exc:  # noqa: BLE001 - torch/Triton raise many types; the core must not become ready
            raise ExecutionError(f"CUDA graph capture failed: {type(exc).__name__}: {exc}", ErrorKind.DEVICE) from exc
        self.capture_s = time.perf_counter() - started

    def pick(self, kind: str, size: int, full_sampling: bool = True, *, batch: int = 1) -> tuple[str, int, int, bool]:
        """The key of the smallest captured graph that holds the step (ExecutionManifest.pick)."""
        return self.manifest.pick(kind, size, full_sampling, batch=batch)

    def pick_speculative(self, rows: int, full_sampling: int) -> tuple[str, int, int, bool]:
        """The smallest speculative decode graph that holds ``rows`` rows (a row per fed token; captured greedy and
        FULL only)."""
        for cap in self.spec_batch_sizes:
            if cap >= rows:
                return graph_key("decode_spec", cap, cap, FULL if full_sampling else GREEDY)
        raise ExecutionError(f"no speculative graph holds {rows} rows (captured: {self.spec_batch_sizes})",
                             ErrorKind.MODEL_CAPACITY)

    def pick_decode(self, rows: int, full_sampling: bool, longest_context: int,
                    adapters: bool = False) -> tuple[str, int, int, bool]:
        """ExecutionManifest.pick_decode with the decoder's megakernel rows (0 when it is off) and context limit;
        ``adapters``: a row of the step names a LoRA adapter (only a decoder with adapters has those graphs)."""
        return self.manifest.pick_decode(rows, full_sampling, longest_context, mega_rows=self.decoder.mega_max_rows,
                                         mega_max_context=self.decoder.mega_max_context,
                                         adapters=adapters and self.decoder.lora is not None)
