"""The CUDA graphs' generic decoder (kernels/paged_decoder.py: a model outside the Llama layer captured through its own
torch layers, DecoderModel._layer_stack, with the paged attention kernels in place of the gathers) checked on the CPU:
its layer plumbing (the attention hook, each layer's window, the pools it writes by kv index, the family's logits)
against the eager forward, with a torch oracle of the kernels' contract standing in for Triton, which needs a GPU.
tests/cuda/test_generic_graphs.py runs the real kernels in captured graphs."""

from __future__ import annotations


import pytest
import torch

from flared.model.decoder import DecoderModel
from flared.model.graph_layers import attention_sinks, generic_layers, layer_pool
from flared.model.loader import read_source

from .conftest import build_hf_checkpoint
from .test_parity_hf import run_paged_greedy

PAGE_TOKENS = 4
NEW_TOKENS = 8
PROMPT = [5, 17, 3, 42, 9, 33, 8, 21, 14, 7, 60, 11, 25]  # 13 tokens: pages of 4 cut it

# Families whose layers only the generic graphs run (ModelConfig.kernels_obstacle set, torch_graphs_obstacle None):
# windows on some layers, experts, partial and no rotary, post-norms, LayerNorms and parallel blocks, multipliers,
# latent attention, head dims that are not powers of two.
GENERIC = ["gemma3", "gemma", "mixtral", "qwen3_moe", "olmoe", "dots1", "ernie4_5_moe", "phi4_mini", "stablelm",
           "phi", "gpt_neox", "olmo2", "smollm3", "granite", "cohere", "cohere2", "starcoder2", "nemotron", "hunyuan",
           "ministral", "apertus", "glm", "gpt_oss", "granitemoe_swa", "gemma2", "ministral3", "hyperclovax", "sarvam_moe", "nanochat", "phimoe", "olmo", "deepseek_v2", "deepseek_v3",
           "glm4_moe_lite", "llama_head24", "gemma4", "gemma4_values", "gemma4_moe", "gemma4_e2b",
           "youtu", "vaultgemma", "jais2", "flex_olmo", "mellum", "gpt2", "gpt_bigcode", "gpt_bigcode_mha", "gptj", "falcon",
           "falcon_new", "falcon_seq", "minicpm3", "bloom", "mpt", "opt", "granite_swa", "stablelm_12b", "cohere2_moe",
           "cohere2_moe_rms", "gpt_neo"]
# ... and what it refuses (the eager executor serves those on a GPU)
REFUSED = {"qwen3_5": "Gated DeltaNet", "llama4": "chunked", "deepseek_v32": "indexer", "glm_moe_dsa": "indexer",
           "falcon_rw": "Falcon-RW's ALiBi"}


def _oracle(k_pool, v_pool, slots_of, positions, scale):
    """attend(q [T, nh, d], kv_index, out, window, sinks) as the Triton kernels compute it: row t, at position
    positions[t], attends the keys of positions (p - window, p] (window 0: [0, p]) held at slots_of[position],
    each head's sink (if any) one more logit in its softmax, the scores soft-capped where ``softcap`` and biased by
    ALiBi's slope * (key position - p) where ``alibi``."""
    def attend(q, layer, out, window=None, sinks=None, softcap=0.0, geometry=None, alibi=None, latent=0):
        nh = q.shape[1]
        if latent:  # (absorbed latent attention: one row a key, its first ``latent`` the value)
            k_layer = k_pool[layer]
            v_layer = k_layer[..., :latent]
        else:
            k_layer, v_layer = layer_pool(k_pool[layer], geometry), layer_pool(v_pool[layer], geometry)
        nkv = k_layer.shape[1]
        for t, p in enumerate(positions.tolist()):
            first = max(0, p - window + 1) if window else 0
            slots = slots_of[first:p + 1]
            keys = k_layer[slots].float().repeat_interleave(nh // nkv, dim=1)  # [L, nh, d]
            values = v_layer[slots].float().repeat_interleave(nh // nkv, dim=1)
            scores = torch.einsum("hd,lhd->hl", q[t].float(), keys) * scale
            if alibi is not None:  # (BLOOM: slope * (key position - the row's))
                scores = scores + alibi[:, None] * (torch.arange(first, p + 1) - p)
            if softcap:
                scores = softcap * torch.tanh(scores / softcap)
            if sinks is not None:
                scores = torch.cat([scores, sinks.float()[:, None]], dim=1)
            probs = scores.softmax(-1)[:, :keys.shape[0]]
            out[t] = torch.einsum("hl,lhd->hd", probs, values).to(out.dtype)
    return attend


def _generic_greedy(model: DecoderModel, prompt: list[int], new_tokens: int) -> tuple[list[int], torch.Tensor]:
    """The prompt as one prefill chunk, then a decode row a step, through PagedCudaDecoder's generic layers over
    scattered pages; the greedy tokens and the logits each was chosen from."""
    c = model.config
    total = len(prompt) + new_tokens
    pages = torch.randperm(-(-total // PAGE_TOKENS) + 5, generator=torch.Generator().manual_seed(3))
    slots_of = torch.tensor([int(pages[p // PAGE_TOKENS]) * PAGE_TOKENS + p % PAGE_TOKENS for p in range(total)])
    shape = (len(c.kv_layers), (len(pages) + 1) * PAGE_TOKENS, c.kv_storage_heads, c.kv_row_dim)
    k_pool = torch.zeros(shape, dtype=model.dtype)
    v_pool = torch.zeros((*shape[:2], c.kv_value_rows, c.kv_row_dim), dtype=model.dtype)
    sinks = attention_sinks(model)
    tokens, logits = [], []
    rows = torch.tensor(prompt)
    positions = torch.arange(len(prompt))
    while len(tokens) < new_tokens:
        attend = _oracle(k_pool, v_pool, slots_of, positions, model.scale)
        x = generic_layers(model, k_pool, v_pool, rows, positions, slots_of[positions], attend, sinks)
        row = model._logits(x[-1:])[0]
        logits.append(row)
        tokens.append(int(row.argmax()))
        rows = torch.tensor(tokens[-1:])
        positions = torch.tensor([len(prompt) + len(tokens) - 1])
    return tokens, torch.stack(logits)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    cache = {}

    def get(family):
        if family not in cache:
            cache[family] = build_hf_checkpoint(family, tmp_path_factory.mktemp(family))
        return cache[family]
    return get


@pytest.mark.parametrize("family", GENERIC)
def test_generic_layers_match_the_eager_forward(family, checkpoints):
    source = read_source(checkpoints(family))
    c = source.config
    assert c.kernels_obstacle is not None and c.torch_graphs_obstacle("bfloat16") is None, c.kernels_obstacle
    model = DecoderModel(c, source.tensors)
    ((want, want_logits),) = run_paged_greedy(model, [PROMPT], num_new_tokens=NEW_TOKENS, page_tokens=PAGE_TOKENS,
                                              chunk_tokens=5)
    got, got_logits = _generic_greedy(model, PROMPT, NEW_TOKENS)
    assert got == want
    torch.testing.assert_close(got_logits, want_logits, atol=2e-4, rtol=2e-4)


@pytest.mark.parametrize("family", sorted(REFUSED))
def test_what_the_generic_graphs_refuse(family, checkpoints):
    c = read_source(checkpoints(family)).config
    assert REFUSED[family] in c.torch_graphs_obstacle("bfloat16")


def test_routed_experts_need_bf16_grouped_products(checkpoints):
    c = read_source(checkpoints("mixtral")).config
    assert "float32" in c.torch_graphs_obstacle("float32")
    assert c.torch_graphs_obstacle("bfloat16") is None
    assert read_source(checkpoints("gemma3")).config.torch_graphs_obstacle("float32") is None


def test_a_head_dim_not_a_power_of_two_keeps_the_llama_kernels_off(checkpoints):
    """A Llama layer whose heads are 24 wide: the CPU runs it as any Llama (graph_obstacle None, its one-call step),
    the GPU's fused kernels do not (kernels_obstacle), the generic graphs do."""
    c = read_source(checkpoints("llama_head24")).config
    assert c.graph_obstacle is None and c.graph_capable
    assert c.kernels_obstacle == "head_dim 24, not a power of two"
    assert c.torch_graphs_obstacle("float32") is None
    assert read_source(checkpoints("llama3")).config.kernels_obstacle is None
