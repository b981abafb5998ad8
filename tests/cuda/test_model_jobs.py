"""The model thread's jobs on the GPU, run eagerly between steps: DecoderModel.pooled_embeddings (/v1/embeddings,
/api/embed) against transformers' final hidden states, and DecoderModel.prompt_logprobs (completions' echo
with logprobs) against transformers' logits, same weights, same device."""

import pytest

torch = pytest.importorskip("torch")


@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-4), (torch.bfloat16, 0.05)])
def test_pooled_embeddings_match_transformers_on_the_gpu(dtype, tol):
    from gpu_models import serving_model, tiny_hf

    hf = tiny_hf(dtype=dtype)
    model = serving_model(hf, dtype=dtype)
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(3, 512, (n,), generator=g).tolist() for n in (1, 7, 40, 300)]
    last = model.pooled_embeddings(prompts, normalize=False)
    mean = model.pooled_embeddings(prompts, pooling="mean", normalize=False)
    assert last.device.type == "cuda" and last.dtype == torch.float32
    for i, p in enumerate(prompts):
        with torch.no_grad():
            h = hf(torch.tensor([p], device="cuda"), output_hidden_states=True).hidden_states[-1][0].float()
        scale = h.abs().max().item()
        assert (last[i] - h[-1]).abs().max().item() <= tol * scale
        assert (mean[i] - h.mean(0)).abs().max().item() <= tol * scale
    unit = model.pooled_embeddings(prompts)
    assert torch.allclose(unit.norm(dim=-1), torch.ones(len(prompts), device="cuda"), atol=1e-5)


def test_prompt_logprobs_match_transformers_on_the_gpu():
    from gpu_models import serving_model, tiny_hf

    hf = tiny_hf(dtype=torch.float32)
    model = serving_model(hf, dtype=torch.float32)
    prompt = torch.randint(3, 512, (300,), generator=torch.Generator().manual_seed(4)).tolist()
    got = model.prompt_logprobs(prompt, top=2, rows_per_chunk=64)
    with torch.no_grad():
        ref = torch.log_softmax(hf(torch.tensor([prompt], device="cuda")).logits[0].float(), dim=-1)
    assert len(got) == len(prompt) - 1
    for p, (lp, top, _rank) in enumerate(got, start=1):
        assert abs(lp - ref[p - 1, prompt[p]].item()) < 1e-3
        assert top[0][0] == int(ref[p - 1].argmax())


@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-3), (torch.bfloat16, 0.05)])
def test_next_token_logits_job_matches_transformers_on_the_gpu(dtype, tol):
    """The job /v1/rerank and /v1/score run (EmbeddingJob with ``project``): chosen tokens' logits after each
    sequence, the LM head's rows on the pooled last hidden state, against transformers' last-position logits."""
    from collections import Counter

    from gpu_models import serving_model, tiny_hf

    from flared.runtime.worker import EmbeddingJob

    hf = tiny_hf(dtype=dtype)
    model = serving_model(hf, dtype=dtype)
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(3, 512, (n,), generator=g).tolist() for n in (1, 9, 120, 300)]
    answers = (17, 42)
    got = {}
    job = EmbeddingJob(prompts, "last", False, lambda value, error: got.update(value=value, error=error),
                       project=answers, counter="relevance")
    stats = Counter()
    while not job.step(model, 128, stats):  # 300 tokens: the long prompt runs in chunks of the budget
        pass
    out = job.result()
    assert out.shape == (4, 2) and out.device.type == "cpu" and stats["relevance_sequences"] == 4
    for i, p in enumerate(prompts):
        with torch.no_grad():
            ref = hf(torch.tensor([p], device="cuda")).logits[0, -1].float()
        scale = ref.abs().max().item()
        assert (out[i] - ref[list(answers)].cpu()).abs().max().item() <= tol * scale
