#!/usr/bin/env python3
"""Scheduler and prefix-cache benchmark.

    .venv/bin/python tools/bench_scheduler.py [--json] [--quick]

(a) host time of one decode step (plan + commit + complete) with 1, 16 and
    64 live requests, median and p99 in us, against the 100 us target; the
    same for a speculative step (every request's drafts looked up; 1, 16
    and 32 live);
(b) prefix hashing throughput on 100k-token prompts: PrefixHistory against a
    straightforward Python loop over hashlib.blake2b per 64-token block (the
    loop computes the same keys; the run checks they agree);
(c) a simulated serving run (synthetic GPU cost model, Poisson arrivals,
    mixed prompt/output lengths, multi-turn conversations sharing system
    prompts): the value-per-duration policy against first-come-first-served
    on the same workload: TTFT p50/p99, inter-token p99, throughput, reuse.

Times in (c) are simulated GPU time from the cost model, not host time.
With --json the last line is one JSON object.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import struct
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from flared.cache import PrefixHistory  # noqa: E402
from flared.errors import AdmissionError  # noqa: E402
from flared.scheduler import (  # noqa: E402
    CompletionRecords,
    GraphKind,
    PolicyConfig,
    RequestScheduler,
    SchedulerConfig,
    Selection,
    plan_records,
)

MODEL = hashlib.sha256(b"bench-model").digest()
MS = 1_000_000


# ---------------------------------------------------------------- helpers


def copies_cost_ns(plan) -> int:
    """A prefill's checkpoint copies (plan.copies), run after its forward in the same frame: priced as a
    snapshot step of as many rows."""
    if plan.kind not in (GraphKind.PREFILL, GraphKind.SCORED_PREFILL) or not len(plan.copies):
        return 0
    return 300_000 + 20_000 * len(plan.copies)


def records_for(plan, rng):
    tokens = np.where(plan.sample == 1, rng.integers(0, 32000, plan.num_participants), -1)
    return plan_records(plan, tokens, copies_cost_ns(plan))


def gpu_cost_ns(plan) -> int:
    """Synthetic cost of an 8B-class model on one GPU: decode is weight-read
    bound (flat in batch), prefill is compute bound (per padded token), plus its checkpoint copies."""
    if plan.kind == GraphKind.DECODE:
        return 7 * MS + 40_000 * plan.batch_capacity
    if plan.kind in (GraphKind.PREFILL, GraphKind.SCORED_PREFILL):
        return 3 * MS + 55_000 * plan.token_capacity + copies_cost_ns(plan)
    return 300_000 + 20_000 * plan.batch_capacity


def percentile(values, q):
    return float(np.percentile(np.asarray(values, dtype=np.float64), q)) if len(values) else float("nan")


# ---------------------------------------------------------------- (a)


def bench_decode_step(num_live: int, num_steps: int) -> dict:
    cfg = SchedulerConfig(
        model_identity=MODEL, max_live_requests=64, num_pages=32768, num_snapshots=256,
        page_tokens=16, context_capacity=8192, prefill_chunk_size=512,
    )
    s = RequestScheduler(cfg, PolicyConfig())
    rng = np.random.default_rng(num_live)
    handles = [s.admit(rng.integers(0, 32000, 32), 6000, 0) for _ in range(num_live)]
    now, fence = 0, 0
    # Warm up: prefill everyone and measure every decode shape.
    while True:
        plan = s.plan(now)
        fence += 1
        s.commit(plan, fence)
        d = gpu_cost_ns(plan)
        now += d
        s.complete(fence, records_for(plan, rng), d, now)
        if all(s.request(h).phase_name == "DECODE" for h in handles) and plan.kind == GraphKind.DECODE:
            if plan.num_participants == num_live and plan.estimated_duration_ns > 0:
                break
    samples = []
    for _ in range(num_steps):
        plan, now, fence, us = timed_step(s, now, fence, lambda p: records_for(p, rng))
        assert plan.kind == GraphKind.DECODE and plan.num_participants == num_live
        samples.append(us)
    return {"median_us": percentile(samples, 50), "p99_us": percentile(samples, 99)}


def timed_step(s, now: int, fence: int, records) -> tuple:
    """One step: plan, commit, the executor's records (``records(plan)``, not timed) and the synthetic GPU time,
    complete. Returns (plan, now, fence, host microseconds of plan + commit + complete)."""
    clock = time.perf_counter_ns
    t0 = clock()
    plan = s.plan(now)
    fence += 1
    s.commit(plan, fence)
    t1 = clock()
    rec = records(plan)
    d = gpu_cost_ns(plan)
    now += d
    t2 = clock()
    s.complete(fence, rec, d, now)
    t3 = clock()
    return plan, now, fence, (t1 - t0 + t3 - t2) / 1000


def spec_records(plan, period: int):
    """Records of a step in which every draft is kept and each token continues a repeating run of ``period``
    tokens (so every request keeps finding drafts)."""
    n = plan.num_participants
    starts = np.asarray(plan.token_starts, dtype=np.int64)[:n]
    generated = np.asarray(plan.generated_ends, dtype=np.int64)[:n]
    accepted = None
    if plan.kind == GraphKind.SPECULATIVE:
        offsets = np.asarray(plan.token_offsets, dtype=np.int64)
        accepted = [tuple(int(t) for t in plan.token_ids[offsets[i] + 1:offsets[i + 1]]) for i in range(n)]
        kept = np.asarray([len(a) for a in accepted], dtype=np.int64)
        consumed, generated = starts + 1 + kept, generated + kept
    else:
        consumed = starts + np.asarray(plan.num_tokens, dtype=np.int64)[:n]
    tokens = np.where(np.asarray(plan.sample)[:n] > 0, consumed % period, -1)
    return CompletionRecords(handles=np.asarray(plan.handles, dtype=np.int64), consumed_tokens=consumed,
                             generated_tokens=generated, token_ids=tokens, accepted_drafts=accepted)


def bench_speculative_step(num_live: int, num_steps: int, period: int = 32) -> dict:
    """(a) for speculative steps: prompts that repeat a run of ``period`` tokens, 4 drafts a request at most,
    every draft kept: each step's plan looks up every request's drafts."""
    cfg = SchedulerConfig(
        model_identity=MODEL, max_live_requests=64, num_pages=32768, num_snapshots=256,
        page_tokens=16, context_capacity=8192, prefill_chunk_size=512, speculative_tokens=4,
    )
    s = RequestScheduler(cfg, PolicyConfig())
    for _ in range(num_live):
        s.admit([t % period for t in range(256)], 6000, 0, speculate=True)
    now, fence, samples = 0, 0, []
    while len(samples) < num_steps:
        plan, now, fence, us = timed_step(s, now, fence, lambda p: spec_records(p, period))
        if plan.kind == GraphKind.SPECULATIVE and plan.num_participants == num_live:
            samples.append(us)
    return {"median_us": percentile(samples, 50), "p99_us": percentile(samples, 99)}


# ---------------------------------------------------------------- (b)


def python_loop_keys(identity: bytes, tokens: list[int]) -> bytes:
    """Straightforward Python: pack each 64-token block, hash it with the parent."""
    parent = hashlib.blake2b(identity + b"flared.prefix.root", digest_size=16).digest()
    for start in range(0, len(tokens) - len(tokens) % 64, 64):
        block = struct.pack("<64i", *tokens[start : start + 64])
        parent = hashlib.blake2b(identity + parent + b"B" + block, digest_size=16).digest()
    return parent


def bench_hashing(num_tokens: int, repeats: int) -> dict:
    tokens = np.random.default_rng(0).integers(0, 150000, num_tokens, dtype=np.int32)
    as_list = tokens.tolist()
    ours, base = [], []
    for _ in range(repeats):
        t0 = time.perf_counter()
        h = PrefixHistory(MODEL, tokens)
        key = h.key_at(num_tokens - num_tokens % 64)
        ours.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        ref = python_loop_keys(MODEL, as_list)
        base.append(time.perf_counter() - t0)
        assert key == ref, "PrefixHistory and the Python loop disagree"
    return {
        "hash_tokens_per_s": num_tokens / min(ours),
        "hash_baseline_tokens_per_s": num_tokens / min(base),
    }


# ---------------------------------------------------------------- (c)


class Conversation:
    """A chat drawn entirely up front (turn count, user message lengths,
    output limits, think times), so every policy serves the same work."""

    def __init__(self, system: np.ndarray, rng):
        self.prompt = system.copy()
        self.boundaries = [len(system)]
        self.turns = 0
        num_turns = int(rng.integers(1, 5))
        self.user_messages = [rng.integers(0, 32000, int(rng.integers(30, 400)), dtype=np.int32) for _ in range(num_turns)]
        self.max_outputs = [int(rng.choice([16, 64, 128, 256, 512], p=[0.2, 0.3, 0.25, 0.15, 0.1])) for _ in range(num_turns)]
        self.think_ns = [int(rng.exponential(3.0) * 1e9) for _ in range(num_turns)]


def simulate(selection: Selection, seconds: float, rate_per_s: float, seed: int = 1) -> dict:
    """Discrete-event run of one policy on a seeded workload."""
    rng = np.random.default_rng(seed)  # the workload: identical for every policy
    token_rng = np.random.default_rng(seed + 1)  # sampled token ids
    cfg = SchedulerConfig(
        model_identity=MODEL, max_live_requests=32, num_pages=6144, num_snapshots=512,
        page_tokens=16, context_capacity=8192, prefill_chunk_size=512, selection=selection,
    )
    s = RequestScheduler(cfg, PolicyConfig())
    systems = [rng.integers(0, 32000, n, dtype=np.int32) for n in (300, 600, 900, 1200)]
    # Arrival events: (time_ns, conversation or None for a new one).
    events = []
    t = 0.0
    while t < seconds:
        t += rng.exponential(1.0 / rate_per_s)
        events.append((int(t * 1e9), None))
    conversations = [Conversation(systems[int(rng.integers(0, len(systems)))], rng) for _ in events]
    new_index = 0
    pending = []  # (arrival_ns, conversation, prompt, boundaries, max_out)
    live = {}  # handle -> dict
    ttft, gaps, admission_wait = [], [], []
    out_tokens = prompt_tokens = 0
    now, fence = 0, 0
    events.sort(key=lambda e: e[0])
    next_event = 0

    def make_turn(conv, arrival_ns):
        prompt = np.concatenate([conv.prompt, conv.user_messages[conv.turns]])
        pending.append((arrival_ns, conv, prompt, list(conv.boundaries), conv.max_outputs[conv.turns]))

    while next_event < len(events) or live or pending:
        while next_event < len(events) and events[next_event][0] <= now:
            at, conv = events[next_event]
            next_event += 1
            if conv is None:
                conv = conversations[new_index]
                new_index += 1
            make_turn(conv, at)
        while pending:
            arrival_ns, conv, prompt, bounds, max_out = pending[0]
            try:
                h = s.admit(prompt, max_out, now, message_boundaries=bounds)
            except AdmissionError:
                break
            pending.pop(0)
            live[h] = {"arrival": arrival_ns, "conv": conv, "prompt": prompt, "out": [], "last": None}
            admission_wait.append((now - arrival_ns) / 1e6)
            prompt_tokens += len(prompt)
        plan = s.plan(now)
        if plan is None:
            # Idle: jump to the next arrival.
            if next_event < len(events):
                now = max(now, events[next_event][0])
                continue
            if not live and not pending:
                break
            raise RuntimeError("scheduler idle with live requests")
        fence += 1
        s.commit(plan, fence)
        d = gpu_cost_ns(plan)
        now += d
        result = s.complete(fence, records_for(plan, token_rng), d, now)
        for h, tok in result.emitted:
            info = live[h]
            if info["last"] is None:
                ttft.append((now - info["arrival"]) / 1e6)
            else:
                gaps.append((now - info["last"]) / 1e6)
            info["last"] = now
            info["out"].append(tok)
            out_tokens += 1
        for h in result.retired:
            info = live.pop(h)
            conv = info["conv"]
            conv.turns += 1
            # Follow-up turn: the whole transcript so far, after think time.
            conv.boundaries = conv.boundaries + [len(info["prompt"]), len(info["prompt"]) + len(info["out"])]
            conv.prompt = np.concatenate([info["prompt"], np.asarray(info["out"], np.int32)])
            if conv.turns < len(conv.user_messages):
                events.append((now + conv.think_ns[conv.turns], conv))
                events[next_event:] = sorted(events[next_event:], key=lambda e: e[0])
    c = s.counters
    return {
        "requests": c["admitted"],
        "ttft_p50_ms": percentile(ttft, 50),
        "ttft_p99_ms": percentile(ttft, 99),
        "admission_wait_p50_ms": percentile(admission_wait, 50),
        "itl_p99_ms": percentile(gaps, 99),
        "output_tokens": out_tokens,
        "throughput_tok_s": out_tokens / (now / 1e9),
        "prefix_reuse": c["prefix_reused_tokens"] / max(prompt_tokens, 1),
        "sim_seconds": now / 1e9,
    }


# ---------------------------------------------------------------- main


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", action="store_true", help="print one JSON object as the last line")
    ap.add_argument("--quick", action="store_true", help="fewer steps and a shorter simulation")
    ap.add_argument(
        "--rates", type=lambda v: [float(x) for x in v.split(",")], default=[3.0, 6.0],
        help="conversation arrival rates per second for (c), comma-separated (default 3,6)",
    )
    args = ap.parse_args()
    steps = 300 if args.quick else 2000
    out: dict = {"decode_step_us_median": {}, "decode_step_us_p99": {}}

    print("(a) host time per decode step: plan + commit + complete")
    print(f"{'live':>6} {'median us':>10} {'p99 us':>10} {'target us':>10} {'median/target':>14}")
    for n in (1, 16, 64):
        r = bench_decode_step(n, steps)
        out["decode_step_us_median"][n] = round(r["median_us"], 1)
        out["decode_step_us_p99"][n] = round(r["p99_us"], 1)
        print(f"{n:>6} {r['median_us']:>10.1f} {r['p99_us']:>10.1f} {100:>10} {r['median_us'] / 100:>14.2f}")

    print("\n(a) the same for a speculative step (4 drafts a request looked up, every draft kept)")
    print(f"{'live':>6} {'median us':>10} {'p99 us':>10}")
    out["speculative_step_us_median"], out["speculative_step_us_p99"] = {}, {}
    for n in (1, 16, 32):  # (64 requests fill a step's 64 tokens: no room for drafts)
        r = bench_speculative_step(n, steps // 4)
        out["speculative_step_us_median"][n] = round(r["median_us"], 1)
        out["speculative_step_us_p99"][n] = round(r["p99_us"], 1)
        print(f"{n:>6} {r['median_us']:>10.1f} {r['p99_us']:>10.1f}")

    print("\n(b) prefix hashing, 100k-token prompt (keys checked equal)")
    h = bench_hashing(100_000, 3 if args.quick else 7)
    out.update({k: round(v) for k, v in h.items()})
    ratio = h["hash_tokens_per_s"] / h["hash_baseline_tokens_per_s"]
    out["hash_speedup"] = round(ratio, 1)
    print(f"{'PrefixHistory':>24} {h['hash_tokens_per_s'] / 1e6:>8.1f} M tokens/s")
    print(f"{'Python blake2b loop':>24} {h['hash_baseline_tokens_per_s'] / 1e6:>8.1f} M tokens/s")
    print(f"{'speedup':>24} {ratio:>8.1f} x")

    seconds = 20.0 if args.quick else 60.0
    out["simulation"] = {}
    for rate in args.rates:
        print(
            f"\n(c) simulated serving: {seconds:.0f} s of Poisson arrivals at {rate:g} conversations/s, "
            "multi-turn, synthetic GPU costs"
        )
        print(f"{'policy':>20} {'reqs':>5} {'TTFT p50':>9} {'TTFT p99':>9} {'ITL p99':>8} {'tok/s':>7} {'reuse':>6}")
        sims = {}
        for name, sel in (("value/duration", Selection.VALUE_PER_DURATION), ("fcfs", Selection.FCFS)):
            r = simulate(sel, seconds, rate)
            sims[name] = r
            print(
                f"{name:>20} {r['requests']:>5} {r['ttft_p50_ms']:>7.0f}ms {r['ttft_p99_ms']:>7.0f}ms "
                f"{r['itl_p99_ms']:>6.1f}ms {r['throughput_tok_s']:>7.0f} {r['prefix_reuse']:>6.1%}"
            )
        ours, base = sims["value/duration"], sims["fcfs"]
        print(
            f"{'ours/fcfs':>20} {'':>5} {ours['ttft_p50_ms'] / base['ttft_p50_ms']:>9.2f} "
            f"{ours['ttft_p99_ms'] / base['ttft_p99_ms']:>9.2f} {ours['itl_p99_ms'] / base['itl_p99_ms']:>8.2f} "
            f"{ours['throughput_tok_s'] / base['throughput_tok_s']:>7.2f}"
        )
        out["simulation"][f"{rate:g}/s"] = {k: {kk: round(vv, 3) for kk, vv in v.items()} for k, v in sims.items()}
    if args.json:
        print(json.dumps(out))


if __name__ == "__main__":
    main()
