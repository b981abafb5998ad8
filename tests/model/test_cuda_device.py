"""The same runtime on a CUDA device (skipped without one): paged chunked
forward and the runner against transformers on the GPU, and seeded sampling
reproducible there. Nothing in flared/model is CPU-only; this checks it."""

from __future__ import annotations

import pytest
import torch

from flared.model.decoder import DecoderModel
from flared.model.loader import read_source
from flared.model.runner import ModelRunner
from flared.model.sampling import SamplingParams

from .conftest import build_hf_checkpoint
from .test_parity_hf import make_prompts, run_paged_greedy

pytestmark = [pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


@pytest.mark.parametrize("family", ["llama3", "mistral", "qwen2", "qwen3", "qwen3_yarn", "gemma3", "mixtral",
                                    "qwen2_moe", "qwen3_moe", "smollm3", "phi3", "phi4_mini", "granite", "gemma2",
                                    "gpt_oss", "glm4", "glm4_moe", "seed_oss", "granite4", "exaone4", "cohere",
                                    "cohere2", "deepseek_v2", "deepseek_v3", "minimax_m2", "ernie4_5",
                                    "olmo3", "qwen3_5", "qwen3_next", "lfm2", "lfm2_moe", "granite4_h",
                                    "granite4_h_moe", "nemotron_h", "nemotron_h_moe", "falcon_h1", "gemma4",
                                    "gemma4_moe", "gemma4_e2b", "bamba", "jamba", "mamba", "mamba2", "falcon_mamba",
                                    "kimi_linear", "apertus", "ernie4_5_moe", "glm4_moe_lite", "dots1", "hunyuan",
                                    "hunyuan_moe", "llama4", "arcee", "granitemoe", "granitemoeshared",
                                    "ministral", "cwm", "olmoe", "solar_open", "exaone_moe",
                                    "hy_v3", "afmoe", "lfm3", "olmo_hybrid",
                                    "starcoder2", "nemotron", "gemma",
                                    "stablelm", "granitemoe_swa", "phi", "glm",
                                    "gpt_neox"])
def test_cuda_forward_and_runner_match_transformers(family, tmp_path):
    from transformers import AutoModelForCausalLM

    build_hf_checkpoint(family, tmp_path)
    source = read_source(tmp_path)
    hf_model = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).to("cuda").eval()
    model = DecoderModel(source.config, source.tensors, device="cuda")
    prompts = make_prompts(source.config.vocab_size)
    for prompt, (out, logits) in zip(prompts, run_paged_greedy(model, prompts, num_new_tokens=16, page_tokens=4,
                                                               chunk_tokens=5)):
        assert logits.device.type == "cuda"
        with torch.no_grad():
            expected = hf_model(torch.tensor([prompt + out[:-1]], device="cuda")).logits[0, len(prompt) - 1:].float()
        assert (expected - logits).abs().max().item() < 1e-4

    runner = ModelRunner(source.config, source.tensors, device="cuda", num_pages=48, page_tokens=8, max_batch=3,
                         prefill_chunk_tokens=6)
    greedy = runner.generate(prompts, [SamplingParams(temperature=0, max_tokens=32)] * len(prompts))
    for prompt, result in zip(prompts, greedy):
        with torch.no_grad():
            expected = hf_model.generate(torch.tensor([prompt], device="cuda"), max_new_tokens=32, do_sample=False,
                                         eos_token_id=None, pad_token_id=0,
                                         attention_mask=torch.ones(1, len(prompt), dtype=torch.long, device="cuda"))
        assert result.token_ids == expected[0, len(prompt):].tolist()

    sampled = [SamplingParams(temperature=0.8, top_p=0.9, top_k=20, repetition_penalty=1.2, seed=5 + i, max_tokens=16,
                              logprobs=2) for i in range(len(prompts))]
    first = runner.generate(prompts, sampled)
    alone = [runner.generate([p], [s])[0] for p, s in zip(prompts, sampled)]
    assert [r.token_ids for r in first] == [r.token_ids for r in alone]
    assert all(len(r.logprobs) == 16 for r in first)
    assert runner.allocator.num_free == runner.num_pages
