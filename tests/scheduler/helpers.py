"""Small factories for scheduler tests: a fake clock, a fake executor that
answers a plan with the records a GPU would report, and a cost model."""

from __future__ import annotations

import numpy as np

from flared.scheduler import GraphKind, PolicyConfig, RequestScheduler, SchedulerConfig, plan_records

MODEL = b"t" * 32
MS = 1_000_000


def make_scheduler(
    max_live_requests=4,
    num_pages=64,
    num_snapshots=8,
    page_tokens=16,
    context_capacity=1024,
    prefill_chunk_size=128,
    graph_shapes=(),
    policy=None,
    **kw,
):
    cfg = SchedulerConfig(
        model_identity=MODEL,
        max_live_requests=max_live_requests,
        num_pages=num_pages,
        num_snapshots=num_snapshots,
        page_tokens=page_tokens,
        context_capacity=context_capacity,
        prefill_chunk_size=prefill_chunk_size,
        graph_shapes=tuple(graph_shapes),
        **kw,
    )
    return RequestScheduler(cfg, policy or PolicyConfig())


def prompt(n, seed=0):
    return np.random.default_rng(seed).integers(0, 30000, n, dtype=np.int32)


def copies_cost_ns(plan) -> int:
    """Synthetic cost of a prefill's checkpoint copies (plan.copies): what a snapshot step of as many rows
    costs; 0 for other kinds, whose copies are the step itself."""
    if plan.kind not in (GraphKind.PREFILL, GraphKind.SCORED_PREFILL) or not len(plan.copies):
        return 0
    return 200_000 + 10_000 * len(plan.copies)


def cost_ns(plan) -> int:
    """Synthetic GPU cost: fixed launch + per-slot + per-token terms."""
    kind = plan.kind
    if kind == GraphKind.DECODE:
        return 2 * MS + 50_000 * plan.batch_capacity
    if kind in (GraphKind.PREFILL, GraphKind.SCORED_PREFILL):
        return 2 * MS + 20_000 * plan.token_capacity + copies_cost_ns(plan)
    return 200_000 + 10_000 * plan.batch_capacity


def records_for(plan, token_ids=None, seed=0):
    """The records a correct executor reports for ``plan`` (a prefill's checkpoint copies timed apart)."""
    n = plan.num_participants
    if token_ids is None:
        token_ids = np.random.default_rng(seed + plan.plan_id).integers(0, 30000, n)
    return plan_records(plan, np.where(plan.sample == 1, token_ids, -1), copies_cost_ns(plan))


class Driver:
    """Runs the model-thread loop against a scheduler with a fake clock."""

    def __init__(self, scheduler, cost=cost_ns):
        self.s = scheduler
        self.cost = cost
        self.now_ns = 0
        self.fence = 0
        self.plans = []
        self.emitted = {}

    def step(self):
        """plan -> commit -> complete one frame; returns the plan or None."""
        plan = self.s.plan(self.now_ns)
        if plan is None:
            return None
        self.fence += 1
        self.s.commit(plan, self.fence)
        self.s.check_integrity()
        d = self.cost(plan)
        self.now_ns += d
        result = self.s.complete(self.fence, records_for(plan), d, self.now_ns)
        for h, tok in result.emitted:
            self.emitted.setdefault(h, []).append(tok)
        self.s.check_integrity()
        self.plans.append(plan)
        self.last_result = result
        return plan

    def until_decoding(self, *handles, max_steps=1000):
        """Step until every handle's request is in its DECODE phase."""
        for _ in range(max_steps):
            if all(self.s.request(h).phase_name == "DECODE" for h in handles):
                return
            self.step()
        raise AssertionError("requests did not reach DECODE")

    def run(self, max_steps=1000):
        for _ in range(max_steps):
            if self.step() is None:
                return
        raise AssertionError("scheduler did not go idle")
