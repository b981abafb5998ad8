"""CPU time of one sampling step (Sampler.sample) per configuration, with top-p's shortlist and without it.

Rows of logits shaped like a language model's (a few likely tokens, a long tail: normal logits scaled by
``--spread``) over ``--vocab`` ids; each configuration draws ``--steps`` steps for ``--rows`` rows, first with
the shortlist (flared.model.sampling.SHORTLIST, the default) and then with the whole vocabulary sorted (the
reference, the same run). Configurations: vLLM's order (the OpenAI routes) and llama.cpp's chain (/completion),
each with and without a top-k.

    python tools/bench_sampler.py [--rows 8] [--vocab 49152] [--steps 30] [--json]

Prints one table; with --json, one JSON object as the last line.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

from flared.model import sampling  # noqa: E402
from flared.model.sampling import LLAMA_CPP_ORDER, Sampler, SamplingParams  # noqa: E402

CONFIGS = {
    "vLLM order, top-p 0.95, min-p 0.05": {"top_p": 0.95, "min_p": 0.05},
    "vLLM order, top-k 40, top-p 0.95": {"top_k": 40, "top_p": 0.95},
    "llama.cpp chain, top-p 0.95, min-p 0.05": {"top_p": 0.95, "min_p": 0.05, "sampler_order": LLAMA_CPP_ORDER},
    "llama.cpp chain, top-k 40, top-p 0.95": {"top_k": 40, "top_p": 0.95, "sampler_order": LLAMA_CPP_ORDER},
}


def step_ms(logits: torch.Tensor, params: dict, steps: int) -> float:
    sampler = Sampler(logits.shape[-1], max_penalty_slots=logits.shape[0])
    states = [sampler.add_sequence(SamplingParams(temperature=0.8, seed=i, **params), [])
              for i in range(logits.shape[0])]
    for _ in range(3):
        sampler.sample(logits, states)
    t = time.perf_counter()
    for _ in range(steps):
        sampler.sample(logits, states)
    return (time.perf_counter() - t) / steps * 1e3


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, default=8)
    ap.add_argument("--vocab", type=int, default=49152)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--spread", type=float, default=5.0, help="std of the logits (5: the top 1,024 ids hold ~99%%)")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    torch.manual_seed(0)
    logits = torch.randn(args.rows, args.vocab) * args.spread
    shortlist = sampling.SHORTLIST
    out = {"rows": args.rows, "vocab": args.vocab, "threads": torch.get_num_threads(), "configs": {}}
    print(f"{args.rows} rows, {args.vocab} ids, {torch.get_num_threads()} threads; ms per step")
    print(f"{'configuration':42} {'shortlist':>10} {'sorted':>10} {'ratio':>7}")
    for name, params in CONFIGS.items():
        sampling.SHORTLIST = shortlist
        fast = step_ms(logits, params, args.steps)
        sampling.SHORTLIST = 10 ** 9  # never shorter than the vocabulary: always sorted
        ref = step_ms(logits, params, args.steps)
        sampling.SHORTLIST = shortlist
        print(f"{name:42} {fast:10.2f} {ref:10.2f} {ref / fast:6.2f}x")
        out["configs"][name] = {"shortlist_ms": round(fast, 3), "sorted_ms": round(ref, 3)}
    if args.json:
        print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
