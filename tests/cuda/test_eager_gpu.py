"""Models the Llama kernels do not run serve on the GPU either through CUDA graphs of their own torch layers
(mixtures of experts, Gemma 3 and 4, gpt-oss, partial rotary, latent attention, heads not a power of two wide:
kernels/paged_decoder.py's generic decoder) or, where even those cannot (recurrent state), through the eager executor (its torch forward on CUDA;
tests/model/test_cuda_device.py holds that forward to transformers on the GPU): a bf16 core's daemon says which, and
its greedy chat tokens are transformers' bf16 tokens on the same GPU. Skipped without a GPU (tests/cuda/conftest.py)."""

from __future__ import annotations

import pytest
import torch


def _core(family, tmp_path):
    from flared_testing.checkpoints import build_hf_checkpoint
    from flared_testing.served import write_char_tokenizer

    from flared.core.export import ExportOptions, export_core

    directory = build_hf_checkpoint(family, tmp_path / "hf")
    tok = write_char_tokenizer(directory, 512)
    core = tmp_path / "core"
    export_core(directory, core, ExportOptions(dtype="bfloat16", concurrency=4, context_tokens=256,
                                               prefill_chunk_tokens=64))
    return directory, tok, core


ASKS = ["Tell me a story about a fox.", "Why is the sky blue?", "Count to ten."]


def _chat_tokens(d) -> list[list[int]]:
    got = []
    for text in ASKS:
        status, body = d.chat([{"role": "user", "content": text}], max_tokens=12, temperature=0, ignore_eos=True,
                              logprobs=True, return_tokens_as_token_ids=True)
        assert status == 200, body
        got.append([int(t["token"].split(":")[1]) for t in body["choices"][0]["logprobs"]["content"]])
    return got


def _prompt(tok, text) -> list[int]:
    return [2] + tok.encode(f"<user>{text}<model>", add_special_tokens=False).ids


@pytest.mark.parametrize("family", ["qwen2_moe", "gemma3", "gpt_oss", "phi4_mini", "gemma4_e2b", "deepseek_v2",
                                    "llama_head24"])
def test_a_core_the_llama_kernels_do_not_run_serves_through_its_own_layers_graphs(family, tmp_path, start_daemon):
    """The daemon says it serves the core through the generic graphs, and its greedy chat tokens are as near
    transformers' float32 argmax (teacher-forced on each run's own tokens) as the tokens the same core gives with
    --enforce-eager: bf16 runs part at near-ties (a router's too), so neither is the other's reference."""
    from gpu_models import argmax_distance
    from transformers import AutoModelForCausalLM

    directory, tok, core = _core(family, tmp_path)
    d = start_daemon(core)
    graphs = _chat_tokens(d)
    log = d.log()
    assert "through the model's torch layers" in log and "executor: eager on" not in log, log[-3000:]
    d.kill()
    e = start_daemon(core, "--enforce-eager")
    eager = _chat_tokens(e)
    assert "executor: eager on" in e.log()
    hf = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32,
                                              attn_implementation="eager").to("cuda").eval()
    prompts = [_prompt(tok, text) for text in ASKS]
    (g_exact, g_gap), (e_exact, e_gap) = argmax_distance(hf, prompts, graphs), argmax_distance(hf, prompts, eager)
    assert g_exact >= e_exact - 4 and g_gap <= e_gap + 0.02, (family, g_exact, g_gap, e_exact, e_gap)


def test_a_recurrent_core_serves_on_the_gpu_through_the_eager_executor(tmp_path, start_daemon):
    """(LFM2's short convolutions: Qwen3-Next's Gated DeltaNet ran here until the GPU machine's transformers 5.17 took
    it through PyTorch fallbacks that part from its own kernels; tools/gpu_family_check.py holds Qwen3-Next on CUDA to
    a newer transformers' references.)"""
    from transformers import AutoModelForCausalLM

    directory, tok, core = _core("lfm2", tmp_path)
    d = start_daemon(core)
    got = _chat_tokens(d)
    log = d.log()
    assert "serving on the GPU with the eager executor" in log and "executor: eager on" in log, log[-3000:]
    hf = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.bfloat16).to("cuda").eval()
    matches = 0
    for text, tokens in zip(ASKS, got):
        prompt = _prompt(tok, text)
        with torch.no_grad():
            expected = hf.generate(torch.tensor([prompt], device="cuda"), max_new_tokens=12, do_sample=False,
                                   eos_token_id=None, pad_token_id=0,
                                   attention_mask=torch.ones(1, len(prompt), dtype=torch.long, device="cuda"))
        expected = expected[0, len(prompt):].tolist()
        # bf16 on both sides: the first token must agree; later ones may part at a near tie, so count them
        assert tokens[0] == expected[0], (tokens, expected)
        matches += tokens == expected
    assert matches >= 2, got
