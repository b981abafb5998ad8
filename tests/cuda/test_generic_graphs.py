"""CUDA graphs over a model's own torch layers (kernels/paged_decoder.py's generic decoder, flared/model/graph_layers.py):
families outside the Llama layer (Gemma 3's windows and sandwich norms, partial rotary, post-norms, LayerNorms,
multipliers, routed experts, gpt-oss' sinks) captured and replayed by the GraphExecutor. float32: greedy tokens equal
the CPU eager executor's and transformers'; bf16 (routed experts' grouped products): each token transformers' float32
argmax or within a rounding of it.
Skipped without a GPU (tests/cuda/conftest.py)."""

import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
sys.path.insert(0, str(Path(__file__).parent))
sys.path.insert(0, str(Path(__file__).parents[1]))

from gpu_models import argmax_distance, make_cpu_executor, make_executor, make_scheduler  # noqa: E402

PROMPTS = [list(range(5, 155)), list(range(200, 210)), [7], list(range(300, 340))]
FLOAT32 = ["gemma2", "gemma3", "phi4_mini", "olmo2", "granite", "ministral", "cohere", "stablelm", "gpt_neox", "smollm3",
           "hunyuan", "starcoder2", "gemma", "llama_head24", "ministral3", "hyperclovax", "olmo", "nanochat", "gemma4",
           "gemma4_values", "gemma4_e2b", "youtu", "minicpm3", "vaultgemma", "jais2", "gpt2", "gpt_bigcode",
           "gpt_bigcode_mha", "gptj", "falcon", "falcon_new", "falcon_seq", "bloom", "mpt", "opt", "granite_swa", "stablelm_12b", "gpt_neo"]
# (deepseek_v2/v3: latent attention served absorbed, triton_mla's kernels; Gemma 4: global layers' wider heads)
BF16 = ["mixtral", "qwen3_moe", "olmoe", "ernie4_5_moe", "gpt_oss", "gemma3", "phi4_mini", "deepseek_v2", "deepseek_v3",
        "phimoe", "gemma4_moe", "gemma4", "flex_olmo", "mellum", "cohere2_moe", "cohere2_moe_rms"]


def params(**kw):
    from flared.model.sampling import SamplingParams

    kw.setdefault("max_tokens", 24)
    kw.setdefault("temperature", 0.0)
    return SamplingParams(**kw)


def _transformers(directory):
    """transformers' float32 model of the checkpoint on the GPU (eager attention: its SDPA path drops Gemma 2's soft
    cap), or None where this machine's transformers does not know the family (the CPU parity tests hold flared to a
    newer one)."""
    from transformers import AutoModelForCausalLM

    try:
        return AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32,
                                                    attn_implementation="eager").to("cuda").eval()
    except (KeyError, ValueError) as error:
        print(f"transformers here cannot build {directory.name}: {error}")
        return None


def _model(family, tmp_path, device, dtype):
    from flared_testing.checkpoints import build_hf_checkpoint

    from flared.model.decoder import DecoderModel
    from flared.model.loader import read_source

    directory = tmp_path / family
    if not (directory / "config.json").exists():
        try:
            build_hf_checkpoint(family, directory)
        except (KeyError, ValueError) as error:  # (a family newer, or older, than this machine's transformers:
            # tools/gpu_family_check.py carries its checkpoint from a machine that can build it)
            pytest.skip(f"this machine's transformers cannot build {family}: {error}"[:300])
    source = read_source(directory)
    return DecoderModel(source.config, source.tensors, dtype=dtype, device=device, max_positions=512), directory


@pytest.mark.parametrize("family", FLOAT32)
def test_float32_graph_tokens_equal_the_cpu_path_and_transformers(family, tmp_path):
    from flared.execution.offline import drive

    model, directory = _model(family, tmp_path, "cuda", torch.float32)
    assert model.config.kernels_obstacle is not None  # (the Llama kernels do not run it)
    ex = make_executor(model)
    ticks = iter(range(1, 10**9))
    try:
        assert ex.graphs.decoder.generic
        result = drive(make_scheduler(), ex, PROMPTS, [params()] * len(PROMPTS), clock_ns=lambda: next(ticks))
        assert ex.max_outstanding == 2
    finally:
        ex.close()
    cpu_model, _ = _model(family, tmp_path, "cpu", torch.float32)
    cpu = drive(make_scheduler(), make_cpu_executor(cpu_model), PROMPTS, [params()] * len(PROMPTS))
    assert result.tokens == cpu.tokens
    hf = _transformers(directory)
    if hf is None:
        return
    for prompt, tokens in zip(PROMPTS, result.tokens):
        ids = torch.tensor([prompt], device="cuda")
        out = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=24, min_new_tokens=24,
                          do_sample=False, eos_token_id=None, pad_token_id=0)
        assert out[0, len(prompt):].tolist() == tokens


@pytest.mark.parametrize("family", BF16)
def test_bf16_graph_tokens_are_as_near_float32_as_the_eager_executors(family, tmp_path):
    """bf16 (routed experts run only there, as grouped products; the split decode attention too). bf16 runs part at
    near-ties, and a router's near-tie swaps an expert, so no bf16 sequence is the reference: each run's tokens are
    judged against transformers' float32 logits teacher-forced on those tokens (how far each chosen token is from
    the step's argmax, over the logits' range), and the graphs' tokens must be as near as the eager executor's (the
    torch forward that served these families on a GPU before, held to transformers' bf16 tokens by
    test_eager_gpu.py)."""
    from flared.execution.eager import EagerExecutor
    from flared.execution.offline import drive

    model, directory = _model(family, tmp_path, "cuda", torch.bfloat16)
    hf = _transformers(directory)
    if hf is None:
        pytest.skip(f"no float32 reference for {family} from this machine's transformers")
    ex = make_executor(model)
    try:
        assert ex.graphs.decoder.generic
        graphs = drive(make_scheduler(), ex, PROMPTS, [params()] * len(PROMPTS)).tokens
    finally:
        ex.close()
    eager = drive(make_scheduler(), EagerExecutor(model, num_pages=128, page_tokens=16, num_state_rows=5,
                                                  num_snapshots=16, vocab_size=model.config.vocab_size, max_live=4),
                  PROMPTS, [params()] * len(PROMPTS)).tokens
    (g_exact, g_gap), (e_exact, e_gap) = argmax_distance(hf, PROMPTS, graphs), argmax_distance(hf, PROMPTS, eager)
    total = len(PROMPTS) * 24
    assert g_exact >= min(e_exact - 0.1 * total, 0.8 * total), (family, g_exact, e_exact, total)
    assert g_gap <= e_gap + 0.02, (family, g_gap, e_gap)
    print(f"{family}: graphs {g_exact}/{total} argmax (mean gap {g_gap:.4f}), eager {e_exact}/{total} ({e_gap:.4f})")


@pytest.mark.parametrize("kind", ["sinks", "softcap", "alibi"])
def test_sinks_and_soft_caps_in_the_kernels(kind):
    """gpt-oss' sinks (a logit per query head in each softmax, giving no value: the one-pass decode kernel and the
    prefill kernel, exp2 and exp forms), Gemma 2's soft caps (those and the split decode kernel) and BLOOM's ALiBi
    biases (slope * (key position - query position): the one-pass decode and the prefill kernels) against float64
    torch over the same paged pool."""
    from flared.model.config import alibi_slopes
    from flared.model.triton_attention import (paged_decode_attention, paged_decode_attention_split,
                                               paged_prefill_attention_varlen)

    torch.manual_seed(0)
    nh, nkv, d, page, pages = 8, 2, 64, 16, 40
    for dtype, tol in ((torch.float32, 1e-5), (torch.bfloat16, 2e-2)):
        k_pool = torch.randn(pages * page, nkv, d, device="cuda").to(dtype)
        v_pool = torch.randn(pages * page, nkv, d, device="cuda").to(dtype)
        sinks = torch.randn(nh, device="cuda") * 2 if kind == "sinks" else None
        alibi = torch.tensor(alibi_slopes(nh), device="cuda") if kind == "alibi" else None
        cap = 3.0 if kind == "softcap" else 0.0
        q_scale = 8.0 if cap else 1.0  # (large scores, so that the cap bends them)
        tables = torch.randperm(pages, device="cuda").to(torch.int32).view(4, 10)
        lens = torch.tensor([0, 1, 37, 150], dtype=torch.int32, device="cuda")
        scale = d ** -0.5

        def reference(q, row, positions, window=0):  # q [n, nh, d] at positions of sequence ``row``
            slots = (tables[row].long()[:, None] * page + torch.arange(page, device="cuda")).flatten()
            out = []
            for qi, p in zip(q, positions):
                first = max(0, p - window + 1) if window else 0
                s = slots[first:p + 1]
                keys = k_pool[s].double().repeat_interleave(nh // nkv, 1)
                values = v_pool[s].double().repeat_interleave(nh // nkv, 1)
                scores = torch.einsum("hd,lhd->hl", qi.double(), keys) * scale
                if alibi is not None:
                    scores = scores + alibi.double()[:, None] * (torch.arange(first, p + 1, device="cuda") - p)
                    probs = scores.softmax(-1)
                elif cap:
                    scores = cap * torch.tanh(scores / cap)
                    probs = scores.softmax(-1)
                else:
                    probs = torch.cat([scores, sinks.double()[:, None]], 1).softmax(-1)[:, :-1]
                out.append(torch.einsum("hl,lhd->hd", probs, values))
            return torch.stack(out)

        for window in (0, 16):
            q = (torch.randn(4, nh, d, device="cuda") * q_scale).to(dtype)
            out = torch.empty_like(q)
            paged_decode_attention(q, k_pool, v_pool, out, tables, lens, page_tokens=page, scale=scale, window=window,
                                   sinks=sinks, softcap=cap, alibi=alibi)
            assert out[0].abs().max().item() == 0  # the padding row
            for r in range(1, 4):
                want = reference(q[r:r + 1], r, [int(lens[r]) - 1], window)
                assert (out[r].double() - want[0]).abs().max().item() <= tol, (dtype, window, r)
            if cap and dtype == torch.bfloat16:
                split = torch.empty_like(q)
                scratch = 4 * nh * 4
                part_acc = torch.empty(scratch * d, device="cuda")
                part_m, part_l = torch.empty(scratch, device="cuda"), torch.empty(scratch, device="cuda")
                paged_decode_attention_split(q, k_pool, v_pool, split, tables, lens, part_acc, part_m, part_l,
                                             num_splits=4, page_tokens=page, scale=scale, window=window, softcap=cap)
                for r in range(1, 4):
                    want = reference(q[r:r + 1], r, [int(lens[r]) - 1], window)
                    assert (split[r].double() - want[0]).abs().max().item() <= tol, (window, r)
            # prefill: 30 new rows of sequence 0 after 20 cached, 12 of sequence 1 after none
            meta = torch.tensor([[20, 30], [0, 12]], dtype=torch.int32, device="cuda")
            q = (torch.randn(64, nh, d, device="cuda") * q_scale).to(dtype)
            out = torch.zeros_like(q)
            paged_prefill_attention_varlen(q, k_pool, v_pool, out, tables[:2], meta, page_tokens=page, scale=scale,
                                           window=window, sinks=sinks, softcap=cap, alibi=alibi)
            want = torch.cat([reference(q[:30], 0, range(20, 50), window), reference(q[30:42], 1, range(12), window)])
            assert (out[:42].double() - want).abs().max().item() <= tol, (dtype, window)


@pytest.mark.parametrize("family", ["gemma3", "gemma4_e2b", "gemma4_values", "minicpm3"])
def test_prefix_hit_and_sampling_on_generic_graphs(family, tmp_path):
    """A repeated prompt restores from the prefix cache with the same tokens; seeded sampling reproduces (Gemma 4:
    snapshots of its kv layers only, their slots' wider rows; MiniCPM3: latent rows and no values)."""
    from flared.execution.offline import drive

    model, _ = _model(family, tmp_path, "cuda", torch.float32)
    ex = make_executor(model)
    sched = make_scheduler()
    try:
        first = drive(sched, ex, [PROMPTS[0]], [params(max_tokens=8)])
        second = drive(sched, ex, [PROMPTS[0]], [params(max_tokens=8)])
        assert first.tokens == second.tokens
        assert second.steps_by_kind.get("RESTORE", 0) >= 1
        p = params(max_tokens=12, temperature=0.9, top_p=0.9, top_k=40, seed=7)
        a = drive(make_scheduler(), ex, [PROMPTS[1]], [p]).tokens
        b = drive(make_scheduler(), ex, [PROMPTS[1]], [p]).tokens
        assert a == b
    finally:
        ex.close()


@pytest.mark.parametrize("family, why", [("qwen3_5", "Gated DeltaNet"), ("deepseek_v3", "float32"),
                                         ("llama4", "chunked"), ("deepseek_v32", "indexer"),
                                         ("glm_moe_dsa", "indexer")])
def test_refused_families_keep_the_eager_executor(family, why, tmp_path):
    model, _ = _model(family, tmp_path, "cuda", torch.float32)
    with pytest.raises(Exception, match=why):
        make_executor(model)
