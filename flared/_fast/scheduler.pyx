# cython: language_level=3
"""Live-request scheduler: admission, plan, commit, complete, retirement.

Rules (the tests check each; docs/scheduling.md explains the policy):
- At most 64 live slots. A handle is ``generation << 8 | slot`` with a
  positive generation that is never reused, so a stale handle cannot reach
  the slot's next occupant. Slot s owns execution-state row s + 1; row 0 is
  padding.
- Admission allocates the request's whole worst-case block table (prompt +
  output limit, minus pages shared with a prefix hit) and the snapshot ids
  of its selected checkpoint endpoints. Nothing is allocated later, so a
  committed plan can never starve for pages: there is no preemption.
- ``plan(now)`` gates on the in-flight queue, asks the SelectionPolicy
  (flared._fast.policy) for the winning shape and cohort, and returns an
  immutable ScheduledPlan (or None). It changes no request state (only the
  policy's scratch fields; going idle lapses positive refresh credit).
  Request and plan data live in flared._fast.request. ``commit`` validates the
  plan's scheduler id and each participant's epoch and records the
  submission; ``complete`` validates every record before mutating anything.
- Completions arrive in fence order. A request is in at most one in-flight
  step, except that two ordinary decode steps may overlap; any other kind,
  and any unmeasured or stale shape, runs with the queue otherwise empty.
- Page and snapshot ids move: free -> request (admission) -> cache
  (publication, CREATED) -> retired (eviction) -> free (advance_completed
  reports the final-use fence). A request's ids return to the free lists
  only after its last submitted fence completed (cancel keeps ownership).
- ``check_integrity()`` recomputes the whole ledger: every page and
  snapshot id is free, owned by one request, cached or retired, never two.
"""

from collections import namedtuple

import numpy as np
cimport numpy as cnp
from libc.stdint cimport int32_t, int64_t, uint8_t
from libc.math cimport INFINITY

from flared._fast.pages cimport PageAllocator
from flared._fast.policy cimport SelectionPolicy, _Candidate
from flared._fast.prefix cimport Checkpoint, PrefixCheckpointCache, PrefixHistory
from flared._fast.request cimport (
    Request, ScheduledPlan, SLOT_BITS, SLOT_MASK, MAX_SLOTS, K_INITIALIZE, K_RESTORE, K_SNAPSHOT,
    K_PREFILL, K_SCORED_PREFILL, K_RESUME_SAMPLING, K_DECODE, K_SPECULATIVE, PH_INITIALIZE, PH_RESTORE, PH_PREFILL,
    PH_RESUME, PH_DECODE, PH_TERMINAL, PH_DRAINING,
)
from flared._fast.timing cimport GraphTimings, ShapeTiming, TIMING_UNMEASURED, TIMING_FRESH, TIMING_STALE
from flared._fast.policy import REFRESH_CAP_NS, REFRESH_FRACTION, SELECTION_FCFS, SELECTION_VALUE
from flared._fast.prefix import PublishOutcome
from flared._fast.request import (
    MAX_LIVE_REQUESTS, GraphKind, RequestPhase, handle_generation, handle_slot,
)
from flared.errors import AdmissionError, ErrorKind, ExecutionError

cnp.import_array()

_LAUNCH_KEYS = ["launches_" + k.name.lower() for k in GraphKind]
# Tokens a speculative step feeds in all (each request's last token and its drafts), where the cohort is smaller.
SPECULATIVE_MAX_TOKENS = 64
# Generation rounds a request whose draft cap fell to 0 goes without drafts before it tries one again.
SPECULATIVE_COOLDOWN = 16
# Generation rounds a request whose lookup found no draft worth feeding lets decode steps stack behind the one in
# flight (pipelined) before it drains the window to look again.
SPECULATIVE_MISS_REST = 8
# How much of a request's draft record (kept drafts, rejecting rounds) carries to its next round; its prior is one
# of each (a first draft is kept with probability 1/2).
SPECULATIVE_DECAY = 0.8
# How much of the step cost fit (RowCost) carries to the next step.
ROW_COST_DECAY = 0.97


cdef inline double _chance(Request r):
    """The chance that ``r``'s next draft is kept, from its record (a draft model's, where there is one)."""
    return r.spec_kept / (r.spec_kept + r.spec_rejected)


cdef inline double _copy_chance(Request r):
    """The same for the drafts copied beside a draft model (prompt lookup, a predicted output)."""
    return r.copy_kept / (r.copy_kept + r.copy_rejected)


cdef class RowCost:
    """A decode or speculative step's duration against the tokens it feeds, fitted as ``a + b * tokens`` by least
    squares over the steps seen, each step weighing ROW_COST_DECAY times less with every later one. ``fit()`` is
    None until the tokens fed have varied enough to tell b (a run of equal steps forgets that)."""

    cdef readonly double w, x, y, xx, xy

    def observe(self, double tokens, double duration_ns):
        self.w = ROW_COST_DECAY * self.w + 1.0
        self.x = ROW_COST_DECAY * self.x + tokens
        self.y = ROW_COST_DECAY * self.y + duration_ns
        self.xx = ROW_COST_DECAY * self.xx + tokens * tokens
        self.xy = ROW_COST_DECAY * self.xy + tokens * duration_ns

    def fit(self):
        """(a, b): ns a step, ns a token fed; None while the tokens fed have a variance under 1/4."""
        if self.w < 2.0:
            return None
        cdef double mean_x = self.x / self.w
        cdef double var_x = self.xx / self.w - mean_x * mean_x
        if var_x < 0.25:
            return None
        cdef double b = (self.xy / self.w - mean_x * self.y / self.w) / var_x
        return (self.y / self.w - b * mean_x, b)

# What one frame reported, one entry per plan participant in plan order:
# handles int64, cumulative consumed/generated token counts int64, and the
# sampled token id (int32, -1 where the step samples nothing); snapshot_ns:
# the GPU time of a prefill frame's checkpoint copies (plan.copies), when
# the executor timed them apart (0: not timed); accepted_drafts: in a
# speculative frame, per participant the draft tokens its step confirmed, in
# order (they come before token_ids[i], the step's own next token), else None.
CompletionRecords = namedtuple("CompletionRecords",
                               "handles consumed_tokens generated_tokens token_ids snapshot_ns accepted_drafts",
                               defaults=(0, None))
# emitted: (handle, token_id) accepted for publication, in order;
# finished: handles that hit their output or context limit in this frame;
# retired: handles whose slot and resources were released;
# published: checkpoint ids created by this frame's snapshots.
CompletionResult = namedtuple("CompletionResult", "emitted finished retired published")


cdef tuple _timing_shape(ScheduledPlan plan):
    """The shape whose timings a plan's duration updates: its own, except that a speculative step is the decode
    cohort the policy chose (and priced by the decode shape's estimate), with drafts added."""
    if plan.kind == K_SPECULATIVE:
        return (K_DECODE, plan.batch_capacity, plan.batch_capacity)
    return plan.shape


cdef int64_t _next_scheduler_id = 1


cdef class RequestScheduler:
    """See the module rules. ``config`` is a flared.scheduler.SchedulerConfig
    (or any object with its attributes); ``policy`` a PolicyConfig."""

    def __init__(self, config, policy):
        global _next_scheduler_id
        self.scheduler_id = _next_scheduler_id
        _next_scheduler_id += 1
        self.config = config
        self.policy = policy
        self.max_live_requests = config.max_live_requests
        if not 1 <= self.max_live_requests <= MAX_SLOTS:
            raise ValueError(f"max_live_requests must be 1..{MAX_SLOTS}")
        self.page_tokens = config.page_tokens
        self.context_capacity = config.context_capacity
        self.prefill_chunk_size = config.prefill_chunk_size
        self.model_identity = bytes(config.model_identity)
        self.cache = PrefixCheckpointCache(config.num_pages, config.num_snapshots, config.page_tokens)
        self.pages = PageAllocator(config.num_pages)
        self.snapshots = PageAllocator(config.num_snapshots)
        self.timings = GraphTimings(policy.timing_freshness_ns)
        self._slots = [None] * MAX_SLOTS
        self._next_generation = 1
        self._next_plan_id = 1
        self.last_committed_fence = 0
        self.completed_fence = 0
        self._inflight = []
        self._draining = []
        self.refresh_credit_ns = 0.0
        self.selection = SelectionPolicy(config, policy, self.timings)
        self.counters = {
            "admitted": 0, "finished": 0, "cancelled": 0, "retired": 0,
            "prefix_lookups": 0, "prefix_hits": 0, "prefix_reused_tokens": 0,
            "publications": 0, "duplicate_publications": 0, "evictions": 0,
            "refreshes": 0,
        }
        for k in GraphKind:
            self.counters["launches_" + k.name.lower()] = 0
        self._extra_work_fraction = config.checkpoint_extra_work_fraction
        self._initialize_state = config.initialize_state
        self._spec_tokens = getattr(config, "speculative_tokens", 0)
        self.row_cost = RowCost()
        self._spec_rows = min(SPECULATIVE_MAX_TOKENS, config.speculative_max_rows or SPECULATIVE_MAX_TOKENS)
        self._lookup_max = getattr(config, "prompt_lookup_max", 4)
        self._lookup_min = getattr(config, "prompt_lookup_min", 2)
        # Drafts from a draft model instead of the lookup (flared.execution.drafter.DraftModel); None: the lookup
        self._drafter = getattr(config, "drafter", None)
        # Speculative decoding's figures (the dashboard's acceptance length and depth): draft tokens fed and kept,
        # request rounds that were offered at least one draft, and every request round of a generation step
        # (decode or speculative; the denominator of depth).
        self.counters["speculative_drafted"] = 0
        self.counters["speculative_accepted"] = 0
        self.counters["speculative_rounds"] = 0
        self.counters["speculative_priced_out"] = 0  # drafts proposed and left out as not worth their cost
        self.counters["generation_rounds"] = 0
        self.counters["drafter_steps"] = 0  # the draft model's forwards behind completed speculative steps

    # ------------------------------------------------------------------
    # queries

    @property
    def num_live(self):
        return sum(1 for r in self._slots if r is not None)

    @property
    def num_inflight(self):
        return len(self._inflight)

    def live_handles(self):
        return [(<Request>r).handle for r in self._slots if r is not None]

    def request(self, int64_t handle):
        return self._get(handle)

    def block_table(self, int64_t handle):
        return self._get(handle).block_table

    def estimated_duration_ns(self, tuple shape, int64_t now_ns=0):
        return self.timings.estimate(shape, now_ns)[0]

    cdef Request _get(self, int64_t handle):
        cdef int64_t slot = handle & SLOT_MASK
        if slot >= MAX_SLOTS or handle <= 0:
            raise ExecutionError(f"invalid request handle {handle}")
        r = self._slots[slot]
        if r is None or (<Request>r).handle != handle:
            raise ExecutionError(f"request handle {handle} is not live (slot {slot} reused or released)")
        return <Request>r

    # ------------------------------------------------------------------
    # admission

    def admit(
        self,
        prompt_tokens,
        int64_t max_output_tokens,
        int64_t now_ns,
        message_boundaries=(),
        conditioning=(),
        bint score_prompt=False,
        int64_t priority=0,
        bint speculate=False,
        prediction=(),
        atomic_spans=(),
    ):
        """Admit a request; returns its handle.

        ``message_boundaries``: token endpoints of complete messages (checkpoint
        candidates). ``conditioning``: (position, 32-byte identity) events.
        ``priority``: vLLM's (lower runs sooner; Request.value_scale).
        ``speculate``: speculative steps may feed this request drafts (the caller vouches that its next tokens are
        the logits' argmax and nothing else: greedy, nothing that shapes the logits). ``prediction``: token ids
        the client expects the output to resemble (OpenAI's predicted outputs), where its drafts are looked up
        first. ``atomic_spans``: prompt spans (start, end) each fed whole by one prefill chunk (Gemma 3's images,
        whose tokens attend to each other both ways); each must fit the prefill chunk.
        Raises AdmissionError (CONTEXT_LENGTH, VALIDATION, MODEL_CAPACITY).
        """
        prompt = np.array(prompt_tokens, dtype=np.int32).reshape(-1)
        cdef int64_t L = prompt.shape[0]
        if L == 0:
            raise AdmissionError("prompt is empty", ErrorKind.VALIDATION)
        if max_output_tokens < 1:
            raise AdmissionError("max_output_tokens must be at least 1", ErrorKind.VALIDATION)
        if L + max_output_tokens > self.context_capacity:
            raise AdmissionError(
                f"prompt of {L} tokens plus {max_output_tokens} output tokens exceeds the context of "
                f"{self.context_capacity}",
                ErrorKind.CONTEXT_LENGTH,
            )
        spans = sorted((int(a), int(b)) for a, b in atomic_spans)
        for a, b in spans:
            if not 0 <= a < b <= L:
                raise AdmissionError(f"span {a}..{b} is not inside the prompt of {L} tokens", ErrorKind.VALIDATION)
            if b - a > self.prefill_chunk_size:
                raise AdmissionError(
                    f"an image of {b - a} tokens must be fed in one prefill chunk, and this model's chunk is "
                    f"{self.prefill_chunk_size} tokens (export the core with a larger --prefill-chunk)",
                    ErrorKind.VALIDATION)
        cdef int32_t slot = -1, i
        for i in range(self.max_live_requests):
            if self._slots[i] is None:
                slot = i
                break
        if slot < 0:
            raise AdmissionError(f"all {self.max_live_requests} request slots are live", ErrorKind.MODEL_CAPACITY)

        cdef PrefixHistory history = PrefixHistory(self.model_identity)
        cdef int64_t at = 0
        for position, ident in sorted(conditioning, key=lambda e: e[0]):
            history.append_tokens(prompt[at:position])
            at = position
            history.append_conditioning(position, ident)
        history.append_tokens(prompt[at:])

        self.counters["prefix_lookups"] += 1
        cdef Checkpoint hit = None if score_prompt else self.cache.lookup(history, L)
        cdef int64_t reused = 0 if hit is None else hit.num_tokens
        if hit is not None:
            self.cache.pin(hit)
            # Lookup counters include attempts rejected below for resource
            # pressure: they describe the cache, not admission.
            self.counters["prefix_hits"] += 1
            self.counters["prefix_reused_tokens"] += reused
        cdef int64_t P = self.page_tokens
        cdef int64_t total_blocks = (L + max_output_tokens + P - 1) // P
        cdef int64_t num_private = total_blocks - reused // P
        if not self._ensure_pages(num_private):
            if hit is not None:
                self.cache.unpin(hit)
            raise AdmissionError(
                f"{num_private} KV pages needed, {self.pages.num_free} free", ErrorKind.MODEL_CAPACITY
            )
        endpoints = []
        snapshot_ids = []
        for e in self.selection.select_endpoints(message_boundaries, L, reused):
            sid = self._take_snapshot()
            if sid < 0:
                break
            endpoints.append(e)
            snapshot_ids.append(sid)
        order = sorted(range(len(endpoints)), key=lambda j: endpoints[j])

        cdef Request r = Request.__new__(Request)
        r.slot = slot
        r.generation = self._next_generation
        self._next_generation += 1
        r.handle = (r.generation << SLOT_BITS) | slot
        r.state_row = slot + 1
        r.prompt = prompt
        r._prompt = prompt
        r.prompt_len = L
        r.history = history
        r.max_output_tokens = max_output_tokens
        r.score_prompt = score_prompt
        r.output_tokens = []
        private = self.pages.allocate(num_private)
        r.block_table = private if hit is None else np.concatenate([hit.block_table(), private])
        r._block_table = r.block_table
        r.num_shared_pages = reused // P
        r.base = hit
        r.reused_tokens = reused
        r.num_computed_tokens = reused
        r.num_scheduled_tokens = reused
        r.endpoints = [endpoints[j] for j in order]
        r.atomic_spans = spans
        r.endpoint_snapshots = [snapshot_ids[j] for j in order]
        r.terminal_snapshot = -1
        r.last_use_fence = 0
        r.arrival_ns = now_ns
        r.last_progress_ns = now_ns
        # Prices are relative: every newcomer starts at the same price, so
        # arrival order alone never ranks one request above another.
        r.token_price = 1.0
        r.delivery_price = 1.0
        r.priority = priority
        r.speculate = speculate
        r.prediction = np.array(prediction, dtype=np.int32).reshape(-1)
        r._prediction = r.prediction
        r.spec_cap = min(1, self._spec_tokens)  # one draft first: wider only once drafts are kept
        r.spec_kept = r.spec_rejected = 1.0
        r.copy_kept = r.copy_rejected = 1.0
        r.spec_cooldown = 0
        r.value_scale = 2.0 ** (-max(-16, min(16, priority)))
        if hit is not None:
            r.phase = PH_RESTORE
        elif self._initialize_state:
            r.phase = PH_INITIALIZE
        else:
            r.phase = PH_PREFILL
        self._slots[slot] = r
        self.counters["admitted"] += 1
        return r.handle

    cdef bint _ensure_pages(self, int64_t n) except -1:
        if self.pages.num_free < n:
            evicted = self.cache.evict(n - self.pages.num_free, 0)
            self.counters["evictions"] += len(evicted)
            self._reclaim(self.cache.advance_completed(self.completed_fence).reusable)
        return self.pages.num_free >= n

    cdef int32_t _take_snapshot(self) except -2:
        if self.snapshots.num_free == 0:
            evicted = self.cache.evict(0, 1)
            self.counters["evictions"] += len(evicted)
            self._reclaim(self.cache.advance_completed(self.completed_fence).reusable)
        if self.snapshots.num_free == 0:
            return -1
        return self.snapshots.allocate(1)[0]

    cdef _reclaim(self, list reusable):
        for res in reusable:
            if len(res.page_ids):
                self.pages.free(np.array(res.page_ids))  # the cache's copy is read-only
            self.snapshots.free(np.array([res.snapshot_id], dtype=np.int32))

    # ------------------------------------------------------------------
    # planning

    def plan(self, int64_t now_ns):
        """Select the next graph submission, or None. Mutates nothing."""
        cdef Py_ssize_t n_inflight = len(self._inflight)
        cdef ScheduledPlan head
        if n_inflight >= 2:
            return None
        if n_inflight:
            head = self._inflight[0][1]
            if head.exclusive:
                return None
            # The oldest frame ran past its expected finish (counted from the end of the frame it was queued
            # behind): something is slower than estimated, so stop stacking work behind it.
            if now_ns > head.expected_finish_ns:
                return None
            for _, p in self._inflight:
                if (<ScheduledPlan>p).kind != K_DECODE:
                    return None

        # With a decode frame in flight every kind still competes (stacking=True): decode cohorts that may
        # join a second frame, and the work that needs an empty window for requests with nothing in
        # flight. If that work wins, nothing stacks and the window drains for it; if a decode wins, it is
        # what a drained window would have chosen too, so stacking it costs no one a turn. (Stopping the
        # stacking whenever such work had waited a while, as before, drained the window for work the
        # policy then passed over again: a run of unpipelined steps.)
        cdef _Candidate best = self.selection.select(self._slots, n_inflight > 0, now_ns, self.refresh_credit_ns, n_inflight == 0)
        if best is None:
            if n_inflight == 0 and self.refresh_credit_ns > 0:
                self.refresh_credit_ns = 0.0  # idle: positive credit lapses, debt stays
            return None
        if n_inflight and best.kind != K_DECODE:
            return None  # the window drains for it
        if best.state != TIMING_FRESH and n_inflight:
            return None  # unmeasured/stale shapes run alone
        if n_inflight and self._spec_tokens and self._drains_to_speculate(best.requests):
            return None  # the window drains, so that the cohort's drafts can be looked up
        # A decode cohort chosen with the window empty may become a speculative step: drafts need every token of
        # their request known on the host, and a speculative step runs alone.
        return self._build_plan(best, now_ns, self._spec_tokens > 0 and n_inflight == 0 and best.kind == K_DECODE)

    cdef int64_t _draft_cap(self, Request r):
        """The drafts ``r`` may be offered this step: its cap (spec_cap) within its output limit (the step adds a
        token of its own); none before its first output."""
        if not r.output_tokens:
            return 0
        return min(<int64_t>r.spec_cap, r.max_output_tokens - r.num_scheduled_samples - 1)

    cdef object _sequence(self, Request r):
        """``r``'s tokens as int32: its prompt and outputs, the last of which the step feeds."""
        cdef Py_ssize_t P = r._prompt.shape[0]
        seq = np.empty(P + len(r.output_tokens), np.int32)
        seq[:P] = r._prompt
        seq[P:] = r.output_tokens
        return seq

    cdef list _proposals(self, list requests, Py_ssize_t budget, ScheduledPlan p):
        """Each request's drafts: prompt lookup's (_propose), or with a draft model (SchedulerConfig.drafter) its,
        except where copying is at hand and pays: drafts found in a predicted output, or after an earlier place of
        the request's latest prompt_lookup_max tokens (a whole n-gram: the text is being copied), cost no draft
        forward, and are taken where a round with them is expected to give at least the tokens per ns of one
        with the draft model's, each source by its own record (copy_kept, copy_rejected against spec_kept,
        spec_rejected). ``budget``: the draft tokens the step has room for, the cohort's earlier requests asking
        first. ``p.drafter_steps``: the draft model's forwards (the deepest draft)."""
        cdef Request r
        cdef int64_t cap
        cdef Py_ssize_t i
        if self._drafter is None:
            return [self._propose(<Request>x) if (<Request>x).speculate else () for x in requests]
        drafts = [()] * len(requests)
        copied = [False] * len(requests)
        p.copied = copied
        # what a round costs (RowCost's fit, else the step's estimate), a share a request, a verify row, and a
        # draft model's forward of one row (its fit; 0 where unknown: copies, which cost no forward, come first)
        cdef double share = 0.0, row = 0.0, forward = 0.0, n = len(requests)
        fit = self._step_cost(p)
        if fit is not None:
            share, row = max(fit[0] + fit[1] * n, fit[1] * n) / n, fit[1]
        draft_fit = self._drafter.forward_cost()
        if draft_fit is not None:
            forward = max(draft_fit[0] + draft_fit[1], 0.0)
        ask, handles, sequences, caps = [], [], [], []
        for i in range(len(requests)):
            r = requests[i]
            cap = min(self._draft_cap(r), <int64_t>budget)
            if not r.speculate or cap <= 0:
                continue
            seq = self._sequence(r)
            found = ()
            # A round with a copied draft against one with a drafted draft, each source by its own record: tokens
            # per ns, the step's share a request and a verify row, plus a draft forward for the draft model's
            if (1.0 + _copy_chance(r)) * (share + row + forward) >= (1.0 + _chance(r)) * (share + row):
                found = self._predicted(r, seq, len(r.output_tokens), cap) if r._prediction.shape[0] else ()
                if not found:  # what follows the latest prompt_lookup_max tokens' earlier place: a whole n-gram
                    found = self._lookup(seq, cap, self._lookup_max)
            if found:
                drafts[i] = found
                copied[i] = True
                budget -= len(found)
                continue
            ask.append(i)
            handles.append(r.handle)
            sequences.append(seq)
            caps.append(cap)
            budget -= cap
        # Priced before they are drafted (a draft's worth depends on its depth and its request's record, not on
        # the token): the draft model drafts only as deep as the pricing keeps, nothing where it keeps nothing.
        counts = [len(d) for d in drafts]
        drafting = [False] * len(requests)
        for i in range(len(ask)):
            counts[ask[i]] = caps[i]
            drafting[ask[i]] = True
        kept = self._priced_counts(requests, counts, p, drafting)
        for i in range(len(requests)):
            if not drafting[i]:
                drafts[i] = drafts[i][:kept[i]]
        caps = [kept[i] for i in ask]
        if any(caps):
            got, depth = self._drafter.propose(handles, sequences, caps)
            p.drafter_steps = depth
            for i in range(len(ask)):
                drafts[ask[i]] = tuple([int(t) for t in got[i][:caps[i]]])
        return drafts

    cdef tuple _propose(self, Request r):
        """Draft tokens for ``r`` by prompt lookup: its latest n tokens (n from prompt_lookup_max down to
        prompt_lookup_min), found again earlier in its prompt and output, and what followed them there (the latest
        such place with as many tokens after it as the cap, else the earliest); as many as its cap (_draft_cap). A
        request with a predicted output looks there first (_predicted)."""
        cdef int64_t cap = self._draft_cap(r)
        if cap <= 0:
            return ()
        seq = self._sequence(r)
        if r._prediction.shape[0]:
            drafts = self._predicted(r, seq, len(r.output_tokens), cap)
            if drafts:
                return drafts
        return self._lookup(seq, cap, self._lookup_min)

    cdef tuple _lookup(self, int32_t[::1] sv, int64_t cap, Py_ssize_t shortest):
        """Prompt lookup over the tokens ``sv``: the continuation of the latest n tokens' earlier place (n from
        prompt_lookup_max down to ``shortest``), up to ``cap`` tokens (_propose)."""
        cdef Py_ssize_t L = sv.shape[0], n, j, m, earliest, latest_full, i
        # An n-gram match ends at each earlier place j (j < L - 1) where the latest n tokens occur again, and its
        # continuation starts at j + 1: plain loops (a few hundred tokens, n <= prompt_lookup_max).
        for n in range(min(<Py_ssize_t>self._lookup_max, L - 1), shortest - 1, -1):
            earliest = latest_full = -1
            for j in range(n - 1, L - 1):
                m = 0
                while m < n and sv[j - m] == sv[L - 1 - m]:
                    m += 1
                if m == n:
                    if earliest < 0:
                        earliest = j
                    if j + 1 + cap <= L:
                        latest_full = j
            if earliest >= 0:
                # the latest place followed by a full cap of tokens; else the earliest (the longest continuation)
                i = (latest_full if latest_full >= 0 else earliest) + 1
                return tuple([sv[j] for j in range(i, min(i + cap, L))])
        return ()

    cdef tuple _predicted(self, Request r, int32_t[::1] sv, Py_ssize_t outputs, int64_t cap):
        """Drafts from ``r``'s predicted output: its latest n tokens (n from prompt_lookup_max down to
        prompt_lookup_min, or to 1 while the output is shorter than that, and at most the output's length) found in
        the prediction, at the place nearest the output's own position (an edited text keeps its order, so the
        prediction's place for the output's k-th token is about k), and what follows them there."""
        cdef int32_t[::1] pv = r._prediction
        cdef Py_ssize_t Q = pv.shape[0], L = sv.shape[0], n, j, m, best, gap, best_gap
        cdef Py_ssize_t low = min(<Py_ssize_t>self._lookup_min, outputs)
        for n in range(min(<Py_ssize_t>self._lookup_max, outputs), max(low, 1) - 1, -1):
            best = -1
            best_gap = Q + L
            for j in range(n - 1, Q - 1):  # a match ending at j with at least one token after it
                m = 0
                while m < n and pv[j - m] == sv[L - 1 - m]:
                    m += 1
                if m == n:
                    gap = j - (outputs - 1) if j >= outputs - 1 else outputs - 1 - j
                    if gap < best_gap:
                        best, best_gap = j, gap
            if best >= 0:
                return tuple([pv[j] for j in range(best + 1, min(best + 1 + cap, Q))])
        return ()

    cdef ScheduledPlan _build_plan(self, _Candidate c, int64_t now_ns, bint speculate=False):
        cdef Py_ssize_t n = len(c.requests), i, j
        cdef ScheduledPlan p = ScheduledPlan.__new__(ScheduledPlan)
        cdef int kind = c.kind
        drafts = None
        cdef Py_ssize_t budget
        p.estimated_duration_ns = c.estimate_ns  # (what a draft model's first drafts are priced against)
        if speculate:
            # At most _spec_rows tokens fed in all (the CPU's one-call decode step takes 64 rows; the GPU's
            # speculative graphs a row per token): the requests earlier in the cohort keep their drafts first.
            budget = max(self._spec_rows, n) - n
            drafts = self._proposals(c.requests, budget, p)  # (a draft model's priced already: _proposals)
            if self._drafter is None:
                for i in range(n):
                    drafts[i] = drafts[i][:budget]
                    budget -= len(drafts[i])
                drafts = self._priced_drafts(c.requests, drafts, p)
            if any(drafts):
                kind = K_SPECULATIVE
            else:
                drafts = None
        p.scheduler_id = self.scheduler_id
        p.plan_id = self._next_plan_id
        self._next_plan_id += 1
        p.kind = kind
        p.spec_tried = speculate
        p.batch_capacity = c.batch
        # a speculative step's width: the most tokens one request feeds (its last token and its drafts)
        p.token_capacity = c.tokens if drafts is None else 1 + max(len(d) for d in drafts)
        p.planned_ns = now_ns
        p.estimated_duration_ns = c.estimate_ns
        p.exclusive = c.state != TIMING_FRESH
        p.refresh = c.refresh
        p.value = c.value
        p.score = c.score
        p._requests = c.requests
        handles = np.empty(n, np.int64)
        slots = np.empty(n, np.int32)
        rows = np.empty(n, np.int32)
        epochs = np.empty(n, np.int64)
        starts = np.empty(n, np.int32)
        counts = np.empty(n, np.int32)
        sample = np.zeros(n, np.uint8)
        gen_ends = np.empty(n, np.int64)
        first_blocks = np.zeros(n, np.int32)
        page_offsets = np.zeros(n + 1, np.int32)
        token_offsets = np.zeros(n + 1, np.int32)
        cdef int64_t[::1] h_v = handles, e_v = epochs, g_v = gen_ends
        cdef int32_t[::1] s_v = slots, r_v = rows, st_v = starts, n_v = counts, fb_v = first_blocks
        cdef int32_t[::1] po_v = page_offsets, to_v = token_offsets
        cdef uint8_t[::1] sm_v = sample
        cdef Request r
        cdef int64_t take, start, P = self.page_tokens, first, last, total_pages = 0, total_tokens = 0
        cdef Py_ssize_t k
        takes = c.takes
        for i in range(n):
            r = c.requests[i]
            h_v[i] = r.handle
            s_v[i] = r.slot
            r_v[i] = r.state_row
            e_v[i] = r.epoch
            start = r.num_scheduled_tokens
            st_v[i] = start
            if kind == K_DECODE:
                take = 1
            elif kind == K_SPECULATIVE:
                take = 1 + len(drafts[i])
            elif kind == K_PREFILL or kind == K_SCORED_PREFILL:
                take = takes[i]
            else:
                take = 0
            n_v[i] = take
            if kind == K_DECODE or kind == K_RESUME_SAMPLING or kind == K_SPECULATIVE:
                sm_v[i] = 1
            elif (kind == K_PREFILL or kind == K_SCORED_PREFILL) and start + take == r.prompt_len:
                sm_v[i] = 1
            g_v[i] = r.num_scheduled_samples + sm_v[i]
            if take > 0:
                first = start // P
                last = (start + take - 1) // P
                fb_v[i] = first
                total_pages += last - first + 1
            elif kind == K_RESTORE:
                fb_v[i] = 0
                total_pages += (start + P - 1) // P
            total_tokens += take
            po_v[i + 1] = total_pages
            to_v[i + 1] = total_tokens
        page_ids = np.empty(total_pages, np.int32)
        token_ids = np.empty(total_tokens, np.int32)
        cdef int32_t[::1] pg_v = page_ids, tk_v = token_ids
        copies = []
        for i in range(n):
            r = c.requests[i]
            j = 0
            for k in range(po_v[i], po_v[i + 1]):
                pg_v[k] = r._block_table[fb_v[i] + j]
                j += 1
            start = st_v[i]
            if kind == K_DECODE or kind == K_SPECULATIVE:
                j = start - r.prompt_len
                tk_v[to_v[i]] = r.output_tokens[j] if j < len(r.output_tokens) else -1
                if kind == K_SPECULATIVE:
                    for j in range(1, n_v[i]):
                        tk_v[to_v[i] + j] = drafts[i][j - 1]
            else:
                for j in range(n_v[i]):
                    tk_v[to_v[i] + j] = r._prompt[start + j]
            if kind == K_RESTORE:
                copies.append(self._copy_row(r.base.snapshot_id, r, r.reused_tokens))
            elif (kind == K_PREFILL or kind == K_SCORED_PREFILL) and r.endpoints and start + n_v[i] == r.endpoints[0]:
                # The chunk ends at a checkpoint endpoint: the frame copies it right after the prefill, so the
                # request never waits for a snapshot step of its own (which needs an empty window and, at the
                # prompt end, competed as one output token against whole decode cohorts).
                copies.append(self._copy_row(r.endpoint_snapshots[0], r, r.endpoints[0]))
            elif kind == K_SNAPSHOT:  # snapshot steps are terminal captures
                copies.append(self._copy_row(r.terminal_snapshot, r, r.terminal_tokens))
        for arr in (handles, slots, rows, epochs, starts, counts, sample, gen_ends, first_blocks,
                    page_offsets, token_offsets, page_ids, token_ids):
            arr.setflags(write=False)
        p.handles = handles
        p.slots = slots
        p.state_rows = rows
        p.epochs = epochs
        p.token_starts = starts
        p.num_tokens = counts
        p.token_offsets = token_offsets
        p.token_ids = token_ids
        p.sample = sample
        p.generated_ends = gen_ends
        p.first_blocks = first_blocks
        p.page_offsets = page_offsets
        p.page_ids = page_ids
        cp = np.array(copies, dtype=np.int32).reshape(-1, 4)
        cp.setflags(write=False)
        p.copies = cp
        return p

    cdef tuple _copy_row(self, int32_t snapshot_id, Request r, int64_t endpoint):
        cdef int64_t P = self.page_tokens
        cdef int64_t partial = endpoint % P
        cdef int32_t page = r._block_table[endpoint // P] if partial else -1
        return (snapshot_id, r.state_row, page, partial)

    # ------------------------------------------------------------------
    # commit and complete

    def commit(self, ScheduledPlan plan, int64_t fence):
        """Record that ``plan`` is being submitted as ``fence``."""
        if plan.scheduler_id != self.scheduler_id:
            raise ExecutionError("plan belongs to another scheduler")
        if plan._committed:
            raise ExecutionError(f"plan {plan.plan_id} was already committed")
        if fence <= self.last_committed_fence:
            raise ExecutionError(f"fence {fence} is not after the last committed fence {self.last_committed_fence}")
        if len(self._inflight) >= 2:
            raise ExecutionError("two frames are already in flight")
        if self._inflight and (plan.exclusive or (<ScheduledPlan>self._inflight[0][1]).exclusive):
            raise ExecutionError("an unmeasured or stale graph must run with the queue empty")
        cdef Py_ssize_t i, n = len(plan._requests)
        cdef Request r
        cdef const int64_t[::1] epochs = plan.epochs
        for i in range(n):
            r = plan._requests[i]
            if self._slots[r.slot] is not r or r.epoch != epochs[i]:
                raise ExecutionError(f"plan {plan.plan_id} is stale: request {r.handle} changed since planning")
            if r.cancelled or (r.finished and plan.kind != K_SNAPSHOT):
                raise ExecutionError(f"plan {plan.plan_id} includes finished request {r.handle}")
        cdef const int32_t[::1] counts = plan.num_tokens
        cdef const uint8_t[::1] sample = plan.sample
        cdef double est = plan.estimated_duration_ns
        for i in range(n):
            r = plan._requests[i]
            r.num_scheduled_tokens += counts[i]
            r.num_scheduled_samples += sample[i]
            r.inflight += 1
            r.last_use_fence = fence
            r.last_inflight_decode = plan.kind == K_DECODE
            r.epoch += 1
            if est > 0:
                # Rate normalizers for fairness: what this request would get
                # from this graph alone. Unmeasured graphs contribute none.
                if counts[i] > 0:
                    # a speculative step serves one certain token (its drafts may all fail)
                    r.token_ns_per_token = est / (1 if plan.kind == K_SPECULATIVE else counts[i])
                if plan.kind == K_DECODE or plan.kind == K_SPECULATIVE:
                    r.delivery_interval_ns = est
            if plan.kind == K_RESTORE:
                self.cache.mark_used(r.base, fence)
        cdef int64_t starts_ns = plan.planned_ns
        if self._inflight:
            starts_ns = max(starts_ns, (<ScheduledPlan>self._inflight[len(self._inflight) - 1][1]).expected_finish_ns)
        plan.expected_finish_ns = starts_ns + plan.estimated_duration_ns
        self.timings.note_attempt(_timing_shape(plan), plan.planned_ns)
        if plan.refresh:
            self.refresh_credit_ns -= plan.estimated_duration_ns
            self.counters["refreshes"] += 1
        plan._committed = True
        self.last_committed_fence = fence
        self._inflight.append((fence, plan))
        self.counters[_LAUNCH_KEYS[plan.kind]] += 1
        self.counters["speculative_priced_out"] += plan.priced_out

    def complete(self, int64_t fence, records, duration_ns, int64_t now_ns, int64_t embedding_wait_ns=0):
        """Apply one frame's completion records (in fence order).

        Every record is validated before anything changes. Returns
        CompletionResult.
        """
        if not self._inflight or self._inflight[0][0] != fence:
            expected = self._inflight[0][0] if self._inflight else None
            raise ExecutionError(f"completion for fence {fence}, expected {expected}")
        cdef ScheduledPlan plan = self._inflight[0][1]
        cdef Py_ssize_t i, n = len(plan._requests)
        handles = np.asarray(records.handles, dtype=np.int64)
        consumed = np.asarray(records.consumed_tokens, dtype=np.int64)
        generated = np.asarray(records.generated_tokens, dtype=np.int64)
        token_ids = np.asarray(records.token_ids, dtype=np.int64)
        if not (handles.shape[0] == consumed.shape[0] == generated.shape[0] == token_ids.shape[0] == n):
            raise ExecutionError(f"frame {fence} reports {handles.shape[0]} records for {n} participants")
        cdef const int64_t[::1] hv = handles, cv = consumed, gv = generated, tv = token_ids
        cdef const int64_t[::1] g_end = plan.generated_ends
        cdef const int32_t[::1] starts = plan.token_starts
        cdef const int32_t[::1] counts = plan.num_tokens
        cdef const uint8_t[::1] sample = plan.sample
        cdef Request r
        cdef int kind = plan.kind
        cdef int64_t accepted = 0
        drafts_kept = records.accepted_drafts if kind == K_SPECULATIVE else None
        if kind == K_SPECULATIVE and (drafts_kept is None or len(drafts_kept) != n):
            raise ExecutionError(f"speculative frame {fence} reports no accepted drafts for its {n} participants")
        for i in range(n):
            r = plan._requests[i]
            if hv[i] != r.handle or hv[i] & SLOT_MASK != r.slot:
                raise ExecutionError(f"frame {fence} record {i}: handle {hv[i]} is not participant {r.handle}")
            if kind == K_SPECULATIVE:
                # the fed token and the confirmed drafts are consumed; each confirmed draft is one more output
                accepted = len(drafts_kept[i])
                if accepted >= counts[i] or cv[i] != starts[i] + 1 + accepted:
                    raise ExecutionError(f"frame {fence} record {i}: consumed {cv[i]} with {accepted} drafts kept "
                                         f"of {counts[i] - 1}, expected {starts[i] + 1 + accepted}")
                if gv[i] != g_end[i] + accepted or gv[i] > r.max_output_tokens:
                    raise ExecutionError(f"frame {fence} record {i}: generated {gv[i]}, expected {g_end[i] + accepted}")
                if any(int(t) < 0 for t in drafts_kept[i]):
                    raise ExecutionError(f"frame {fence} record {i}: a kept draft has no token id")
            elif cv[i] != starts[i] + counts[i] or cv[i] < r.num_computed_tokens or cv[i] > self.context_capacity:
                raise ExecutionError(
                    f"frame {fence} record {i}: consumed {cv[i]}, expected {starts[i] + counts[i]}"
                )
            elif gv[i] != g_end[i] or gv[i] < r.num_generated_tokens or gv[i] > r.max_output_tokens:
                raise ExecutionError(f"frame {fence} record {i}: generated {gv[i]}, expected {g_end[i]}")
            if sample[i] and tv[i] < 0:
                raise ExecutionError(f"frame {fence} record {i}: sampled no token")

        self._inflight.pop(0)
        self.completed_fence = fence
        cdef int64_t copy_rows = plan.copies.shape[0], copy_cap = 1
        snapshot_ns = records.snapshot_ns
        if copy_rows and snapshot_ns and (kind == K_PREFILL or kind == K_SCORED_PREFILL):
            # The checkpoint copies after the prefill, timed apart by the executor, are what a snapshot step
            # of that many rows costs (terminal captures and checkpoint extras are priced by it).
            while copy_cap < copy_rows:
                copy_cap <<= 1
            self.timings.observe((K_SNAPSHOT, copy_cap, 0), int(snapshot_ns), now_ns)
            if isinstance(duration_ns, int):  # the prefill shape keeps its own time
                duration_ns = max(1, duration_ns - int(snapshot_ns))
        cdef int64_t measured = self.timings.observe(_timing_shape(plan), duration_ns, now_ns, embedding_wait_ns)
        cdef int64_t fed = 0
        if self._spec_tokens and measured > 0 and (kind == K_DECODE or kind == K_SPECULATIVE):
            for i in range(n):
                fed += counts[i]
            self.row_cost.observe(<double>fed, <double>measured)
        if plan.refresh:
            self.refresh_credit_ns += plan.estimated_duration_ns - measured
        elif measured > 0:
            self.refresh_credit_ns = min(self.refresh_credit_ns + measured * REFRESH_FRACTION, REFRESH_CAP_NS)
        # Readiness and reuse first, so this frame's snapshots publish ready.
        self._reclaim(self.cache.advance_completed(fence).reusable)

        emitted = []
        finished = []
        published = []
        if kind == K_DECODE or kind == K_SPECULATIVE:
            self.counters["generation_rounds"] += n
        if kind == K_SPECULATIVE:
            self.counters["drafter_steps"] += plan.drafter_steps
        for i in range(n):
            r = plan._requests[i]
            r.inflight -= 1
            r.epoch += 1
            r.num_computed_tokens = cv[i]
            if counts[i] > 0 or sample[i]:
                r.last_progress_ns = now_ns
            if kind == K_SPECULATIVE:
                # The rejected drafts were scheduled but not consumed: the next step feeds from here (their K/V
                # slots are written over). The kept drafts are outputs, before the step's own token.
                r.num_scheduled_tokens = cv[i]
                r.num_scheduled_samples = gv[i]
                self.counters["speculative_drafted"] += counts[i] - 1
                self.counters["speculative_accepted"] += len(drafts_kept[i])
                self.counters["speculative_rounds"] += counts[i] > 1
                if counts[i] > 1:
                    self._adapt_drafts(r, counts[i] - 1, len(drafts_kept[i]),
                                       plan.copied is not None and plan.copied[i])
                for t in drafts_kept[i]:
                    r.output_tokens.append(int(t))
                    if not r.finished and not r.cancelled:
                        emitted.append((r.handle, int(t)))
            if plan.spec_tried and r.speculate and counts[i] == 1:  # no draft this round: stack a few rounds
                r.spec_rest = SPECULATIVE_MISS_REST
            elif kind == K_DECODE and r.spec_rest > 0:
                r.spec_rest -= 1
            if (kind == K_DECODE or (kind == K_SPECULATIVE and counts[i] == 1)) and r.spec_cooldown > 0:
                r.spec_cooldown -= 1
                if r.spec_cooldown == 0:
                    r.spec_cap = 1
            if sample[i]:
                r.num_generated_tokens = gv[i]
                # Kept even after a stop: a pipelined decode may already have
                # fed it, and the terminal key must match the consumed state.
                r.output_tokens.append(int(tv[i]))
                if not r.finished and not r.cancelled:
                    emitted.append((r.handle, int(tv[i])))
                    if measured > 0:
                        r.terminal_credit_ns += self._extra_work_fraction * measured
            if r.cancelled:
                continue
            if kind == K_SNAPSHOT:
                cid = self._publish(r, fence)
                if cid >= 0:
                    published.append(cid)
            if r.finished:
                continue
            if (kind == K_PREFILL or kind == K_SCORED_PREFILL) and r.endpoints and cv[i] == r.endpoints[0]:
                # This frame copied the endpoint's checkpoint after its prefill (_build_plan): publish it now.
                cid = self._publish(r, fence)
                if cid >= 0:
                    published.append(cid)
            self._advance_phase(r, kind)
            # Admission bounds prompt + output by the context, so the output
            # limit is the only length stop.
            if r.phase == PH_DECODE and r.num_generated_tokens >= r.max_output_tokens:
                self._finish(r, now_ns)
                finished.append(r.handle)
        if measured > 0:
            self.selection.update_prices(self._slots, plan, measured)
        retired = self._retire_drained()
        return CompletionResult(emitted, finished, retired, published)

    cdef bint _drains_to_speculate(self, list requests):
        """Whether a decode cohort chosen with a step in flight should wait for an empty window instead of
        stacking: some request in it may speculate, drafts at its cap, and its last lookup did not come up empty
        (spec_rest); and the step has room for a draft beside the cohort's own tokens (_spec_rows). Drafts need
        every token of their request on the host."""
        cdef Request r
        cdef Py_ssize_t n = len(requests)
        if n >= self._spec_rows:
            return False
        for x in requests:
            r = x
            if r.speculate and r.spec_cap > 0 and r.spec_rest == 0:
                return True
        return False

    cdef list _priced_drafts(self, list requests, list drafts, ScheduledPlan p):
        """The drafts worth their cost (_priced_counts over their numbers), each request's cut to its count."""
        kept = self._priced_counts(requests, [len(d) for d in drafts], p, None)
        return [drafts[i][:kept[i]] for i in range(len(drafts))]

    cdef object _step_cost(self, ScheduledPlan p):
        """(a, b): the step cost fit (RowCost: ns a step, ns a token fed), or before it forms the step's estimate
        with rows free; None before either."""
        fit = self.row_cost.fit()
        if fit is not None and fit[1] > 0:
            return fit
        if p.estimated_duration_ns > 0:
            return (float(p.estimated_duration_ns), 0.0)
        return None

    cdef list _priced_counts(self, list requests, list counts, ScheduledPlan p, object drafting):
        """How many of each request's ``counts[i]`` drafts are worth their cost: with the step cost fit (RowCost:
        a + b per token fed), a draft whose chance of being kept (its request's record to the power of its depth)
        is g joins while g / cost beats the step's expected tokens per ns so far, best first; so a wide step of
        drafts seldom kept is cut back to the cohort's own tokens, and a cheap one keeps them all. A draft costs
        b, and where ``drafting[i]`` (a draft model has yet to draft request i's) also the draft model's fit
        (DraftModel.forward_cost: a forward, a row): a row, and a whole forward where it is deeper than every draft
        chosen so far. Without a fit (the tokens fed have not varied yet), or where a token costs nothing, every
        draft stays, except a draft model's: those are priced against the step's estimate with rows free (none
        before there is one). ``p.priced_out`` gets the number left out."""
        draft_fit = self._drafter.forward_cost() if drafting is not None and any(drafting) else None
        if draft_fit is not None:
            # A draft model's cost is known from its warm-up, so its first drafts are priced too, against the step's
            # estimate before the step fit forms (where drafting costs more than the step saves, it never starts);
            # before the step has an estimate, it waits for one.
            fit = self._step_cost(p)
            if fit is None:
                return [0 if drafting[i] else counts[i] for i in range(len(counts))]
        else:
            fit = self.row_cost.fit()
            if fit is None or fit[1] <= 0:
                return list(counts)
        cdef double a = fit[0], b = fit[1], da = 0.0, db = 0.0
        if draft_fit is not None:
            da, db = max(draft_fit[0], 0.0), max(draft_fit[1], 0.0)
        cdef Py_ssize_t n = len(requests), i, best, deepest = 0
        cdef double tokens = n, cost = max(a + b * n, b * n), g, c, v, value, best_g = 0.0, best_c = 0.0
        cdef Request r
        kept = [0] * n
        chance = []
        for i in range(n):
            r = requests[i]
            chance.append(_copy_chance(r) if p.copied is not None and p.copied[i] else _chance(r))
        while True:
            best, value = -1, 0.0
            for i in range(n):
                if kept[i] >= counts[i]:
                    continue
                g = chance[i] ** (kept[i] + 1)
                c = b
                if drafting is not None and drafting[i]:
                    c += db + (da if kept[i] + 1 > deepest else 0.0)
                v = g / c if c > 0 else INFINITY  # (a draft that costs nothing is always worth it)
                if v > value:
                    best, value, best_g, best_c = i, v, g, c
            if best < 0 or best_g * cost <= best_c * tokens:
                break
            kept[best] += 1
            tokens += best_g
            cost += best_c
            if drafting is not None and drafting[best] and kept[best] > deepest:
                deepest = kept[best]
        p.priced_out = sum(counts[i] - kept[i] for i in range(n))
        return kept

    cdef _adapt_drafts(self, Request r, int64_t offered, int64_t kept, bint copied=False):
        """A request's draft cap after a round that offered ``offered`` drafts and kept ``kept``: twice as many after
        all were kept (at most speculative_tokens), half after none was; at 0 it rests SPECULATIVE_COOLDOWN rounds,
        then tries one again. Drafts nobody keeps make every step of the cohort wider for nothing. The request's
        record (spec_kept, spec_rejected) decays by SPECULATIVE_DECAY and takes this round in. ``copied`` (drafts
        copied beside a draft model): the copies' record (copy_kept, copy_rejected) takes it, and the cap stays."""
        if copied:
            r.copy_kept = SPECULATIVE_DECAY * r.copy_kept + kept
            r.copy_rejected = SPECULATIVE_DECAY * r.copy_rejected + (kept < offered)
            return
        r.spec_kept = SPECULATIVE_DECAY * r.spec_kept + kept
        r.spec_rejected = SPECULATIVE_DECAY * r.spec_rejected + (kept < offered)
        if kept == offered:
            r.spec_cap = min(self._spec_tokens, max(1, 2 * r.spec_cap))
        elif kept == 0:
            r.spec_cap //= 2
            if r.spec_cap == 0:
                r.spec_cooldown = SPECULATIVE_COOLDOWN

    cdef _advance_phase(self, Request r, int kind):
        if r.phase == PH_INITIALIZE:
            r.phase = PH_PREFILL
        elif r.phase == PH_RESTORE:
            r.phase = PH_RESUME if r.reused_tokens >= r.prompt_len else PH_PREFILL
        elif r.phase == PH_RESUME:
            r.phase = PH_DECODE
        elif r.phase == PH_PREFILL and r.num_computed_tokens == r.prompt_len:
            r.phase = PH_DECODE

    cdef int64_t _publish(self, Request r, int64_t fence) except -2:
        """Publish the snapshot this frame wrote for ``r``; returns the new id or -1."""
        cdef int64_t endpoint
        cdef int32_t sid
        if r.phase == PH_TERMINAL:
            endpoint = r.terminal_tokens
            sid = r.terminal_snapshot
            r.terminal_snapshot = -1
        else:
            endpoint = r.endpoints.pop(0)
            sid = r.endpoint_snapshots.pop(0)
        if r.history.num_tokens < endpoint:
            outputs = np.asarray(r.output_tokens[r.history.num_tokens - r.prompt_len : endpoint - r.prompt_len], np.int32)
            r.history.append_tokens(outputs)
        cdef int64_t P = self.page_tokens
        pages = r.block_table[r.num_shared_pages : endpoint // P]
        result = self.cache.publish(r.history, endpoint, r.base, pages, sid, endpoint, fence)
        if r.phase == PH_TERMINAL:
            r.phase = PH_DRAINING
            self._draining.append(r)
        if result.outcome != PublishOutcome.CREATED:
            # The copy finished with this frame and nothing else reads the
            # row, so the duplicate's snapshot id is free right away.
            self.snapshots.free(np.array([sid], dtype=np.int32))
            self.counters["duplicate_publications"] += 1
            return -1
        cdef Checkpoint created = result.checkpoint
        self.cache.pin(created)
        if r.base is not None:
            self.cache.mark_used(r.base, r.last_use_fence)
            self.cache.unpin(r.base)
        r.base = created
        r.num_shared_pages = endpoint // P
        self.counters["publications"] += 1
        return created.checkpoint_id

    # ------------------------------------------------------------------
    # lifecycle

    def finish(self, int64_t handle, int64_t now_ns):
        """Stop generation (EOS, stop string); publish terminal state if funded.
        Returns the handles released by this call."""
        cdef Request r = self._get(handle)
        if r.finished or r.cancelled:
            return []
        self._finish(r, now_ns)
        return self._retire_drained()

    cdef _finish(self, Request r, int64_t now_ns):
        r.finished = True
        r.epoch += 1
        self.counters["finished"] += 1
        cdef int64_t snapshot_ns = self.timings.get((K_SNAPSHOT, 1, 0)).estimate_ns
        cdef int64_t base_tokens = 0 if r.base is None else r.base.num_tokens
        cdef int32_t sid
        if (
            r.phase == PH_DECODE
            and snapshot_ns > 0
            and r.terminal_credit_ns >= snapshot_ns
            and r.num_scheduled_tokens > base_tokens
            and self.selection.has_shapes(K_SNAPSHOT)
        ):
            sid = self._take_snapshot()
            if sid >= 0:
                r.terminal_snapshot = sid
                r.terminal_tokens = r.num_scheduled_tokens
                r.phase = PH_TERMINAL
                r.last_progress_ns = now_ns
                return
        r.phase = PH_DRAINING
        self._draining.append(r)

    def cancel(self, int64_t handle):
        """Stop scheduling now; resources stay owned until the last GPU use
        completes. Returns the handles released by this call (this one if
        nothing of it is in flight)."""
        cdef Request r = self._get(handle)
        if r.cancelled:
            return []
        r.cancelled = True
        r.epoch += 1
        self.counters["cancelled"] += 1
        if r.phase != PH_DRAINING:
            r.phase = PH_DRAINING
            self._draining.append(r)
        return self._retire_drained()

    cdef list _retire_drained(self):
        retired = []
        keep = []
        cdef Request r
        for x in self._draining:
            r = <Request>x
            if r.inflight == 0 and r.last_use_fence <= self.completed_fence:
                self._release(r)
                retired.append(r.handle)
            else:
                keep.append(r)
        self._draining = keep
        return retired

    cdef _release(self, Request r):
        if r.base is not None:
            self.cache.mark_used(r.base, r.last_use_fence)
            self.cache.unpin(r.base)
            r.base = None
        private = r.block_table[r.num_shared_pages :]
        if len(private):
            self.pages.free(private)
        sids = list(r.endpoint_snapshots)
        if r.terminal_snapshot >= 0:
            sids.append(r.terminal_snapshot)
        if sids:
            self.snapshots.free(np.array(sids, dtype=np.int32))
        r.endpoints = []
        r.endpoint_snapshots = []
        r.terminal_snapshot = -1
        r.num_shared_pages = r._block_table.shape[0]
        self._slots[r.slot] = None
        self.counters["retired"] += 1
        if self._drafter is not None:
            self._drafter.release(r.handle)

    def release_after_shutdown(self):
        """After a failed submission and a confirmed stream drain: every
        submitted fence is complete (its results are void); release all."""
        for _, p in self._inflight:
            for x in (<ScheduledPlan>p)._requests:
                (<Request>x).inflight -= 1
        self._inflight = []
        self.completed_fence = self.last_committed_fence
        self._reclaim(self.cache.advance_completed(self.completed_fence).reusable)
        released = []
        for x in list(self._slots):
            if x is not None and not (<Request>x).cancelled:
                released += self.cancel((<Request>x).handle)
        return released + self._retire_drained()

    # ------------------------------------------------------------------
    # integrity

    def check_integrity(self):
        """Recompute the page/snapshot ledger and pin counts; raise on mismatch."""
        self.cache.check_integrity()
        self.pages.check_integrity()
        self.snapshots.check_integrity()
        cdef Request r
        private_pages = set()
        reserved_snapshots = set()
        pins = {}
        inflight = {}
        for _, p in self._inflight:
            for x in (<ScheduledPlan>p)._requests:
                inflight[(<Request>x).slot] = inflight.get((<Request>x).slot, 0) + 1
        for slot, x in enumerate(self._slots):
            if x is None:
                continue
            r = <Request>x
            if r.slot != slot or r.handle != (r.generation << SLOT_BITS) | slot or r.state_row != slot + 1:
                raise AssertionError(f"slot {slot}: handle/row mismatch")
            if r.inflight != inflight.get(slot, 0):
                raise AssertionError(f"request {r.handle}: inflight {r.inflight} != {inflight.get(slot, 0)}")
            if not (r.num_computed_tokens <= r.num_scheduled_tokens <= self.context_capacity):
                raise AssertionError(f"request {r.handle}: token counters")
            if r.num_generated_tokens > r.max_output_tokens or r.num_scheduled_samples > r.max_output_tokens:
                raise AssertionError(f"request {r.handle}: output counters")
            if r.base is not None:
                pins[r.base.checkpoint_id] = pins.get(r.base.checkpoint_id, 0) + 1
                if not np.array_equal(r.block_table[: r.num_shared_pages], r.base.block_table()):
                    raise AssertionError(f"request {r.handle}: shared pages differ from its base chain")
            elif r.num_shared_pages != 0:
                raise AssertionError(f"request {r.handle}: shared pages without a base")
            for page in r.block_table[r.num_shared_pages :]:
                if page in private_pages or self.cache.owns_page(page):
                    raise AssertionError(f"page {page} owned twice")
                private_pages.add(int(page))
            sids = list(r.endpoint_snapshots) + ([r.terminal_snapshot] if r.terminal_snapshot >= 0 else [])
            for sid in sids:
                if sid in reserved_snapshots or self.cache.owns_snapshot(sid):
                    raise AssertionError(f"snapshot {sid} owned twice")
                reserved_snapshots.add(sid)
            if r.endpoints != sorted(r.endpoints) or len(r.endpoints) != len(r.endpoint_snapshots):
                raise AssertionError(f"request {r.handle}: endpoints")
        for cid in range(self.cache.next_checkpoint_id):
            c = self.cache.get(cid)
            if c is not None and c.direct_pins != pins.get(cid, 0):
                raise AssertionError(f"checkpoint {cid}: {c.direct_pins} pins, {pins.get(cid, 0)} holders")
        used_pages = self.pages.num_used
        if used_pages != len(private_pages) + self.cache.num_cached_pages + self.cache.num_retired_pages:
            raise AssertionError(
                f"pages: {used_pages} used != {len(private_pages)} private + {self.cache.num_cached_pages} cached "
                f"+ {self.cache.num_retired_pages} retired"
            )
        used_snapshots = self.snapshots.num_used
        if used_snapshots != len(reserved_snapshots) + self.cache.num_cached_snapshots + self.cache.num_retired_snapshots:
            raise AssertionError("snapshot ledger does not add up")
        for x in self._draining:
            if self._slots[(<Request>x).slot] is not x:
                raise AssertionError("draining request lost its slot")
        return True
