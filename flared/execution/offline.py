"""Offline driver: the real scheduler and an executor, without threads or HTTP.

``drive(scheduler, executor, prompts, params)`` admits every prompt at once
and runs the model-thread step (plan -> commit -> submit -> poll -> complete)
until every request finished by length, then drains. It is what the GPU
qualification and benchmarks measure and what the parity checks compare:
the same scheduler and executor the daemon's model thread uses, minus the
event loop. Executors with ``submit``/``poll`` run with up to two decode
steps in flight (the scheduler decides when overlap is allowed); executors
with only ``run`` (the eager CPU one) run one step at a time.

Timing: ``host_ns`` counts host time spent outside the blocking wait in
``poll`` (planning, packing, launching, completing); ``gpu_ns`` sums the
executor's per-step device durations. ``1 - gpu_ns / wall`` is the GPU
idle fraction of the run.
"""

from __future__ import annotations

import collections
import time
from dataclasses import dataclass, field

from flared.errors import ExecutionError


@dataclass
class DriveResult:
    tokens: list[list[int]]
    first_token_ns: list[int]  # since the start of the drive
    finish_ns: list[int]
    wall_ns: int = 0
    host_ns: int = 0
    gpu_ns: int = 0
    steps: int = 0
    steps_by_kind: dict = field(default_factory=collections.Counter)
    decode_gpu_ns: int = 0
    decode_host_ns: int = 0
    decode_step_ns: list[int] = field(default_factory=list)  # each decode step's device duration, in order


def drive(scheduler, executor, prompts, params, *, pipeline: bool = True, clock_ns=time.monotonic_ns,
          loras=None, speculate: bool = False, predictions=None, visions=None) -> DriveResult:
    """``clock_ns`` is the scheduler's clock (tests pass a fake one: the scheduler stops stacking a second
    step behind one that runs past its estimate, which a slow or loaded host can trigger). ``loras``: each
    request's per-request LoRA adapter (DecoderModel.add_lora_module's index; 0 the base), as the worker sets it.
    ``speculate``: admit the requests whose drafts the executor can verify (its ``speculates``) for speculative
    steps, as the worker does (the scheduler's speculative_tokens turns them on). ``predictions``: each request's
    predicted output (token ids; GenerateRequest.prediction), or None. ``visions``: each request's images
    (flared.runtime.request.VisionInput, its ``features`` made by the image tower) or None, as the worker sets them
    (no prefix-cache conditioning: prompts of the same tokens with other images must not share a drive)."""
    from flared.execution.images import atomic_spans

    clock = time.perf_counter_ns
    t0 = clock()
    n = len(prompts)
    states = []
    by_handle: dict[int, int] = {}
    for i, (prompt, p) in enumerate(zip(prompts, params)):
        states.append(executor.sampler.add_sequence(p, prompt))
        if loras is not None:
            states[-1].lora = loras[i]
        if visions is not None:
            states[-1].vision = visions[i]
        handle = scheduler.admit(list(prompt), p.max_tokens, clock_ns(), speculate=speculate and executor.speculates(p),
                                 prediction=predictions[i] if predictions is not None else (),
                                 atomic_spans=atomic_spans(getattr(executor, "model", None), states[-1].vision
                                                           if visions is not None else None))
        by_handle[int(handle)] = i
    result = DriveResult([[] for _ in range(n)], [0] * n, [0] * n)
    finished = 0
    retired = 0
    inflight: collections.deque[tuple[int, str]] = collections.deque()  # (scheduler fence, kind name)
    asynchronous = pipeline and hasattr(executor, "submit")
    host_ns = 0
    # Past the last token, the loop keeps stepping until every request is retired (terminal snapshots),
    # so the scheduler's slots are free for the next drive; wall_ns stops at the last token.
    while retired < n or inflight:
        step_start = clock()
        plan = None
        if not inflight or (asynchronous and executor.outstanding < 2):
            plan = scheduler.plan(clock_ns())
        if plan is not None:
            fence = scheduler.last_committed_fence + 1
            handles = [int(h) for h in plan.handles]
            tables = [scheduler.block_table(h) for h in handles]
            row_states = [states[by_handle[h]] if h in by_handle else None for h in handles]
            scheduler.commit(plan, fence)
            result.steps += 1
            result.steps_by_kind[plan.kind_name] += 1
            if asynchronous:
                if executor.submit(plan, tables, row_states) is None:
                    raise ExecutionError("executor refused a step the scheduler allowed (window full)")
                inflight.append((fence, plan.kind_name))
                spent = clock() - step_start
                host_ns += spent
                if plan.kind_name == "DECODE":
                    result.decode_host_ns += spent
                continue
            records, duration_ns = executor.run(plan, tables, row_states)[:2]
            done = (fence, plan.kind_name, records, duration_ns)
        elif inflight:
            wait_start = clock()
            polled = executor.poll(block=True)
            step_start += clock() - wait_start  # the blocking wait is GPU time, not host time
            fence, kind_name = inflight.popleft()
            done = (fence, kind_name, polled[1], polled[2])
        elif finished == n:
            break  # finished; nothing left to snapshot
        else:
            raise ExecutionError("live requests but the scheduler planned nothing")
        fence, kind_name, records, duration_ns = done
        completed = scheduler.complete(fence, records, duration_ns, clock_ns())
        now = clock() - t0
        for handle, token in completed.emitted:
            i = by_handle[int(handle)]
            if not result.tokens[i]:
                result.first_token_ns[i] = now
            result.tokens[i].append(int(token))
        for handle in completed.finished:
            i = by_handle.get(int(handle))
            if i is not None and not result.finish_ns[i]:
                result.finish_ns[i] = now
                finished += 1
        for handle in completed.retired:
            i = by_handle.get(int(handle))
            if i is not None:
                executor.sampler.release(states[i])
                retired += 1
        result.gpu_ns += duration_ns
        spent = clock() - step_start
        host_ns += spent
        if kind_name == "DECODE":
            result.decode_gpu_ns += duration_ns
            result.decode_host_ns += spent
            result.decode_step_ns.append(duration_ns)
    result.wall_ns = max(result.finish_ns) if n else clock() - t0
    result.host_ns = host_ns
    return result
