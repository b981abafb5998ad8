"""Drive sessions against a server at a fixed concurrency or a Poisson arrival rate; summarise.

Rules:
- Bounded twice: at most `max_requests` turns are sent, and none starts after
  `duration_s`; a request still running gets `request_timeout_s` at most.
- Fixed concurrency: `concurrency` workers each take the next session and
  send its turns back to back. Poisson: sessions start at exponential gaps of
  mean 1/rate (seeded), each runs its turns back to back.
- Multi-turn sessions resend the conversation with the server's own answers,
  so later turns share everything before them as a prefix.
- Throughput is over the wall time from the first send to the last finish.
"""

from __future__ import annotations

import asyncio
import random
import sys
import time
from collections import Counter
from dataclasses import asdict, dataclass, field
from urllib.parse import urlsplit

from flared.bench.client import Outcome, stream_chat
from flared.bench.workload import Turn


@dataclass(frozen=True)
class BenchConfig:
    base_url: str  # e.g. http://127.0.0.1:8000
    model: str
    concurrency: int | None = 1  # fixed-concurrency mode when request_rate is None
    request_rate: float | None = None  # requests (sessions) per second, Poisson
    max_requests: int = 100
    duration_s: float = 300.0
    request_timeout_s: float = 600.0
    api_key: str | None = None
    ignore_eos: bool = True  # make output lengths the workload's (flared, vLLM, llama.cpp read it)
    banned_token_ids: tuple[int, ...] = ()  # logit_bias -100, for servers without ignore_eos
    temperature: float = 0.0
    seed: int = 0
    progress: bool = True

    def __post_init__(self):
        if self.request_rate is None and (self.concurrency or 0) < 1:
            raise ValueError("concurrency must be >= 1 (or give a request rate)")
        if self.request_rate is not None and self.request_rate <= 0:
            raise ValueError("request rate must be > 0")
        if self.max_requests < 1 or self.duration_s <= 0:
            raise ValueError("max_requests and duration_s must be positive")


@dataclass
class TurnRecord:
    session: int
    turn: int
    outcome: Outcome


def _percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    s = sorted(values)
    pos = (len(s) - 1) * q
    lo = int(pos)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (pos - lo)


def _dist(values: list[float]) -> dict:
    return {"mean": (sum(values) / len(values)) if values else None,
            **{f"p{int(q * 100)}": _percentile(values, q) for q in (0.5, 0.9, 0.99)}}


@dataclass
class BenchResult:
    config: dict
    num_sent: int
    num_ok: int
    errors: dict[str, int]
    duration_s: float
    request_throughput_rps: float
    output_throughput_tps: float
    input_tokens_total: int
    output_tokens_total: int
    cached_tokens_total: int | None
    ttft_ms: dict
    ttft_first_turn_ms: dict
    ttft_later_turns_ms: dict
    itl_ms: dict
    tpot_ms: dict
    e2e_ms: dict
    records: list[TurnRecord] = field(default_factory=list, repr=False)

    def to_json(self) -> dict:
        d = asdict(self)
        d.pop("records")
        return d

    def table(self) -> str:
        def ms(dist: dict) -> str:
            if dist["p50"] is None:
                return "-"
            return f"{dist['p50']:.1f} / {dist['p90']:.1f} / {dist['p99']:.1f}"

        mode = (f"rate {self.config['request_rate']}/s" if self.config["request_rate"]
                else f"concurrency {self.config['concurrency']}")
        rows = [
            ("mode", mode),
            ("requests ok / sent", f"{self.num_ok} / {self.num_sent}"),
            ("errors", ", ".join(f"{k}: {v}" for k, v in sorted(self.errors.items())) or "none"),
            ("duration", f"{self.duration_s:.2f} s"),
            ("request throughput", f"{self.request_throughput_rps:.3f} req/s"),
            ("output throughput", f"{self.output_throughput_tps:.1f} tok/s"),
            ("input / output tokens", f"{self.input_tokens_total} / {self.output_tokens_total}"),
            ("cached prompt tokens", "-" if self.cached_tokens_total is None else str(self.cached_tokens_total)),
            ("TTFT p50/p90/p99 ms", ms(self.ttft_ms)),
            ("  first turns", ms(self.ttft_first_turn_ms)),
            ("  later turns", ms(self.ttft_later_turns_ms)),
            ("inter-token p50/p90/p99 ms", ms(self.itl_ms)),
            ("per-token (TPOT) p50/p90/p99 ms", ms(self.tpot_ms)),
            ("end-to-end p50/p90/p99 ms", ms(self.e2e_ms)),
        ]
        width = max(len(k) for k, _ in rows)
        return "\n".join(f"{k:<{width}}  {v}" for k, v in rows)


def summarise(config: BenchConfig, records: list[TurnRecord], wall_ns: int) -> BenchResult:
    ok = [r for r in records if r.outcome.error is None]
    errors = Counter(r.outcome.error for r in records if r.outcome.error is not None)
    ttft, first, later, itl, tpot, e2e = [], [], [], [], [], []
    for r in ok:
        o = r.outcome
        e2e.append((o.end_ns - o.start_ns) / 1e6)
        if o.first_token_ns:
            t = (o.first_token_ns - o.start_ns) / 1e6
            ttft.append(t)
            (first if r.turn == 0 else later).append(t)
        itl.extend((b - a) / 1e6 for a, b in zip(o.token_times_ns, o.token_times_ns[1:]))
        if o.num_output_tokens > 1 and o.first_token_ns:
            tpot.append((o.end_ns - o.first_token_ns) / 1e6 / (o.num_output_tokens - 1))
    cached = [r.outcome.cached_tokens for r in ok if r.outcome.cached_tokens is not None]
    wall_s = max(wall_ns / 1e9, 1e-9)
    out_tokens = sum(r.outcome.num_output_tokens for r in ok)
    return BenchResult(
        config={k: v for k, v in asdict(config).items() if k != "api_key"},
        num_sent=len(records), num_ok=len(ok), errors=dict(errors), duration_s=wall_s,
        request_throughput_rps=len(ok) / wall_s, output_throughput_tps=out_tokens / wall_s,
        input_tokens_total=sum(r.outcome.prompt_tokens or 0 for r in ok), output_tokens_total=out_tokens,
        cached_tokens_total=sum(cached) if cached else None,
        ttft_ms=_dist(ttft), ttft_first_turn_ms=_dist(first), ttft_later_turns_ms=_dist(later),
        itl_ms=_dist(itl), tpot_ms=_dist(tpot), e2e_ms=_dist(e2e), records=records)


class _Progress:
    def __init__(self, total: int, enabled: bool):
        self.total, self.done, self.enabled = total, 0, enabled
        self.errors = 0

    def step(self, ok: bool) -> None:
        self.done += 1
        self.errors += not ok
        if self.enabled:
            filled = int(30 * self.done / self.total)
            sys.stderr.write(f"\r[{'#' * filled}{'.' * (30 - filled)}] {self.done}/{self.total}"
                             f" errors {self.errors}")
            sys.stderr.flush()

    def close(self) -> None:
        if self.enabled:
            sys.stderr.write("\n")


async def run_bench_async(config: BenchConfig, sessions: list[list[Turn]]) -> BenchResult:
    url = urlsplit(config.base_url)
    host, port = url.hostname or "127.0.0.1", url.port or 80
    path = (url.path.rstrip("/") or "") + "/v1/chat/completions"
    budget = min(config.max_requests, sum(len(s) for s in sessions))
    progress = _Progress(budget, config.progress)
    records: list[TurnRecord] = []
    state = {"sent": 0}
    start_ns = time.perf_counter_ns()
    stop_at_ns = start_ns + int(config.duration_s * 1e9)

    def may_send() -> bool:
        return state["sent"] < budget and time.perf_counter_ns() < stop_at_ns

    async def run_session(index: int, turns: list[Turn]) -> None:
        messages: list[dict] = []
        for t, turn in enumerate(turns):
            if not may_send():
                return
            state["sent"] += 1
            messages.append({"role": "user", "content": turn.user_text})
            body = {"model": config.model, "messages": messages, "max_tokens": turn.max_tokens,
                    "temperature": config.temperature, "seed": config.seed, "stream": True,
                    "stream_options": {"include_usage": True}}
            if config.ignore_eos:
                body["ignore_eos"] = True
            if config.banned_token_ids:
                body["logit_bias"] = {str(i): -100 for i in config.banned_token_ids}
            outcome = await stream_chat(host, port, path, body, api_key=config.api_key,
                                        timeout_s=config.request_timeout_s)
            records.append(TurnRecord(index, t, outcome))
            progress.step(outcome.error is None)
            if outcome.error is not None:
                return  # a conversation cannot go on without its answer
            messages.append({"role": "assistant", "content": outcome.text})

    if config.request_rate is None:
        queue = list(enumerate(sessions))
        queue.reverse()

        async def worker() -> None:
            while queue and may_send():
                await run_session(*queue.pop())

        await asyncio.gather(*(worker() for _ in range(min(config.concurrency, len(sessions)))))
    else:
        rng = random.Random(config.seed)
        tasks = []
        for index, turns in enumerate(sessions):
            if not may_send():
                break
            tasks.append(asyncio.create_task(run_session(index, turns)))
            await asyncio.sleep(rng.expovariate(config.request_rate))
        await asyncio.gather(*tasks)
    wall_ns = time.perf_counter_ns() - start_ns
    progress.close()
    return summarise(config, records, wall_ns)


def run_bench(config: BenchConfig, sessions: list[list[Turn]]) -> BenchResult:
    return asyncio.run(run_bench_async(config, sessions))
