"""A load generator for any OpenAI-compatible server (`flarectl bench`, tools/bench_serving.py).

It talks HTTP/1.1 + SSE over raw asyncio streams, so it measures the server
and not a client library, and imports nothing from the daemon.
"""

from flared.bench.run import BenchConfig, BenchResult, run_bench
from flared.bench.workload import Turn, WorkloadSpec, build_sessions

__all__ = ["BenchConfig", "BenchResult", "Turn", "WorkloadSpec", "build_sessions", "run_bench"]
