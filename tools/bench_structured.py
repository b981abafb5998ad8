"""Per-token cost of grammar-constrained decoding vs unconstrained, at batch 1.

Runs the embedded model (or --core) in a real ModelRuntime (the model thread,
scheduler, eager executor and sampler the daemon uses) and times the decode
phase of one request at a time: from its first token event to its finish,
divided by the tokens in between. Each round runs the unconstrained request
and every constrained variant back to back (alternating, so load bursts on a
shared box hit all of them); the table reports each variant's best and median
round and the ratio to unconstrained measured in the same run.

Schemas never let the document end inside the budget (minItems /
minLength), so every request decodes exactly --tokens tokens; the
unconstrained request has no stop tokens for the same reason.

End-to-end ratios on a loaded shared box swing by more than the effect, so
the script also times the grammar's own work per token in isolation: for
each variant's generated tokens, computing the mask, applying it to a
[1, vocab] logits row the way the sampler does, and advancing the matcher
(best of several passes), reported as a share of the unconstrained best
ms/token.

    python tools/bench_structured.py [--core DIR] [--tokens 64] [--rounds 5] [--threads 2] [--json]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time
from pathlib import Path

VARIANTS = {
    "records": {"type": "array", "minItems": 100, "items": {
        "type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                         "age": {"type": "integer", "minimum": 0, "maximum": 99},
                                         "role": {"enum": ["admin", "user", "guest"]}},
        "required": ["name", "age", "role"], "additionalProperties": False}},
    "long_string": {"type": "object", "properties": {"text": {"type": "string", "minLength": 2000}},
                    "required": ["text"], "additionalProperties": False},
}
PROMPT = ("<|im_start|>user\nList the people in the office as JSON records with name, age and role."
          "<|im_end|>\n<|im_start|>assistant\n")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--core", type=Path, default=None, help="core directory (default: the embedded SmolLM2)")
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--json", action="store_true", help="print one JSON object as the last line")
    args = ap.parse_args()

    from tokenizers import Tokenizer

    from flared.core.load import open_core
    from flared.model.grammar import GrammarCompiler
    from flared.model.sampling import SamplingParams
    from flared.runtime.request import EventSink, FinishEvent, GenerateRequest, TokenEvent
    from flared.runtime.worker import ModelRuntime

    if args.core is None:
        from flared.cli.ctl import default_cache_dir
        from flared.core.default import ensure_default_core

        args.core = ensure_default_core(default_cache_dir())
    core = open_core(args.core)
    tok_json = (args.core / core.manifest.tokenizer).read_text()
    compiler = GrammarCompiler(tok_json, vocab_size=core.config.vocab_size,
                               eos_token_ids=core.manifest.tokens.eos_token_ids)
    grammars = {name: compiler.json_schema(schema) for name, schema in VARIANTS.items()}
    prompt = tuple(Tokenizer.from_str(tok_json).encode(PROMPT).ids)
    # The prefix cache is off so each request runs the same prefill and decode work from scratch.
    runtime = ModelRuntime(core, prefix_cache=False, torch_threads=args.threads)
    runtime.start(max_pending=4)

    generated: dict[str, list[int]] = {}

    async def decode_ms_per_token(grammar, name: str = "") -> float:
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue = asyncio.Queue()
        req = GenerateRequest(prompt, (), SamplingParams(temperature=0.0, max_tokens=args.tokens), frozenset(),
                              grammar=grammar)
        runtime.submit(req, EventSink(loop, queue))
        first_ns = None
        count = 0
        tokens = generated.setdefault(name, [])
        tokens.clear()
        while True:
            _, event = await queue.get()
            if isinstance(event, TokenEvent):
                count += len(event.token_ids)
                tokens.extend(event.token_ids)
                if first_ns is None:
                    first_ns = time.perf_counter_ns()
            elif isinstance(event, FinishEvent):
                end_ns = time.perf_counter_ns()
                if count != args.tokens:
                    raise SystemExit(f"expected {args.tokens} tokens, got {count} ({event.reason})")
                return (end_ns - first_ns) / 1e6 / (count - 1)
            else:
                raise SystemExit(f"request failed: {event}")

    names = ["unconstrained", *VARIANTS]
    samples: dict[str, list[float]] = {n: [] for n in names}
    try:
        asyncio.run(decode_ms_per_token(None))  # warm-up: first-shape timing, allocator
        for name in VARIANTS:
            asyncio.run(decode_ms_per_token(grammars[name]))
        for _ in range(args.rounds):
            for name in names:
                samples[name].append(asyncio.run(decode_ms_per_token(grammars.get(name), name)))
    finally:
        runtime.stop()

    grammar_ms = {name: grammar_work_ms(grammars[name], generated[name], core.config.vocab_size)
                  for name in VARIANTS}
    base_best = min(samples["unconstrained"])
    base_median = statistics.median(samples["unconstrained"])
    rows = []
    for name in names:
        best, median = min(samples[name]), statistics.median(samples[name])
        rows.append({"variant": name, "best_ms_per_token": round(best, 3), "median_ms_per_token": round(median, 3),
                     "overhead_best_pct": round(100 * (best / base_best - 1), 2),
                     "overhead_median_pct": round(100 * (median / base_median - 1), 2),
                     "grammar_ms_per_token": round(grammar_ms.get(name, 0.0), 4),
                     "grammar_share_pct": round(100 * grammar_ms.get(name, 0.0) / base_best, 2)})
    print(f"constrained decoding, batch 1, {core.manifest.model_name}, {args.tokens} tokens, "
          f"{args.rounds} rounds, {args.threads} threads")
    print(f"{'variant':<15} {'best ms/tok':>12} {'median ms/tok':>14} {'overhead best':>14} {'overhead median':>16}"
          f" {'grammar ms/tok':>15} {'grammar share':>14}")
    for r in rows:
        print(f"{r['variant']:<15} {r['best_ms_per_token']:>12.2f} {r['median_ms_per_token']:>14.2f} "
              f"{r['overhead_best_pct']:>13.1f}% {r['overhead_median_pct']:>15.1f}%"
              f" {r['grammar_ms_per_token']:>15.3f} {r['grammar_share_pct']:>13.2f}%")
    if args.json:
        print(json.dumps({"bench": "structured", "model": core.manifest.model_name, "tokens": args.tokens,
                          "rounds": args.rounds, "threads": args.threads, "rows": rows}))
    sys.stdout.flush()


def grammar_work_ms(grammar, tokens: list[int], vocab_size: int, passes: int = 5) -> float:
    """Best-of-``passes`` mean ms per token of mask + apply + advance over ``tokens``."""
    import torch

    from flared.model.sampling import Sampler, SamplingParams

    sampler = Sampler(vocab_size)
    logits = torch.randn(1, vocab_size)
    best = float("inf")
    for _ in range(passes):
        state = sampler.add_sequence(SamplingParams(temperature=0.0), [], grammar=grammar.matcher())
        started = time.perf_counter_ns()
        for token in tokens:
            # The sampler's constrained-row work, exactly as sample() does it.
            sampler._apply_grammar_masks(logits, [state], owned=False)
            if not state.grammar.consume(token):
                raise SystemExit(f"replayed token {token} left the grammar: {state.grammar.error}")
        best = min(best, (time.perf_counter_ns() - started) / 1e6 / len(tokens))
    return best


if __name__ == "__main__":
    main()
