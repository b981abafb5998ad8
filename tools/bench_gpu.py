"""GPU parity and benchmarks: flared's CUDA graph executor beside Hugging Face transformers, same run.

Random weights of the real architectures (Llama-3.1-8B shape, SmolLM2-135M
shape), built once per shape on the GPU and shared by both sides. flared runs
through the real scheduler and the GraphExecutor (flared.execution.offline);
transformers runs ``generate`` with its dynamic cache (the issue's compiled
static-cache figures are quoted, not re-measured: compiling costs minutes of
device time).

    python tools/bench_gpu.py [--shapes 8b,135m,mistral7b] [--b64-only | --b1-only | --parity-only]
                              [--ab-env NAME=VALUE] [--json]

The executors prefill in chunks of 2,048 tokens, up to 16 prompts a graph; FLARED_BENCH_PREFILL=TOKENS:SEQUENCES
sets both (the chunk at most the 4,096-token context), also as an A/B through --ab-env; likewise
FLARED_BENCH_KV_CACHE_DTYPE=fp8 builds the executors with a float8 KV cache (GraphExecutor's kv_cache_dtype).

Prints a table; with --json, one JSON object as the last line. CUDA only.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

SHAPES = {
    "8b": dict(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
               num_attention_heads=32, num_key_value_heads=8, rope_theta=500000.0, rms_norm_eps=1e-5,
               max_position_embeddings=131072, tie_word_embeddings=False,
               rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                             "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}),
    # Mistral-7B-v0.1's shape: a 4,096-token sliding window (the decode megakernel serves contexts inside it)
    "mistral7b": dict(arch="mistral", vocab_size=32000, hidden_size=4096, intermediate_size=14336,
                      num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8, rope_theta=10000.0,
                      rms_norm_eps=1e-5, max_position_embeddings=32768, sliding_window=4096, tie_word_embeddings=False),
    "135m": dict(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                 num_attention_heads=9, num_key_value_heads=3, rope_theta=100000.0, rms_norm_eps=1e-5,
                 max_position_embeddings=8192, tie_word_embeddings=True),
}
PAGE_TOKENS = 16
CONTEXT_TOKENS = 4096
CONCURRENCY = 64
PREFILL_CHUNK = 2048


def prefill_setup() -> tuple[int, int]:
    """(prefill chunk tokens, most sequences a prefill graph) of the executors built now: the bench's defaults,
    or FLARED_BENCH_PREFILL=TOKENS:SEQUENCES (an A/B through --ab-env); the chunk at most the context (the
    scheduler's bound)."""
    from flared.execution.graphs import PREFILL_MAX_BATCH

    tokens, _, seqs = os.environ.get("FLARED_BENCH_PREFILL", "").partition(":")
    return min(int(tokens or PREFILL_CHUNK), CONTEXT_TOKENS), int(seqs or PREFILL_MAX_BATCH)


@contextlib.contextmanager
def default_dtype(dtype):
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(old)


def make_hf(shape: str, dtype: torch.dtype, seed: int = 0):
    from transformers import LlamaConfig, LlamaForCausalLM, MistralConfig, MistralForCausalLM

    torch.manual_seed(seed)
    fields = dict(SHAPES[shape])
    config_cls, model_cls = ((MistralConfig, MistralForCausalLM) if fields.pop("arch", "llama") == "mistral"
                             else (LlamaConfig, LlamaForCausalLM))
    cfg = config_cls(**fields, bos_token_id=None, eos_token_id=None, pad_token_id=0)
    with default_dtype(dtype), torch.device("cuda"):
        model = model_cls(cfg).eval()
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    return model


def serving(hf, dtype: torch.dtype, device="cuda", quantization=None):
    from flared.model.config import from_hf_config
    from flared.model.decoder import DecoderModel
    from flared.model.loader import _hf_to_serving

    hf_config = hf.config.to_dict()
    config = from_hf_config(hf_config)
    # (hf_config: the renames and folds of families whose checkpoints name their tensors otherwise, Phi-2's)
    tensors = _hf_to_serving({k: v.detach() for k, v in hf.state_dict().items()}, config, source="random",
                             hf_config=hf_config)
    return DecoderModel(config, tensors, dtype=dtype, device=device, max_positions=CONTEXT_TOKENS,
                        quantization=quantization)


def scheduler(concurrency=CONCURRENCY, num_pages=None, graph_shapes=(), speculative_tokens=0, spec_max_rows=0):
    """``graph_shapes``: the executor's (GraphExecutor.graph_shapes); () = the defaults (one-sequence prefill);
    ``speculative_tokens``: prompt-lookup drafts a step, up to ``spec_max_rows`` tokens a step in all (the
    executor's GraphExecutor.spec_max_rows)."""
    from flared.scheduler import PolicyConfig, RequestScheduler, SchedulerConfig

    num_pages = num_pages or concurrency * CONTEXT_TOKENS // PAGE_TOKENS // 4
    return RequestScheduler(SchedulerConfig(
        model_identity=hashlib.sha256(b"bench").digest(), max_live_requests=concurrency, num_pages=num_pages,
        num_snapshots=4 * concurrency, page_tokens=PAGE_TOKENS, context_capacity=CONTEXT_TOKENS,
        prefill_chunk_size=prefill_setup()[0], graph_shapes=tuple(graph_shapes), speculative_tokens=speculative_tokens,
        speculative_max_rows=spec_max_rows), PolicyConfig()), num_pages


def graph_executor(model, concurrency=CONCURRENCY, num_pages=None, prefill_batch_shapes=None, lora=None,
                   speculative_tokens=0):
    """The executor (multi-sequence prefill graphs by default, as the daemon captures them) and a scheduler
    that plans exactly its captured shapes; ``lora``: per-request adapters (kernels/lora_rows.StackedLora)."""
    from flared.execution.executor import GraphExecutor
    from flared.execution.graphs import default_prefill_batch_shapes

    num_pages = num_pages or concurrency * CONTEXT_TOKENS // PAGE_TOKENS // 4
    batches = tuple(1 << i for i in range(concurrency.bit_length()) if 1 << i <= concurrency)
    chunk, most = prefill_setup()
    prefill = tuple(64 << i for i in range(8) if 64 << i <= chunk)
    if prefill_batch_shapes is None:
        prefill_batch_shapes = default_prefill_batch_shapes(concurrency, prefill, most)
    ex = GraphExecutor(model, num_pages=num_pages, page_tokens=PAGE_TOKENS, num_state_rows=concurrency + 1,
                       num_snapshots=4 * concurrency, vocab_size=model.config.vocab_size, max_live=concurrency,
                       decode_batch_sizes=batches, prefill_token_sizes=prefill,
                       max_pages_per_sequence=CONTEXT_TOKENS // PAGE_TOKENS, prefill_batch_shapes=prefill_batch_shapes,
                       lora=lora, speculative=speculative_tokens,
                       kv_cache_dtype=os.environ.get("FLARED_BENCH_KV_CACHE_DTYPE", "auto"))
    sched, _ = scheduler(concurrency, num_pages, ex.graph_shapes, speculative_tokens, ex.spec_max_rows)
    return sched, ex


def greedy(max_tokens):
    from flared.model.sampling import SamplingParams

    return SamplingParams(temperature=0.0, max_tokens=max_tokens)


def prompts(vocab, count, length, seed=1):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, vocab, (count, length), generator=g).tolist()


def run_flared(model, prompt_list, max_tokens, *, ex_pair=None):
    from flared.execution.offline import drive

    sched, ex = ex_pair
    return drive(sched, ex, prompt_list, [greedy(max_tokens)] * len(prompt_list))


@torch.inference_mode()
def hf_generate(hf, prompt_list, max_tokens):
    ids = torch.tensor(prompt_list, device="cuda")
    torch.cuda.synchronize()
    t = time.perf_counter()
    out = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_tokens,
                      min_new_tokens=max_tokens, do_sample=False)
    torch.cuda.synchronize()
    return out[:, ids.shape[1]:].tolist(), time.perf_counter() - t


@torch.inference_mode()
def hf_ttft(hf, prompt):
    ids = torch.tensor([prompt], device="cuda")
    best = float("inf")
    for _ in range(3):
        torch.cuda.synchronize()
        t = time.perf_counter()
        hf(ids).logits[:, -1].argmax(-1).item()
        best = min(best, time.perf_counter() - t)
    return best


def matched_prefix(a, b):
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


@contextlib.contextmanager
def env_set(env: dict):
    """``env`` in os.environ for the block (an executor reads its FLARED_* settings when built), then each
    name back as it was."""
    saved = {name: os.environ.get(name) for name in env}
    os.environ.update(env)
    try:
        yield
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def fp32_parity(shape: str, rows: list, out: dict, parity_tokens: int, cpu: bool = True) -> None:
    """Greedy tokens on float32 against transformers and (``cpu``) flared's CPU path (exact parity). The 8B shape
    takes 32 GB a copy in float32: two fit the H200; its CPU path would take minutes, so it is left out there."""
    vocab = SHAPES[shape]["vocab_size"]
    hf32 = make_hf(shape, torch.float32)
    m32 = serving(hf32, torch.float32)
    pair = graph_executor(m32, concurrency=4, num_pages=512)
    p = prompts(vocab, 2, 32, seed=7)
    ours = run_flared(m32, p, parity_tokens, ex_pair=pair).tokens
    ref, _ = hf_generate(hf32, p, parity_tokens)
    exact = [matched_prefix(a, b) for a, b in zip(ours, ref)]
    rows.append((shape, "fp32 greedy tokens = transformers", f"{min(exact)}/{parity_tokens}", "",
                 "exact" if min(exact) == parity_tokens else "DIFFERS"))
    out[f"{shape}_fp32_parity_hf"] = exact
    if cpu:
        cpu_exact = [matched_prefix(a, b) for a, b in zip(ours, cpu_tokens(hf32, p, parity_tokens))]
        rows.append((shape, "fp32 greedy tokens = flared CPU path", f"{min(cpu_exact)}/{parity_tokens}", "",
                     "exact" if min(cpu_exact) == parity_tokens else "DIFFERS"))
        out[f"{shape}_fp32_parity_cpu"] = cpu_exact
    pair[1].close()
    del hf32, m32, pair
    torch.cuda.empty_cache()


def executor_rows(shape: str, ex, build_s: float, rows: list, out: dict) -> dict:
    """The executor's graphs, build time and capture-time calibration; returns the calibration."""
    out[f"{shape}_capture_s"] = round(build_s, 2)
    num_graphs = len(ex.graphs.graph_execs)
    batched = ex.manifest.prefill_batch_shapes
    batched_s = sum(sec for (kind, b, _, _), sec in ex.graphs.key_seconds.items() if kind == "prefill" and b > 1)
    rows.append((shape, "graphs (multi-seq prefill) | executor build s | of it multi-seq",
                 f"{num_graphs} ({len(batched)}) | {build_s:.1f} | {batched_s:.1f}", "",
                 f"graph capture alone {ex.graphs.capture_s:.1f} s"))
    out[f"{shape}_graphs"] = num_graphs
    out[f"{shape}_prefill_batch_shapes"] = [list(x) for x in batched]
    out[f"{shape}_graph_capture_s"] = round(ex.graphs.capture_s, 2)
    out[f"{shape}_multi_seq_prefill_graphs_s"] = round(batched_s, 2)
    out[f"{shape}_graph_seconds"] = {f"{k[0]}-{k[1]}x{k[2]}-{int(k[3])}": round(v, 3)
                                     for k, v in ex.graphs.key_seconds.items()}
    cal = ex.graphs.decoder.calibration
    if not cal:
        return {}
    if "skinny_us" in cal:
        rows.append((shape, "batch-1 decode graph us: skinny kernels | cuBLAS (capture-time pick)",
                     f"{cal['skinny_us']:.0f} | {cal['cublas_us']:.0f}", "",
                     "skinny" if cal["skinny_max_rows"] else "cuBLAS"))
    if cal.get("mega_us"):
        mega = " ".join(f"b{b}: {cal['mega_us'][b]:.0f} vs {cal['mega_other_us'][b]:.0f}" for b in cal["mega_us"])
        rows.append((shape, "decode graph us: megakernel vs the pick without it", mega, "",
                     f"megakernel up to {cal['mega_max_rows']} rows"))
    if cal.get("mega_ll_us"):
        ll = " ".join(f"b{b}: {cal['mega_ll_us'][b]:.0f} vs {cal['mega_barrier_us'][b]:.0f}"
                      for b in cal["mega_ll_us"])
        rows.append((shape, "megakernel graph us: tagged words vs barriers", ll, "",
                     f"tagged words at {cal['mega_ll_rows'] or 'no batch'}"))
    if cal.get("lt_us"):
        lt = " ".join(f"b{b}: {cal['lt_us'][b]:.0f} vs {cal['blas_us'][b]:.0f}" for b in cal["lt_us"])
        rows.append((shape, "decode graph us: cuBLASLt vs cuBLAS", lt, "",
                     f"cuBLASLt at {cal['lt_batches'] or 'no batch'}"))
    if cal.get("p64_us"):
        p64 = " ".join(f"b{b}: {cal['p64_us'][b]:.0f} vs {cal['p64_other_us'][b]:.0f}" for b in cal["p64_us"])
        rows.append((shape, "decode graph us: products64 vs cuBLAS(Lt)", p64, "",
                     f"products64 at {cal['p64_batches'] or 'no batch'}"))
    if "products64_error" in cal:
        rows.append((shape, "products64", "failed", "", cal["products64_error"][:60]))
    if "megakernel_error" in cal:
        rows.append((shape, "megakernel", "failed", "", cal["megakernel_error"][:60]))
    out[f"{shape}_calibration"] = cal
    return cal


def single_stream(shape: str, hf, model, pair, rows: list, out: dict, *, parity_tokens: int, new_tokens: int,
                  prompt_len: int, ab_mega: bool) -> None:
    """bf16 parity, then one stream (128-token prompt, 256 new tokens): its speed, host and GPU time per step,
    GPU time by context, and two A/Bs (uploads on the model stream; the decode megakernel off)."""
    vocab = SHAPES[shape]["vocab_size"]
    ex = pair[1]
    p = prompts(vocab, 1, 32, seed=3)
    ours = run_flared(model, p, parity_tokens, ex_pair=pair).tokens[0]
    ref, _ = hf_generate(hf, p, parity_tokens)
    same = matched_prefix(ours, ref[0])
    agree = sum(a == b for a, b in zip(ours, ref[0]))
    rows.append((shape, "bf16 greedy tokens = transformers (prefix / total)",
                 f"{same} / {agree} of {len(ours)}|{len(ref[0])}",
                 "", "bf16: rounding may flip a near-tie"))
    out[f"{shape}_bf16_parity_prefix"] = same

    p = prompts(vocab, 1, prompt_len, seed=4)
    # Warm-up on other prompts (the same prompt would be a prefix-cache hit): times the shapes once.
    run_flared(model, prompts(vocab, 1, prompt_len, seed=40), 16, ex_pair=pair)
    ex.max_outstanding = 0
    r = run_flared(model, p, new_tokens, ex_pair=pair)
    out[f"{shape}_b1_max_frames_in_flight"] = ex.max_outstanding
    decode_s = (r.finish_ns[0] - r.first_token_ns[0]) / 1e9
    tps = (new_tokens - 1) / decode_s
    _, hf_s = hf_generate(hf, p, 64)
    hf_tps = 64 / hf_s
    rows.append((shape, "batch-1 decode tok/s", f"{tps:,.0f}", f"{hf_tps:,.0f}", f"x{tps / hf_tps:.2f}"))
    out[f"{shape}_b1_tok_s"] = tps
    out[f"{shape}_b1_hf_tok_s"] = hf_tps
    steps = r.steps_by_kind["DECODE"]
    host_us = r.decode_host_ns / max(1, steps) / 1e3
    gpu_us = r.decode_gpu_ns / max(1, steps) / 1e3
    idle = 1 - r.gpu_ns / r.wall_ns
    rows.append((shape, "batch-1 host us/step | GPU us/step | GPU idle", f"{host_us:.0f} | {gpu_us:.0f} | {idle:.0%}",
                 "", f"frames in flight <= {ex.max_outstanding}"))
    out[f"{shape}_b1_host_us_per_step"] = host_us
    out[f"{shape}_b1_gpu_us_per_step"] = gpu_us
    out[f"{shape}_b1_gpu_idle"] = idle
    # The same steps by context length (decode step i attends over prompt_len + i + 1 tokens): where the
    # average goes between short and long contexts (the megakernel's resident attention ends at 320 at 8B).
    spans, cells = [(prompt_len + 1, 256), (257, 304), (305, prompt_len + new_tokens)], []
    for lo, hi in spans:
        ns = [d for i, d in enumerate(r.decode_step_ns) if lo <= prompt_len + i + 1 <= hi]
        if ns:
            cells.append(f"{lo}-{hi}: {sum(ns) / len(ns) / 1e3:.0f}")
            out[f"{shape}_b1_gpu_us_per_step_{lo}_{hi}"] = sum(ns) / len(ns) / 1e3
    rows.append((shape, "batch-1 GPU us/step by context (tokens: us)", " | ".join(cells), "",
                 f"{len(r.decode_step_ns)} steps"))

    # The same single stream with each decode step's upload on the model stream, ahead of its launch (A/B on
    # this executor, its graphs and pool): off, on, off, on.
    ab = {False: [], True: []}
    for overlap in (False, True, False, True):
        ex.overlap_uploads = overlap
        r1 = run_flared(model, p, new_tokens, ex_pair=pair)
        ab[overlap].append(((new_tokens - 1) / ((r1.finish_ns[0] - r1.first_token_ns[0]) / 1e9),
                            r1.decode_gpu_ns / max(1, r1.steps_by_kind["DECODE"]) / 1e3,
                            matched_prefix(r.tokens[0], r1.tokens[0])))
    ex.overlap_uploads = True
    cell = " / ".join(f"{t:,.0f} | {g:.0f}" for t, g, _ in ab[False])
    rows.append((shape, "batch-1 decode tok/s | GPU us/step, uploads on the model stream (A/B)", cell, "",
                 "overlapped: " + " / ".join(f"{t:,.0f} | {g:.0f}" for t, g, _ in ab[True])
                 + f"; tokens = main run: {min(x[2] for v in ab.values() for x in v)}/{new_tokens}"))
    out[f"{shape}_b1_upload_ab"] = {str(k): v for k, v in ab.items()}
    if not ab_mega:
        return

    # The same single stream without the decode megakernel (the skinny-or-cuBLAS pick it competes with), on an
    # executor of its own.
    with env_set({"FLARED_MEGAKERNEL": "0"}):
        plain = graph_executor(model, concurrency=1, num_pages=64)
    run_flared(model, prompts(vocab, 1, prompt_len, seed=41), 16, ex_pair=plain)
    r0 = run_flared(model, p, new_tokens, ex_pair=plain)
    tps0 = (new_tokens - 1) / ((r0.finish_ns[0] - r0.first_token_ns[0]) / 1e9)
    gpu0 = r0.decode_gpu_ns / max(1, r0.steps_by_kind["DECODE"]) / 1e3
    same0 = matched_prefix(r.tokens[0], r0.tokens[0])
    rows.append((shape, "batch-1 decode tok/s without the megakernel | GPU us/step", f"{tps0:,.0f} | {gpu0:.0f}", "",
                 f"tokens = main run: {same0}/{new_tokens}"))
    out[f"{shape}_b1_no_mega_tok_s"] = tps0
    out[f"{shape}_b1_no_mega_gpu_us_per_step"] = gpu0
    out[f"{shape}_b1_mega_vs_no_mega_prefix"] = same0
    plain[1].close()
    del plain


def streams64(shape: str, model, pair, *, new_tokens: int, prompt_len: int):
    """64 streams: 128-token prompts, 256 new tokens, admitted together (after a warm-up on other prompts);
    returns (output tokens a second over the whole run, the run, the prompts)."""
    vocab = SHAPES[shape]["vocab_size"]
    p = prompts(vocab, CONCURRENCY, prompt_len, seed=5)
    run_flared(model, prompts(vocab, CONCURRENCY, prompt_len, seed=50), 4, ex_pair=pair)
    r = run_flared(model, p, new_tokens, ex_pair=pair)
    return CONCURRENCY * new_tokens / (r.wall_ns / 1e9), r, p


def streams64_rows(shape: str, hf, model, pair, rows: list, out: dict, *, new_tokens: int, prompt_len: int) -> float:
    """The 64 streams beside transformers' generate on the same prompts, with host and GPU time per step and the
    prefill steps; returns flared's output tokens a second."""
    agg, r, p = streams64(shape, model, pair, new_tokens=new_tokens, prompt_len=prompt_len)
    _, hf_s = hf_generate(hf, p, new_tokens)
    hf_agg = CONCURRENCY * new_tokens / hf_s
    rows.append((shape, "batch-64 output tok/s", f"{agg:,.0f}", f"{hf_agg:,.0f}", f"x{agg / hf_agg:.2f}"))
    out[f"{shape}_b64_tok_s"] = agg
    out[f"{shape}_b64_hf_tok_s"] = hf_agg
    # The decode phase alone (every stream past its first token), beside the whole run's figure above, which counts
    # the prefill as transformers' generate() does and as the issue's target reads.
    decode_phase = CONCURRENCY * (new_tokens - 1) / ((max(r.finish_ns) - max(r.first_token_ns)) / 1e9)
    rows.append((shape, "batch-64 decode phase output tok/s (last first token to last finish)",
                 f"{decode_phase:,.0f}", "", "the prefill left out"))
    out[f"{shape}_b64_decode_phase_tok_s"] = decode_phase
    steps = r.steps_by_kind["DECODE"]
    rows.append((shape, "batch-64 host us/decode step | GPU us/step | GPU idle",
                 f"{r.decode_host_ns / max(1, steps) / 1e3:.0f} | {r.decode_gpu_ns / max(1, steps) / 1e3:.0f} | "
                 f"{1 - r.gpu_ns / r.wall_ns:.0%}", "", f"steps {dict(r.steps_by_kind)}"))
    out[f"{shape}_b64_steps"] = dict(r.steps_by_kind)
    prefill_steps = r.steps_by_kind["PREFILL"]
    rows.append((shape, "batch-64 prefill steps for 64 prompts | decode steps", f"{prefill_steps} | {steps}", "",
                 f"prefill GPU ms total {(r.gpu_ns - r.decode_gpu_ns) / 1e6:.0f} (all non-decode steps)"))
    out[f"{shape}_b64_prefill_steps"] = prefill_steps
    out[f"{shape}_b64_decode_steps"] = steps
    out[f"{shape}_b64_non_decode_gpu_ms"] = (r.gpu_ns - r.decode_gpu_ns) / 1e6
    return agg


def one_seq_prefill_and_ttft(shape: str, hf, model, pair, agg: float, rows: list, out: dict, *, new_tokens: int,
                             prompt_len: int) -> None:
    """A/B: the 64 streams under a scheduler of one-sequence prefill chunks only (what ran before multi-sequence
    prefill graphs); then a 2048-token prompt's time to first token (best of 3) beside transformers'."""
    vocab = SHAPES[shape]["vocab_size"]
    ex = pair[1]
    one_seq = (scheduler(CONCURRENCY, ex.decoder.num_pages)[0], ex)
    p = prompts(vocab, CONCURRENCY, prompt_len, seed=5)
    run_flared(model, prompts(vocab, CONCURRENCY, prompt_len, seed=51), 4, ex_pair=one_seq)
    r1 = run_flared(model, p, new_tokens, ex_pair=one_seq)
    agg1 = CONCURRENCY * new_tokens / (r1.wall_ns / 1e9)
    rows.append((shape, "batch-64 output tok/s, one-sequence prefill only (A/B)", f"{agg1:,.0f}", "",
                 f"x{agg / agg1:.2f} batched; steps {dict(r1.steps_by_kind)}"))
    out[f"{shape}_b64_one_seq_prefill_tok_s"] = agg1
    out[f"{shape}_b64_one_seq_prefill_steps"] = dict(r1.steps_by_kind)

    # A fresh prompt each time: a repeated one would be served from the prefix cache.
    ttft = min(run_flared(model, prompts(vocab, 1, 2048, seed=60 + i), 1, ex_pair=pair).first_token_ns[0]
               for i in range(3)) / 1e6
    p = prompts(vocab, 1, 2048, seed=60)
    hf_ms = hf_ttft(hf, p[0]) * 1e3
    rows.append((shape, "2048-token prompt TTFT ms", f"{ttft:.1f}", f"{hf_ms:.1f}", f"x{hf_ms / ttft:.2f}"))
    out[f"{shape}_ttft_ms"] = ttft
    out[f"{shape}_hf_ttft_ms"] = hf_ms


def streams64_ab(shape: str, model, agg: float, cal: dict, ab_env: str, rows: list, out: dict, *, new_tokens: int,
                 prompt_len: int) -> None:
    """A/B in the same run: the 64 streams on an executor built with ``ab_env`` set, else with products64 pinned
    off where calibration put some batch on it (the step then runs cuBLASLt's products), else with cuBLASLt
    pinned off where it did; nothing where none of these applies."""
    if ab_env:
        name, _, value = ab_env.partition("=")
        env, label, what, key = {name: value}, f"with {ab_env}", "without it", "ab_env"
    elif cal.get("p64_batches"):
        env, label, what, key = {"FLARED_PRODUCTS64": "0"}, "without products64", "with products64", "no_products64"
    elif cal.get("lt_batches"):
        env, label, what, key = {"FLARED_BLAS_LT": "0"}, "with cuBLAS only", "with cuBLASLt", "cublas_only"
    else:
        return
    with env_set(env):
        plain = graph_executor(model)
    agg2, r2, _ = streams64(shape, model, plain, new_tokens=new_tokens, prompt_len=prompt_len)
    steps2 = r2.steps_by_kind["DECODE"]
    rows.append((shape, f"batch-64 output tok/s {label} (A/B) | GPU us/decode step", f"{agg2:,.0f} | "
                 f"{r2.decode_gpu_ns / max(1, steps2) / 1e3:.0f}", "", f"x{agg / agg2:.3f} {what}"))
    out[f"{shape}_b64_{key}_tok_s"] = agg2
    if ab_env:
        out[f"{shape}_b64_ab_env"] = ab_env
    plain[1].close()
    del plain


def bench_shape(shape: str, rows: list, out: dict, *, parity_tokens=128, new_tokens=256, prompt_len=128,
                ab_mega=True, b64_only=False, ab_env="", b1_only=False):
    """Every row for one shape; ``b64_only``: only the executor's and the 64 streams' (with their A/B);
    ``b1_only``: only the executor's and the single stream's."""
    if shape == "135m" and not b64_only:  # an 8B float32 copy is 32 GB and adds nothing
        fp32_parity(shape, rows, out, parity_tokens)
    hf = make_hf(shape, torch.bfloat16)
    model = serving(hf, torch.bfloat16)
    t = time.perf_counter()
    pair = graph_executor(model)
    cal = executor_rows(shape, pair[1], time.perf_counter() - t, rows, out)
    sizes = dict(new_tokens=new_tokens, prompt_len=prompt_len)
    if not b64_only:
        single_stream(shape, hf, model, pair, rows, out, parity_tokens=parity_tokens, ab_mega=ab_mega, **sizes)
    if b1_only:
        pair[1].close()
        return
    agg = streams64_rows(shape, hf, model, pair, rows, out, **sizes)
    if not b64_only:
        one_seq_prefill_and_ttft(shape, hf, model, pair, agg, rows, out, **sizes)
    pair[1].close()
    del pair
    torch.cuda.empty_cache()
    streams64_ab(shape, model, agg, cal, ab_env, rows, out, **sizes)
    del hf, model
    torch.cuda.empty_cache()


def cpu_tokens(hf, prompt_list, max_tokens):
    """flared's CPU path (eager executor, float32) on the same weights."""
    from flared.execution.eager import EagerExecutor

    hf_cpu = {k: v.detach().to("cpu") for k, v in hf.state_dict().items()}
    from flared.model.config import from_hf_config
    from flared.model.decoder import DecoderModel
    from flared.model.loader import _hf_to_serving

    config = from_hf_config(hf.config.to_dict())
    model = DecoderModel(config, _hf_to_serving(hf_cpu, config, source="random"), dtype=torch.float32,
                         device="cpu", max_positions=CONTEXT_TOKENS)
    sched, num_pages = scheduler(4, 512)
    ex = EagerExecutor(model, num_pages=num_pages, page_tokens=PAGE_TOKENS, num_state_rows=5, num_snapshots=16,
                       vocab_size=config.vocab_size, max_live=4)
    from flared.execution.offline import drive

    return drive(sched, ex, prompt_list, [greedy(max_tokens)] * len(prompt_list)).tokens


class _EchoRows(list):
    """Rows also go to stderr as they are measured, so a run cut short still leaves them in the log."""

    def append(self, row) -> None:
        print("ROW", row, file=sys.stderr, flush=True)
        super().append(row)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", default="135m,8b")
    ap.add_argument("--prefill-attention", default="",
                    help="PREFILL_CONFIG overrides for the bf16 prefill attention kernel, as 'key=value ...' "
                         "(tools/probe_prefill_attention.py's variants)")
    ap.add_argument("--b64-only", action="store_true",
                    help="only the 64-stream rows (and their A/B): no parity, batch-1 or TTFT rows")
    ap.add_argument("--b1-only", action="store_true",
                    help="only the executor's and the single stream's rows (with the megakernel A/B)")
    ap.add_argument("--parity-only", action="store_true",
                    help="only the float32 greedy-token parity rows, for every shape given (8B: against transformers)")
    ap.add_argument("--ab-env", default="",
                    help="NAME=VALUE: the 64-stream A/B row builds its executor with this set (default: products64 "
                         "or cuBLASLt pinned off, whichever calibration took)")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    rows = _EchoRows()
    out: dict = {"device": torch.cuda.get_device_name(), "torch": torch.__version__}
    from flared.model import triton_attention

    if args.prefill_attention:
        from probe_prefill_attention import parse_variant  # the probe's variant syntax (this directory)

        overrides = parse_variant(args.prefill_attention)
        unknown = sorted(set(overrides) - set(triton_attention.PREFILL_CONFIG))
        if unknown:
            ap.error(f"--prefill-attention: no setting {unknown[0]!r} ({sorted(triton_attention.PREFILL_CONFIG)})")
        triton_attention.PREFILL_CONFIG.update(overrides)
    out["prefill_attention"] = dict(triton_attention.PREFILL_CONFIG)
    print(f"prefill attention {triton_attention.PREFILL_CONFIG}", file=sys.stderr, flush=True)
    for shape in args.shapes.split(","):
        try:
            if args.parity_only:
                fp32_parity(shape, rows, out, 128, cpu=shape != "8b")
                continue
            bench_shape(shape, rows, out, b64_only=args.b64_only, ab_env=args.ab_env, b1_only=args.b1_only)
        except Exception as exc:  # noqa: BLE001 - report the failure in the table, keep the other shape
            import traceback

            traceback.print_exc()
            rows.append((shape, "FAILED", f"{type(exc).__name__}: {exc}"[:120], "", ""))
            out[f"{shape}_error"] = f"{type(exc).__name__}: {exc}"
    print(f"\n{'shape':6} {'measure':55} {'flared':>22} {'transformers':>13}  note")
    for r in rows:
        print(f"{r[0]:6} {r[1]:55} {r[2]:>22} {r[3]:>13}  {r[4]}")
    if args.json:
        print(json.dumps(out, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
