#!/usr/bin/env python
"""Speculative decoding on the CPU: greedy streams (or sampled ones, ``--temperature``) with ``--draft`` drafts a
step, by prompt lookup or (``--draft-model``) from a draft model, against the same streams without, in one run.

The embedded SmolLM2-135M-Instruct (the GGUF, dequantised) in bf16 behind the scheduler and the eager executor
(what ``flared run`` serves on a CPU). Three workloads of chat prompts (ChatML, the model's template):
``quote`` asks it to repeat a passage (much of the answer is in the prompt), ``edit`` to fix a typo in a code
snippet (some of it is), ``chat`` an open question (little of it is: the overhead); with OpenAI's predicted
outputs (the request's ``prediction``, where the drafts are looked up first), ``edit+pred`` is ``edit`` predicted to
answer the corrected code, and ``write+pred`` asks for such code from a description (not in the prompt) predicted
to be that code, beside ``write`` without the prediction. Each stream generates
``--tokens`` tokens (EOS ignored, as a load generator's ignore_eos); tok/s = streams x tokens over the whole run,
from admission to the last token (the prompts' prefill is the same work in both variants). Each figure is the best
of ``--repeats``, the variants alternating. Also: the decode and speculative steps each variant took, the drafts fed
and kept, and how many streams' tokens equal the plain run's (they should all: a speculative step's rows go
through the same one-call decode step, tests/model/test_decode_kernel.py, and a sampled stream's rows draw with
its seed at their own positions). Sampled streams are seeded, stream i with seed i, in both variants.

``--draft-model q4_1`` (or q8_0, bf16) drafts with a DraftModel (flared.execution.drafter) of the same embedded model,
its products kept in that format (a faster copy that mostly agrees with the served one: the only model with this
vocabulary here), each request's drafts stopped at a token it gives less than ``--p-min``.

    .venv/bin/python tools/bench_speculative.py [--draft 4] [--tokens 96] [--streams 1,8] [--repeats 3]
        [--temperature 0.7 --top-p 0.9] [--workloads edit,edit+pred,write,write+pred] [--dtype float32]
        [--draft-model q4_1 [--p-min 0.75]] [--json]

Prints a table; with --json, one JSON object as the last line.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_lora_cpu import load_model, load_source  # noqa: E402  the embedded model in bf16, the one-call decode step

PASSAGE = ("The lighthouse stood at the edge of the harbour for two hundred years. Every night its keeper climbed "
           "the one hundred and twelve steps, trimmed the wick, polished the great lens and wound the clockwork "
           "that turned it. Ships far out at sea saw the beam sweep the water once every ten seconds and knew "
           "exactly where the rocks began.")
CODE = ("def mean(values):\n    total = 0\n    for value in values:\n        total += value\n"
        "    return total / len(vales)\n\n\ndef variance(values):\n    m = mean(values)\n"
        "    return sum((v - m) ** 2 for v in values) / len(values)\n")
WORKLOADS = {
    "quote": "Repeat the following text exactly, word for word:\n\n" + PASSAGE,
    "edit": "Fix the typo in this Python code and return the whole corrected code:\n\n" + CODE,
    "chat": "What are three good habits for staying healthy? Explain each one briefly.",
    "write": "Write a Python function mean(values) that returns the mean of a list of numbers, and a function "
             "variance(values) that uses it.",
}
WORKLOADS["edit+pred"] = WORKLOADS["edit"]
WORKLOADS["write+pred"] = WORKLOADS["write"]
PREDICTIONS = {"edit+pred": CODE.replace("vales", "values"), "write+pred": CODE.replace("vales", "values")}


def tokenizer():
    from tokenizers import Tokenizer

    from flared.cli.ctl import default_cache_dir
    from flared.core.default import ensure_default_core

    core = Path(ensure_default_core(default_cache_dir(), "bfloat16"))
    return Tokenizer.from_file(str(core / "tokenizer.json"))


def chat_prompt(tok, text: str) -> list[int]:
    return tok.encode(f"<|im_start|>user\n{text}<|im_end|>\n<|im_start|>assistant\n", add_special_tokens=False).ids


def run(model, prompts, tokens: int, draft: int, temperature: float = 0.0, top_p: float = 1.0,
        prediction=None, drafter=None) -> dict:
    from flared.execution.eager import EagerExecutor
    from flared.execution.offline import drive
    from flared.model.sampling import SamplingParams
    from flared.scheduler import PolicyConfig, RequestScheduler, SchedulerConfig

    n = len(prompts)
    pages = n * 1024 // 16
    sched = RequestScheduler(SchedulerConfig(
        model_identity=hashlib.sha256(b"bench-spec").digest(), max_live_requests=n, num_pages=pages,
        num_snapshots=4 * n, page_tokens=16, context_capacity=1024, prefill_chunk_size=512,
        speculative_tokens=draft, drafter=drafter if draft else None), PolicyConfig())
    ex = EagerExecutor(model, num_pages=pages, page_tokens=16, num_state_rows=n + 1, num_snapshots=4 * n,
                       vocab_size=model.config.vocab_size, max_live=n)
    params = [SamplingParams(temperature=temperature, top_p=top_p, seed=i, max_tokens=tokens) for i in range(n)]
    r = drive(sched, ex, prompts, params, speculate=True, predictions=None if prediction is None else [prediction] * n)
    return {"tok_s": n * tokens / (r.wall_ns / 1e9), "tokens": r.tokens,
            "steps": r.steps_by_kind["DECODE"] + r.steps_by_kind["SPECULATIVE"],
            "speculative_steps": r.steps_by_kind["SPECULATIVE"],
            "drafted": sched.counters["speculative_drafted"], "accepted": sched.counters["speculative_accepted"],
            "drafter_steps": sched.counters["drafter_steps"]}


def draft_model(fmt: str, p_min: float, streams: int):
    """A DraftModel of the embedded model with its products as ``fmt`` (q4_1, q8_0 or bf16), a KV pool for
    ``streams`` sequences of 1,024 tokens."""
    from flared.execution.drafter import DraftModel
    from flared.model.decoder import DecoderModel

    source = load_source()
    model = DecoderModel(source.config, source.tensors, dtype=torch.bfloat16, max_positions=1024,
                         quantization=None if fmt == "bf16" else fmt)
    drafter = DraftModel(model, num_pages=streams * 1024 // 16 + 1, page_tokens=16, max_context=1024,
                         vocab_limit=source.config.vocab_size, p_min=p_min)
    drafter.warm_up(streams)  # (as the model thread does at load)
    return drafter


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--draft", type=int, default=4, help="speculative_tokens")
    ap.add_argument("--tokens", type=int, default=96)
    ap.add_argument("--streams", default="1,8")
    ap.add_argument("--workloads", default="quote,edit,chat")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--temperature", type=float, default=0.0, help="0: greedy streams")
    ap.add_argument("--top-p", type=float, default=1.0)
    ap.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"),
                    help="float32: the eager forward, for hosts without AVX-512 BF16 (what flared run serves there)")
    ap.add_argument("--draft-model", default=None, choices=("q4_1", "q8_0", "bf16"),
                    help="draft with the embedded model, its products in this format (default: prompt lookup)")
    ap.add_argument("--p-min", type=float, default=0.0, help="the draft model's --draft-p-min")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    if args.dtype == "bfloat16":
        model = load_model()
    else:
        from flared.model.decoder import DecoderModel

        source = load_source()
        model = DecoderModel(source.config, source.tensors, dtype=torch.float32, max_positions=1024)
    tok = tokenizer()
    out = {"draft": args.draft, "tokens": args.tokens, "temperature": args.temperature, "top_p": args.top_p,
           "threads": torch.get_num_threads(), "dtype": args.dtype, "draft_model": args.draft_model,
           "p_min": args.p_min if args.draft_model else None}
    sampling = {"temperature": args.temperature, "top_p": args.top_p}
    print(f"{'workload':8} {'streams':>7} {'plain tok/s':>12} {'spec tok/s':>11} {'ratio':>6} {'steps':>11} "
          f"{'kept/fed':>11} {'same':>6}")
    for name in args.workloads.split(","):
        for streams in (int(s) for s in args.streams.split(",")):
            prompts = [chat_prompt(tok, WORKLOADS[name])] * streams
            prediction = (tuple(tok.encode(PREDICTIONS[name], add_special_tokens=False).ids)
                          if name in PREDICTIONS else None)
            drafter = draft_model(args.draft_model, args.p_min, streams) if args.draft_model else None
            run(model, prompts, 8, args.draft, drafter=drafter, **sampling)  # warm both paths
            best: dict[str, dict] = {}
            for _ in range(args.repeats):
                for variant, draft in (("plain", 0), ("spec", args.draft)):
                    got = run(model, prompts, args.tokens, draft, prediction=prediction, drafter=drafter, **sampling)
                    if variant not in best or got["tok_s"] > best[variant]["tok_s"]:
                        best[variant] = got
            plain, spec = best["plain"], best["spec"]
            same = sum(a == b for a, b in zip(plain["tokens"], spec["tokens"]))
            ratio = spec["tok_s"] / plain["tok_s"]
            print(f"{name:8} {streams:>7} {plain['tok_s']:12.1f} {spec['tok_s']:11.1f} {ratio:6.2f} "
                  f"{plain['steps']:>5} -> {spec['steps']:<3} {spec['accepted']:>5}/{spec['drafted']:<5} "
                  f"{same:>3}/{streams}", flush=True)
            out[f"{name}|{streams}"] = {"plain_tok_s": round(plain["tok_s"], 1), "spec_tok_s": round(spec["tok_s"], 1),
                                        "ratio": round(ratio, 3), "plain_steps": plain["steps"],
                                        "spec_steps": spec["steps"], "drafted": spec["drafted"],
                                        "accepted": spec["accepted"], "same_tokens": same,
                                        "drafter_steps": spec["drafter_steps"]}
    if args.json:
        print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
