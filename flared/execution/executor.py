"""The CUDA graph executor: ScheduledPlans run as captured graphs, two frames in flight.

Same model-thread contract as the eager executor (``run(plan, block_tables,
states, score_from) -> (records, duration_ns, logprobs, scores)``, a ``sampler``
for per-request state) plus the asynchronous pair the two-frame window needs:

    fence = executor.submit(plan, block_tables, states, score_from)  # None: backpressure, poll first
    done = executor.poll(block=False)  # (fence, records, duration_ns, logprobs, scores) or None

One submission: pack the plan into a free pinned input frame (numpy views of
the ExecutionManifest layout), enqueue on the model stream the uploads of
the spans the step uses (others keep their device values), a start event,
the graph launch through CuPy, the eager sampler for rows that need it, an
end event (a decode step's inputs go up on an upload stream instead, into
the device region its frame owns, and the model stream only waits for that
copy, which ran while the step before it did); the copy stream waits on the end event and copies the sampled
tokens into the frame's pinned completion slot, then records a copied
event. ``poll`` consumes the oldest frame once its copy is done, joins the
tokens into the frame's completion records (flared._fast.frames) and frees
the frame. GPU duration of every step comes from its two events.

Rules:
- Prefill steps may carry several sequences (their chunks packed back to back,
  one sampled row each; a chunk that does not end its prompt samples nothing
  the host keeps); the scheduler plans them with ``graph_shapes``.
- Scoring (a SCORED_PREFILL plan, or a participant whose ``score_from`` falls
  in its chunk) runs the prefill graph's own forward eagerly on the model
  stream, at the graph's capacities, instead of launching the graph (the graph
  keeps only each chunk's last row), then scores the participant's positions
  from the final hidden states as the eager executor does (the chunk's first
  token from its state row's logits, read before the forward), and reads the
  scores back with the step (SYNC).
- Frames: ordinary decodes share the two-frame window; every other kind needs
  it empty (and is run with torch ops on the model stream, not a graph); a
  third submission gets None. FrameRing enforces it.
- Rows under a grammar (the step has the window to itself) are drawn after the step's graph: the graph is
  launched first and takes their argmax unshaped; their masks are computed on the host while it runs, staged
  in their Sampler slots, and a small captured graph (kernels.sampling.draw_rows) draws them from their model
  logits as the graph's sampler would have, over the graph's tokens. The host's mask time and the forward
  overlap instead of adding up.
- A failure while enqueueing poisons the executor: later submissions raise.
- ``close()`` synchronises its streams before freeing pinned memory; if that
  fails, the pinned buffers are kept (the device may still write them).
- No per-step device allocation on the graph path; one read-back per step
  (the completion copy) — labelled SYNC where the host waits.
"""

from __future__ import annotations

import logging

import numpy as np
import torch

from flared._fast.frames import DRAINING, EXCLUSIVE, WINDOW, CompletionTable, FrameRing
from flared.errors import AdmissionError, ErrorKind, ExecutionError
from flared.execution import cuda
from flared.execution.graphs import (ExecutionManifest, GraphSet, collector_paused, default_prefill_batch_shapes,
                                     pack_decode, pack_prefill, speculative_batch_sizes, speculative_rows)
from flared.execution.images import flat_positions, image_rows, join_images, rope_positions, shifted_positions
from flared.model.batch import ImageRows
from flared.model.kernels import FULL, GREEDY, TEMPERATURE, min_p_log_threshold
from flared.model.kernels.sampling import GRAPH_LOGPROBS, LogprobScratch, RowDraws, draw_rows, row_logprobs
from flared.model.kv_cache import kv_pool_dtype
from flared.model.sampling import Sampler, graph_step_rows, on_device
from flared.runtime.request import TokenLogprob
from flared.scheduler import CompletionRecords, GraphKind, scored_participants

_NUM_FRAMES = 2


def _pow2_buckets(cap: int) -> list[int]:
    """The powers of two below ``cap``, and ``cap``: the row counts a set of small graphs is captured for."""
    return sorted({min(1 << i, cap) for i in range(max(1, cap).bit_length() + 1)})


def _captured(fn, stream, pool=None) -> tuple[torch.cuda.CUDAGraph, int]:
    """``fn`` captured as a CUDA graph on ``stream`` (in ``pool``, if given): the graph and its executable."""
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g, pool=pool, stream=stream):
        fn()
    return g, int(g.raw_cuda_graph_exec())


log = logging.getLogger("flared.execution")

# Rows of hidden states a scored step takes through the LM head at once (float32 logits: 256 MB at a 128K vocabulary).
_SCORE_ROWS = 512


class _Pending:
    """Host-side facts of one in-flight frame, read back by poll."""

    __slots__ = ("num_participants", "logprobs", "row_logprobs", "copies_timed", "scores", "spec")

    def __init__(self):
        self.num_participants = 0
        # groups of rows' log-probabilities copied to pinned host memory behind the step: ([(row, top_n)], (chosen
        # [k], top values [k, n] or None, top ids [k, n] or None)), rows named by participant once submit returns
        self.logprobs: list[tuple[list[tuple[int, int]], tuple]] = []
        # rows whose log-probabilities kernels.sampling.row_logprobs took into the frame's pinned results, in
        # their order there: [(row, top_n)], rows named by participant once submit returns
        self.row_logprobs: list[tuple[int, int]] = []
        self.copies_timed = False  # a prefill's checkpoint copies ran between _copies_start and _end
        self.scores: list[list[float] | None] | None = None  # per participant, where the step scored
        # a speculative step: (token offsets, fed tokens, state rows, states); its rows' logits are the decoder's
        self.spec = None


class GraphExecutor:
    def __init__(self, model, *, num_pages: int, page_tokens: int, num_state_rows: int, num_snapshots: int,
                 vocab_size: int, max_live: int, decode_batch_sizes, prefill_token_sizes,
                 max_pages_per_sequence: int, prefill_batch_shapes=None, lora=None, speculative: bool = False,
                 kv_cache_dtype: str = "auto"):
        """``prefill_batch_shapes``: (batch, tokens) capacities of multi-sequence prefill graphs; None = the
        default (graphs.default_prefill_batch_shapes), () = one-sequence prefill graphs only. The scheduler
        must plan with ``graph_shapes`` (what was captured). ``lora``: the per-request LoRA adapters
        (kernels/lora_rows.StackedLora) the graphs run for rows whose state names one (``lora``); None: none.
        ``speculative``: the most draft tokens a request feeds a SPECULATIVE step (prompt lookup; 0 = none):
        each such step runs as a decode graph with a row per fed token (kind "decode_spec", captured for
        ``spec_batch_sizes``; the scheduler must cap a step's tokens at ``spec_max_rows``), and every row's
        token (the argmax, or the request's own draw at that position) verifies the drafts
        (_submit_speculative). ``kv_cache_dtype``: "auto" (the model's dtype) or "fp8" / "fp8_e4m3" (vLLM's
        --kv-cache-dtype): the KV pool and the prefix cache's snapshots in float8 e4m3, one byte a value
        (kv_cache.kv_pool_dtype)."""
        self.model = model
        self.device = model.device
        self.page_tokens = page_tokens
        self.max_live = max_live
        if prefill_batch_shapes is None:
            prefill_batch_shapes = default_prefill_batch_shapes(max_live, prefill_token_sizes)
        self.spec_batch_sizes = speculative_batch_sizes(max_live, speculative)
        self.spec_max_rows = max(self.spec_batch_sizes, default=0)
        # a speculative step's rows are decode rows: the decode spans (and graphs) reach its capacities too
        decode_batch_sizes = sorted(set(decode_batch_sizes) | set(self.spec_batch_sizes))
        self.manifest = ExecutionManifest.build(decode_batch_sizes=decode_batch_sizes,
                                                prefill_token_sizes=prefill_token_sizes,
                                                max_pages_per_sequence=max_pages_per_sequence,
                                                prefill_batch_shapes=prefill_batch_shapes)
        self.manifest.validate()
        self.max_slots = num_state_rows - 1
        self._pinned: list[cuda.PinnedBuffer] = []
        self.closed = False
        self.leaked = False
        self.model_stream = torch.cuda.Stream(device=self.device)
        self.copy_stream = torch.cuda.Stream(device=self.device)
        self.upload_stream = torch.cuda.Stream(device=self.device)  # decode steps' inputs (GraphSet's regions)
        self._model_ptr = self.model_stream.cuda_stream
        self._copy_ptr = self.copy_stream.cuda_stream
        self._upload_ptr = self.upload_stream.cuda_stream
        self.graphs = GraphSet(model, self.manifest, num_pages=num_pages, page_tokens=page_tokens,
                               num_state_rows=num_state_rows, lora=lora, spec_batch_sizes=self.spec_batch_sizes,
                               kv_dtype=kv_pool_dtype(kv_cache_dtype, model.dtype))
        self.speculative = speculative > 0
        self.decoder = self.graphs.decoder
        c = model.config
        # (a page of every kv layer's pool: Gemma 4's shared-KV layers keep none, its slots hold kv_storage_heads rows)
        # (no value rows where the values are the keys' latent part: ModelConfig.latent_kv)
        snap_shape = (num_snapshots, len(c.kv_layers), page_tokens, c.kv_storage_heads, c.kv_row_dim)
        self.snap_keys = torch.zeros(snap_shape, dtype=self.decoder.kv_dtype, device=self.device)
        self.snap_values = torch.zeros((*snap_shape[:3], c.kv_value_rows, c.kv_row_dim), dtype=self.decoder.kv_dtype,
                                       device=self.device)
        self.snap_logits = torch.zeros(num_snapshots, vocab_size, dtype=torch.float32, device=self.device)
        # the graphs' samplers shape rows with logit bias and penalties from the Sampler's slot tables
        self.sampler = Sampler(vocab_size, device=self.device, max_penalty_slots=max_live, graph_tables=True,
                               stream=self.model_stream)
        self.decoder.shape_tables = self.sampler.shape_tables()
        self.graphs.capture(self.model_stream)
        # Pinned frames: inputs (manifest layout) and completion tokens (one int64 per batch row).
        self._in_frames = [self._pin(self.manifest.total_bytes) for _ in range(_NUM_FRAMES)]
        self._in_views = [self.manifest.host_views(f.array) for f in self._in_frames]
        self._token_frames = [self._pin(8 * self.manifest.max_batch) for _ in range(_NUM_FRAMES)]
        self._tokens = [f.array.view(np.int64) for f in self._token_frames]
        # A speculative step's token at every row (one per fed token), read back beside the participants' own.
        self._drawn_frames = [self._pin(8 * max(1, self.spec_max_rows)) for _ in range(_NUM_FRAMES)]
        self.ring = FrameRing()
        self.table = CompletionTable(self.max_slots)
        self._start = [cuda.Event() for _ in range(_NUM_FRAMES)]
        self._end = [cuda.Event() for _ in range(_NUM_FRAMES)]
        self._copied = [cuda.Event() for _ in range(_NUM_FRAMES)]
        self._copies_start = [cuda.Event() for _ in range(_NUM_FRAMES)]
        self._uploaded = [cuda.Event(timing=False) for _ in range(_NUM_FRAMES)]
        self._pending = [_Pending() for _ in range(_NUM_FRAMES)]
        self._spans = {s.name: s for s in self.manifest.spans}
        self._input_ptr = self.graphs.input_ptr
        # where a decode upload of manifest offset o lands: _decode_base[region] + o (the regions never move)
        self._decode_base = tuple(self.graphs.decode_region_ptr(r) - self.graphs.decode_span_offset for r in (0, 1))
        self._sampled_ptr = self.decoder.sampled.data_ptr()
        # Log-probabilities of the rows the graphs draw (kernels.sampling.row_logprobs): kernels behind the step's
        # graph, their results read back beside the tokens. Per frame its arguments (pinned, then on the device) and
        # results (on the device, then pinned); one scratch for both (the kernels run in turn on the model stream).
        cap = self.manifest.max_batch
        width = 1 + 2 * GRAPH_LOGPROBS
        self._lp_arg_frames = [self._pin(8 * 3 * cap) for _ in range(_NUM_FRAMES)]
        self._lp_args_host = [f.array.view(np.int64).reshape(3, cap) for f in self._lp_arg_frames]
        self._lp_args = torch.zeros(_NUM_FRAMES, 3, cap, dtype=torch.int64, device=self.device)
        self._lp_out = torch.zeros(_NUM_FRAMES, cap, width, dtype=torch.float32, device=self.device)
        self._lp_scratch = LogprobScratch(cap, self.decoder.state_logits.shape[1], self.device)
        # compiled now (a request's first logprobs would otherwise wait seconds for Triton): a launch with no row
        with torch.cuda.stream(self.model_stream):
            self._lp_args[:, 2].fill_(-1)
            row_logprobs(self.decoder.state_logits, self._lp_args[0], self.decoder.sampled, self._lp_out[0],
                         self._lp_scratch)
        self.model_stream.synchronize()
        # ... then captured, a graph a frame and a power-of-two count of rows (rows past a step's own wanting -1,
        # which the kernels skip): one launch of about 2 us of host time, where Triton's three launches from Python
        # cost tens of microseconds each (docs/benchmarks.md, thirty-ninth session)
        self._lp_buckets = _pow2_buckets(cap)
        self._lp_graphs: dict[tuple[int, int], torch.cuda.CUDAGraph] = {}
        self._lp_execs: dict[tuple[int, int], int] = {}
        self._capture_logprob_graphs()
        self._lp_frames = [self._pin(4 * cap * width) for _ in range(_NUM_FRAMES)]
        self._lp_host = [(f.array.view(np.float32).reshape(cap, width), f.array.view(np.int32).reshape(cap, width))
                         for f in self._lp_frames]
        # False: every logprob row takes torch's ops, as before the thirty-eighth session (tools/bench_graph_sampler's
        # A/B sets it)
        self.logprob_kernel = True
        # False: the kernels launched from Python each step, as in the thirty-eighth session (the A/B again)
        self.logprob_graphs = True
        # Grammar rows drawn after the step's graph (kernels.sampling.draw_rows), so their masks are computed on the
        # host while the graph runs rather than before its launch: one argument block on the device and one pinned
        # (a grammar step runs alone in the window, so one serves every frame), and a graph a power-of-two count of
        # rows up to the live requests
        rows_cap = max(1, min(cap, max_live))
        self._gd = RowDraws(rows_cap, self.decoder.state_logits.shape[1], self.device)
        self._gd_frame = self._pin(self._gd.nbytes)
        self._gd_host = self._gd.views(self._gd_frame.array)
        self._gd_buckets = _pow2_buckets(rows_cap)
        self._gd_graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self._gd_execs: dict[int, int] = {}
        # False: a grammar step's masks are computed and staged before its graph's launch, whose sampler draws the
        # rows, as in the thirty-ninth session (tools/bench_structured_gpu's A/B sets it; so does a failed capture)
        self.grammar_after = self._capture_grammar_draws()
        self.max_outstanding = 0  # most frames ever in flight at once (qualification reads it)
        # Decode uploads on the upload stream into the frame's own region (False: into region 0 on the model
        # stream, ahead of the launch, as before the nineteenth session; tools/bench_gpu.py's A/B sets it).
        self.overlap_uploads = True

    def _capture_logprob_graphs(self) -> None:
        """row_logprobs over each frame's arguments and results, for each count of rows in _lp_buckets, captured on
        the model stream (the kernels allocate nothing, so no pool is shared with the step graphs)."""
        d = self.decoder
        try:
            with collector_paused(), torch.cuda.stream(self.model_stream):
                for frame in range(_NUM_FRAMES):
                    for rows in self._lp_buckets:
                        self._lp_graphs[frame, rows], self._lp_execs[frame, rows] = _captured(
                            lambda: row_logprobs(d.state_logits, self._lp_args[frame], d.sampled,
                                                 self._lp_out[frame], self._lp_scratch, rows=rows),
                            self.model_stream)
            self.model_stream.synchronize()
        except Exception as exc:  # noqa: BLE001 - torch/Triton raise many types; the core must not become ready
            raise ExecutionError(f"capture of the logprob graphs failed: {type(exc).__name__}: {exc}",
                                 ErrorKind.DEVICE) from exc

    def _capture_grammar_draws(self) -> bool:
        """draw_rows over the argument block for each count of rows in _gd_buckets: each compiled by a run with no
        row (every index -1), then captured on the model stream, in one pool of their own. False (logged) if that
        fails: grammar rows are then drawn by the step's graphs, their masks staged before the launch, which serve
        them as well, only slower."""
        d = self.decoder
        tables = d.shape_tables
        try:
            with collector_paused(), torch.inference_mode(), torch.cuda.stream(self.model_stream):
                self._gd.i64[0].fill_(-1)
                self._gd.i32[0].fill_(-1)
                for rows in self._gd_buckets:
                    draw_rows(d.state_logits, self._gd, tables, d.sampled, d.last_token, rows)
                self.model_stream.synchronize()
                pool = torch.cuda.graph_pool_handle()
                for rows in reversed(self._gd_buckets):  # largest first: the smaller reuse its memory
                    self._gd_graphs[rows], self._gd_execs[rows] = _captured(
                        lambda: draw_rows(d.state_logits, self._gd, tables, d.sampled, d.last_token, rows),
                        self.model_stream, pool)
            self.model_stream.synchronize()
        except Exception as exc:  # noqa: BLE001 - torch/Triton raise many types
            log.warning("grammar rows will be drawn by the step graphs, their masks before the launch: capture of "
                        "the grammar draw graphs failed: %s: %s", type(exc).__name__, exc)
            self._gd_graphs.clear()
            self._gd_execs.clear()
            self.model_stream.synchronize()
            return False
        return True

    def _pin(self, nbytes: int) -> cuda.PinnedBuffer:
        buf = cuda.PinnedBuffer(nbytes)
        self._pinned.append(buf)
        return buf

    @property
    def num_bytes(self) -> int:
        return self.decoder.kv_bytes + (self.snap_keys.numel() + self.snap_values.numel()) * self.snap_keys.element_size()

    @property
    def kv_cache(self) -> tuple[str, int]:
        """(element type, bytes) of the KV cache: the pool and the prefix cache's K/V snapshots."""
        return str(self.decoder.kv_dtype).removeprefix("torch."), self.num_bytes

    @property
    def graph_shapes(self) -> tuple[tuple[int, int, int], ...]:
        """``SchedulerConfig.graph_shapes`` for this executor: the decode and prefill (batch, tokens) graphs
        it captured, and the default shapes of the kinds it runs without a graph."""
        return self.manifest.scheduler_graph_shapes(self.max_live)

    @property
    def outstanding(self) -> int:
        return self.ring.outstanding

    # -- model-thread contract ---------------------------------------------------------------------

    def run(self, plan, block_tables, states, score_from=None):
        """Synchronous: submit (draining older frames for room), then wait for this step.
        Returns (records, duration_ns, logprobs, scores) like the eager executor."""
        while True:
            fence = self.submit(plan, block_tables, states, score_from)
            if fence is not None:
                break
            self.poll(block=True)
        while True:
            done = self.poll(block=True)
            if done is not None and done[0] == fence:
                return done[1], done[2], done[3], done[4]

    def submit(self, plan, block_tables, states, score_from=None) -> int | None:
        if self.closed:
            raise ExecutionError("the executor is closed", ErrorKind.EXECUTION)
        kind = plan.kind
        klass = WINDOW if kind == GraphKind.DECODE else DRAINING
        if any(s is not None and getattr(s, "grammar", None) is not None for s in states):
            klass = EXCLUSIVE
        frame = self.ring.acquire(klass)
        if frame < 0:
            return None
        try:
            n = plan.num_participants
            pending = self._pending[frame]
            pending.num_participants = n
            pending.logprobs = []
            pending.row_logprobs = []
            pending.copies_timed = False
            pending.scores = None
            pending.spec = None
            with torch.cuda.stream(self.model_stream):
                self._start[frame].record(self._model_ptr)
                if kind == GraphKind.DECODE:
                    self._submit_graph(frame, plan, block_tables, states, "decode")
                elif kind == GraphKind.SPECULATIVE and self.speculative:
                    self._submit_speculative(frame, plan, block_tables, states)
                elif kind in (GraphKind.PREFILL, GraphKind.SCORED_PREFILL):
                    scoring = [(i, max(0, first - int(plan.token_starts[i])))  # (participant, first chunk index)
                               for i, first in scored_participants(plan, score_from)]
                    self._submit_graph(frame, plan, block_tables, states, "prefill", scoring)
                    if len(plan.copies):  # checkpoints at the chunks' ends, after the forward, timed apart
                        self._copies_start[frame].record(self._model_ptr)
                        self._snapshot_copies(plan.copies, to_snapshot=True)
                        pending.copies_timed = True
                else:
                    self._submit_eager(plan, states, pending)
                self._end[frame].record(self._model_ptr)
            cuda.stream_wait_event(self._copy_ptr, self._end[frame])
            if n:
                cuda.copy_d2h_async(self._token_frames[frame].ptr, self._sampled_ptr, 8 * n, self._copy_ptr)
            if pending.spec is not None:  # every row's token (a participant's rows from token offset on)
                rows = int(pending.spec[0][-1])
                cuda.copy_d2h_async(self._drawn_frames[frame].ptr, self._sampled_ptr, 8 * rows, self._copy_ptr)
            if pending.row_logprobs:
                cuda.copy_d2h_async(self._lp_frames[frame].ptr, self._lp_out[frame].data_ptr(),
                                    self._lp_out.stride(1) * 4 * len(pending.row_logprobs), self._copy_ptr)
            self._copied[frame].record(self._copy_ptr)
            fence = self.ring.submitted(frame)
            self.max_outstanding = max(self.max_outstanding, self.ring.outstanding)
            sample = np.ascontiguousarray(plan.sample, dtype=np.uint8)
            consumed = np.asarray(plan.token_starts, dtype=np.int64) + np.asarray(plan.num_tokens, dtype=np.int64)
            self.table.write(frame, fence, np.asarray(plan.slots, dtype=np.int64),
                             np.asarray(plan.handles, dtype=np.int64), consumed,
                             np.asarray(plan.generated_ends, dtype=np.int64), sample)
            return fence
        except Exception as exc:
            self.ring.poison(f"{type(exc).__name__}: {exc}")
            if isinstance(exc, ExecutionError):
                raise
            raise ExecutionError(f"submission of {plan.kind_name} step failed: {exc}", ErrorKind.POISONED) from exc

    def poll(self, block: bool = False):
        """The oldest step's completion: (fence, CompletionRecords, gpu_duration_ns, logprobs, scores), or None;
        ``scores[i]``: participant i's log-probabilities of the positions it scored this step, else None."""
        frame = self.ring.oldest()
        if frame < 0:
            return None
        copied = self._copied[frame]
        if not block and not copied.query():
            return None
        copied.synchronize()  # SYNC: the step's one read-back (its sampled tokens)
        pending = self._pending[frame]
        n = pending.num_participants
        fence = self.ring.fence(frame)
        handles, consumed, generated, token_ids = self.table.parse(frame, fence, self._tokens[frame][:n])
        duration_ns = self._end[frame].elapsed_ns(self._start[frame])
        snapshot_ns = self._end[frame].elapsed_ns(self._copies_start[frame]) if pending.copies_timed else 0
        logprobs: list[TokenLogprob | None] = [None] * n
        # copied behind the step (_eager_sample, _graph_logprobs), which copied.synchronize saw finish
        for rows, out in pending.logprobs:
            chosen, top_v, top_i = (None if t is None else t.tolist() for t in out)
            for k, (i, top_n) in enumerate(rows):
                top = tuple(zip(top_i[k][:top_n], top_v[k][:top_n])) if top_n and top_i is not None else ()
                logprobs[i] = TokenLogprob(int(token_ids[i]), chosen[k], top)
        if pending.row_logprobs:
            values, ids = self._lp_host[frame]
            for k, (i, top_n) in enumerate(pending.row_logprobs):
                top = tuple(zip(ids[k, 1 + GRAPH_LOGPROBS:1 + GRAPH_LOGPROBS + top_n].tolist(),
                                values[k, 1:1 + top_n].tolist()))
                logprobs[i] = TokenLogprob(int(token_ids[i]), float(values[k, 0]), top)
        scores = pending.scores if pending.scores is not None else [None] * n
        accepted = None
        if pending.spec is not None:
            consumed, generated, token_ids, accepted = self._verify_drafts(frame, pending, consumed, generated,
                                                                           token_ids)
        self.ring.release(frame)
        return fence, CompletionRecords(handles=handles, consumed_tokens=consumed, generated_tokens=generated,
                                        token_ids=token_ids, snapshot_ns=snapshot_ns,
                                        accepted_drafts=accepted), duration_ns, logprobs, scores

    # -- graph steps -------------------------------------------------------------------------------

    def _upload(self, frame: int, name: str, count: int) -> None:
        """Copy the first ``count`` elements (rows) of span ``name`` from the pinned frame."""
        span = self._spans[name]
        row_bytes = span.nbytes // span.shape[0]
        src = self._in_frames[frame].ptr + span.offset_bytes
        cuda.copy_h2d_async(self._input_ptr + span.offset_bytes, src, row_bytes * count, self._model_ptr)

    def _submit_graph(self, frame: int, plan, block_tables, states, kind: str, scoring=(), depths=None) -> None:
        """``depths`` (speculative steps): per row, how many tokens past its state's draw count the row draws at."""
        v = self._in_views[frame]
        P = self.page_tokens
        n = plan.num_participants
        starts = np.asarray(plan.token_starts, dtype=np.int64)
        rows = np.asarray(plan.state_rows, dtype=np.int64)
        sample_flags = np.asarray(plan.sample, dtype=bool)
        scratch = self.decoder.scratch_slot
        # each row's per-request LoRA adapter, where the graphs run adapters (else lora_ids is never read)
        adapters = [s.lora if s is not None else 0 for s in states] if self.decoder.lora is not None else None
        # The rows the graph's sampler draws, those it shapes from the Sampler's tables (bias, penalties), those
        # the torch Sampler draws after the graph, and those whose logprobs are taken beside the graph's draw.
        in_graph, shaped, eager_rows, logprob_rows = graph_step_rows(states[:n], sample_flags[:n])
        # Rows under a grammar the graphs' sampler takes (graph_grammar): drawn after the graph (_draw_grammar_rows),
        # their masks computed while it runs; the graph takes their argmax unshaped, which that draw overwrites.
        # With grammar_after off, their masks are staged before the launch and the graph's sampler draws them.
        grammar_rows = [i for i in shaped if states[i].graph_grammar]
        apart = grammar_rows if self.grammar_after else []
        skip = set(apart)
        if apart:
            shaped = [i for i in shaped if i not in skip]
        # The sampler the step's graph needs: greedy while no row draws or is shaped; temperature alone (no masks)
        # while no drawing row has a min-p, top-k or top-p; else the full one.
        drawing = [s.params for i, s in enumerate(states)
                   if s is not None and s.params.temperature > 0 and i not in skip]
        full_sampling = (GREEDY if not drawing and not shaped else
                         TEMPERATURE if all(p.top_k == 0 and p.top_p >= 1.0 and p.min_p <= 0 for p in drawing)
                         else FULL)
        if kind == "decode_spec":
            key = self.graphs.pick_speculative(n, full_sampling)
            cap = key[1]
            f = "decode_"
            pack_decode(v, plan, block_tables, page_tokens=P, scratch_slot=scratch, capacity=cap, adapters=adapters)
        elif kind == "decode":
            key = self.graphs.pick_decode(n, full_sampling, int(starts[:n].max()) + 1 if n else 0,
                                          adapters=adapters is not None and any(adapters[:n]))
            cap = key[1]
            f = "decode_"  # decode graphs read the decode spans, uploaded in one copy below
            pack_decode(v, plan, block_tables, page_tokens=P, scratch_slot=scratch, capacity=cap, adapters=adapters)
        else:
            f = ""
            offsets = np.asarray(plan.token_offsets, dtype=np.int64)
            key = self.graphs.pick("prefill", int(offsets[n]), batch=n)
            _, batch_cap, cap, _ = key
            width = pack_prefill(v, plan, block_tables, page_tokens=P, scratch_slot=scratch, batch_capacity=batch_cap,
                                 token_capacity=cap, adapters=adapters)
        decode = kind != "prefill"
        images = self._place_images(v, f, plan, states, decode, cap) if self.model.vision is not None else None
        token_rows = cap
        batch_rows = cap if decode else batch_cap
        # Sampling parameters (graph sampler) and per-row step counters.
        v[f + "shape_slot"][:batch_rows] = -1
        for i in shaped:
            v[f + "shape_slot"][i] = states[i].penalty_slot
        for i in range(n):
            s = states[i]
            if s is None or not sample_flags[i] or i in skip:
                v[f + "temperature"][i] = 0.0
                continue
            p = s.params
            v[f + "temperature"][i] = p.temperature
            v[f + "top_k"][i] = p.top_k
            v[f + "top_p"][i] = p.top_p
            # llama.cpp's chain judges its filters on the unscaled logits (graph_samples: its default chain)
            v[f + "min_p_log"][i] = min_p_log_threshold(p.min_p, p.temperature, bool(p.sampler_order))
            v[f + "chain"][i] = 1 if p.sampler_order else 0
            v[f + "seeds"][i] = s.seed & 0x7FFFFFFFFFFFFFFF
            v[f + "steps"][i] = s.num_output_tokens + (int(depths[i]) if depths is not None else 0)
        v[f + "temperature"][n:batch_rows] = 0.0
        execs = self.graphs.graph_execs
        if decode:
            # One copy: every decode span and the block-table rows up to the capacity (whole rows: they are
            # contiguous; only the columns in use matter), into the frame's own device region on the upload
            # stream. The graph that read this region last was this frame's previous step, which poll saw
            # finish before the frame was free again, so the copy may run at once, beside the step in flight.
            offset, nbytes = self.manifest.decode_upload(batch_rows)
            region = frame if self.overlap_uploads else 0
            dst = self._decode_base[region] + offset
            if self.overlap_uploads:
                cuda.copy_h2d_async(dst, self._in_frames[frame].ptr + offset, nbytes, self._upload_ptr)
                self._uploaded[frame].record(self._upload_ptr)
                cuda.stream_wait_event(self._model_ptr, self._uploaded[frame])
            else:
                cuda.copy_h2d_async(dst, self._in_frames[frame].ptr + offset, nbytes, self._model_ptr)
            execs = self.graphs.decode_execs(region)
        else:
            for name in ("token_ids", "positions", "slot_ids") + (("lora_ids",) if adapters is not None else ()):
                self._upload(frame, name, token_rows)
            for name in ("state_rows", "context_lens", "temperature", "top_k", "top_p", "min_p_log", "chain",
                         "shape_slot", "seeds", "steps", "chunk_meta", "logit_rows"):
                self._upload(frame, name, batch_rows)
            self._upload(frame, "block_tables", width)
        # Grammar rows the graph draws (grammar_after off): their masks for this step into the slots' tables, on the
        # model stream ahead of the launch (such a step has nothing in flight: the worker drains the window for it)
        if not apart:
            self.sampler.stage_grammar_masks([states[i] for i in grammar_rows])
        if scoring:
            self._forward_scoring(frame, plan, batch_cap, cap, scoring, images)
        elif images is not None:  # the prefill graph's forward, run eagerly with the image rows
            with torch.inference_mode():
                self.decoder.prefill(batch_cap, cap, images)
        else:
            cuda.graph_launch(execs[key], self._model_ptr)
        if apart:  # before the logprobs, which read the drawn tokens
            self._draw_grammar_rows(apart, rows, states)
        if eager_rows:
            self._eager_sample(self.decoder.logits, eager_rows, rows, states, self._pending[frame])
        if logprob_rows:
            self._graph_logprobs(frame, logprob_rows, rows, states, self._pending[frame])
        for i in range(n):
            if in_graph[i]:
                states[i].num_output_tokens += 1

    def _place_images(self, v, f: str, plan, states, decode: bool, cap: int) -> ImageRows | None:
        """A step of a vision core's requests (flared.execution.images): the image rows of a prefill that feeds
        image tokens, which then runs the prefill graph's forward eagerly with them (the graphs take token ids only;
        returned, with the rows' 3D rope positions where a request has them); else, where a request has 3D rope
        positions (Qwen VL), its rows' plain-rope positions written into the frame's ``positions`` (each text
        token's three are equal: its index in the prompt's, index + delta past it) and None."""
        n = plan.num_participants
        rows = states[:n]
        if all(getattr(s, "vision", None) is None for s in rows):
            return None
        starts = np.asarray(plan.token_starts, dtype=np.int64)[:n]
        positions = v[f + "positions"][:cap]
        if decode:
            positions[:n] = shifted_positions(rows, starts)
            return None
        counts = np.asarray(plan.num_tokens, dtype=np.int64)[:n]
        bounds = np.asarray(plan.token_offsets, dtype=np.int64)[:n + 1]
        found, values = image_rows(rows, starts, counts, bounds)
        mrope = rope_positions(rows, starts, counts, bounds, positions)
        if not found:
            flat = None if mrope is None else flat_positions(mrope)
            if flat is not None:
                positions[:] = flat
            if mrope is None or flat is not None:
                return None
        # The rows were made on the default stream (the image tower on the model thread, the frontend's joining of a
        # request's images): the model stream reads them after that work, and their memory is not reused before
        # it has
        self.model_stream.wait_stream(torch.cuda.default_stream(self.device))
        images = join_images(found, values, mrope, hidden=self.model.config.hidden_size, device=self.device)
        for t in (images.values, images.mrope, *(images.deepstack or ())):
            if t is not None:
                t.record_stream(self.model_stream)
        return images

    def _draw_grammar_rows(self, apart: list[int], rows, states) -> None:
        """Rows ``apart`` (participants under a grammar, graph_grammar) drawn behind the step's graph on the model
        stream: their masks computed now, while the graph runs, and staged in their slots' tables
        (Sampler.stage_grammar_masks), then one copy of their arguments and one captured draw_rows graph, which
        gathers their model logits from the state rows, shapes them by their slots (bias, penalties, the mask),
        draws each as the graph's sampler would have and writes the tokens where the graph wrote its own."""
        self.sampler.stage_grammar_masks([states[i] for i in apart])
        k = len(apart)
        bucket = next(b for b in self._gd_buckets if b >= k)
        i64, i32, f32 = self._gd_host
        i64[0, :k] = apart
        i64[1, :k] = np.asarray(rows)[apart]
        for j, i in enumerate(apart):
            s = states[i]
            p = s.params
            i64[2, j] = s.seed & 0x7FFFFFFFFFFFFFFF
            i64[3, j] = s.num_output_tokens
            i32[0, j] = s.penalty_slot
            i32[1, j] = p.top_k
            i32[2, j] = 1 if p.sampler_order else 0
            f32[0, j] = p.temperature
            f32[1, j] = p.top_p
            f32[2, j] = min_p_log_threshold(p.min_p, p.temperature, bool(p.sampler_order))
        # the bucket's rows past k: none (an earlier step's would be drawn and placed again otherwise)
        i64[0, k:bucket] = -1
        i64[1:, k:bucket] = 0
        i32[0, k:bucket] = -1
        i32[1:, k:bucket] = 0
        f32[0, k:bucket] = 0.0
        f32[1, k:bucket] = 1.0
        f32[2, k:bucket] = float("-inf")
        cuda.copy_h2d_async(self._gd.block.data_ptr(), self._gd_frame.ptr, self._gd.nbytes, self._model_ptr)
        cuda.graph_launch(self._gd_execs[bucket], self._model_ptr)

    def speculates(self, params, grammar: bool = False) -> bool:
        """Whether a request with these sampling params (and a grammar, or not) may feed drafts: the graph's own
        sampler draws every one of its rows (SamplingParams.graph_drawable, no grammar)."""
        return params.graph_drawable and not grammar

    def _submit_speculative(self, frame: int, plan, block_tables, states) -> None:
        """A speculative step as a decode graph with a row per fed token (kind "decode_spec"): participant i's
        last token and drafts are rows offsets[i].. at consecutive positions, each with the participant's block
        table and its own context, so row j attends to the positions up to its own. The graph writes every row's
        K/V before any row attends (its rotary and KV write run apart from the attention), and samples every
        row, row j of a participant at its draw count plus j, so a participant's rows draw the tokens that plain
        decoding would draw at those positions (the argmax for a greedy one) and verify its drafts
        (poll, _verify_drafts). A participant's lone row samples into its state row as a decode row does; the
        rows of one with drafts sample into the scratch state row 0, and poll gives its state row the logits and
        token of the row after its last kept draft."""
        n = plan.num_participants
        rows, part = speculative_rows(plan)
        offsets = np.asarray(plan.token_offsets, dtype=np.int64)[:n + 1]
        widths = np.diff(offsets)
        row_states = [states[i] for i in part]
        pending = self._pending[frame]
        # row j of a participant draws j tokens past its state's draw count
        self._submit_graph(frame, rows, [block_tables[i] for i in part], row_states, "decode_spec", depths=rows.depths)
        for i in np.flatnonzero(widths > 1):  # one output token at submit, as a decode row; poll adds the kept
            if states[i] is not None:
                states[i].num_output_tokens -= int(widths[i]) - 1
        # rows with log-probabilities are lone rows: name their participants
        pending.logprobs = [([(int(part[r]), top_n) for r, top_n in group], out) for group, out in pending.logprobs]
        pending.row_logprobs = [(int(part[r]), top_n) for r, top_n in pending.row_logprobs]
        pending.spec = (offsets, np.asarray(plan.token_ids, dtype=np.int64)[:len(part)],
                        np.asarray(plan.state_rows, dtype=np.int64)[:n], list(states))

    def _verify_drafts(self, frame: int, pending: _Pending, consumed, generated, token_ids):
        """poll's half of a speculative step: a participant's drafts are kept while each equals the token drawn
        at the row before it, and the token drawn after the last kept one is its own (a participant without
        drafts keeps what its row sampled). A participant with drafts then gets that row's logits and token in
        its state row, on the model stream before any later step. Returns the step's consumed and generated
        counts, tokens and kept drafts."""
        offsets, fed, rows, states = pending.spec
        pending.spec = None
        drawn = self._drawn_frames[frame].array.view(np.int64)
        consumed, generated, token_ids = consumed.copy(), generated.copy(), token_ids.copy()
        kept: list[tuple[int, ...]] = []
        fix_rows, fix_at, fix_tokens = [], [], []
        for i in range(len(rows)):
            lo, hi = int(offsets[i]), int(offsets[i + 1])
            a = 0
            while lo + 1 + a < hi and int(drawn[lo + a]) == int(fed[lo + 1 + a]):
                a += 1
            kept.append(tuple(int(t) for t in fed[lo + 1:lo + 1 + a]))
            token_ids[i] = int(drawn[lo + a])
            if hi - lo == 1:
                continue
            consumed[i] -= hi - lo - 1 - a
            generated[i] += a
            fix_rows.append(int(rows[i]))
            fix_at.append(lo + a)
            fix_tokens.append(int(token_ids[i]))
            if states[i] is not None:
                states[i].num_output_tokens += a
        if fix_rows:
            d = self.decoder
            with torch.cuda.stream(self.model_stream):
                index, at, tokens = torch.as_tensor([fix_rows, fix_at, fix_tokens], dtype=torch.int64).to(self.device)
                d.state_logits.index_copy_(0, index, d.logits.index_select(0, at))
                d.last_token.index_copy_(0, index, tokens)
        return consumed, generated, token_ids, kept

    def _forward_scoring(self, frame: int, plan, batch_cap: int, cap: int, scoring, images=None) -> None:
        """The prefill graph's forward run eagerly (inputs already uploaded; ``images``: its image rows), then each scoring participant's
        log P(token[p] | tokens[:p]) for its positions from ``scoring``'s first index on: the chunk's first
        token from its state row's logits (the position before the chunk), every other from the final hidden
        state of the row before it, through the LM head in blocks of rows. Scores are read back here."""
        d = self.decoder
        n = plan.num_participants
        offsets = np.asarray(plan.token_offsets, dtype=np.int64)
        counts = np.asarray(plan.num_tokens, dtype=np.int64)
        state_rows = np.asarray(plan.state_rows, dtype=np.int64)
        # the logits before each chunk, read before the forward overwrites the state rows
        before = d.state_logits.index_select(0, torch.as_tensor(state_rows[[i for i, _ in scoring]]).to(self.device))
        with torch.inference_mode():
            hidden = d.prefill(batch_cap, cap, images)  # [cap, H], final-normed; the step's sampling ran as in the graph
            parts = []
            for k, (i, first) in enumerate(scoring):
                offset, count = int(offsets[i]), int(counts[i])
                tokens = torch.as_tensor(np.asarray(plan.tokens(i), dtype=np.int64)[first:]).to(self.device)
                lps = []
                if first == 0:
                    lps.append(torch.log_softmax(before[k:k + 1].float(), dim=-1).gather(1, tokens[:1, None])[:, 0])
                # hidden row r predicts chunk index r - offset + 1
                lo, hi = offset + max(first, 1) - 1, offset + count - 1
                for a in range(lo, hi, _SCORE_ROWS):
                    b = min(hi, a + _SCORE_ROWS)
                    logits = torch.nn.functional.linear(hidden[a:b], d.model.lm_head).float()
                    want = tokens[a - offset + 1 - first:b - offset + 1 - first]
                    lps.append(torch.log_softmax(logits, dim=-1).gather(1, want[:, None])[:, 0])
                parts.append(torch.cat(lps))
            flat = torch.cat(parts).tolist()  # SYNC: scored steps read their scores back with the step
        scores: list[list[float] | None] = [None] * n
        at = 0
        for (i, first), part in zip(scoring, parts):
            scores[i] = flat[at:at + part.numel()]
            at += part.numel()
        self._pending[frame].scores = scores

    # -- non-graph steps (rare: restores, terminal snapshots, resumed sampling) ----------------------

    def _submit_eager(self, plan, states, pending: _Pending) -> None:
        kind = plan.kind
        n = plan.num_participants
        rows = torch.as_tensor(np.asarray(plan.state_rows, dtype=np.int64)).to(self.device, non_blocking=False)
        d = self.decoder
        if kind == GraphKind.RESUME_SAMPLING:
            sample_idx = [i for i in range(n) if plan.sample[i]]
            if sample_idx:
                logits = d.state_logits.index_select(0, rows)
                self._eager_sample(logits, sample_idx, np.asarray(plan.state_rows, dtype=np.int64), states, pending)
        elif kind in (GraphKind.SNAPSHOT, GraphKind.RESTORE):
            self._snapshot_copies(plan.copies, to_snapshot=kind == GraphKind.SNAPSHOT)
        elif kind == GraphKind.INITIALIZE:
            pass  # attention-only models keep no per-row state that needs a reset
        else:
            raise ExecutionError(f"the graph executor cannot run {plan.kind_name} steps", ErrorKind.UNSUPPORTED)
        d.sampled[:n].masked_fill_(~torch.as_tensor(np.asarray(plan.sample, dtype=bool)).to(self.device), -1)

    def _snapshot_copies(self, copies, *, to_snapshot: bool) -> None:
        """Rows (snapshot_id, state_row, page_id or -1, tokens in the page), as torch copies on the current
        (model) stream: live state -> snapshot row, or back for a restore."""
        d = self.decoder
        P = self.page_tokens
        for snapshot_id, state_row, page_id, _partial in np.asarray(copies, dtype=np.int64).reshape(-1, 4):
            if to_snapshot:
                self.snap_logits[snapshot_id].copy_(d.state_logits[state_row])
            else:
                d.state_logits[state_row].copy_(self.snap_logits[snapshot_id])
            if page_id < 0:
                continue
            pool_slice = slice(int(page_id) * P, (int(page_id) + 1) * P)
            if to_snapshot:
                self.snap_keys[snapshot_id].copy_(d.k_pool[:, pool_slice])
                self.snap_values[snapshot_id].copy_(d.v_pool[:, pool_slice])
            else:
                d.k_pool[:, pool_slice].copy_(self.snap_keys[snapshot_id])
                d.v_pool[:, pool_slice].copy_(self.snap_values[snapshot_id])

    def _eager_sample(self, logits, sample_idx, rows, states, pending: _Pending) -> None:
        """flared.model.sampling.Sampler on the GPU for rows the graph sampler cannot serve."""
        d = self.decoder
        # (indices through pinned memory, no wait: the host keeps running ahead of the step's graph)
        idx = on_device(list(sample_idx), self.device, dtype=torch.int64)
        row_states = [states[i] for i in sample_idx]
        out = self.sampler.sample(logits.index_select(0, idx), row_states)
        d.sampled.index_copy_(0, idx, out.token_ids)
        d.last_token.index_copy_(0, on_device(np.asarray(rows)[sample_idx].tolist(), self.device, dtype=torch.int64),
                                 out.token_ids)
        want = [(k, i, s.params.logprobs) for k, (i, s) in enumerate(zip(sample_idx, row_states))
                if s.params.logprobs is not None]
        if want and out.chosen_logprobs is not None:
            # The rows' log-probabilities to pinned host memory behind the step (before its end event, which the
            # token copy waits on), read in poll: no sync here.
            at = on_device([k for k, _, _ in want], self.device, dtype=torch.int64)
            pending.logprobs.append(([(i, top_n) for _, i, top_n in want],
                                     tuple(None if t is None else t.index_select(0, at).to("cpu", non_blocking=True)
                                           for t in (out.chosen_logprobs, out.top_logprobs, out.top_token_ids))))

    def _graph_logprobs(self, frame: int, sample_idx, rows, states, pending: _Pending) -> None:
        """Log-probabilities of rows the graph drew (the model's own distribution, as the Sampler gives them: the
        log-softmax of the logits before bias, penalties and temperature; the drawn token's and the likeliest
        ``logprobs``), from the state rows' logits, which the graph wrote before it shaped or drew any row: three
        small kernels (kernels.sampling.row_logprobs) behind the graph, their results copied to the frame's pinned
        memory behind the step (submit). A step with a row asking for more than GRAPH_LOGPROBS takes torch's ops,
        copied as _eager_sample's."""
        d = self.decoder
        vocab = d.state_logits.shape[1]
        wants = [min(states[i].params.logprobs, vocab) for i in sample_idx]
        if self.logprob_kernel and max(wants) <= GRAPH_LOGPROBS:
            k = len(sample_idx)
            args = self._lp_args_host[frame]
            args[0, :k] = np.asarray(rows)[sample_idx]
            args[1, :k] = sample_idx
            args[2, :k] = wants
            args[2, k:] = -1  # the bucket's rows past k (an earlier step's stay behind otherwise)
            cuda.copy_h2d_async(self._lp_args[frame].data_ptr(), self._lp_arg_frames[frame].ptr, args.nbytes,
                                self._model_ptr)
            if self.logprob_graphs:
                bucket = next(b for b in self._lp_buckets if b >= k)
                cuda.graph_launch(self._lp_execs[frame, bucket], self._model_ptr)
            else:
                row_logprobs(d.state_logits, self._lp_args[frame], d.sampled, self._lp_out[frame],
                             self._lp_scratch, rows=k)
            pending.row_logprobs = list(zip(sample_idx, wants))
            return
        state_rows = on_device(np.asarray(rows)[sample_idx].tolist(), self.device, dtype=torch.int64)
        raw = torch.log_softmax(d.state_logits.index_select(0, state_rows).float(), dim=-1)
        chosen = raw.gather(1, d.sampled.index_select(0, on_device(list(sample_idx), self.device,
                                                                   dtype=torch.int64))[:, None])[:, 0]
        top_n = max(states[i].params.logprobs for i in sample_idx)
        top_v = top_i = None
        if top_n > 0:
            top_v, top_i = raw.topk(top_n, dim=-1)
        pending.logprobs.append(([(i, states[i].params.logprobs) for i in sample_idx],
                                 tuple(None if t is None else t.to("cpu", non_blocking=True)
                                       for t in (chosen, top_v, top_i))))

    # -- per-request LoRA adapters loaded while serving -----------------------------------------------

    def install_lora(self, factors: dict, index: int) -> int:
        """Write adapter ``index`` (lora.lora_factors' factors) into a free slot of the graphs' stack
        (StackedLora.install) on the model stream, behind the steps in flight; returns the slot. AdmissionError
        (503) when every slot holds an adapter."""
        stack = self.decoder.lora
        if stack is None or stack.slots is None:
            raise AdmissionError("this executor's graphs were captured without LoRA slots (start the server with "
                                 "--allow-runtime-lora-updating)", ErrorKind.UNSUPPORTED)
        slot = stack.free_slot()
        if slot is None:
            raise AdmissionError(f"all {stack.slots} LoRA adapter slots hold adapters: unload one (its slot frees "
                                 "once its last request ends) or start with a larger --max-loras",
                                 ErrorKind.MODEL_CAPACITY)
        with torch.cuda.stream(self.model_stream):
            stack.install(slot, factors, index)
        return slot

    def release_lora(self, index: int) -> None:
        """Adapter ``index``'s slot (if it has one) belongs to no adapter from the next step on."""
        stack = self.decoder.lora
        slot = stack.slot_of(index) if stack is not None else None
        if slot is not None:
            with torch.cuda.stream(self.model_stream):
                stack.release(slot)

    # -- shutdown ----------------------------------------------------------------------------------

    def close(self) -> None:
        """Drain the streams, then free pinned memory. Idempotent; a failed drain keeps the memory."""
        if self.closed:
            return
        self.closed = True
        try:
            cuda.stream_synchronize(self._upload_ptr)
            cuda.stream_synchronize(self._model_ptr)
            cuda.stream_synchronize(self._copy_ptr)
        except ExecutionError as exc:
            self.leaked = True
            raise ExecutionError(f"drain failed, pinned frames kept: {exc}", ErrorKind.DRAIN) from exc
        for buf in self._pinned:
            buf.free()
        self._pinned.clear()
        for ev in self._start + self._end + self._copied + self._copies_start + self._uploaded:
            ev.destroy()
