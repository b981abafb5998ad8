"""Prometheus metrics: the one place that names every ``flare_*`` series.

Rules:
- Everything is registered on an injected ``CollectorRegistry`` (one per
  serving session), never the process-global default, so two sessions in one
  process (tests, embedding) do not collide.
- Runtime counters and gauges are read at scrape time from plain data: the
  scheduler's ``counters`` dict, ``ModelRuntime.snapshot()`` and the HTTP
  state. Reads are independent (no lock spans a scrape); a scrape may straddle
  a model-thread step.
- Histograms are fed on the event loop where a response's choice ends
  (``RequestObserver``), one observation per model request.
- No series carries a request label, prompt text or token id. The only
  labels are closed sets (graph kind, slot state).
- Names are ``flare_<noun>_<unit>``; docs/metrics.md lists each one.
"""

from __future__ import annotations

import asyncio
import collections
import time

from prometheus_client import CollectorRegistry, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.exposition import CONTENT_TYPE_LATEST, generate_latest

from flared.scheduler import GraphKind

# The tokens-per-minute gauge samples the cumulative token count this often
# and reports the difference across the last minute of samples.
TOKEN_SAMPLE_INTERVAL_S = 5.0
TOKEN_WINDOW_S = 60.0

# Bucket bounds chosen for a CPU tiny model up to a large GPU model: from a
# few milliseconds to minutes.
_LATENCY_BUCKETS_S = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)
_ITL_BUCKETS_S = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.5, 1.0, 2.5)
_TOKEN_BUCKETS = (1, 4, 16, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384, 32768, 65536, 131072)

# (series name without _total, HELP text, key in the scheduler counters)
_SCHEDULER_COUNTERS = (
    ("flare_model_requests_admitted", "Requests the scheduler admitted into a slot.", "admitted"),
    ("flare_model_requests_completed", "Requests that finished (stop token or output limit).", "finished"),
    ("flare_model_requests_cancelled", "Admitted requests cancelled (client gone, stop string, shutdown).",
     "cancelled"),
    ("flare_prefix_lookups", "Prefix-cache lookups at admission, including attempts later refused for room.",
     "prefix_lookups"),
    ("flare_prefix_hits", "Prefix-cache lookups that reused a checkpoint.", "prefix_hits"),
    ("flare_prefix_reused_tokens", "Prompt tokens reused from the prefix cache instead of computed.",
     "prefix_reused_tokens"),
    ("flare_checkpoint_publications", "Unique prefix checkpoints published ready (duplicates excluded).",
     "publications"),
    ("flare_checkpoint_evictions", "Prefix checkpoints logically evicted to free pages or snapshots.", "evictions"),
    ("flare_speculative_draft_tokens", "Draft tokens speculative steps fed (prompt lookup or a draft model).",
     "speculative_drafted"),
    ("flare_speculative_accepted_tokens", "Draft tokens speculative steps confirmed and emitted.",
     "speculative_accepted"),
    ("flare_speculative_priced_out_tokens", "Draft tokens proposed and left out as worth less than their cost.",
     "speculative_priced_out"),
    ("flare_speculative_drafter_steps", "Draft-model forwards behind completed speculative steps (their depth).",
     "drafter_steps"),
)


class TokenRate:
    """Tokens generated during the most recent minute, sampled every 5 s.

    ``sample()`` runs on the event loop from a timer; the gauge is the
    cumulative count now minus the oldest sample inside the window."""

    def __init__(self, read_total):
        self._read_total = read_total
        self._samples: collections.deque[tuple[float, int]] = collections.deque(
            maxlen=int(TOKEN_WINDOW_S / TOKEN_SAMPLE_INTERVAL_S) + 1)
        self._task: asyncio.Task | None = None
        self.last_minute = 0

    def sample(self, now_s: float | None = None) -> None:
        now_s = time.monotonic() if now_s is None else now_s
        total = int(self._read_total())
        self._samples.append((now_s, total))
        while self._samples and now_s - self._samples[0][0] > TOKEN_WINDOW_S:
            self._samples.popleft()
        self.last_minute = total - self._samples[0][1]

    def start(self) -> None:
        async def run():
            while True:
                self.sample()
                await asyncio.sleep(TOKEN_SAMPLE_INTERVAL_S)
        self._task = asyncio.get_running_loop().create_task(run())

    def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            self._task = None


class _RuntimeCollector:
    """Reads the runtime, scheduler and HTTP state at scrape time."""

    def __init__(self, metrics: "ServerMetrics"):
        self._m = metrics

    def describe(self):
        return []  # collected lazily: the registry must not call collect() at registration

    def collect(self):
        m = self._m
        rt = m.runtime.snapshot()
        counters = rt.get("counters", {})
        for name, help_text, key in _SCHEDULER_COUNTERS:
            yield _counter(name, help_text, counters.get(key, 0))
        lookups, hits = counters.get("prefix_lookups", 0), counters.get("prefix_hits", 0)
        yield _counter("flare_prefix_misses", "Prefix-cache lookups that reused nothing.", lookups - hits)
        yield _counter("flare_model_requests_failed", "Requests ended by an execution or admission error.",
                       rt.get("failed_requests", 0))
        launches = CounterMetricFamily("flare_graph_launches", "Successful graph launches by graph kind.",
                                       labels=["kind"])
        for k in GraphKind:
            launches.add_metric([k.name.lower()], counters.get("launches_" + k.name.lower(), 0))
        yield launches
        yield _counter("flare_prompt_tokens", "Prompt tokens computed by prefill graphs (reuse and padding excluded).",
                       rt.get("prompt_tokens", 0))
        yield _counter("flare_generation_tokens", "Output tokens committed by the model (EOS and withheld included).",
                       rt.get("generated_tokens", 0))
        yield _counter("flare_model_steps", "Model-thread steps (graphs submitted).", rt.get("steps", 0))
        yield _counter("flare_lora_swaps_in", "Per-request LoRA adapters written into a slot of the CUDA graphs after "
                       "their load (--max-cpu-loras swapping).", rt.get("lora_swaps_in", 0))
        yield _counter("flare_embedded_sequences", "Inputs embedded (/v1/embeddings, /api/embed, /api/embeddings).",
                       rt.get("embedded_sequences", 0))
        yield _counter("flare_embedded_tokens", "Tokens run through the model for embeddings.",
                       rt.get("embedded_tokens", 0))
        yield _counter("flare_vision_images", "Images (an audio model: clips) run through the model's image tower "
                       "(audio encoder), not those whose rows were cached from an earlier request.",
                       rt.get("vision_images", 0))
        yield _counter("flare_vision_videos", "Videos run through the model's image tower, not those whose rows were "
                       "cached from an earlier request.", rt.get("vision_videos", 0))
        yield _counter("flare_vision_tiles",
                       "Image tiles run through a tiling image tower (SmolVLM, Idefics3, InternVL, LLaVA-NeXT).",
                       rt.get("vision_tiles", 0))
        yield _counter("flare_relevance_pairs", "Query-document pairs scored (/v1/rerank, /rerank, /v1/score).",
                       rt.get("relevance_sequences", 0))
        yield _counter("flare_relevance_tokens", "Tokens run through the model to score query-document pairs.",
                       rt.get("relevance_tokens", 0))

        slots = GaugeMetricFamily("flare_request_slots", "Scheduler request slots by state.", labels=["state"])
        live, retiring = m.slot_states()
        slots.add_metric(["live"], live)
        slots.add_metric(["retiring"], retiring)
        slots.add_metric(["free"], max(0, m.max_slots - live - retiring))
        yield slots
        yield _gauge("flare_reusable_pages", "KV pages free for new use (fence completed).", rt.get("free_pages", 0))
        yield _gauge("flare_reusable_snapshots", "State snapshots free for new use.", rt.get("free_snapshots", 0))
        yield _gauge("flare_kv_pages", "KV pages in the pool.", rt.get("total_pages", 0))
        kv = m.runtime.kv_cache_info()
        if kv:
            kv_bytes = GaugeMetricFamily("flare_kv_cache_bytes", "Bytes of the KV cache (pool and prefix snapshots), "
                                         "by element type (kv_cache_dtype).", labels=["dtype"])
            kv_bytes.add_metric([kv["dtype"]], kv["bytes"])
            yield kv_bytes
        weights = m.runtime.weights_info()
        if weights:
            weight_bytes = GaugeMetricFamily("flare_weight_bytes", "Bytes the layers' products and the LM head hold, "
                                             "by how they are kept (quantization).", labels=["quantization"])
            weight_bytes.add_metric([weights["quantization"] or weights["dtype"]], weights["product_bytes"])
            yield weight_bytes
        cache = m.cache_sizes()
        yield _gauge("flare_cached_checkpoints", "Prefix checkpoints held by the cache.", cache[0])
        yield _gauge("flare_cached_pages", "KV pages owned by cached prefix checkpoints.", cache[1])
        yield _gauge("flare_model_pending_requests", "Requests handed to the model thread and waiting for a slot.",
                     rt.get("pending", 0))
        st = m.state
        yield _gauge("flare_http_capacity_requests", "HTTP admission permits (queue capacity + max active).",
                     st.http_permits)
        yield _gauge("flare_http_requests_in_flight", "HTTP admission permits in use.", st.http_in_use)
        yield _gauge("flare_frontend_capacity_workers", "Frontend (template and tokenizer) worker threads.",
                     st.frontend_workers)
        yield _gauge("flare_frontend_busy_workers", "Frontend workers preparing a request now.", st.frontend_busy)
        yield _gauge("flare_admission_paused", "1 while admission is paused (pause_admission or shutdown).",
                     1 if st.paused else 0)
        yield _gauge("flare_listener_uptime_seconds", "Seconds since the HTTP listener started.", m.uptime_s())
        yield _gauge("flare_generated_tokens_last_minute",
                     "Tokens generated during the most recent minute, sampled every 5 seconds.",
                     m.token_rate.last_minute)


def _counter(name: str, help_text: str, value) -> CounterMetricFamily:
    return CounterMetricFamily(name, help_text, value=float(value))


def _gauge(name: str, help_text: str, value) -> GaugeMetricFamily:
    return GaugeMetricFamily(name, help_text, value=float(value))


class RequestObserver:
    """Per-request latency and size histograms, fed on the event loop.

    One instance per model request (choice): ``token()`` on each published
    step, ``finish()`` once at the end."""

    __slots__ = ("_m", "_start_s", "_last_s")

    def __init__(self, metrics: "ServerMetrics", start_s: float):
        self._m = metrics
        self._start_s = start_s
        self._last_s = 0.0

    def token(self, now_s: float | None = None) -> None:
        now_s = time.monotonic() if now_s is None else now_s
        if self._last_s == 0.0:
            self._m.ttft.observe(now_s - self._start_s)
        else:
            self._m.itl.observe(now_s - self._last_s)
        self._last_s = now_s

    def finish(self, num_prompt_tokens: int, num_generated_tokens: int, queue_ns: int,
               now_s: float | None = None) -> None:
        now_s = time.monotonic() if now_s is None else now_s
        m = self._m
        m.e2e.observe(now_s - self._start_s)
        m.queue.observe(queue_ns / 1e9)
        m.prompt_tokens.observe(num_prompt_tokens)
        m.generation_tokens.observe(num_generated_tokens)


class ServerMetrics:
    """The session's metrics: collectors over live state plus request histograms."""

    def __init__(self, runtime, state, *, max_slots: int, uptime_s=None,
                 registry: CollectorRegistry | None = None):
        self.runtime = runtime
        self.state = state
        self.max_slots = max_slots
        self._uptime_s = uptime_s or (lambda: 0.0)
        self.registry = registry if registry is not None else CollectorRegistry()
        self.token_rate = TokenRate(lambda: runtime.stats.get("generated_tokens", 0))
        r = self.registry
        self.ttft = Histogram("flare_time_to_first_token_seconds",
                              "Time from handing a request to the model to its first output token.",
                              buckets=_LATENCY_BUCKETS_S, registry=r)
        self.itl = Histogram("flare_inter_token_latency_seconds",
                             "Time between consecutive output steps of one request.",
                             buckets=_ITL_BUCKETS_S, registry=r)
        self.e2e = Histogram("flare_request_duration_seconds",
                             "Time from handing a request to the model to its terminal event.",
                             buckets=_LATENCY_BUCKETS_S, registry=r)
        self.queue = Histogram("flare_request_queue_seconds",
                               "Time from model admission to the request's first scheduled step.",
                               buckets=_LATENCY_BUCKETS_S, registry=r)
        self.prompt_tokens = Histogram("flare_request_prompt_tokens", "Prompt tokens per request.",
                                       buckets=_TOKEN_BUCKETS, registry=r)
        self.generation_tokens = Histogram("flare_request_generation_tokens", "Generated tokens per request.",
                                           buckets=_TOKEN_BUCKETS, registry=r)
        r.register(_RuntimeCollector(self))

    def uptime_s(self) -> float:
        return float(self._uptime_s())

    def set_uptime_source(self, uptime_s) -> None:
        self._uptime_s = uptime_s

    def observer(self, start_s: float | None = None) -> RequestObserver:
        return RequestObserver(self, time.monotonic() if start_s is None else start_s)

    def slot_states(self) -> tuple[int, int]:
        """(live, retiring) slots; retiring = finished or cancelled, awaiting its last GPU use."""
        s = self.runtime.scheduler
        if s is None:
            return 0, 0
        live = retiring = 0
        for handle in s.live_handles():
            try:
                r = s.request(handle)
            except Exception:  # noqa: BLE001 - the slot was released between the two reads
                continue
            if r.finished or r.cancelled:
                retiring += 1
            else:
                live += 1
        return live, retiring

    def cache_sizes(self) -> tuple[int, int]:
        s = self.runtime.scheduler
        if s is None:
            return 0, 0
        return int(s.cache.num_checkpoints), int(s.cache.num_cached_pages)

    content_type = CONTENT_TYPE_LATEST

    def render(self) -> bytes:
        return generate_latest(self.registry)

    def start(self) -> None:
        self.token_rate.start()

    def stop(self) -> None:
        self.token_rate.stop()


def metrics_route(metrics: ServerMetrics):
    """A handler for GET /metrics (public on the main listener and the admin socket)."""
    from flared.server.http import Response

    async def handler(request) -> Response:
        return Response(metrics.render(), media_type=metrics.content_type)
    return handler
