"""The load generator (`flarectl bench`) against a real daemon: counts, latencies and cached tokens add up."""

from __future__ import annotations

import json
import subprocess
import sys

from flared.bench.run import BenchConfig, run_bench
from flared.bench.workload import WorkloadKind, WorkloadSpec, build_sessions


def test_fixed_workload_at_fixed_concurrency(tiny_core, in_process):
    srv = in_process(tiny_core)
    spec = WorkloadSpec(kind=WorkloadKind.FIXED, num_sessions=6, input_tokens=20, output_tokens=5)
    result = run_bench(BenchConfig(base_url=f"http://127.0.0.1:{srv.port}", model=srv.model, concurrency=3,
                                   max_requests=6, progress=False), build_sessions(spec))
    assert result.num_ok == result.num_sent == 6 and result.errors == {}
    assert result.output_tokens_total == 30  # ignore_eos makes every output the workload's length
    assert result.ttft_ms["p50"] <= result.e2e_ms["p50"]
    assert result.output_throughput_tps > 0
    srv.assert_no_leaks()


def test_multi_turn_reports_cached_tokens_and_poisson_mode_is_bounded(tiny_core, in_process):
    srv = in_process(tiny_core)
    spec = WorkloadSpec(kind=WorkloadKind.MULTI_TURN, num_sessions=2, input_tokens=10, output_tokens=4, turns=3,
                        turn_input_tokens=3)  # the tiny core has 256 tokens of context
    result = run_bench(BenchConfig(base_url=f"http://127.0.0.1:{srv.port}", model=srv.model, concurrency=None,
                                   request_rate=50.0, max_requests=5, progress=False), build_sessions(spec))
    assert result.errors == {} and result.num_sent == 5, (result.errors, result.num_sent)  # the bound cuts turn six
    assert result.cached_tokens_total and result.cached_tokens_total > 0  # later turns reuse earlier ones
    assert result.ttft_later_turns_ms["p50"] is not None


def test_cli_prints_a_table_and_a_json_last_line(tiny_core, in_process):
    srv = in_process(tiny_core)
    out = subprocess.run([sys.executable, "-m", "flared.cli.ctl", "bench", "--url", f"http://127.0.0.1:{srv.port}",
                          "--model", srv.model, "--workload", "sharegpt", "--length-scale", "0.05",
                          "--num-requests", "3", "--concurrency", "2", "--json"],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "output throughput" in out.stdout
    doc = json.loads(out.stdout.strip().splitlines()[-1])
    assert doc["num_ok"] == 3 and doc["workload"] == "sharegpt"
