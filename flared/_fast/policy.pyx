# cython: language_level=3
"""Selection policy: which graph shape and cohort runs next.

Rules (docs/scheduling.md explains them with a worked example):
- Every captured shape of every kind competes with the best cohort it can
  take; among shapes doing exactly the same work, larger ones are dropped.
- Score = expected useful value / estimated ms - waiting rate of the
  decoding and terminal requests the candidate leaves out. Unmeasured shapes
  rank first (by value); a step of a prompt path is worth its duration share
  of the path that starts with it.
- Funded refresh: with enough credit a stale alternative, the one observed
  or tried longest ago, displaces the winner once.
- FCFS (the baseline) ignores value: the earliest arrival's prompt work
  first, else every decoder together.
- Fairness prices age by unserved execution time (e-fold per adaptation
  time) and fall back toward 1 as the request is served.
This module reads request state and writes only the requests' scratch
fields (_weight, _wait_rate, _take, _path_value) and prices.
"""

from libc.math cimport exp
from libc.stdint cimport int32_t, int64_t, uint8_t
from libc.stdlib cimport qsort

from flared._fast.request cimport (
    Request, ScheduledPlan, K_INITIALIZE, K_RESTORE, K_SNAPSHOT, K_PREFILL, K_SCORED_PREFILL,
    K_RESUME_SAMPLING, K_DECODE, K_SPECULATIVE, NUM_KINDS, PH_INITIALIZE, PH_RESTORE, PH_PREFILL,
    PH_RESUME, PH_DECODE, PH_TERMINAL, PH_DRAINING,
)
from flared._fast.timing cimport GraphTimings, ShapeTiming, TIMING_UNMEASURED, TIMING_FRESH, TIMING_STALE

# Selection policies (flared.scheduler.Selection mirrors these values).
SELECTION_VALUE = 0
SELECTION_FCFS = 1
# Funded timing refresh: ordinary work pays 0.2% of its time (0.002 / 0.998
# of the measured interval, so refreshes are 0.2% of all graph time) into a
# credit capped at 5 ms, so one refresh is never bought by a long idle backlog.
REFRESH_FRACTION = 0.002 / 0.998
REFRESH_CAP_NS = 5_000_000
# Prices start at 1 (baseline) and stay below 2^20: beyond that the
# exponent has already decided every comparison; the clamp keeps them finite.
cdef double PRICE_MIN = 1.0
cdef double PRICE_MAX = float(1 << 20)


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


cdef class _Candidate:
    pass


cdef class SelectionPolicy:
    def __init__(self, config, policy, GraphTimings timings):
        self.timings = timings
        self._capacities = {}
        for kind, batch, tokens in config.graph_shapes:
            self._capacities.setdefault(int(kind), []).append((int(batch), int(tokens)))
        for shapes in self._capacities.values():
            shapes.sort()
        self.prefill_chunk_size = config.prefill_chunk_size
        self._output_value = policy.output_token_value
        self._token_fairness = policy.token_fairness
        self._delivery_fairness = policy.delivery_fairness
        self._decode_age_price = policy.decode_age_price
        self._terminal_value = policy.terminal_value
        self._terminal_age_price = policy.terminal_age_price
        self._adaptation_ns = policy.service_price_adaptation_ns
        self._extra_work_fraction = config.checkpoint_extra_work_fraction
        self.fcfs = int(getattr(config, "selection", SELECTION_VALUE)) == SELECTION_FCFS

    def has_shapes(self, int kind):
        return kind in self._capacities

    cdef _Candidate select(self, list slots, bint stacking, int64_t now_ns, double refresh_credit_ns, bint queue_empty):
        """The winning candidate (refresh flag set if bought by refresh
        credit), or None when nothing is runnable. ``stacking``: a decode frame
        is in flight; decoding requests may join a second frame behind it (one
        frame of their own in flight at most, and that one a decode), every
        other kind competes only for requests with nothing in flight, exactly
        as it would once the window drained."""
        pools = [[] for _ in range(NUM_KINDS)]
        cdef double total_wait = 0.0, age_ms
        cdef Request r
        cdef int64_t stop
        cdef double tf = self._token_fairness, df = self._delivery_fairness, ov = self._output_value
        for x in slots:
            if x is None:
                continue
            r = <Request>x
            r._wait_rate = 0.0
            age_ms = (now_ns - r.last_progress_ns) * 1e-6
            if age_ms < 0:
                age_ms = 0
            if r.phase == PH_DECODE and not r.finished and not r.cancelled:
                r._wait_rate = self._decode_age_price * age_ms * r.value_scale
            elif r.phase == PH_TERMINAL:
                r._wait_rate = self._terminal_age_price * age_ms * r.value_scale
            total_wait += r._wait_rate
            if r.cancelled or r.phase == PH_DRAINING:
                continue
            if stacking and r.phase == PH_DECODE:
                if r.finished or r.inflight > 1 or (r.inflight == 1 and not r.last_inflight_decode):
                    continue
            elif r.inflight:
                continue
            r._path_value = 0.0
            if r.phase <= PH_PREFILL:
                r._path_value = self._path_value(r) * r.value_scale
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
                if r.phase == PH_RESTORE:
                    pools[K_RESTORE].append(r)
                elif r.phase == PH_RESUME:
                    r._weight = ov + tf * r.token_price + df * r.delivery_price
                    pools[K_RESUME_SAMPLING].append(r)
                elif r.phase == PH_INITIALIZE:
                    pools[K_INITIALIZE].append(r)
            r._weight *= r.value_scale  # vLLM's priority

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
            return None

        cdef _Candidate best = None, c
        if self.fcfs:
            best = _fcfs_choice(candidates)
        else:
            for c in candidates:
                if best is None or _better(c, best):
                    best = c
        cdef bint refresh = False
        cdef _Candidate stale = None
        if not self.fcfs and best.state == TIMING_FRESH and queue_empty and refresh_credit_ns > 0:
            for c in candidates:
                if c is best or c.state != TIMING_STALE:
                    continue
                if stale is None or c.last_touch_ns < stale.last_touch_ns:
                    stale = c
            if stale is not None and refresh_credit_ns >= min(stale.estimate_ns, REFRESH_CAP_NS):
                best = stale
                refresh = True
        best.refresh = refresh
        return best

    cdef list select_endpoints(self, message_boundaries, int64_t L, int64_t reused):
        """Anchor first (last eligible message boundary, else the prompt end),
        then extras while their cost fits the extra-work allowance."""
        bounds = sorted({int(b) for b in message_boundaries if reused < b < L})
        if reused >= L:
            return []
        selected = [bounds[len(bounds) - 1] if bounds else L]
        extras = ([L] if bounds else []) + list(reversed(bounds[: max(len(bounds) - 1, 0)]))
        if not extras:
            return selected
        cdef int64_t snapshot_ns = self.timings.get((K_SNAPSHOT, 1, 0)).estimate_ns
        best_ns_per_token = None
        split_ns = None
        for batch, tokens in self._capacities.get(K_PREFILL, ()):
            if batch != 1:
                continue
            est = self.timings.get((K_PREFILL, batch, tokens)).estimate_ns
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

    cdef double _unlock_value(self, Request r) except? -1:
        """Value of a prerequisite step (initialize, restore).

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
        at = r.num_scheduled_tokens
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
                if take < r._take and r.atomic_spans:  # (a chunk that would end inside an image ends before it)
                    take = r._cut(take)
                    if take == 0:
                        continue
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

    cdef update_prices(self, list slots, ScheduledPlan plan, int64_t measured):
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
            served[r.slot] = (counts[i] if plan.kind != K_DECODE and plan.kind != K_SPECULATIVE else 1, sample[i])
        cdef double x_exp, tokens, delivered
        cdef double tau = self._adaptation_ns
        for x in slots:
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

cdef inline double _clamp(double x, double lo, double hi) noexcept:
    return lo if x < lo else (hi if x > hi else x)


cdef _Candidate _fcfs_choice(list candidates):
    """Baseline selection: first come, first served, prefill first.

    Work that moves a not-yet-decoding request forward (prefill and its
    prerequisites, terminal snapshots) runs for the earliest arrival (of the
    lowest priority value), with the largest chunk it can use; otherwise every
    decoder decodes together.
    """
    cdef _Candidate c, best = None
    cdef Request oldest = None, r
    for c in candidates:
        if c.kind == K_DECODE:
            continue
        for x in c.requests:
            r = <Request>x
            if oldest is None or r.priority < oldest.priority or (r.priority == oldest.priority and (
                r.arrival_ns < oldest.arrival_ns
                or (r.arrival_ns == oldest.arrival_ns and r.generation < oldest.generation)
            )):
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
