#!/usr/bin/env python3
"""Streaming output-parser cost: what splitting reasoning and tool calls adds to a stream.

Every generated token of a streamed choice already goes through the
incremental detokenizer (ids -> text, stop strings). A chat route whose
template has a tool-call or reasoning format also pushes that text through an
``OutputParser``. This measures, per token, the detokenizer alone (the
reference, measured in the same run) and the detokenizer followed by the
parser, and reports the parser's overhead as a ratio, for:

- ``plain``: a 2000-token answer with a reasoning parser active but no markers,
- ``reasoning``: a ``<think>`` block then an answer,
- ``hermes``: a Hermes/Qwen ``<tool_call>`` whose arguments are ~8 KB of code,
- ``qwen3_coder``: the same call in Qwen3-Coder's XML form,
- ``llama3_json``: the same call as a Llama 3.x JSON call.

Tokens come from the embedded SmolLM2 tokenizer (the text is encoded once,
then replayed id by id). Best of ``--rounds`` rounds, alternating reference and
measured runs so load bursts on a shared machine hit both.

Usage: tools/bench_toolparse.py [--rounds N] [--json]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from flared.frontend.reasoning import THINK  # noqa: E402
from flared.frontend.toolcalls import PARSERS, OutputParser  # noqa: E402

CODE = "".join(f"def f{i}(x):\n    return {{'k': [x, {i}], \"s\": \"a\\\\b\"}}\n" for i in range(160))
ARGS = json.dumps({"path": "src/module.py", "content": CODE})
ANSWER = " ".join(["The quick brown fox jumps over the lazy dog."] * 220)

SCENARIOS = {
    "plain": (None, ANSWER),
    "reasoning": (None, "<think>\n" + ANSWER[:4000] + "\n</think>\n\n" + ANSWER[:4000]),
    "hermes": ("hermes", 'I will write it.\n<tool_call>\n{"name": "write_file", "arguments": ' + ARGS
               + "}\n</tool_call>"),
    "qwen3_coder": ("qwen3_coder", "I will write it.\n<tool_call>\n<function=write_file>\n<parameter=path>\n"
                    "src/module.py\n</parameter>\n<parameter=content>\n" + CODE
                    + "\n</parameter>\n</function>\n</tool_call>"),
    "llama3_json": ("llama3_json", '{"name": "write_file", "parameters": ' + ARGS + "}"),
}


def load_frontend():
    from flared.core.default import default_gguf_path
    from flared.frontend import Frontend

    return Frontend.from_gguf(default_gguf_path())


def run(frontend, ids, family, with_parser: bool) -> tuple[float, str]:
    detok = frontend.detokenizer()
    parser = OutputParser(PARSERS[family]() if family else None, THINK) if with_parser else None
    out = []
    t0 = time.perf_counter_ns()
    for token in ids:
        text = detok.push(token).text
        if parser is not None:
            d = parser.push(text)
            out.append(d.content)
        else:
            out.append(text)
    tail = detok.finish().text
    if parser is not None:
        out.append(parser.push(tail).content)
        out.append(parser.finish().content)
    elapsed_ns = time.perf_counter_ns() - t0
    return elapsed_ns / max(len(ids), 1), "".join(out)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    frontend = load_frontend()
    rows = []
    for name, (family, text) in SCENARIOS.items():
        ids = frontend.encode(text)
        ref_ns, meas_ns = [], []
        for _ in range(args.rounds):
            ref_ns.append(run(frontend, ids, family, False)[0])
            meas_ns.append(run(frontend, ids, family, True)[0])
        ref, meas = min(ref_ns), min(meas_ns)
        rows.append({"scenario": name, "tokens": len(ids), "detok_ns_per_token": round(ref),
                     "detok_parse_ns_per_token": round(meas), "parser_ns_per_token": round(meas - ref),
                     "ratio": round(meas / ref, 3)})
    print(f"{'scenario':<12} {'tokens':>7} {'detok ns/tok':>13} {'+parser ns/tok':>15} {'parser ns/tok':>14} "
          f"{'ratio':>6}")
    for r in rows:
        print(f"{r['scenario']:<12} {r['tokens']:>7} {r['detok_ns_per_token']:>13} "
              f"{r['detok_parse_ns_per_token']:>15} {r['parser_ns_per_token']:>14} {r['ratio']:>6.2f}")
    if args.json:
        print(json.dumps({"benchmark": "toolparse", "rounds": args.rounds, "rows": rows}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
