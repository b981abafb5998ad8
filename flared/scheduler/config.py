"""Scheduler and policy configuration (frozen, validated dataclasses).

PolicyConfig holds value coefficients, not time limits: they say how much the
scheduler prefers one kind of useful work over another. None of them caps a
frame's duration; they are preferences, not latency bounds.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from flared._fast.policy import SELECTION_FCFS, SELECTION_VALUE
from flared._fast.request import MAX_LIVE_REQUESTS, GraphKind

# The prefix-key block size: prefill chunks end on it so every chunk
# boundary is also a cheap exact key.
PREFILL_ALIGNMENT_TOKENS = 64


class Selection(enum.IntEnum):
    # Rank every (shape, cohort) by useful value per estimated duration
    # less waiting cost (the reference policy; docs/scheduling.md).
    VALUE_PER_DURATION = SELECTION_VALUE
    # Baseline for comparisons: earliest arrival's prefill first, else
    # decode everyone (vLLM-style continuous batching).
    FCFS = SELECTION_FCFS


@dataclass(frozen=True)
class PolicyConfig:
    # Value of one output token, in units of one consumed prompt token. A
    # sampled token is what a client waits for; 64 prompt tokens of prefill
    # are worth about one of them.
    output_token_value: float = 64.0
    # Weight of a request's token-service price (fairness of consumed and
    # generated tokens across requests).
    token_fairness: float = 16.0
    # Weight of a request's delivery-service price (fairness of how often a
    # streaming request gets new output).
    delivery_fairness: float = 4.0
    # Waiting cost per ms of age, per ms of graph duration, of a decoding
    # request that a candidate leaves out.
    decode_age_price: float = 0.1
    # Intrinsic value of retiring a finished request (its terminal snapshot).
    terminal_value: float = 256.0
    # Waiting cost rate (per ms of age) of a finished request awaiting retirement.
    terminal_age_price: float = 1.0
    # Time constant of service-price adaptation: a price moves by a factor e
    # after this much unserved (or over-served) execution time.
    service_price_adaptation_ns: int = 100_000_000
    # An estimate with no valid observation for this long is stale: still
    # used, but refreshable and replaced by the next observation.
    timing_freshness_ns: int = 30_000_000_000
    # Exponent of the adaptive speculative-verification width rule; stored
    # for the speculative-decoding work, unused by the kinds scheduled today.
    adaptive_verification_exponent: float = 1.0

    def __post_init__(self):
        for name in (
            "output_token_value", "token_fairness", "delivery_fairness", "decode_age_price",
            "terminal_value", "terminal_age_price", "adaptive_verification_exponent",
        ):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be non-negative")
        if self.service_price_adaptation_ns <= 0 or self.timing_freshness_ns <= 0:
            raise ValueError("service_price_adaptation_ns and timing_freshness_ns must be positive")


def _powers_of_two_up_to(n: int) -> tuple[int, ...]:
    top = 1
    while top < n:
        top *= 2
    out, b = [], 1
    while b <= top:
        out.append(b)
        b *= 2
    return tuple(out)


def default_graph_shapes(concurrency: int, prefill_chunk_size: int) -> tuple[tuple[int, int, int], ...]:
    """Shapes a core would capture: power-of-two batches up to the
    concurrency (rounded up), prefill token capacities 64..chunk by doubling."""
    batches = _powers_of_two_up_to(concurrency)
    token_caps = []
    t = PREFILL_ALIGNMENT_TOKENS
    while t < prefill_chunk_size:
        token_caps.append(t)
        t *= 2
    token_caps.append(prefill_chunk_size)
    shapes = []
    for kind in (GraphKind.INITIALIZE, GraphKind.RESTORE, GraphKind.SNAPSHOT, GraphKind.RESUME_SAMPLING):
        shapes += [(int(kind), b, 0) for b in batches]
    shapes += [(int(GraphKind.DECODE), b, b) for b in batches]
    for kind in (GraphKind.PREFILL, GraphKind.SCORED_PREFILL):
        shapes += [(int(kind), 1, t) for t in token_caps]
    return tuple(shapes)


# Draft tokens a speculative step may feed per request.
MAX_SPECULATIVE_TOKENS = 16


@dataclass(frozen=True)
class SchedulerConfig:
    # 32-byte model/recipe identity mixed into every prefix key.
    model_identity: bytes
    # Live request slots (the prepared concurrency), at most 64.
    max_live_requests: int
    # KV pages and snapshot rows the core prepared, and tokens per page.
    num_pages: int
    num_snapshots: int
    page_tokens: int
    # Longest prompt + output the core supports.
    context_capacity: int
    # Largest prefill token capacity; 64-aligned, >= 64, <= context.
    prefill_chunk_size: int = 512
    # Captured graph shapes (kind, batch_capacity, token_capacity); empty
    # means default_graph_shapes(max_live_requests, prefill_chunk_size).
    graph_shapes: tuple = field(default=())
    # Extra checkpoint captures may cost up to this fraction of the
    # estimated uncached prefill work (scheduler_checkpoint_extra_work_fraction).
    checkpoint_extra_work_fraction: float = 0.05
    # Fresh requests need an INITIALIZE step (models with recurrent state).
    initialize_state: bool = False
    selection: Selection = Selection.VALUE_PER_DURATION
    # Speculative decoding by prompt lookup (vLLM's "ngram" method): a decode step that runs alone may feed each
    # eligible request up to this many draft tokens after its last one, copied from where the request's latest
    # prompt_lookup_max .. prompt_lookup_min tokens last occurred earlier in its prompt and output; the step keeps
    # the drafts its own greedy tokens confirm, and one more. 0 = off.
    speculative_tokens: int = 0
    prompt_lookup_max: int = 4
    prompt_lookup_min: int = 2
    # The most tokens a speculative step feeds in all (its cohort's last tokens and drafts): the CUDA graph
    # executor runs one as a decode graph with a row per token, of up to its spec_max_rows rows, so a cohort of
    # that many requests or more does not speculate. 0: SPECULATIVE_MAX_TOKENS (64, the CPU's one-call step).
    speculative_max_rows: int = 0
    # Drafts from a draft model instead (flared.execution.drafter.DraftModel, or any object with its propose,
    # release and forward_cost): each speculating request's next tokens as the draft model continues them; None:
    # prompt lookup.
    drafter: object = None

    def __post_init__(self):
        if len(self.model_identity) != 32:
            raise ValueError("model_identity must be 32 bytes")
        if not 1 <= self.max_live_requests <= MAX_LIVE_REQUESTS:
            raise ValueError(f"max_live_requests must be 1..{MAX_LIVE_REQUESTS}")
        if min(self.num_pages, self.num_snapshots, self.page_tokens, self.context_capacity) <= 0:
            raise ValueError("capacities must be positive")
        chunk = self.prefill_chunk_size
        if chunk < PREFILL_ALIGNMENT_TOKENS or chunk % PREFILL_ALIGNMENT_TOKENS or chunk > self.context_capacity:
            raise ValueError(
                f"prefill_chunk_size {chunk} must be a multiple of {PREFILL_ALIGNMENT_TOKENS}, "
                f"at least {PREFILL_ALIGNMENT_TOKENS} and within the context of {self.context_capacity}"
            )
        object.__setattr__(self, "selection", Selection(self.selection))
        if not 0 <= self.checkpoint_extra_work_fraction <= 1:
            raise ValueError("checkpoint_extra_work_fraction must be within 0..1")
        if not 0 <= self.speculative_tokens <= MAX_SPECULATIVE_TOKENS:
            raise ValueError(f"speculative_tokens must be 0..{MAX_SPECULATIVE_TOKENS}")
        if self.speculative_max_rows < 0:
            raise ValueError("speculative_max_rows must be 0 (the default) or more")
        if not 1 <= self.prompt_lookup_min <= self.prompt_lookup_max:
            raise ValueError("prompt lookup needs 1 <= prompt_lookup_min <= prompt_lookup_max")
        if not self.graph_shapes:
            object.__setattr__(self, "graph_shapes", default_graph_shapes(self.max_live_requests, chunk))
        for kind, batch, tokens in self.graph_shapes:
            GraphKind(kind)
            if batch < 1 or tokens < 0:
                raise ValueError(f"bad graph shape {(kind, batch, tokens)}")
            if kind in (GraphKind.PREFILL, GraphKind.SCORED_PREFILL) and not 0 < tokens <= chunk:
                raise ValueError(f"prefill shape {(kind, batch, tokens)} exceeds prefill_chunk_size {chunk}")
