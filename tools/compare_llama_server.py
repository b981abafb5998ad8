#!/usr/bin/env python3
"""flared against llama.cpp's `llama-server`, side by side in one run, on the same GGUF.

Both servers serve the embedded SmolLM2-135M (`default_gguf_path()`): flared
through its default core (`flared run --threads N`), llama-server from the
same file with N threads and 32 slots. The load generator is flared.bench
(raw HTTP + SSE, the same requests to both, `ignore_eos` so output lengths
are the workload's).

Configurations: fixed ~508-token prompts at concurrency 1, 8 and 32, and a
multi-turn workload (conversations whose later turns resend the earlier
ones). The machine is shared and noisy, so every configuration runs
alternately (flared, llama, flared, llama, ... for --rounds rounds) and the
table holds medians with the ratio flared / llama-server; the load average at
each run is recorded.

llama-server is built once from the vendored llama.cpp source of PyPI's
`llama-cpp-python` sdist into --llama-dir (nothing of it is committed):

    .venv/bin/python tools/compare_llama_server.py --llama-dir /tmp/llama-build [--rounds 2] [--json]

``--ab-env FLARED_X=0`` adds a second flared started with that environment, in the same alternation: an
A/B of one flared setting, with llama-server as the fixed reference.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import glob
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO_ROOT))

from flared.bench.run import BenchConfig, run_bench_async  # noqa: E402
from flared.bench.workload import WorkloadKind, WorkloadSpec, build_sessions  # noqa: E402

MODEL = "smollm2-135m-instruct"


# -- llama-server: fetch and build ----------------------------------------------------------

def ensure_llama_server(llama_dir: Path) -> Path:
    found = glob.glob(str(llama_dir / "llama_cpp_python-*/vendor/llama.cpp/build/bin/llama-server"))
    if found:
        return Path(found[0])
    llama_dir.mkdir(parents=True, exist_ok=True)
    if not glob.glob(str(llama_dir / "llama_cpp_python-*.tar.gz")):
        subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:",
                        "-d", str(llama_dir), "llama-cpp-python"], check=True)
    sdist = sorted(glob.glob(str(llama_dir / "llama_cpp_python-*.tar.gz")))[-1]
    subprocess.run(["tar", "xzf", sdist, "-C", str(llama_dir)], check=True)
    src = Path(sdist[: -len(".tar.gz")]) / "vendor" / "llama.cpp"
    print(f"building llama-server in {src} (minutes)", file=sys.stderr)
    subprocess.run(["cmake", "-S", str(src), "-B", str(src / "build"), "-DCMAKE_BUILD_TYPE=Release",
                    "-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_EXAMPLES=OFF", "-DLLAMA_CURL=OFF",
                    "-DLLAMA_OPENSSL=OFF", "-DGGML_NATIVE=ON", "-DBUILD_SHARED_LIBS=OFF"],
                   check=True, stdout=sys.stderr)
    # (llama-quantize too: tools/bench_quant.py --gguf-mix --llama-dir makes llama.cpp's own Q4_K_M with it)
    subprocess.run(["cmake", "--build", str(src / "build"), "--target", "llama-server", "llama-quantize", "-j",
                    str(os.cpu_count())], check=True, stdout=sys.stderr)
    return src / "build" / "bin" / "llama-server"


def llama_version(binary: Path) -> str:
    out = subprocess.run([str(binary), "--version"], capture_output=True, text=True, timeout=30)
    text = (out.stdout + out.stderr).strip().splitlines()
    return next((line for line in text if line.startswith("version")), text[0] if text else "?")


# -- servers ----------------------------------------------------------------------------------

def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_healthy(url: str, proc: subprocess.Popen, timeout_s: float = 300.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode}")
        try:
            with urllib.request.urlopen(url + "/health", timeout=5) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.2)  # polling a server that is loading its model
    raise RuntimeError(f"{url} did not become healthy")


def start_flared(core: Path, threads: int, log: Path, env: dict | None = None) -> tuple[subprocess.Popen, str]:
    port_file = Path(tempfile.mkdtemp()) / "port"
    proc = subprocess.Popen([str(REPO_ROOT / ".venv/bin/flared"), "run", str(core), "--port", "0",
                             "--port-file", str(port_file),
                             "--threads", str(threads), "--no-admin-socket", "--no-dashboard"],
                            stdout=open(log, "wb"), stderr=subprocess.STDOUT, env={**os.environ, **(env or {})})
    deadline = time.monotonic() + 300
    while not (port_file.exists() and port_file.read_text().endswith("\n")):
        if proc.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError(f"flared did not start; see {log}")
        time.sleep(0.1)  # polling the port file the daemon writes once listening
    url = f"http://127.0.0.1:{int(port_file.read_text())}"
    wait_healthy(url, proc)
    return proc, url


def start_llama(binary: Path, gguf: str, threads: int, slots: int, ctx_per_slot: int,
                log: Path) -> tuple[subprocess.Popen, str]:
    port = free_port()
    proc = subprocess.Popen([str(binary), "-m", gguf, "--host", "127.0.0.1", "--port", str(port),
                             "-t", str(threads), "-tb", str(threads), "-np", str(slots),
                             "-c", str(slots * ctx_per_slot), "--jinja", "-a", MODEL],
                            stdout=open(log, "wb"), stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    wait_healthy(url, proc)
    return proc, url


# -- configurations -----------------------------------------------------------------------------

def configurations(args) -> list[tuple[str, WorkloadSpec, int, int]]:
    """(name, workload, concurrency, turns to send)."""
    fixed = dict(kind=WorkloadKind.FIXED, input_tokens=args.input_tokens, output_tokens=args.output_tokens)
    out = []
    for c, n in ((1, args.requests_c1), (8, args.requests_c8), (32, args.requests_c32)):
        out.append((f"fixed c{c}", WorkloadSpec(num_sessions=n, seed=c, **fixed), c, n))
    mt = WorkloadSpec(kind=WorkloadKind.MULTI_TURN, num_sessions=args.conversations, seed=99,
                      input_tokens=args.input_tokens, output_tokens=args.turn_output_tokens, turns=args.turns,
                      turn_input_tokens=args.turn_input_tokens)
    out.append((f"multi-turn c{args.conversations}", mt, args.conversations, args.conversations * args.turns))
    return out


def measure(url: str, spec: WorkloadSpec, concurrency: int, num: int, tokenizer) -> dict:
    config = BenchConfig(base_url=url, model=MODEL, concurrency=concurrency, max_requests=num,
                         duration_s=900, request_timeout_s=900, progress=False)
    result = asyncio.run(run_bench_async(config, build_sessions(spec, tokenizer)))
    j = result.to_json()
    return {"load_avg_1m": os.getloadavg()[0], "ok": j["num_ok"], "sent": j["num_sent"], "errors": j["errors"],
            "output_tps": j["output_throughput_tps"], "ttft_p50_ms": j["ttft_ms"]["p50"],
            "ttft_first_p50_ms": j["ttft_first_turn_ms"]["p50"], "ttft_later_p50_ms": j["ttft_later_turns_ms"]["p50"],
            "itl_p50_ms": j["itl_ms"]["p50"], "e2e_p50_ms": j["e2e_ms"]["p50"],
            "prompt_tokens_mean": j["input_tokens_total"] / max(1, j["num_ok"]),
            "cached_tokens": j["cached_tokens_total"]}


def median_of(runs: list[dict], key: str):
    values = [r[key] for r in runs if r[key] is not None]
    return statistics.median(values) if values else None


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--llama-dir", type=Path, default=Path("/tmp/llama-build"))
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--slots", type=int, default=32)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--input-tokens", type=int, default=480, help="user text; the template brings it to ~508")
    p.add_argument("--output-tokens", type=int, default=128)
    p.add_argument("--requests-c1", type=int, default=3)
    p.add_argument("--requests-c8", type=int, default=16)
    p.add_argument("--requests-c32", type=int, default=32)
    p.add_argument("--conversations", type=int, default=8)
    p.add_argument("--turns", type=int, default=4)
    p.add_argument("--turn-input-tokens", type=int, default=64)
    p.add_argument("--turn-output-tokens", type=int, default=64)
    p.add_argument("--only", default=None, help="comma-separated configuration names to run")
    p.add_argument("--dtype", choices=("float32", "bfloat16"), default="bfloat16",
                   help="flared's core dtype (both sides load the same GGUF; llama-server computes on Q4_1)")
    p.add_argument("--ab-env", default=None, metavar="KEY=VALUE[,KEY=VALUE]",
                   help="also run a second flared with these environment variables, alternating with the others "
                        "(an A/B of a flared setting beside llama-server, same run)")
    p.add_argument("--json", action="store_true")
    args = p.parse_args()
    ab_env = dict(kv.split("=", 1) for kv in args.ab_env.split(",")) if args.ab_env else None

    from tokenizers import Tokenizer

    from flared.core.default import default_gguf_path, ensure_default_core

    core = ensure_default_core(Path(os.path.expanduser("~/.cache/flared/cores")), args.dtype)
    tokenizer = Tokenizer.from_file(str(core / "tokenizer.json"))
    gguf = str(default_gguf_path())
    binary = ensure_llama_server(args.llama_dir)
    logs = Path(tempfile.mkdtemp(prefix="compare-llama-"))
    ctx_per_slot = args.input_tokens + 64 + args.turns * (args.turn_input_tokens + args.turn_output_tokens + 16) \
        + args.output_tokens
    servers, procs = [], []
    ab_name = "flared " + ",".join(f"{k}={v}" for k, v in ab_env.items()) if ab_env else None
    try:
        for name, start in (("flared", lambda: start_flared(core, args.threads, logs / "flared.log")),
                            (ab_name, lambda: start_flared(core, args.threads, logs / "flared-ab.log", ab_env)),
                            ("llama-server", lambda: start_llama(binary, gguf, args.threads, args.slots, ctx_per_slot,
                                                                 logs / "llama.log"))):
            if name is None:
                continue
            proc, url = start()
            procs.append(proc)
            servers.append((name, url))
    except BaseException:
        for proc in procs:  # a server that failed to start must not leave the others running
            proc.kill()
        raise
    configs = configurations(args)
    if args.only:
        wanted = set(args.only.split(","))
        configs = [c for c in configs if c[0] in wanted]
    runs: dict[tuple[str, str], list[dict]] = {}
    try:
        # Warm both (first-request allocations, page faults) outside the figures.
        warm = WorkloadSpec(kind=WorkloadKind.FIXED, num_sessions=2, input_tokens=32, output_tokens=8, seed=7)
        for _, url in servers:
            measure(url, warm, 2, 2, tokenizer)
        for rnd in range(args.rounds):
            for name, spec, conc, num in configs:
                # Fresh prompts every round: a repeat would be served from either server's prompt cache.
                spec = dataclasses.replace(spec, seed=spec.seed + 1000 * rnd)
                for server, url in servers:
                    r = measure(url, spec, conc, num, tokenizer)
                    runs.setdefault((name, server), []).append(r)
                    print(f"round {rnd + 1} {name:<16} {server:<24} {r['output_tps']:7.1f} tok/s  "
                          f"TTFT p50 {r['ttft_p50_ms'] or 0:8.1f} ms  ok {r['ok']}/{r['sent']}  "
                          f"load {r['load_avg_1m']:.2f}", file=sys.stderr)
    finally:
        for proc in procs:
            proc.terminate()
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                proc.kill()

    keys = ("output_tps", "ttft_p50_ms", "ttft_first_p50_ms", "ttft_later_p50_ms", "itl_p50_ms", "e2e_p50_ms",
            "prompt_tokens_mean", "load_avg_1m")
    summary = []
    for name, _, conc, _ in configs:
        row = {"config": name, "concurrency": conc}
        for server, _ in servers:
            rs = runs[(name, server)]
            row[server] = {k: median_of(rs, k) for k in keys}
            row[server]["errors"] = sum(sum(r["errors"].values()) for r in rs)
            row[server]["cached_tokens"] = median_of(rs, "cached_tokens")
        f, l_ = row["flared"], row["llama-server"]
        row["ratio_output_tps"] = f["output_tps"] / l_["output_tps"] if l_["output_tps"] else None
        row["ratio_ttft_p50"] = (f["ttft_p50_ms"] / l_["ttft_p50_ms"]) if l_["ttft_p50_ms"] else None
        if f["ttft_later_p50_ms"] and l_["ttft_later_p50_ms"]:
            row["ratio_ttft_later_p50"] = f["ttft_later_p50_ms"] / l_["ttft_later_p50_ms"]
        if ab_name:
            b = row[ab_name]
            row["ratio_output_tps_vs_ab"] = f["output_tps"] / b["output_tps"] if b["output_tps"] else None
        summary.append(row)

    print(f"flared ({args.dtype} core) vs llama-server ({llama_version(binary)}), {args.threads} threads, {args.slots} slots, "
          f"{args.rounds} alternating rounds, medians; load avg seen "
          f"{min(r['load_avg_1m'] for rs in runs.values() for r in rs):.2f}-"
          f"{max(r['load_avg_1m'] for rs in runs.values() for r in rs):.2f}")
    head = f"{'config':<16} {'prompt tok':>10} {'flared tok/s':>12} {'llama tok/s':>11} {'ratio':>6} " \
           f"{'flared TTFT':>11} {'llama TTFT':>10} {'ratio':>6} {'later-turn TTFT f/l':>20} {'errors f/l':>10}"
    print(head)
    print("-" * len(head))
    for row in summary:
        f, l_ = row["flared"], row["llama-server"]
        later = (f"{f['ttft_later_p50_ms']:.0f}/{l_['ttft_later_p50_ms']:.0f} ms"
                 if f["ttft_later_p50_ms"] and l_["ttft_later_p50_ms"] else "-")
        print(f"{row['config']:<16} {f['prompt_tokens_mean'] or 0:>10.0f} {f['output_tps']:>12.1f} "
              f"{l_['output_tps']:>11.1f} {row['ratio_output_tps'] or 0:>6.2f} {f['ttft_p50_ms'] or 0:>9.0f}ms "
              f"{l_['ttft_p50_ms'] or 0:>8.0f}ms {row['ratio_ttft_p50'] or 0:>6.2f} {later:>20} "
              f"{f['errors']:>4}/{l_['errors']}")
    if ab_name:
        print(f"\nA/B: flared as is vs {ab_name}")
        for row in summary:
            f, b = row["flared"], row[ab_name]
            print(f"{row['config']:<16} {f['output_tps']:>8.1f} vs {b['output_tps']:>8.1f} tok/s "
                  f"(x{row['ratio_output_tps_vs_ab'] or 0:.3f})  TTFT p50 {f['ttft_p50_ms'] or 0:.0f} vs "
                  f"{b['ttft_p50_ms'] or 0:.0f} ms  errors {f['errors']}/{b['errors']}")
    if args.json:
        print(json.dumps({"llama_server_version": llama_version(binary), "threads": args.threads,
                          "flared_dtype": args.dtype,
                          "slots": args.slots, "rounds": args.rounds, "ab_env": ab_env, "summary": summary,
                          "runs": {f"{k[0]}|{k[1]}": v for k, v in runs.items()}}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
