"""The decode graphs' top-k/top-p sampler: the walk up the ranking (``sample_full``, no sort) against the sort it
replaced, in one run.

Kernels (always): each sampler captured in a CUDA graph over fixed logits, the step counter advanced inside the
graph so every replay draws anew; microseconds a call from CUDA events over ``--replays`` replays, beside the
race without masks (``sample_race``, the TEMPERATURE graphs' sampler: the floor). Two kinds of rows: "zipf"
(probabilities falling as rank^-2 in a shuffled vocabulary, as a trained model's next token; its nucleus is a few
tokens) and "flat" (normal logits, std 0.5: a random model's). "passes": the walk's mean passes over a row.

Serving (``--serving``): sampled streams (temperature ``--temperature``, top-p 0.95 or top-k 40, each seeded with
its index) through the graph executor with each sampler captured into its graphs, tok/s over the whole run
(prefill included), best of ``--repeats``, the two alternating; temperature alone (TEMPERATURE graphs) beside.
Random bf16 weights of bench_gpu's shapes.

Features (``--features``): the same serving drive, top-p 0.95 streams against the same streams each with one more
setting: min-p (drawn in the graphs' sampler); a repetition penalty (vLLM's, or llama.cpp's over the last 64 tokens)
or a logit bias, shaped and drawn in the graphs' sampler from the Sampler's slot tables; log-probabilities, drawn
by the graphs and taken by the executor beside the draw; top-k 40 beside the top-p (top-p then judges shares of
the k: the walk finds each row's 40th largest logit first); llama.cpp's default chain with top-k 40 and min-p 0.05;
allowed_token_ids (every seventh id), as -inf in the slot's bias row; min_tokens over the whole run (three ids
banned).
"(eager)": the same streams drawn by the torch Sampler after the graph, as before; "(torch ops)": drawn by the
graphs, their logprobs from torch's ops behind the graph (before the thirty-eighth session's kernel); "(launched)": the
logprobs kernels launched from Python each step rather than as one captured graph (the thirty-eighth session's).
tok/s, host and GPU us a step.

Log-probabilities (``--logprob-shapes 1x49152,...``): the logprobs kernel against those torch ops, us a call.

    python3 tools/bench_graph_sampler.py [--shapes 135m] [--streams 1,16,64] [--serving] [--features] [--json]

CUDA only. Prints tables; with --json, one JSON object as the last line.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from flared.model.sampling import LLAMA_CPP_ORDER  # noqa: E402

PARAMS = {"top-p 0.95": (0, 0.95), "top-k 40": (40, 1.0), "top-k 40 + top-p 0.9": (40, 0.9)}


def sort_sample_full(logits, temperature, top_k, top_p, seeds, steps, passes=None):
    """The sampler the walk replaced (main until the thirty-fourth session): sort each row for the masks, then the
    same race over the kept tokens; top-p on shares of the k tokens (renormalised), as the walk now judges it."""
    from flared.model.kernels.sampling import sample_race

    vocab = logits.shape[-1]
    greedy = logits.argmax(dim=-1)
    scaled = logits / temperature.clamp_min(1e-5)[:, None]
    sorted_logits, sorted_ids = scaled.sort(dim=-1, descending=True)
    ranks = torch.arange(vocab, device=logits.device)
    k = torch.where(top_k > 0, top_k, vocab).to(torch.int64)
    in_k = ranks[None, :] < k[:, None]
    probs = torch.softmax(sorted_logits.masked_fill(~in_k, float("-inf")), dim=-1)
    mass_before = probs.cumsum(dim=-1) - probs
    keep = in_k & (mass_before < top_p[:, None])
    kept = torch.zeros_like(keep).scatter_(1, sorted_ids, keep)
    drawn = sample_race(torch.where(kept, logits, float("-inf")), temperature, seeds, steps)
    return torch.where(temperature == 0, greedy, drawn)


def rows_of(kind: str, batch: int, vocab: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator(device="cuda").manual_seed(seed)
    if kind == "flat":
        return torch.randn(batch, vocab, device="cuda", generator=g) * 0.5
    rank = torch.arange(1, vocab + 1, device="cuda", dtype=torch.float32)
    out = torch.empty(batch, vocab, device="cuda")
    for b in range(batch):
        out[b] = (-2.0 * rank.log())[torch.randperm(vocab, device="cuda", generator=g)]
    return out


def time_graph(fn, replays: int) -> float:
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    for _ in range(5):
        g.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(replays):
        g.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1e3 / replays


@torch.inference_mode()
def bench_logprob_kernel(args, out: dict) -> None:
    """The log-probabilities of drawn tokens (kernels.sampling.row_logprobs, three kernels behind the graph) against
    the torch ops the executor ran before (index_select, log_softmax, gather, topk), each captured in a graph over
    normal logits (std 3) of every row; us a call."""
    from flared.model.kernels.sampling import GRAPH_LOGPROBS, LogprobScratch, row_logprobs

    print(f"\n{'rows x vocab':>14} {'top n':>5} {'torch us':>8} {'kernel us':>9} {'ratio':>6}")
    for shape in args.logprob_shapes.split(","):
        rows, vocab = (int(v) for v in shape.split("x"))
        logits = torch.randn(rows, vocab, device="cuda") * 3
        sampled = torch.randint(0, vocab, (rows,), device="cuda")
        index = torch.arange(rows, device="cuda")
        result = torch.empty(rows, 1 + 2 * GRAPH_LOGPROBS, device="cuda")
        scratch = LogprobScratch(rows, vocab, "cuda")
        for top_n in (5, 20):
            lp_args = torch.stack([index, index, torch.full_like(index, top_n)])

            def ops():
                raw = torch.log_softmax(logits.index_select(0, index), dim=-1)
                raw.gather(1, sampled.index_select(0, index)[:, None])
                raw.topk(top_n, dim=-1)

            torch_us = time_graph(ops, args.replays)
            kernel_us = time_graph(lambda: row_logprobs(logits, lp_args, sampled, result, scratch), args.replays)
            out[f"logprobs|{shape}|{top_n}"] = {"torch_us": round(torch_us, 1), "kernel_us": round(kernel_us, 1),
                                                "ratio": round(torch_us / kernel_us, 2)}
            print(f"{shape:>14} {top_n:5} {torch_us:8.1f} {kernel_us:9.1f} {torch_us / kernel_us:6.2f}", flush=True)


@torch.inference_mode()
def bench_kernels(args, out: dict, tag: str = "") -> None:
    from flared.model.kernels.sampling import sample_full, sample_race

    print(f"{'rows x vocab':>14} {'kind':5} {'params':21} {'kept':>7} {'sort us':>8} {'walk us':>8} {'ratio':>6} "
          f"{'passes':>6} {'race us':>8}")
    for shape in args.kernel_shapes.split(","):
        batch, vocab = (int(v) for v in shape.split("x"))
        for kind in ("zipf", "flat"):
            logits = rows_of(kind, batch, vocab)
            temperature = torch.full((batch,), args.temperature, device="cuda")
            seeds = torch.arange(batch, dtype=torch.int64, device="cuda") * 7919 + 11
            steps = torch.zeros(batch, dtype=torch.int64, device="cuda")
            race_us = time_graph(lambda: (sample_race(logits, temperature, seeds, steps), steps.add_(1)),
                                 args.replays)
            for name, (k, p) in PARAMS.items():
                top_k = torch.full((batch,), k, dtype=torch.int32, device="cuda")
                top_p = torch.full((batch,), p, device="cuda")
                probs = torch.softmax(logits[0] / args.temperature, 0).sort(descending=True).values
                kept = int(min(k or vocab, int(((probs.cumsum(0) - probs) < p).sum())))
                passes = torch.zeros(batch, dtype=torch.int32, device="cuda")
                total = torch.zeros(batch, dtype=torch.int64, device="cuda")
                sort_us = time_graph(lambda: (sort_sample_full(logits, temperature, top_k, top_p, seeds, steps),
                                              steps.add_(1)), args.replays)
                steps.zero_()
                walk_us = time_graph(lambda: (sample_full(logits, temperature, top_k, top_p, seeds, steps, passes),
                                              total.add_(passes), steps.add_(1)), args.replays)
                mean_passes = float(total.sum()) / batch / (args.replays + 8)  # 3 eager runs + 5 warm replays
                row = {"sort_us": round(sort_us, 1), "walk_us": round(walk_us, 1),
                       "ratio": round(sort_us / walk_us, 2), "passes": round(mean_passes, 2),
                       "race_us": round(race_us, 1), "kept_row0": kept}
                out[f"kernel|{tag}{shape}|{kind}|{name}"] = row
                print(f"{shape:>14} {kind:5} {name:21} {kept:>7} {sort_us:8.1f} {walk_us:8.1f} "
                      f"{row['ratio']:6.2f} {row['passes']:6.2f} {race_us:8.1f}", flush=True)


def random_model(shape: str):
    """bench_gpu's random bf16 weights of ``shape`` as a serving DecoderModel (transformers' copy freed)."""
    from bench_gpu import make_hf, serving

    hf = make_hf(shape, torch.bfloat16)
    model = serving(hf, torch.bfloat16)
    del hf
    torch.cuda.empty_cache()
    return model


@torch.inference_mode()
def bench_serving(args, out: dict) -> None:
    import flared.model.kernels.paged_decoder as pd
    from bench_gpu import SHAPES, graph_executor, prompts

    from flared.execution.offline import drive
    from flared.model.sampling import SamplingParams

    print(f"\n{'shape':6} {'streams':>7} {'params':21} {'sort tok/s':>10} {'walk tok/s':>10} {'ratio':>6} "
          f"{'temperature alone':>17}   GPU us a step (sort / walk / alone)")
    for shape in args.shapes.split(","):
        model = random_model(shape)
        concurrency = max(args.streams)
        walk_fn = pd.sample_full
        pairs = {}
        try:
            pd.sample_full = sort_sample_full
            pairs["sort"] = graph_executor(model, concurrency)
            pd.sample_full = walk_fn
            pairs["walk"] = graph_executor(model, concurrency)
            vocab = SHAPES[shape]["vocab_size"]
            for streams in args.streams:
                for name, (k, top_p) in list(PARAMS.items())[:2]:
                    params = [SamplingParams(temperature=args.temperature, top_k=k, top_p=top_p, seed=i,
                                             max_tokens=args.tokens) for i in range(streams)]
                    alone = [SamplingParams(temperature=args.temperature, seed=i, max_tokens=args.tokens)
                             for i in range(streams)]
                    best = {}
                    for repeat in range(args.repeats):
                        # Fresh prompts every repeat (the same for sort and walk, in their own schedulers;
                        # others for the run alone): no run resumes another's cached prompts.
                        seed = 1000 * streams + 10 * repeat + len(out)
                        p = prompts(vocab, streams, args.prompt, seed=seed)
                        for label, pair, ps, pr in (("sort", pairs["sort"], params, p),
                                                    ("walk", pairs["walk"], params, p),
                                                    ("alone", pairs["walk"], alone,
                                                     prompts(vocab, streams, args.prompt, seed=seed + 1))):
                            r = drive(pair[0], pair[1], pr, ps)
                            tok_s = streams * args.tokens / (r.wall_ns / 1e9)
                            steps = sum(r.steps_by_kind.values())
                            if tok_s > best.get(label, (0, 0))[0]:
                                best[label] = (tok_s, r.gpu_ns / 1e3 / max(1, steps), r.tokens)
                    row = {"sort_tok_s": round(best["sort"][0], 1), "walk_tok_s": round(best["walk"][0], 1),
                           "ratio": round(best["walk"][0] / best["sort"][0], 3),
                           "alone_tok_s": round(best["alone"][0], 1),
                           "gpu_us_per_step": [round(best[x][1], 1) for x in ("sort", "walk", "alone")],
                           "same_tokens": sum(a == b for a, b in zip(best["sort"][2], best["walk"][2]))}
                    out[f"serving|{shape}|{streams}|{name}"] = row
                    print(f"{shape:6} {streams:>7} {name:21} {row['sort_tok_s']:10,.0f} {row['walk_tok_s']:10,.0f} "
                          f"{row['ratio']:6.2f} {row['alone_tok_s']:17,.0f}   "
                          f"{' / '.join(f'{v:,.0f}' for v in row['gpu_us_per_step'])}  "
                          f"(same tokens {row['same_tokens']}/{streams})", flush=True)
        finally:
            pd.sample_full = walk_fn
            for pair in pairs.values():
                pair[1].close()
        del model
        torch.cuda.empty_cache()


BIAS = {t: -2.0 for t in range(100, 110)}
ALLOWED = tuple(range(0, 40000, 7))
FEATURES = {"top-p 0.95": {}, "+ min-p 0.05": {"min_p": 0.05}, "+ repetition 1.1": {"repetition_penalty": 1.1},
            "+ repetition (eager)": {"repetition_penalty": 1.1, "_eager": True},
            "+ freq/presence": {"frequency_penalty": 0.3, "presence_penalty": 0.3},
            "+ repeat_last_n 64": {"repetition_penalty": 1.1, "penalty_last_n": 64},
            "+ repeat_last_n (eager)": {"repetition_penalty": 1.1, "penalty_last_n": 64, "_eager": True},
            "+ logprobs 5": {"logprobs": 5}, "+ logprobs 5 (eager)": {"logprobs": 5, "_eager": "graph_samples"},
            # the graphs draw, the logprobs from torch's ops behind them (before the thirty-eighth session)
            "+ logprobs 5 (torch ops)": {"logprobs": 5, "_executor": {"logprob_kernel": False}},
            # the kernels launched from Python each step instead of as a captured graph (the thirty-eighth session's)
            "+ logprobs 5 (launched)": {"logprobs": 5, "_executor": {"logprob_graphs": False}},
            "+ logprobs 20": {"logprobs": 20},
            "+ logprobs 20 (torch ops)": {"logprobs": 20, "_executor": {"logprob_kernel": False}},
            "+ logit bias": {"logit_bias": BIAS},
            "+ logit bias (eager)": {"logit_bias": BIAS, "_eager": True},
            # vLLM's allowed_token_ids (every 7th id): -inf for the rest in the slot's bias row
            "+ allowed ids": {"allowed_token_ids": ALLOWED},
            "+ allowed ids (eager)": {"allowed_token_ids": ALLOWED, "_eager": True},
            # vLLM's min_tokens (every token: the run ignores EOS): EOS-like ids banned in the slot's tables
            "+ min_tokens": {"min_tokens": 256, "min_tokens_banned": frozenset({0, 1, 2})},
            "+ min_tokens (eager)": {"min_tokens": 256, "min_tokens_banned": frozenset({0, 1, 2}), "_eager": True},
            # top-p on shares of the k tokens: the walk first finds each row's 40th largest logit
            "+ top-k 40": {"top_k": 40},
            # llama.cpp's default chain (top-k, top-p on the unscaled logits, min-p, the temperature last)
            "llama.cpp chain": {"top_k": 40, "min_p": 0.05, "sampler_order": LLAMA_CPP_ORDER},
            "llama.cpp chain (eager)": {"top_k": 40, "min_p": 0.05, "sampler_order": LLAMA_CPP_ORDER,
                                        "_eager": "graph_samples"}}


def bench_features(args, out: dict) -> None:
    from bench_gpu import SHAPES, graph_executor, prompts

    from flared.execution.offline import drive
    from flared.model.sampling import SamplingParams, SequenceSamplingState

    graph_shaped, graph_samples = SequenceSamplingState.graph_shaped, SequenceSamplingState.graph_samples
    print(f"\n{'shape':6} {'streams':>7} {'params':22} {'tok/s':>8} {'ratio':>6} {'host us/step':>12} "
          f"{'GPU us/step':>11} {'steps':>6}")
    for shape in args.shapes.split(","):
        model = random_model(shape)
        pair = graph_executor(model, max(args.streams))
        vocab = SHAPES[shape]["vocab_size"]
        try:
            for streams in args.streams:
                best = {}
                for repeat in range(args.repeats):
                    chosen = {"top-p 0.95", *filter(None, args.feature_names.split(","))}
                    for j, (name, extra) in enumerate(FEATURES.items()):
                        if args.feature_names and name not in chosen:
                            continue
                        extra = dict(extra)
                        eager = extra.pop("_eager", False)
                        settings = extra.pop("_executor", {})
                        params = [SamplingParams(temperature=args.temperature, top_p=0.95, seed=i,
                                                 max_tokens=args.tokens, **extra) for i in range(streams)]
                        pr = prompts(vocab, streams, args.prompt, seed=7000 * streams + 100 * repeat + j)
                        if eager:  # the rows shaped or drawn by the torch Sampler after the graph
                            setattr(SequenceSamplingState, eager if isinstance(eager, str) else "graph_shaped",
                                    property(lambda self: False))
                        before = {key: getattr(pair[1], key) for key in settings}
                        for key, value in settings.items():
                            setattr(pair[1], key, value)
                        try:
                            r = drive(pair[0], pair[1], pr, params)
                        finally:
                            for key, value in before.items():
                                setattr(pair[1], key, value)
                            SequenceSamplingState.graph_shaped = graph_shaped
                            SequenceSamplingState.graph_samples = graph_samples
                        steps = max(1, sum(r.steps_by_kind.values()))
                        tok_s = streams * args.tokens / (r.wall_ns / 1e9)
                        if tok_s > best.get(name, {}).get("tok_s", 0):
                            best[name] = {"tok_s": round(tok_s, 1),
                                          "host_us_per_step": round(r.host_ns / 1e3 / steps, 1),
                                          "gpu_us_per_step": round(r.gpu_ns / 1e3 / steps, 1), "steps": steps}
                base = best["top-p 0.95"]["tok_s"]
                for name, row in best.items():
                    row["ratio"] = round(row["tok_s"] / base, 3)
                    out[f"features|{shape}|{streams}|{name}"] = row
                    print(f"{shape:6} {streams:>7} {name:22} {row['tok_s']:8,.0f} {row['ratio']:6.2f} "
                          f"{row['host_us_per_step']:12,.0f} {row['gpu_us_per_step']:11,.0f} {row['steps']:6}",
                          flush=True)
        finally:
            pair[1].close()
        del model
        torch.cuda.empty_cache()


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--kernel-shapes", default="1x49152,16x49152,64x49152,1x128256,64x128256", help="'': none")
    ap.add_argument("--replays", type=int, default=200)
    ap.add_argument("--temperature", type=float, default=0.7)
    ap.add_argument("--walk-variants", default="", help="BLOCK/WARPS,...: the walk kernel's shapes to time")
    ap.add_argument("--logprob-shapes", default="", help="ROWSxVOCAB,...: time the logprobs kernel ('': not)")
    ap.add_argument("--serving", action="store_true")
    ap.add_argument("--features", action="store_true")
    ap.add_argument("--feature-names", default="", help="comma list: only these --features rows (top-p always)")
    ap.add_argument("--shapes", default="135m")
    ap.add_argument("--streams", default="1,16,64")
    ap.add_argument("--prompt", type=int, default=128)
    ap.add_argument("--tokens", type=int, default=256)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    args.streams = [int(s) for s in args.streams.split(",")]
    out = {"device": torch.cuda.get_device_name(), "temperature": args.temperature}
    if args.walk_variants:
        import flared.model.kernels.sampling as sampling

        for variant in args.walk_variants.split(","):
            sampling.WALK_BLOCK, sampling.WALK_WARPS = (int(v) for v in variant.split("/"))
            print(f"\nwalk: {sampling.WALK_BLOCK} logits an iteration, {sampling.WALK_WARPS} warps")
            bench_kernels(args, out, f"{variant}|")
    elif args.kernel_shapes:
        bench_kernels(args, out)
    if args.logprob_shapes:
        bench_logprob_kernel(args, out)
    if args.serving:
        bench_serving(args, out)
    if args.features:
        bench_features(args, out)
    if args.json:
        print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
