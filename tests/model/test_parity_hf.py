"""Parity with transformers on random-weight tiny models of every family:
logits of a batched, paged, chunked-prefill + decode run, and greedy tokens."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from flared._fast.pages import PageAllocator
from flared.model.batch import ForwardBatch, SequenceChunk
from flared.model.decoder import DecoderModel
from flared.model.loader import read_source
from flared.model.runner import ModelRunner
from flared.model.sampling import SamplingParams

from .conftest import FAMILIES, build_hf_checkpoint

PROMPT_LENGTHS = (3, 11, 20, 7)
NUM_GREEDY_TOKENS = 64


def make_prompts(vocab_size: int, seed: int = 1) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(3, vocab_size, size=n).tolist() for n in PROMPT_LENGTHS]


def run_paged_greedy(model: DecoderModel, prompts, *, num_new_tokens: int, page_tokens: int, chunk_tokens: int):
    """Drive the forward directly: sequence i joins at step i, so prefill chunks of
    later sequences share forwards with decode steps of earlier ones. Returns, per
    sequence, the generated ids and the logits each was chosen from."""
    kv = model.make_kv_cache(num_pages=64, page_tokens=page_tokens, state_rows=len(prompts))
    allocator = PageAllocator(64)
    state = [dict(prompt=p, computed=0, pages=[], out=[], logits=[]) for p in prompts]
    step = 0
    while any(len(s["out"]) < num_new_tokens for s in state):
        chunks, owners = [], []
        for s in state[: step + 1]:
            if len(s["out"]) >= num_new_tokens:
                continue
            if s["computed"] < len(s["prompt"]):
                new = s["prompt"][s["computed"]: s["computed"] + chunk_tokens]
                needs = s["computed"] + len(new) == len(s["prompt"])
            else:
                new, needs = s["out"][-1:], True
            context = s["computed"] + len(new)
            missing = -(-context // page_tokens) - len(s["pages"])
            if missing > 0:
                s["pages"].extend(allocator.allocate(missing).tolist())
            chunks.append(SequenceChunk(new, s["computed"], s["pages"], needs, state_row=state.index(s)))
            owners.append((s, needs))
        batch = ForwardBatch.build(chunks, page_tokens=page_tokens, sliding_window=model.config.sliding_window,
                                   device=model.device)
        logits = model.forward(batch, kv)
        rows = iter(range(logits.shape[0]))
        for (s, needs), chunk in zip(owners, chunks):
            s["computed"] += len(chunk.token_ids)
            if needs:
                row = logits[next(rows)]
                s["logits"].append(row)
                s["out"].append(int(row.argmax()))
        step += 1
    for s in state:
        allocator.free(np.asarray(s["pages"], dtype=np.int32))
    allocator.check_integrity()
    assert allocator.num_free == 64
    return [(s["out"], torch.stack(s["logits"])) for s in state]


@pytest.fixture(scope="module", params=sorted(set(FAMILIES) - {"qwen3_wide"}))
def family_checkpoint(request, tmp_path_factory):
    from transformers import AutoModelForCausalLM

    directory = tmp_path_factory.mktemp(request.param)
    build_hf_checkpoint(request.param, directory)
    hf_model = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32)
    hf_model.eval()
    return request.param, directory, hf_model


def test_config_round_trips_through_a_manifest(family_checkpoint):
    """Every family's ModelConfig (its rope tables, layer lists, flags) comes back equal from a core manifest's JSON."""
    import json

    from flared.model.config import ModelConfig

    config = read_source(family_checkpoint[1]).config
    assert ModelConfig.from_dict(json.loads(json.dumps(config.to_dict()))) == config


def test_paged_chunked_logits_match_transformers(family_checkpoint):
    family, directory, hf_model = family_checkpoint
    source = read_source(directory)
    assert source.source_kind == "hf"
    model = DecoderModel(source.config, source.tensors, dtype=torch.float32)
    prompts = make_prompts(source.config.vocab_size)
    results = run_paged_greedy(model, prompts, num_new_tokens=24, page_tokens=4, chunk_tokens=5)
    for prompt, (out, logits) in zip(prompts, results):
        full = torch.tensor([prompt + out[:-1]])
        with torch.no_grad():
            hf_logits = hf_model(full).logits[0, len(prompt) - 1:].float()
        assert hf_logits.shape == logits.shape
        max_diff = (hf_logits - logits).abs().max().item()
        assert max_diff < 1e-4, f"{family}: max |logit diff| {max_diff}"


def test_runner_greedy_tokens_match_transformers_generate(family_checkpoint):
    family, directory, hf_model = family_checkpoint
    if family == "deepseek_v32":
        # A key at the indexer's top-k boundary changes a token's attention outright, and where two keys' index
        # scores differ in their last bits the order of the sums picks one: transformers' own cached decoding parts
        # from its full forward on this checkpoint (a 0.57 logit margin at one step). The paged test above holds
        # flared's logits to the full forward's along flared's tokens.
        pytest.skip("sparse attention's top-k boundary: transformers' cached and full forwards disagree here")
    source = read_source(directory)
    eos = hf_model.generation_config.eos_token_id
    eos_ids = {eos} if isinstance(eos, int) else set(eos or [])
    runner = ModelRunner(source.config, source.tensors, num_pages=48, page_tokens=8, max_batch=3,
                         prefill_chunk_tokens=6)
    prompts = make_prompts(source.config.vocab_size, seed=2)
    params = [SamplingParams(temperature=0, max_tokens=NUM_GREEDY_TOKENS)] * len(prompts)
    ours = runner.generate(prompts, params, stop_token_ids=eos_ids)
    assert runner.allocator.num_free == runner.num_pages
    runner.allocator.check_integrity()
    for prompt, result in zip(prompts, ours):
        with torch.no_grad():
            generated = hf_model.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                                          max_new_tokens=NUM_GREEDY_TOKENS, do_sample=False)[0, len(prompt):].tolist()
        expected = []
        for token in generated:
            expected.append(token)
            if token in eos_ids:
                break
        assert result.token_ids == expected, f"{family}: tokens differ"
        assert result.finish_reason == ("stop" if expected[-1] in eos_ids else "length")


def test_sharded_checkpoint_reads_like_single_file(tmp_path):
    from transformers import AutoModelForCausalLM

    single = build_hf_checkpoint("qwen2", tmp_path / "single")
    model = AutoModelForCausalLM.from_pretrained(single, dtype=torch.float32)
    model.save_pretrained(tmp_path / "sharded", max_shard_size="100KB")
    assert (tmp_path / "sharded" / "model.safetensors.index.json").is_file()
    a, b = read_source(single), read_source(tmp_path / "sharded")
    assert a.config == b.config
    assert a.tensors.keys() == b.tensors.keys()
    for name in a.tensors:
        assert torch.equal(a.tensors[name], b.tensors[name]), name


def test_embeddings_match_transformers_hidden_states(family_checkpoint):
    """DecoderModel.pooled_embeddings pools the final-normed hidden states transformers returns (hidden_states[-1]):
    the last token's, or the mean over the tokens; normalized to unit length when asked."""
    family, directory, hf_model = family_checkpoint
    source = read_source(directory)
    model = DecoderModel(source.config, source.tensors, dtype=torch.float32)
    prompts = make_prompts(source.config.vocab_size, seed=3) + [[5], list(range(3, 40))]  # one token; > a window
    last = model.pooled_embeddings(prompts, pooling="last", normalize=False)
    mean = model.pooled_embeddings(prompts, pooling="mean", normalize=False)
    unit = model.pooled_embeddings(prompts)
    # in chunks of 8 tokens (every prompt of over 8 alone, each chunk attending to the ones before): the same
    chunked_last = model.pooled_embeddings(prompts, pooling="last", normalize=False, chunk_tokens=8)
    chunked_mean = model.pooled_embeddings(prompts, pooling="mean", normalize=False, chunk_tokens=8)
    assert torch.allclose(chunked_last, last, atol=1e-5) and torch.allclose(chunked_mean, mean, atol=1e-5)
    assert last.shape == mean.shape == (len(prompts), source.config.hidden_size) and last.dtype == torch.float32
    for i, prompt in enumerate(prompts):
        with torch.no_grad():
            hidden = hf_model(torch.tensor([prompt]), output_hidden_states=True).hidden_states[-1][0].float()
        assert (last[i] - hidden[-1]).abs().max().item() < 1e-4, family
        assert (mean[i] - hidden.mean(dim=0)).abs().max().item() < 1e-4, family
        assert torch.allclose(unit[i], hidden[-1] / hidden[-1].norm(), atol=1e-5)
    # a sequence's embedding does not depend on what it was batched with
    assert torch.allclose(model.pooled_embeddings([prompts[1]]), unit[1:2], atol=1e-6)
    with pytest.raises(ValueError):
        model.pooled_embeddings([[1, 2], []])


def test_prompt_logprobs_match_transformers(family_checkpoint):
    """DecoderModel.prompt_logprobs: each prompt token's log-probability given the tokens before it, and the
    most likely alternatives there, from transformers' logits of the same weights."""
    family, directory, hf_model = family_checkpoint
    source = read_source(directory)
    model = DecoderModel(source.config, source.tensors, dtype=torch.float32)
    prompt = list(range(3, 40))  # longer than mistral's window
    got = model.prompt_logprobs(prompt, top=3, rows_per_chunk=8)  # several LM-head chunks
    chunked = model.prompt_logprobs(prompt, top=3, rows_per_chunk=3, chunk_tokens=7)  # and prefill chunks
    # (OLMo Hybrid's beta up to 2 lets the delta rule's float32 rounding grow a little faster between chunkings)
    tolerance = 3e-5 if family == "olmo_hybrid" else 1e-5
    assert len(chunked) == len(got) and all(abs(a[0] - b[0]) < tolerance and [t for t, _ in a[1]] == [t for t, _ in b[1]]
                                            for a, b in zip(chunked, got))
    with torch.no_grad():
        ref = torch.log_softmax(hf_model(torch.tensor([prompt])).logits[0].float(), dim=-1)
    assert len(got) == len(prompt) - 1
    for p, (lp, top, rank) in enumerate(got, start=1):
        assert abs(lp - ref[p - 1, prompt[p]].item()) < 1e-4, family
        value = ref[p - 1, prompt[p]]  # the rank, up to ties within the tolerance
        assert int((ref[p - 1] > value + 1e-4).sum()) + 1 <= rank <= int((ref[p - 1] > value - 1e-4).sum()) + 1
        values, ids = ref[p - 1].topk(3)
        assert [t for t, _ in top] == ids.tolist()
        assert max(abs(v - w) for (_, v), w in zip(top, values.tolist())) < 1e-4
    assert model.prompt_logprobs([7]) == [] and all(t == () for _, t, _ in model.prompt_logprobs([7, 8, 9]))


def test_model_jobs_run_a_long_sequence_a_chunk_a_turn(family_checkpoint):
    """The model thread's jobs (flared.runtime.worker): a sequence longer than a turn's budget runs one prefill
    chunk a turn, so live requests' steps go on between its chunks, and the result is the one-call result."""
    from collections import Counter

    from flared.runtime.worker import EmbeddingJob, PromptLogprobsJob

    family, directory, _ = family_checkpoint
    source = read_source(directory)
    model = DecoderModel(source.config, source.tensors, dtype=torch.float32)
    lists = [list(range(3, 9)), list(range(3, 40)), [5, 6], list(range(10, 14))]  # short, long, short, short
    for pooling in ("last", "mean"):
        job, stats, turns = EmbeddingJob(lists, pooling, True, done=None), Counter(), 1
        while not job.step(model, 8, stats):
            turns += 1
        assert turns == 1 + 5 + 1  # the first; the 37-token one in 5 chunks of 8; the last two together
        assert torch.allclose(job.result(), model.pooled_embeddings(lists, pooling=pooling), atol=1e-5), family
        assert stats["embedded_sequences"] == 4 and stats["embedded_tokens"] == sum(map(len, lists))
    job, stats, turns = PromptLogprobsJob(lists[1], 2, done=None), Counter(), 1
    while not job.step(model, 8, stats):
        turns += 1
    assert turns == 5 + 1  # a chunk a turn, then the end
    want = model.prompt_logprobs(lists[1], top=2)
    assert len(job.result()) == len(want) and all(abs(a[0] - b[0]) < 1e-5 and a[2] == b[2]
                                                  for a, b in zip(job.result(), want))
    assert stats["scored_prompt_tokens"] == len(lists[1])


def test_next_token_logits_job_matches_transformers(family_checkpoint):
    """The job /v1/rerank and /v1/score run (EmbeddingJob with ``project``): the chosen tokens' logits after each
    sequence, the LM head's rows on the final-normed last hidden state, are transformers' last-position logits;
    a sequence longer than a turn's budget runs a chunk a turn with the same result."""
    from collections import Counter

    from flared.runtime.worker import EmbeddingJob

    family, directory, hf_model = family_checkpoint
    source = read_source(directory)
    model = DecoderModel(source.config, source.tensors, dtype=torch.float32)
    lists = [[5], list(range(3, 40)), list(range(10, 14))]
    answers = (7, 11, 3)
    job, stats = EmbeddingJob(lists, "last", False, done=None, project=answers, counter="relevance"), Counter()
    while not job.step(model, 8, stats):
        pass
    out = job.result()
    assert out.shape == (3, 3) and stats["relevance_sequences"] == 3 and stats["embedded_sequences"] == 0
    for i, tokens in enumerate(lists):
        with torch.no_grad():
            ref = hf_model(torch.tensor([tokens])).logits[0, -1].float()
        assert (out[i] - ref[list(answers)]).abs().max().item() < 1e-4 * max(1.0, ref.abs().max().item()), family


@pytest.mark.parametrize("family", ["cohere2", "deepseek_v2", "ernie4_5", "exaone4", "gemma2", "gemma3", "glm4",
                                    "glm4_moe", "gpt_oss", "granite", "olmo3", "phi4_mini", "qwen3_5", "qwen3_moe",
                                    "qwen3_next", "smollm3", "lfm2", "lfm2_moe", "granite4_h", "granite4_h_moe",
                                    "nemotron_h", "nemotron_h_moe", "falcon_h1", "falcon_h1_norm", "gemma4",
                                    "gemma4_values", "gemma4_moe", "gemma4_e2b", "bamba", "jamba", "mamba",
                                    "mamba2", "falcon_mamba", "kimi_linear", "apertus",
                                    "ernie4_5_moe", "glm4_moe_lite", "dots1", "hunyuan",
                                    "hunyuan_moe"])
def test_bf16_follows_float32(family, tmp_path):
    """The families whose layers are not Llama's, in bf16: the same likely next tokens as float32, their logprobs
    parted from float32's by no more than twice what transformers' own bf16 parts from its float32 (0.03-0.13 on
    these weights); a wrong layer, norm or route moves them by whole units."""
    from transformers import AutoModelForCausalLM

    directory = build_hf_checkpoint(family, tmp_path)
    source = read_source(directory)
    prompts = make_prompts(source.config.vocab_size, seed=4)[:2]
    tops, theirs = {}, {}
    for dtype in (torch.float32, torch.bfloat16):
        runner = ModelRunner(source.config, source.tensors, dtype=dtype, num_pages=32, page_tokens=8, max_batch=2)
        results = runner.generate(prompts, [SamplingParams(temperature=0, max_tokens=1, logprobs=5)] * 2)
        tops[dtype] = [dict(r.logprobs[0].top) for r in results]
        hf = AutoModelForCausalLM.from_pretrained(directory, dtype=dtype).eval()
        with torch.no_grad():
            theirs[dtype] = [torch.log_softmax(hf(torch.tensor([p])).logits[0, -1].float(), -1) for p in prompts]
    ours_drift = reference = 0.0  # the largest over the prompts: one prompt's roundings may land either side
    for i, (a, b) in enumerate(zip(tops[torch.float32], tops[torch.bfloat16])):
        shared = a.keys() & b.keys()
        # the same likely tokens (a near tie may swap two of them), or as many as transformers' own bf16 keeps of its
        # float32's five (a route an expert choice flips in bf16 moves whole logprobs, theirs as ours)
        top_hf = [set(theirs[dtype][i].topk(5).indices.tolist()) for dtype in (torch.float32, torch.bfloat16)]
        assert len(shared) >= min(4, len(top_hf[0] & top_hf[1])), family
        reference = max(reference, *(abs(theirs[torch.float32][i][t] - theirs[torch.bfloat16][i][t]).item()
                                     for t in shared))
        ours_drift = max(ours_drift, *(abs(a[t] - b[t]) for t in shared))
    assert ours_drift <= max(0.05, 2 * reference), family
