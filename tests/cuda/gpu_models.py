"""A small random-weight Llama on the GPU with a GraphExecutor and a scheduler around it."""

import hashlib
import math

import torch

PAGE_TOKENS = 16
CONTEXT = 512


def tiny_hf(seed=0, dtype=torch.float32):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=CONTEXT,
                      tie_word_embeddings=False, bos_token_id=None, eos_token_id=None, pad_token_id=0)
    return LlamaForCausalLM(cfg).eval().to(device="cuda", dtype=dtype)


def serving_model(hf, device="cuda", dtype=torch.float32, max_positions=CONTEXT):
    from flared.model.config import from_hf_config
    from flared.model.decoder import DecoderModel
    from flared.model.loader import _hf_to_serving

    config = from_hf_config(hf.config.to_dict())
    tensors = _hf_to_serving({k: v.detach().to(device) for k, v in hf.state_dict().items()}, config, source="tiny")
    return DecoderModel(config, tensors, dtype=dtype, device=device, max_positions=max_positions)


def make_scheduler(concurrency=4, num_pages=128, chunk=128, graph_shapes=(), speculative_tokens=0, spec_max_rows=0):
    """``graph_shapes``: an executor's ``graph_shapes`` (its multi-sequence prefill graphs); () = defaults.
    ``speculative_tokens``: drafts a step (0: none), at most ``spec_max_rows`` tokens a step (an executor's)."""
    from flared.scheduler import PolicyConfig, RequestScheduler, SchedulerConfig

    return RequestScheduler(SchedulerConfig(
        model_identity=hashlib.sha256(b"cuda-tests").digest(), max_live_requests=concurrency, num_pages=num_pages,
        num_snapshots=16, page_tokens=PAGE_TOKENS, context_capacity=CONTEXT, prefill_chunk_size=chunk,
        graph_shapes=tuple(graph_shapes), speculative_tokens=speculative_tokens,
        speculative_max_rows=spec_max_rows), PolicyConfig())


def make_executor(model, concurrency=4, num_pages=128, chunk=128, prefill_batch_shapes=(), lora=None,
                  speculative=0, kv_cache_dtype="auto"):
    """One-sequence prefill graphs unless ``prefill_batch_shapes`` lists (batch, tokens) ones; ``lora``: per-request
    LoRA adapters (a StackedLora); ``speculative``: serve speculative steps of up to that many drafts a request;
    ``kv_cache_dtype``: GraphExecutor's ("fp8": a float8 KV cache)."""
    from flared.execution.executor import GraphExecutor

    return GraphExecutor(model, num_pages=num_pages, page_tokens=PAGE_TOKENS, num_state_rows=concurrency + 1,
                         num_snapshots=16, vocab_size=model.config.vocab_size, max_live=concurrency,
                         decode_batch_sizes=(1, 2, 4), prefill_token_sizes=(64, chunk),
                         max_pages_per_sequence=CONTEXT // PAGE_TOKENS, prefill_batch_shapes=prefill_batch_shapes,
                         lora=lora, speculative=speculative, kv_cache_dtype=kv_cache_dtype)


def make_cpu_executor(model, concurrency=4, num_pages=128):
    from flared.execution.eager import EagerExecutor

    return EagerExecutor(model, num_pages=num_pages, page_tokens=PAGE_TOKENS, num_state_rows=concurrency + 1,
                         num_snapshots=16, vocab_size=model.config.vocab_size, max_live=concurrency)


def attention_reference(q, k_seq, v_seq, q_positions):
    """Attention in float64: q [n, nh, d]; k_seq/v_seq [L, nkv, d]; query i sees keys 0..q_positions[i] ->
    [n, nh, d]."""
    nh, nkv = q.shape[1], k_seq.shape[1]
    k = k_seq.double().repeat_interleave(nh // nkv, dim=1)
    v = v_seq.double().repeat_interleave(nh // nkv, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q.double(), k) / math.sqrt(q.shape[-1])
    keys = torch.arange(k.shape[0], device=q.device)
    scores = scores.masked_fill(keys[None, None, :] > q_positions[None, :, None], float("-inf"))
    return torch.einsum("hqk,khd->qhd", torch.softmax(scores, -1), v)


def argmax_distance(hf, prompts, runs) -> tuple[int, float]:
    """How near each run's tokens are to the float32 argmax of ``hf`` (transformers on the GPU), teacher-forced on
    the run's own tokens: (tokens that are the argmax, mean of (best - chosen) / (best - worst) over all tokens)."""
    gaps = []
    for prompt, tokens in zip(prompts, runs):
        with torch.no_grad():
            logits = hf(torch.tensor([prompt + tokens], device="cuda")).logits[0, len(prompt) - 1:-1].float()
        chosen = logits.gather(1, torch.tensor(tokens, device="cuda")[:, None])[:, 0]
        best, worst = logits.max(dim=1).values, logits.min(dim=1).values
        gaps += ((best - chosen) / (best - worst)).tolist()
    return sum(gap == 0 for gap in gaps), sum(gaps) / len(gaps)
