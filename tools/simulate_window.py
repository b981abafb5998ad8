"""The two-frame model-thread loop on a simulated clock: the real scheduler, no model.

    python tools/simulate_window.py [--shape 135m] [--streams 64] [--prompt 128] [--new 256]
                                    [--jitter 0.1] [--runs 5] [--cold] [--cached N] [--json]

``offline.drive`` (the loop bench_gpu measures) runs the real RequestScheduler against ``SimExecutor``:
the executor's submit/poll contract (two frames in flight at most, completions in order) whose steps
take the GPU durations measured on the H200 (docs/benchmarks.md, eighth session), with ``--jitter``
relative noise, and whose host costs (planning + packing + launch, completion) advance the same clock.
Every token is 7 (requests finish by length). As bench_gpu does, a 4-token drive on other prompts
measures the shapes first (``--cold`` skips it); ``--cached N`` drives the measured prompts N times before, so
the measured drive resumes every prompt from the prefix cache (its restore steps' sizes are printed). It prints,
per run, the decode steps, their batch sizes, how often the loop drained the window, and the output tok/s the
simulated clock gives, so scheduler changes can be judged on CPU before a GPU run. Durations are a model, not a
measurement.
"""

from __future__ import annotations

import argparse
import collections
import json
import random
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import numpy as np  # noqa: E402

# GPU microseconds by (kind, batch capacity) on the H200 (bench_gpu / profile_decode_step, eighth session);
# prefill: fixed + per token.
COSTS = {
    "135m": dict(decode={1: 440, 2: 470, 4: 540, 8: 760, 16: 830, 32: 880, 64: 1040}, prefill=(300, 1.9),
                 submit_us=300, complete_us=200, other_us=100),
    "8b": dict(decode={1: 4170, 2: 4560, 4: 4590, 8: 4600, 16: 4930, 32: 4660, 64: 5250}, prefill=(6000, 21.0),
               submit_us=300, complete_us=150, other_us=150),
}


class SimExecutor:
    """GraphExecutor's submit/poll/outstanding contract on a simulated clock (nanoseconds in ``now``)."""

    def __init__(self, costs: dict, jitter: float, rng: random.Random):
        from flared.model.sampling import Sampler

        self.costs = costs
        self.jitter = jitter
        self.rng = rng
        self.now = 0
        self.gpu_free_at = 0
        self.frames: collections.deque = collections.deque()
        self.sampler = Sampler(64, device="cpu", max_penalty_slots=256)
        self.decode_rows: list[int] = []
        self.drained_decode_rows: list[int] = []  # the rows of each decode step that found the window empty
        self.drains = 0
        self.last_token_ns = 0
        self.restore_rows: list[int] = []  # the rows of each restore step (cached prompts resumed)

    @property
    def outstanding(self) -> int:
        return len(self.frames)

    def _duration_us(self, plan) -> float:
        kind = plan.kind_name
        if kind == "DECODE":
            return self.costs["decode"][plan.batch_capacity]
        if kind in ("PREFILL", "SCORED_PREFILL"):
            fixed, per_token = self.costs["prefill"]
            return fixed + per_token * plan.token_capacity
        return self.costs["other_us"]

    def submit(self, plan, tables, states):
        from flared.scheduler import plan_records

        if len(self.frames) >= 2:
            return None
        if not self.frames:
            self.drains += 1
            if plan.kind_name == "DECODE":
                self.drained_decode_rows.append(plan.num_participants)
        self.now += int(self.costs["submit_us"] * 1e3)
        start = max(self.now, self.gpu_free_at)
        dur = int(self._duration_us(plan) * (1 + self.rng.uniform(-self.jitter, self.jitter)) * 1e3)
        copies_ns = 0
        if plan.kind_name in ("PREFILL", "SCORED_PREFILL") and len(plan.copies):
            # the checkpoint copies after the prefill, in the same frame and timed apart
            copies_ns = int(self.costs["other_us"] * 1e3)
            dur += copies_ns
        self.gpu_free_at = start + dur
        n = plan.num_participants
        if plan.kind_name == "DECODE":
            self.decode_rows.append(n)
        elif plan.kind_name == "RESTORE":
            self.restore_rows.append(n)
        records = plan_records(plan, np.where(np.asarray(plan.sample) == 1, 7, -1), copies_ns)
        self.frames.append((self.gpu_free_at, records, dur, plan.kind_name))
        return len(self.frames)

    def poll(self, block: bool = True):
        end, records, dur, kind = self.frames.popleft()
        self.now = max(self.now, end) + int(self.costs["complete_us"] * 1e3)
        if kind in ("DECODE", "PREFILL"):
            self.last_token_ns = end
        return (None, records, dur)


def simulate(shape: str, streams: int, prompt: int, new: int, jitter: float, seed: int, warm: bool = True,
             cached: int = 0) -> dict:
    """``cached``: drives of the measured prompts before the measured one, so its prompts are all in the prefix
    cache and resume (restore + resume-sampling) instead of prefilling."""
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from bench_gpu import PREFILL_CHUNK, scheduler

    from flared.execution.graphs import ExecutionManifest, default_prefill_batch_shapes
    from flared.execution.offline import drive
    from flared.model.sampling import SamplingParams

    batches = tuple(1 << i for i in range(streams.bit_length()) if 1 << i <= streams)
    prefill = tuple(64 << i for i in range(8) if 64 << i <= PREFILL_CHUNK)
    manifest = ExecutionManifest.build(decode_batch_sizes=batches, prefill_token_sizes=prefill,
                                       max_pages_per_sequence=256,
                                       prefill_batch_shapes=default_prefill_batch_shapes(streams, prefill))
    sched, _ = scheduler(streams, None, manifest.scheduler_graph_shapes(streams))
    rng = random.Random(seed)
    ex = SimExecutor(COSTS[shape], jitter, rng)
    # As bench_gpu: a short warm drive on other prompts first (it measures the shapes), then the measured one.
    if warm:
        other = [[3 + rng.randrange(1000) for _ in range(prompt)] for _ in range(streams)]
        drive(sched, ex, other, [SamplingParams(temperature=0.0, max_tokens=4)] * streams, clock_ns=lambda: ex.now)
    prompts = [[3 + rng.randrange(1000) for _ in range(prompt)] for _ in range(streams)]
    params = [SamplingParams(temperature=0.0, max_tokens=new)] * streams
    for _ in range(cached):
        drive(sched, ex, prompts, params, clock_ns=lambda: ex.now)
    ex.decode_rows, ex.drained_decode_rows, ex.drains, ex.restore_rows, t0 = [], [], 0, [], ex.now
    r = drive(sched, ex, prompts, params, clock_ns=lambda: ex.now)
    assert all(len(t) == new for t in r.tokens)
    rows = collections.Counter(ex.decode_rows)
    return {"decode_steps": len(ex.decode_rows), "steps": dict(r.steps_by_kind), "drains": ex.drains,
            "tok_s": streams * new / ((ex.last_token_ns - t0) / 1e9),
            "rows": dict(sorted(rows.items())), "first_rows": ex.decode_rows[:40], "restore_rows": ex.restore_rows,
            "drained_rows": dict(sorted(collections.Counter(ex.drained_decode_rows).items()))}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="135m", choices=sorted(COSTS))
    ap.add_argument("--streams", type=int, default=64)
    ap.add_argument("--prompt", type=int, default=128)
    ap.add_argument("--new", type=int, default=256)
    ap.add_argument("--jitter", type=float, default=0.1)
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--cold", action="store_true", help="no warm drive: the measured run meets unmeasured shapes")
    ap.add_argument("--cached", type=int, default=0,
                    help="drives of the measured prompts first: the measured one resumes them from the prefix cache")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    out = []
    print(f"{'run':>3} {'decode steps':>12} {'drains':>6} {'tok/s':>9}  decode rows (count)")
    for run in range(args.runs):
        res = simulate(args.shape, args.streams, args.prompt, args.new, args.jitter, seed=run, warm=not args.cold,
                       cached=args.cached)
        out.append(res)
        print(f"{run:3d} {res['decode_steps']:12d} {res['drains']:6d} {res['tok_s']:9,.0f}  {res['rows']}"
              + (f"  restores {res['restore_rows']}" if res["restore_rows"] else ""))
    print("first decode steps' rows (last run):", out[-1]["first_rows"])
    if args.json:
        print(json.dumps({"shape": args.shape, "streams": args.streams, "cold": args.cold, "cached": args.cached,
                          "runs": out}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
