"""Live-request scheduler facade.

The implementation is Cython (``flared._fast.scheduler``); this module names
the surface the model thread uses. One model-thread step:

    handle = scheduler.admit(prompt, max_output_tokens, now_ns, message_boundaries)
    plan = scheduler.plan(now_ns)             # ScheduledPlan or None; pure
    scheduler.commit(plan, fence)             # just before enqueueing fence
    result = scheduler.complete(fence, CompletionRecords(...), duration_ns, now_ns)
    scheduler.finish(handle, now_ns) / scheduler.cancel(handle)

``ScheduledPlan`` is plain data: numpy arrays per participant (handles,
slots, state rows, token positions and ids, sample flags, touched block-table
entries, snapshot/restore copy rows); its docstring lists every field.
docs/scheduling.md explains the policy with a worked example.
"""

import numpy as np

from flared._fast.policy import REFRESH_CAP_NS, REFRESH_FRACTION, SelectionPolicy
from flared._fast.request import (
    MAX_LIVE_REQUESTS,
    GraphKind,
    Request,
    RequestPhase,
    ScheduledPlan,
    handle_generation,
    handle_slot,
)
from flared._fast.scheduler import CompletionRecords, CompletionResult, RequestScheduler, RowCost
from flared.scheduler.config import PolicyConfig, SchedulerConfig, Selection, default_graph_shapes


def plan_records(plan: ScheduledPlan, token_ids, snapshot_ns: int = 0) -> CompletionRecords:
    """The completion records an executor reports for ``plan``: each participant's consumed and generated
    counts as the plan scheduled them, ``token_ids`` (its sampled token, -1 where it sampled none) and the
    time its checkpoint copies took after a prefill (``snapshot_ns``, 0 when not timed)."""
    return CompletionRecords(
        handles=np.asarray(plan.handles, dtype=np.int64),
        consumed_tokens=np.asarray(plan.token_starts, dtype=np.int64) + np.asarray(plan.num_tokens, dtype=np.int64),
        generated_tokens=np.asarray(plan.generated_ends, dtype=np.int64),
        token_ids=np.asarray(token_ids, dtype=np.int64),
        snapshot_ns=int(snapshot_ns),
    )


def scored_participants(plan: ScheduledPlan, score_from) -> list[tuple[int, int]]:
    """(participant, first position it scores) for each participant of ``plan`` that scores positions this step:
    from ``score_from[i]`` (None: it scores nothing), in a SCORED_PREFILL plan from position 1 or a later
    ``score_from``; only participants whose chunk reaches that position."""
    out = []
    for i in range(plan.num_participants):
        first = score_from[i] if score_from is not None else None
        if plan.kind == GraphKind.SCORED_PREFILL:
            first = 1 if first is None else max(1, first)
        if first is not None and int(plan.token_starts[i]) + int(plan.num_tokens[i]) > first:
            out.append((i, first))
    return out


__all__ = [
    "MAX_LIVE_REQUESTS",
    "REFRESH_CAP_NS",
    "REFRESH_FRACTION",
    "CompletionRecords",
    "CompletionResult",
    "GraphKind",
    "PolicyConfig",
    "Request",
    "RequestPhase",
    "RequestScheduler",
    "RowCost",
    "ScheduledPlan",
    "scored_participants",
    "SelectionPolicy",
    "SchedulerConfig",
    "Selection",
    "default_graph_shapes",
    "handle_generation",
    "handle_slot",
    "plan_records",
]
