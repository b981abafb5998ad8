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
- ``plan(now)`` is pure policy: it reads state and returns an immutable
  ScheduledPlan (or None); it changes nothing. ``commit`` validates the
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

import enum
from collections import namedtuple

import numpy as np
cimport numpy as cnp
from libc.math cimport exp
from libc.stdint cimport int32_t, int64_t, uint8_t
from libc.stdlib cimport qsort

from flared._fast.pages cimport PageAllocator
from flared._fast.prefix cimport Checkpoint, PrefixCheckpointCache, PrefixHistory
from flared._fast.timing cimport GraphTimings, ShapeTiming, TIMING_UNMEASURED, TIMING_FRESH, TIMING_STALE
from flared._fast.prefix import PublishOutcome
from flared.errors import AdmissionError, ErrorKind, ExecutionError

cnp.import_array()

MAX_LIVE_REQUESTS = 64
# Selection policies (flared.scheduler.Selection mirrors these values).
SELECTION_VALUE = 0
SELECTION_FCFS = 1
cdef int64_t SLOT_BITS = 8
cdef int64_t SLOT_MASK = 0xFF

# Funded timing refresh: ordinary work pays 0.2% of its time (0.002 / 0.998
# of the measured interval, so refreshes are 0.2% of all graph time) into a
# credit capped at 5 ms, so one refresh is never bought by a long idle backlog.
REFRESH_FRACTION = 0.002 / 0.998
REFRESH_CAP_NS = 5_000_000
# Prices start at 1 (baseline) and stay below 2^20: beyond that the
# exponent has already decided every comparison; the clamp keeps them finite.
cdef double PRICE_MIN = 1.0
cdef double PRICE_MAX = float(1 << 20)


class GraphKind(enum.IntEnum):
    INITIALIZE = K_INITIALIZE
    RESTORE = K_RESTORE
    SNAPSHOT = K_SNAPSHOT
    PREFILL = K_PREFILL
    SCORED_PREFILL = K_SCORED_PREFILL
    RESUME_SAMPLING = K_RESUME_SAMPLING
    DECODE = K_DECODE
    SPECULATIVE = K_SPECULATIVE
    VISION = K_VISION
    MIXED = K_MIXED


_LAUNCH_KEYS = ["launches_" + k.name.lower() for k in GraphKind]


class RequestPhase(enum.IntEnum):
    INITIALIZE = PH_INITIALIZE
    RESTORE = PH_RESTORE
    PREFILL = PH_PREFILL
    SNAPSHOT = PH_SNAPSHOT
    RESUME = PH_RESUME
    DECODE = PH_DECODE
    TERMINAL = PH_TERMINAL
    DRAINING = PH_DRAINING


# What one frame reported, one entry per plan participant in plan order:
# handles int64, cumulative consumed/generated token counts int64, and the
# sampled token id (int32, -1 where the step samples nothing).
CompletionRecords = namedtuple("CompletionRecords", "handles consumed_tokens generated_tokens token_ids")
# emitted: (handle, token_id) accepted for publication, in order;
# finished: handles that hit their output or context limit in this frame;
# retired: handles whose slot and resources were released;
# published: checkpoint ids created by this frame's snapshots.
CompletionResult = namedtuple("CompletionResult", "emitted finished retired published")


def handle_slot(int64_t handle):
    return handle & SLOT_MASK


def handle_generation(int64_t handle):
    return handle >> SLOT_BITS


cdef class Request:
    """Scheduler-side state of one live request (read-only from Python)."""

    @property
    def phase_name(self):
        return RequestPhase(self.phase).name

    @property
    def next_stop(self):
        return self._next_stop()

    cdef int64_t _next_stop(self):
        if self.endpoints:
            return self.endpoints[0]
        return self.prompt_len

    @property
    def num_private_pages(self):
        return self._block_table.shape[0] - self.num_shared_pages

    def __repr__(self):
        return (
            f"Request(handle={self.handle}, slot={self.slot}, phase={self.phase_name}, "
            f"computed={self.num_computed_tokens}/{self.prompt_len}, generated={self.num_generated_tokens})"
        )


cdef class ScheduledPlan:
    """One graph submission: plain arrays indexed by participant.

    kind, batch_capacity, token_capacity: the graph shape to launch.
    handles/slots/state_rows/epochs: who runs (int64/int32/int32/int64).
    token_starts, num_tokens: first absolute position and number of tokens
        fed per participant; token_offsets[i]:token_offsets[i+1] slices the
        flat token_ids (-1 = the token sampled by the previous, still
        in-flight decode step of that request).
    sample: 1 where the step produces logits and samples a token;
        generated_ends: the participant's cumulative sampled count after it.
    first_blocks, page_offsets, page_ids: block-table entries the step
        touches: page_ids[page_offsets[i]:page_offsets[i+1]] are entries
        first_blocks[i], first_blocks[i]+1, ... of participant i's table.
    copies: int32 [m, 4] rows (snapshot_id, state_row, page_id or -1,
        tokens in that partial page): restore copies snapshot -> slot,
        snapshot copies slot -> snapshot.
    """

    @property
    def num_participants(self):
        return len(self._requests)

    @property
    def shape(self):
        return (self.kind, self.batch_capacity, self.token_capacity)

    @property
    def kind_name(self):
        return GraphKind(self.kind).name

    def positions(self, Py_ssize_t i):
        cdef int64_t s = self.token_starts[i]
        return np.arange(s, s + self.num_tokens[i], dtype=np.int32)

    def tokens(self, Py_ssize_t i):
        return self.token_ids[self.token_offsets[i] : self.token_offsets[i + 1]]

    def pages(self, Py_ssize_t i):
        return self.page_ids[self.page_offsets[i] : self.page_offsets[i + 1]]

    def __repr__(self):
        return (
            f"ScheduledPlan({self.kind_name}, b={self.batch_capacity}, t={self.token_capacity}, "
            f"n={len(self._requests)}, est={self.estimated_duration_ns}ns)"
        )


cdef struct SortItem:
    double key
    int32_t index


cdef int _by_key_desc(const void* a, const void* b) noexcept nogil:
    cdef double ka = (<SortItem*>a).key, kb = (<SortItem*>b).key
    if ka > kb:
        return -1
    if ka < kb:
        return 1
    return (<SortItem*>a).index - (<SortItem*>b).index


cdef list _sorted_by_weight(list pool):
    """Pool sorted by scratch weight + wait rate, highest first (C qsort)."""
    cdef Py_ssize_t n = len(pool), i
    if n <= 1:
        return pool
    cdef SortItem[64] items
    cdef Request r
    for i in range(n):
        r = pool[i]
        items[i].key = r._weight + r._wait_rate
        items[i].index = <int32_t>i
    qsort(items, n, sizeof(SortItem), _by_key_desc)
    return [pool[items[i].index] for i in range(n)]


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
        if not 1 <= self.max_live_requests <= MAX_LIVE_REQUESTS:
            raise ValueError(f"max_live_requests must be 1..{MAX_LIVE_REQUESTS}")
        self.page_tokens = config.page_tokens
        self.context_capacity = config.context_capacity
        self.prefill_chunk_size = config.prefill_chunk_size
        self.model_identity = bytes(config.model_identity)
        self.cache = PrefixCheckpointCache(config.num_pages, config.num_snapshots, config.page_tokens)
        self.pages = PageAllocator(config.num_pages)
        self.snapshots = PageAllocator(config.num_snapshots)
        self.timings = GraphTimings(policy.timing_freshness_ns)
        self._slots = [None] * MAX_LIVE_REQUESTS
        self._next_generation = 1
        self._next_plan_id = 1
        self.last_committed_fence = 0
        self.completed_fence = 0
        self._inflight = []
        self._draining = []
        self.refresh_credit_ns = 0.0
        self._capacities = {}
        for kind, batch, tokens in config.graph_shapes:
            self._capacities.setdefault(int(kind), []).append((int(batch), int(tokens)))
        for shapes in self._capacities.values():
            shapes.sort()
        self.counters = {
            "admitted": 0, "finished": 0, "cancelled": 0, "retired": 0,
            "prefix_lookups": 0, "prefix_hits": 0, "prefix_reused_tokens": 0,
            "publications": 0, "duplicate_publications": 0, "evictions": 0,
            "refreshes": 0,
        }
        for k in GraphKind:
            self.counters["launches_" + k.name.lower()] = 0
        self._output_value = policy.output_token_value
        self._token_fairness = policy.token_fairness
        self._delivery_fairness = policy.delivery_fairness
        self._decode_age_price = policy.decode_age_price
        self._terminal_value = policy.terminal_value
        self._terminal_age_price = policy.terminal_age_price
        self._adaptation_ns = policy.service_price_adaptation_ns
        self._extra_work_fraction = config.checkpoint_extra_work_fraction
        self._initialize_state = config.initialize_state
        self._fcfs = int(getattr(config, "selection", 0)) == SELECTION_FCFS

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
        if slot >= MAX_LIVE_REQUESTS or handle <= 0:
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
    ):
        """Admit a request; returns its handle.

        ``message_boundaries``: token endpoints of complete messages (checkpoint
        candidates). ``conditioning``: (position, 32-byte identity) events.
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
        cdef int64_t P = self.page_tokens
        cdef int64_t total_blocks = (L + max_output_tokens + P - 1) // P
        cdef int64_t num_private = total_blocks - reused // P
        if not self._ensure_pages(num_private):
            if hit is not None:
                self.cache.unpin(hit)
            raise AdmissionError(
                f"{num_private} KV pages needed, {self.pages.num_free} free", ErrorKind.MODEL_CAPACITY
            )
        if hit is not None:
            self.counters["prefix_hits"] += 1
            self.counters["prefix_reused_tokens"] += reused

        endpoints = []
        snapshot_ids = []
        for e in self._select_endpoints(message_boundaries, L, reused, now_ns):
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
        r.endpoint_snapshots = [snapshot_ids[j] for j in order]
        r.terminal_snapshot = -1
        r.last_use_fence = 0
        r.arrival_ns = now_ns
        r.last_progress_ns = now_ns
        # Prices are relative: every newcomer starts at the same price, so
        # arrival order alone never ranks one request above another.
        r.token_price = 1.0
        r.delivery_price = 1.0
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

    cdef list _select_endpoints(self, message_boundaries, int64_t L, int64_t reused, int64_t now_ns):
        """Anchor first (last eligible message boundary, else the prompt end),
        then extras while their cost fits the extra-work allowance."""
        bounds = sorted({int(b) for b in message_boundaries if reused < b < L})
        if reused >= L:
            return []
        selected = [bounds[len(bounds) - 1] if bounds else L]
        extras = ([L] if bounds else []) + list(reversed(bounds[: max(len(bounds) - 1, 0)]))
        if not extras:
            return selected
        cdef int64_t snapshot_ns = self._measured_ns((K_SNAPSHOT, 1, 0), now_ns)
        best_ns_per_token = None
        split_ns = None
        for batch, tokens in self._capacities.get(K_PREFILL, ()):
            if batch != 1:
                continue
            est = self._measured_ns((K_PREFILL, batch, tokens), now_ns)
            if est > 0:
                per = est / tokens
                if best_ns_per_token is None or per < best_ns_per_token:
                    best_ns_per_token = per
                if split_ns is None or est < split_ns:
                    split_ns = est
        if snapshot_ns <= 0 or best_ns_per_token is None:
            return selected  # unknown costs: best-effort anchor only
        allowance = self._extra_work_fraction * best_ns_per_token * (L - reused)
        cost = snapshot_ns + split_ns
        spent = 0.0
        for e in extras:
            if spent + cost > allowance:
                break
            selected.append(e)
            spent += cost
        return selected

    cdef int64_t _measured_ns(self, tuple shape, int64_t now_ns):
        cdef ShapeTiming t = self.timings.get(shape)
        return t.estimate_ns

    # ------------------------------------------------------------------
    # planning

    def plan(self, int64_t now_ns):
        """Select the next graph submission, or None. Mutates nothing."""
        cdef Py_ssize_t n_inflight = len(self._inflight)
        cdef ScheduledPlan head
        cdef bint decode_only = False
        if n_inflight >= 2:
            return None
        if n_inflight:
            head = self._inflight[0][1]
            if head.exclusive:
                return None
            # The oldest frame ran past its expected finish: something is
            # slower than estimated, so stop stacking work behind it.
            if now_ns > head.planned_ns + head.estimated_duration_ns:
                return None
            for _, p in self._inflight:
                if (<ScheduledPlan>p).kind != K_DECODE:
                    return None
            decode_only = True

        pools = [[] for _ in range(NUM_KINDS)]
        cdef double total_wait = 0.0, age_ms
        cdef Request r
        cdef int64_t stop
        cdef double tf = self._token_fairness, df = self._delivery_fairness, ov = self._output_value
        for x in self._slots:
            if x is None:
                continue
            r = <Request>x
            r._wait_rate = 0.0
            age_ms = (now_ns - r.last_progress_ns) * 1e-6
            if age_ms < 0:
                age_ms = 0
            if r.phase == PH_DECODE and not r.finished and not r.cancelled:
                r._wait_rate = self._decode_age_price * age_ms
            elif r.phase == PH_TERMINAL:
                r._wait_rate = self._terminal_age_price * age_ms
            total_wait += r._wait_rate
            if r.cancelled or r.phase == PH_DRAINING:
                continue
            if decode_only:
                if r.phase != PH_DECODE or r.finished or r.inflight > 1 or (r.inflight == 1 and not r.last_inflight_decode):
                    continue
            elif r.inflight:
                continue
            r._path_value = 0.0
            if r.phase <= PH_SNAPSHOT and not (r.phase == PH_SNAPSHOT and r.endpoints[0] >= r.prompt_len):
                r._path_value = self._path_value(r)
            if r.phase == PH_DECODE:
                if r.finished or r.num_scheduled_samples >= r.max_output_tokens:
                    continue
                r._weight = ov + tf * r.token_price + df * r.delivery_price
                pools[K_DECODE].append(r)
            elif r.phase == PH_PREFILL:
                stop = r._next_stop()
                r._take = stop - r.num_scheduled_tokens
                r._weight = tf * r.token_price
                pools[K_SCORED_PREFILL if r.score_prompt else K_PREFILL].append(r)
            elif r.phase == PH_TERMINAL:
                r._weight = self._terminal_value
                pools[K_SNAPSHOT].append(r)
            else:
                r._weight = self._unlock_value(r)
                if r.phase == PH_SNAPSHOT:
                    pools[K_SNAPSHOT].append(r)
                elif r.phase == PH_RESTORE:
                    pools[K_RESTORE].append(r)
                elif r.phase == PH_RESUME:
                    r._weight = ov + tf * r.token_price + df * r.delivery_price
                    pools[K_RESUME_SAMPLING].append(r)
                elif r.phase == PH_INITIALIZE:
                    pools[K_INITIALIZE].append(r)

        candidates = []
        cdef int kind
        for kind in range(NUM_KINDS):
            pool = pools[kind]
            if not pool:
                continue
            pool = _sorted_by_weight(pool)
            if kind == K_PREFILL or kind == K_SCORED_PREFILL:
                self._prefill_candidates(kind, pool, total_wait, now_ns, candidates)
            else:
                self._batch_candidates(kind, pool, total_wait, now_ns, candidates)
        if not candidates:
            if n_inflight == 0 and self.refresh_credit_ns > 0:
                self.refresh_credit_ns = 0.0  # idle: positive credit lapses, debt stays
            return None

        cdef _Candidate best = None, c
        if self._fcfs:
            best = _fcfs_choice(candidates)
        else:
            for c in candidates:
                if best is None or _better(c, best):
                    best = c
        cdef bint refresh = False
        cdef _Candidate stale = None
        if not self._fcfs and best.state == TIMING_FRESH and n_inflight == 0 and self.refresh_credit_ns > 0:
            for c in candidates:
                if c is best or c.state != TIMING_STALE:
                    continue
                if stale is None or c.last_touch_ns < stale.last_touch_ns:
                    stale = c
            if stale is not None and self.refresh_credit_ns >= min(stale.estimate_ns, REFRESH_CAP_NS):
                best = stale
                refresh = True
        if best.state != TIMING_FRESH and n_inflight:
            return None  # unmeasured/stale shapes run alone
        return self._build_plan(best, now_ns, refresh)

    cdef double _unlock_value(self, Request r) except? -1:
        """Value of a prerequisite step (initialize, restore, boundary snapshot).

        It does no useful work itself; it is the only way forward for the
        request, so it carries the value of the path it unblocks: the rest
        of the prompt and the first sampled token (or, past the prompt end,
        the next output token).
        """
        cdef int64_t at
        cdef double token_value = 1.0 + self._token_fairness * r.token_price
        cdef double output_value = (
            self._output_value + self._token_fairness * r.token_price + self._delivery_fairness * r.delivery_price
        )
        at = r.endpoints[0] if r.phase == PH_SNAPSHOT else r.num_scheduled_tokens
        if at >= r.prompt_len:
            return output_value
        return (r.prompt_len - at) * token_value + output_value

    cdef double _path_value(self, Request r) except? -1:
        """Value of the request's whole remaining path to its first token:
        the prompt tokens still to consume and the first sampled token."""
        return (r.prompt_len - r.num_scheduled_tokens) * (1.0 + self._token_fairness * r.token_price) + (
            self._output_value + self._token_fairness * r.token_price + self._delivery_fairness * r.delivery_price
        )

    cdef int64_t _path_after_ns(self, Request r, int64_t at, bint snapshot_due) except -2:
        """Estimated time from position ``at`` to the first token: the
        snapshot due there (if any), then prefill up to each remaining
        endpoint and its snapshot, then up to the prompt end. -1 when a
        needed shape is unmeasured."""
        cdef int64_t total = 0, stop, est
        cdef int64_t snapshot_ns = self.timings.get((K_SNAPSHOT, 1, 0)).estimate_ns
        cdef int kind = K_SCORED_PREFILL if r.score_prompt else K_PREFILL
        if snapshot_due:
            if snapshot_ns <= 0:
                return -1
            total += snapshot_ns
        for x in r.endpoints + [r.prompt_len]:
            stop = x
            if stop <= at:
                continue
            est = self._prefill_ns(stop - at, kind)
            if est <= 0:
                return -1
            total += est
            if stop < r.prompt_len:
                if snapshot_ns <= 0:
                    return -1
                total += snapshot_ns
            at = stop
        return total

    cdef double _step_path_value(self, Request r, int kind, int64_t take, double step_est, double step_value) except? -1:
        """Value of one step on a prompt path: its duration share of the path
        that starts with this step (value of the whole remaining path times
        step / (step + rest)). Every step of a path then ranks like the path
        itself, and a chunk that would leave a costly short tail ranks below
        one that finishes the prompt. Falls back to the step's own value
        when a needed shape is unmeasured."""
        cdef int64_t after
        if r._path_value <= 0 or step_est <= 0:
            return step_value
        if kind == K_PREFILL or kind == K_SCORED_PREFILL:
            after = self._path_after_ns(
                r, r.num_scheduled_tokens + take,
                bool(r.endpoints) and r.num_scheduled_tokens + take == r.endpoints[0] and r.endpoints[0] < r.prompt_len,
            )
        elif kind == K_SNAPSHOT:
            after = self._path_after_ns(r, r.endpoints[0], False)
        else:
            after = self._path_after_ns(r, r.num_scheduled_tokens, False)
        if after < 0:
            return step_value
        return r._path_value * step_est / (step_est + after)

    cdef int64_t _prefill_ns(self, int64_t num_tokens, int kind) except -1:
        """Estimated time to prefill ``num_tokens`` alone: full chunks of the
        largest single-row capacity, then the smallest capacity that covers
        the rest; 0 when a needed shape is unmeasured."""
        shapes = [t for b, t in self._capacities.get(kind, ()) if b == 1]
        if not shapes:
            return 0
        cdef int64_t largest = shapes[len(shapes) - 1]
        cdef int64_t full = num_tokens // largest, rest = num_tokens % largest, total = 0, est
        if full:
            est = self.timings.get((kind, 1, largest)).estimate_ns
            if est <= 0:
                return 0
            total += full * est
        if rest:
            for t in shapes:
                if t >= rest:
                    est = self.timings.get((kind, 1, t)).estimate_ns
                    if est <= 0:
                        return 0
                    total += est
                    break
        return total

    cdef _batch_candidates(self, int kind, list pool, double total_wait, int64_t now_ns, list out):
        cdef Py_ssize_t n = len(pool), m, i, last_m = -1
        cdef double value, wait_in
        cdef Request r
        cdef _Candidate c
        cdef ShapeTiming t
        cdef double est
        for batch, tokens in self._capacities.get(kind, ()):
            m = min(batch, n)
            if m == last_m:
                continue  # same cohort as a smaller capacity: dominated
            last_m = m
            est = self.timings.get((kind, batch, tokens)).estimate_ns
            value = 0.0
            wait_in = 0.0
            for i in range(m):
                r = pool[i]
                value += self._step_path_value(r, kind, 0, est, r._weight)
                wait_in += r._wait_rate
            c = _Candidate.__new__(_Candidate)
            c.kind = kind
            c.batch = batch
            c.tokens = tokens
            c.requests = pool[:m]
            c.takes = None
            c.value = value
            c.wait_rate = total_wait - wait_in
            self._estimate(c, now_ns)
            out.append(c)

    cdef _prefill_candidates(self, int kind, list pool, double total_wait, int64_t now_ns, list out):
        cdef Request r
        cdef _Candidate c, other
        cdef int64_t remaining, take
        cdef double value, wait_in, est, step_value
        by_work = {}
        for batch, tokens in self._capacities.get(kind, ()):
            est = self.timings.get((kind, batch, tokens)).estimate_ns
            remaining = tokens
            cohort = []
            takes = []
            value = 0.0
            wait_in = 0.0
            for x in pool:
                if len(cohort) == batch or remaining == 0:
                    break
                r = <Request>x
                take = min(r._take, remaining)
                cohort.append(r)
                takes.append(take)
                remaining -= take
                step_value = take * (1.0 + r._weight)
                if r.num_scheduled_tokens + take == r.prompt_len:
                    step_value += self._output_value + self._delivery_fairness * r.delivery_price
                value += self._step_path_value(r, kind, take, est, step_value)
                wait_in += r._wait_rate
            work = tuple([((<Request>cohort[i]).slot, takes[i]) for i in range(len(cohort))])
            dominated = False
            kept = []
            for other in by_work.get(work, ()):
                if other.batch <= batch and other.tokens <= tokens:
                    dominated = True
                    kept.append(other)
                elif not (batch <= other.batch and tokens <= other.tokens):
                    kept.append(other)
            if dominated:
                continue
            c = _Candidate.__new__(_Candidate)
            c.kind = kind
            c.batch = batch
            c.tokens = tokens
            c.requests = cohort
            c.takes = takes
            c.value = value
            c.wait_rate = total_wait - wait_in
            self._estimate(c, now_ns)
            kept.append(c)
            by_work[work] = kept
        for kept in by_work.values():
            out.extend(kept)

    cdef _estimate(self, _Candidate c, int64_t now_ns):
        cdef ShapeTiming t = self.timings.get((c.kind, c.batch, c.tokens))
        c.state = t.state(now_ns, self.timings.freshness_ns)
        c.estimate_ns = t.estimate_ns
        c.last_touch_ns = max(t.last_observed_ns, t.last_attempt_ns)
        if c.state == TIMING_UNMEASURED:
            c.score = c.value
        else:
            c.score = c.value / (c.estimate_ns * 1e-6) - c.wait_rate

    cdef ScheduledPlan _build_plan(self, _Candidate c, int64_t now_ns, bint refresh):
        cdef Py_ssize_t n = len(c.requests), i, j
        cdef ScheduledPlan p = ScheduledPlan.__new__(ScheduledPlan)
        p.scheduler_id = self.scheduler_id
        p.plan_id = self._next_plan_id
        self._next_plan_id += 1
        p.kind = c.kind
        p.batch_capacity = c.batch
        p.token_capacity = c.tokens
        p.planned_ns = now_ns
        p.estimated_duration_ns = c.estimate_ns
        p.exclusive = c.state != TIMING_FRESH
        p.refresh = refresh
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
        cdef int kind = c.kind
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
            elif kind == K_PREFILL or kind == K_SCORED_PREFILL:
                take = takes[i]
            else:
                take = 0
            n_v[i] = take
            if kind == K_DECODE or kind == K_RESUME_SAMPLING:
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
            if kind == K_DECODE:
                j = start - r.prompt_len
                tk_v[to_v[i]] = r.output_tokens[j] if j < len(r.output_tokens) else -1
            else:
                for j in range(n_v[i]):
                    tk_v[to_v[i] + j] = r._prompt[start + j]
            if kind == K_RESTORE:
                copies.append(self._copy_row(r.base.snapshot_id, r, r.reused_tokens))
            elif kind == K_SNAPSHOT:
                if r.phase == PH_TERMINAL:
                    copies.append(self._copy_row(r.terminal_snapshot, r, r.terminal_tokens))
                else:
                    copies.append(self._copy_row(r.endpoint_snapshots[0], r, r.endpoints[0]))
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
                    r.token_ns_per_token = est / counts[i]
                if plan.kind == K_DECODE:
                    r.delivery_interval_ns = est
            if plan.kind == K_RESTORE:
                self.cache.mark_used(r.base, fence)
        self.timings.note_attempt(plan.shape, plan.planned_ns)
        if plan.refresh:
            self.refresh_credit_ns -= plan.estimated_duration_ns
            self.counters["refreshes"] += 1
        plan._committed = True
        self.last_committed_fence = fence
        self._inflight.append((fence, plan))
        self.counters[_LAUNCH_KEYS[plan.kind]] += 1

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
        for i in range(n):
            r = plan._requests[i]
            if hv[i] != r.handle or hv[i] & SLOT_MASK != r.slot:
                raise ExecutionError(f"frame {fence} record {i}: handle {hv[i]} is not participant {r.handle}")
            if cv[i] != starts[i] + counts[i] or cv[i] < r.num_computed_tokens or cv[i] > self.context_capacity:
                raise ExecutionError(
                    f"frame {fence} record {i}: consumed {cv[i]}, expected {starts[i] + counts[i]}"
                )
            if gv[i] != g_end[i] or gv[i] < r.num_generated_tokens or gv[i] > r.max_output_tokens:
                raise ExecutionError(f"frame {fence} record {i}: generated {gv[i]}, expected {g_end[i]}")
            if sample[i] and tv[i] < 0:
                raise ExecutionError(f"frame {fence} record {i}: sampled no token")

        self._inflight.pop(0)
        self.completed_fence = fence
        cdef int64_t measured = self.timings.observe(plan.shape, duration_ns, now_ns, embedding_wait_ns)
        if plan.refresh:
            self.refresh_credit_ns += plan.estimated_duration_ns - measured
        elif measured > 0:
            self.refresh_credit_ns = min(self.refresh_credit_ns + measured * REFRESH_FRACTION, REFRESH_CAP_NS)
        # Readiness and reuse first, so this frame's snapshots publish ready.
        self._reclaim(self.cache.advance_completed(fence).reusable)

        emitted = []
        finished = []
        published = []
        cdef int kind = plan.kind
        for i in range(n):
            r = plan._requests[i]
            r.inflight -= 1
            r.epoch += 1
            r.num_computed_tokens = cv[i]
            if counts[i] > 0 or sample[i]:
                r.last_progress_ns = now_ns
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
            self._advance_phase(r, kind)
            # Admission bounds prompt + output by the context, so the output
            # limit is the only length stop.
            if r.phase == PH_DECODE and r.num_generated_tokens >= r.max_output_tokens:
                self._finish(r, now_ns)
                finished.append(r.handle)
        if measured > 0:
            self._update_prices(plan, measured)
        retired = self._retire_drained()
        return CompletionResult(emitted, finished, retired, published)

    cdef _advance_phase(self, Request r, int kind):
        if r.phase == PH_INITIALIZE:
            r.phase = PH_PREFILL
        elif r.phase == PH_RESTORE:
            r.phase = PH_RESUME if r.reused_tokens >= r.prompt_len else PH_PREFILL
        elif r.phase == PH_RESUME:
            r.phase = PH_DECODE
        elif r.phase == PH_SNAPSHOT:
            r.phase = PH_PREFILL if r.num_computed_tokens < r.prompt_len else PH_DECODE
        elif r.phase == PH_PREFILL:
            if r.endpoints and r.num_computed_tokens == r.endpoints[0]:
                r.phase = PH_SNAPSHOT
            elif r.num_computed_tokens == r.prompt_len:
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

    cdef _update_prices(self, ScheduledPlan plan, int64_t measured):
        """Age each runnable request's service prices by this frame.

        A price rises by exp(measured / tau) over a frame that did not serve
        the request, and falls by exp(-service / tau) over one that did,
        where service is what it received counted in time at its feasible
        rate (tokens x ns per token alone; deliveries x reference interval).
        Prices never fall below 1: batching serves many requests at their
        full rate at once, so "served" means "back to baseline", and only
        waiting makes a request more valuable than its peers.
        """
        cdef Py_ssize_t i, n = len(plan._requests)
        cdef const int32_t[::1] counts = plan.num_tokens
        cdef const uint8_t[::1] sample = plan.sample
        cdef Request r
        served = {}
        for i in range(n):
            r = plan._requests[i]
            served[r.slot] = (counts[i] if plan.kind != K_DECODE else 1, sample[i])
        cdef double x_exp, tokens, delivered
        cdef double tau = self._adaptation_ns
        for x in self._slots:
            if x is None:
                continue
            r = <Request>x
            if r.finished or r.cancelled:
                continue
            tokens, delivered = served.get(r.slot, (0, 0))
            # Unserved time raises the price even before the request has a
            # rate normalizer (it was never in a measured graph): otherwise a
            # newcomer could wait behind measured work indefinitely.
            if tokens == 0:
                x_exp = measured / tau
            else:
                x_exp = -tokens * r.token_ns_per_token / tau
            r.token_price = _clamp(r.token_price * exp(_clamp(x_exp, -50.0, 50.0)), PRICE_MIN, PRICE_MAX)
            if r.phase == PH_DECODE:
                if delivered == 0:
                    x_exp = measured / tau
                else:
                    x_exp = -delivered * r.delivery_interval_ns / tau
                r.delivery_price = _clamp(r.delivery_price * exp(_clamp(x_exp, -50.0, 50.0)), PRICE_MIN, PRICE_MAX)

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
        cdef int64_t snapshot_ns = self._measured_ns((K_SNAPSHOT, 1, 0), now_ns)
        cdef int64_t base_tokens = 0 if r.base is None else r.base.num_tokens
        cdef int32_t sid
        if (
            r.phase == PH_DECODE
            and snapshot_ns > 0
            and r.terminal_credit_ns >= snapshot_ns
            and r.num_scheduled_tokens > base_tokens
            and (K_SNAPSHOT in self._capacities)
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


cdef inline double _clamp(double x, double lo, double hi) noexcept:
    return lo if x < lo else (hi if x > hi else x)


cdef _Candidate _fcfs_choice(list candidates):
    """Baseline selection: first come, first served, prefill first.

    Work that moves a not-yet-decoding request forward (prefill and its
    prerequisites, terminal snapshots) runs for the earliest arrival, with
    the largest chunk it can use; otherwise every decoder decodes together.
    """
    cdef _Candidate c, best = None
    cdef Request oldest = None, r
    for c in candidates:
        if c.kind == K_DECODE:
            continue
        for x in c.requests:
            r = <Request>x
            if oldest is None or r.arrival_ns < oldest.arrival_ns or (
                r.arrival_ns == oldest.arrival_ns and r.generation < oldest.generation
            ):
                oldest = r
    for c in candidates:
        if oldest is not None:
            if c.kind == K_DECODE or oldest not in c.requests:
                continue
            if best is None or c.value > best.value or (
                c.value == best.value and (c.batch, c.tokens) < (best.batch, best.tokens)
            ):
                best = c
        elif best is None or len(c.requests) > len(best.requests) or (
            len(c.requests) == len(best.requests) and c.batch < best.batch
        ):
            best = c
    return best


cdef bint _better(_Candidate a, _Candidate b):
    """Unmeasured shapes first (by value), then by score; ties: smaller shape."""
    cdef bint ua = a.state == TIMING_UNMEASURED, ub = b.state == TIMING_UNMEASURED
    if ua != ub:
        return ua
    if a.score != b.score:
        return a.score > b.score
    if a.batch != b.batch:
        return a.batch < b.batch
    return a.tokens < b.tokens
