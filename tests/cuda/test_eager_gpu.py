"""Models the Llama kernels do not run serve on the GPU either through CUDA graphs of their own torch layers
(mixtures of experts, Gemma 3, gpt-oss, partial rotary: kernels/paged_decoder.py's generic decoder) or, where even those
cannot (Qwen3-Next's recurrent state), through the eager executor (its torch forward on CUDA;
tests/model/test_cuda_device.py holds that forward to transformers on the GPU): a bf16 core's daemon says which, and
its greedy chat tokens are transformers' bf16 tokens on the same GPU. Skipped without a GPU (tests/cuda/conftest.py)."""

from __future__ import annotations

import pytest
import torch


@pytest.mark.parametrize("family,graphs", [("qwen2_moe", True), ("gemma3", True), ("gpt_oss", True),
                                           ("phi4_mini", True), ("qwen3_next", False)])
def test_a_core_the_llama_kernels_do_not_run_serves_on_the_gpu(family, graphs, tmp_path, start_daemon):
    from flared_testing.checkpoints import build_hf_checkpoint
    from flared_testing.served import write_char_tokenizer
    from transformers import AutoModelForCausalLM

    from flared.core.export import ExportOptions, export_core

    directory = build_hf_checkpoint(family, tmp_path / "hf")
    tok = write_char_tokenizer(directory, 512)
    core = tmp_path / "core"
    export_core(directory, core, ExportOptions(dtype="bfloat16", concurrency=4, context_tokens=256,
                                               prefill_chunk_tokens=64))
    d = start_daemon(core)
    asks = ["Tell me a story about a fox.", "Why is the sky blue?", "Count to ten."]
    got = []
    for text in asks:
        status, body = d.chat([{"role": "user", "content": text}], max_tokens=12, temperature=0, ignore_eos=True,
                              logprobs=True, return_tokens_as_token_ids=True)
        assert status == 200, body
        got.append([int(t["token"].split(":")[1]) for t in body["choices"][0]["logprobs"]["content"]])
    log = d.log()
    if graphs:
        assert "through the model's torch layers" in log and "executor: eager on" not in log, log[-3000:]
    else:
        assert "serving on the GPU with the eager executor" in log and "executor: eager on" in log, log[-3000:]
    hf = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.bfloat16).to("cuda").eval()
    matches = 0
    for text, tokens in zip(asks, got):
        prompt = [2] + tok.encode(f"<user>{text}<model>", add_special_tokens=False).ids
        with torch.no_grad():
            expected = hf.generate(torch.tensor([prompt], device="cuda"), max_new_tokens=12, do_sample=False,
                                   eos_token_id=None, pad_token_id=0,
                                   attention_mask=torch.ones(1, len(prompt), dtype=torch.long, device="cuda"))
        expected = expected[0, len(prompt):].tolist()
        # bf16 on both sides: the first token must agree; later ones may part at a near tie, so count them
        assert tokens[0] == expected[0], (tokens, expected)
        matches += tokens == expected
    assert matches >= 2, got
