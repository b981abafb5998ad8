"""Hybrid models: Qwen3-Next's and Qwen3.5's Gated DeltaNet layers, LFM2's gated short convolutions (a recurrent
state per sequence beside the KV cache of the attention layers), against transformers on random weights, and served
by the daemon with its prefix cache, whose exact checkpoints carry the recurrent state (the families' parity runs are
in test_parity_hf.py)."""

from __future__ import annotations

import json

import pytest
import torch
import transformers

from flared.errors import CoreError, ErrorKind
from flared.model.config import from_hf_config
from flared.model.decoder import DecoderModel
from flared.model.loader import read_source
from flared.model.recurrent import chunked_gated_delta, gated_delta_step, prepare

from .conftest import build_hf_checkpoint
from .test_lora import write_adapter


def test_lfm2_reads_its_layer_kinds_and_mlp_width():
    """LFM2's config: the attention layers from layer_types or full_attn_idxs, the rest short convolutions; its MLP
    two thirds of block_ff_dim, times the multiplier, rounded up to block_multiple_of; biased convolutions refused."""
    hf = dict(model_type="lfm2", vocab_size=512, hidden_size=64, num_hidden_layers=4, num_attention_heads=4,
              num_key_value_heads=2, block_ff_dim=1000, block_multiple_of=64, block_ffn_dim_multiplier=1.5,
              full_attn_idxs=[1, 3])
    config = from_hf_config(hf)
    assert config.short_conv and config.linear_layers == (0, 2) and config.kv_layers == (1, 3)
    assert config.intermediate_size == 1024 and config.rope_theta == 1e6 and config.tie_word_embeddings
    assert config.linear_conv_dim == 64 and config.graph_obstacle == "short convolution layers"
    assert from_hf_config({**hf, "block_auto_adjust_ff_dim": False}).intermediate_size == 1000
    with pytest.raises(CoreError, match="conv_bias") as info:
        from_hf_config({**hf, "conv_bias": True})
    assert info.value.kind == ErrorKind.UNSUPPORTED_MODEL


def test_nemotron_h_pairs_its_blocks_into_layers():
    """Nemotron-H's blocks (hybrid_override_pattern's M * - E) paired into layers: a mixer with the MLP block right
    after it, a mixer alone, an MLP alone; the KV cache holds the attention layers; latent experts and a clamped time
    step refused."""
    from flared.model.config import layer_blocks, pair_blocks

    hf = dict(model_type="nemotron_h", vocab_size=512, hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
              head_dim=16, mamba_num_heads=4, mamba_head_dim=32, n_groups=2, ssm_state_size=16, intermediate_size=96,
              hybrid_override_pattern="M-MM*--*")
    config = from_hf_config(hf)
    assert layer_blocks(config) == pair_blocks(["linear_attention", "mlp", "linear_attention", "linear_attention",
                                                "full_attention", "mlp", "mlp", "full_attention"])
    assert layer_blocks(config) == [(0, 1), (2, None), (3, None), (4, 5), (None, 6), (7, None)]
    assert config.linear_layers == (0, 1, 2) and config.mlpless_layers == (1, 2, 5)
    assert config.mixerless_layers == (4,) and config.kv_layers == (3, 5) and config.nope_layers == (3, 5)
    assert not config.mlp_gated and config.hidden_act == "relu2" and not config.graph_capable
    for bad in ({"moe_latent_size": 32}, {"time_step_limit": [0.0, 10.0]}, {"mlp_hidden_act": "silu"}):
        with pytest.raises(CoreError) as info:
            from_hf_config({**hf, **bad})
        assert info.value.kind == ErrorKind.UNSUPPORTED_MODEL, bad


def test_falcon_h1_attends_beside_every_mixer():
    """Falcon-H1: every layer a Mamba-2 layer that attends too (its KV cached); its Mamba norm only with
    mamba_rms_norm, refused before the gate; its embedding and LM head multipliers kept, the logits' as a divisor."""
    hf = dict(model_type="falcon_h1", vocab_size=512, hidden_size=64, intermediate_size=96, num_hidden_layers=3,
              num_attention_heads=4, num_key_value_heads=2, head_dim=16, mamba_d_ssm=128, mamba_n_heads=4,
              mamba_n_groups=2, mamba_d_state=16, embedding_multiplier=3.0, lm_head_multiplier=0.25)
    config = from_hf_config(hf)
    assert config.linear_layers == config.kv_layers == (0, 1, 2) and config.parallel_mixers
    assert config.linear_value_dim == 32 and not config.linear_norm
    assert config.embedding_multiplier == 3.0 and config.logits_scaling == 4.0
    assert from_hf_config({**hf, "mamba_rms_norm": True, "mamba_norm_before_gate": False}).linear_norm
    with pytest.raises(CoreError, match="before its gate") as info:
        from_hf_config({**hf, "mamba_rms_norm": True})
    assert info.value.kind == ErrorKind.UNSUPPORTED_MODEL


def test_jamba_reads_its_layer_periods():
    """Jamba: every attn_layer_period-th layer (from attn_layer_offset) attends unrotated, the rest are Mamba-1 layers
    (the expanded width in channels of one state each, dt's rank hidden / 16 by default); every expert_layer_period-th
    layer's MLP is routed experts, the others dense."""
    hf = dict(model_type="jamba", vocab_size=512, hidden_size=72, intermediate_size=128, num_hidden_layers=8,
              num_attention_heads=4, num_key_value_heads=2, num_experts=4, num_experts_per_tok=2)
    config = from_hf_config(hf)
    assert config.linear_kind == "mamba1" and config.kv_layers == config.nope_layers == (4,)
    assert config.dense_layers == (0, 2, 4, 6) and config.num_experts == 4 and not config.norm_topk_prob
    assert config.linear_value_heads == 144 and config.linear_key_dim == 16 and config.linear_dt_rank == 5
    assert config.linear_conv_dim == 144 and config.graph_obstacle == "Mamba layers"
    assert from_hf_config({**hf, "num_experts": 1}).num_experts == 0


def test_kimi_linear_reads_its_released_config():
    """Kimi Linear's configs as released: linear_attn_config's layers numbered from 1, its own names for DeepSeek's
    expert keys, the first first_k_dense_replace MLPs dense; its attention layers unrotated latent attention."""
    hf = dict(model_type="kimi_linear", vocab_size=512, hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
              num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=4, kv_lora_rank=16, q_lora_rank=None,
              qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=16, num_experts=8, num_experts_per_token=2,
              num_expert_group=1, num_shared_experts=1, moe_renormalize=True, first_k_dense_replace=1,
              model_max_length=1048576, linear_attn_config={"full_attn_layers": [4], "kda_layers": [1, 2, 3],
                                                            "head_dim": 16, "num_heads": 4, "short_conv_kernel_size": 4})
    config = from_hf_config(hf)
    assert config.linear_kind == "kda" and config.linear_layers == (0, 1, 2) and config.nope_layers == (3,)
    assert config.kv_lora_rank == 16 and config.dense_layers == (0,) and config.num_experts == 8
    assert config.experts_per_token == 2 and config.router_sigmoid and config.shared_expert_intermediate_size == 32
    assert config.linear_conv_dim == 192 and config.max_position_embeddings == 1048576


def test_the_chunked_channel_delta_rule_equals_its_steps():
    """Kimi Delta Attention's chunked form (a decay per key channel) against one token at a time from the same state,
    across a chunk boundary."""
    from flared.model.recurrent import channel_delta_step, chunked_channel_delta

    g = torch.Generator().manual_seed(0)
    length, heads, dk, dv = 45, 2, 8, 6
    q, k = prepare(torch.randn(length, heads, dk, generator=g), torch.randn(length, heads, dk, generator=g), heads)
    v = torch.randn(length, heads, dv, generator=g)
    decay = -torch.rand(length, heads, dk, generator=g) * 2
    beta = torch.rand(length, heads, generator=g)
    start = torch.randn(heads, dk, dv, generator=g) * 0.1
    chunked_state = start.clone()
    chunked = chunked_channel_delta(q, k, v, decay, beta, chunked_state, chunk=16)
    state = start.clone()[None]
    steps = torch.cat([channel_delta_step(q[t:t + 1], k[t:t + 1], v[t:t + 1], decay[t:t + 1], beta[t:t + 1], state)
                       for t in range(length)])
    assert (chunked - steps).abs().max().item() < 1e-4
    assert (chunked_state - state[0]).abs().max().item() < 1e-4


def test_the_chunked_selective_scan_equals_its_steps():
    """Mamba-1's scan in blocks (decays and inputs as products, the block's states read at once) against one token at
    a time from the same state."""
    from flared.model.recurrent import chunked_selective_scan, selective_step

    g = torch.Generator().manual_seed(0)
    length, channels, size = 37, 12, 5
    u, b, c = torch.randn(length, channels, generator=g), torch.randn(length, size, generator=g), \
        torch.randn(length, size, generator=g)
    log_decay = -torch.rand(length, channels, size, generator=g)
    start = torch.randn(channels, size, generator=g)
    chunked_state = start.clone()
    chunked = chunked_selective_scan(u, b, c, log_decay, chunked_state, block=5)
    state = start.clone()[None]
    steps = torch.cat([selective_step(u[t:t + 1], b[t:t + 1], c[t:t + 1], log_decay[t:t + 1], state)
                       for t in range(length)])
    assert (chunked - steps).abs().max().item() < 1e-4
    assert (chunked_state - state[0]).abs().max().item() < 1e-4


def test_layer_types_default_to_every_fourth_layer_attending():
    hf = dict(model_type="qwen3_next", vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=8,
              num_attention_heads=4, num_key_value_heads=2, head_dim=16, linear_num_key_heads=2,
              linear_num_value_heads=4, linear_key_head_dim=8, linear_value_head_dim=16)
    config = from_hf_config(hf)
    assert config.linear_layers == (0, 1, 2, 4, 5, 6) and config.kv_layers == (3, 7)
    assert config.rotary_dim == 4 and config.attn_output_gate and config.graph_obstacle.startswith("Gated DeltaNet")
    assert from_hf_config({**hf, "full_attention_interval": 2}).kv_layers == (1, 3, 5, 7)
    with pytest.raises(CoreError, match="linear_attention or full_attention") as info:
        from_hf_config({**hf, "layer_types": ["mamba"] * 8})
    assert info.value.kind == ErrorKind.SOURCE_FORMAT


def test_chunked_and_step_forms_agree():
    """The chunked form over a sequence equals one recurrent step a token (state and outputs), across a chunk
    boundary and from a state carried in."""
    g = torch.Generator().manual_seed(0)
    length, nk, nv, dk, dv = 150, 2, 4, 8, 16
    q, k = prepare(torch.randn(length, nk, dk, generator=g), torch.randn(length, nk, dk, generator=g), nv)
    v = torch.randn(length, nv, dv, generator=g)
    decay = -torch.rand(length, nv, generator=g) * 2
    beta = torch.rand(length, nv, generator=g)
    start = torch.randn(nv, dk, dv, generator=g) * 0.1
    chunked_state = start.clone()
    chunked = chunked_gated_delta(q, k, v, decay, beta, chunked_state)
    state = start.clone()[None]
    steps = torch.cat([gated_delta_step(q[t:t + 1], k[t:t + 1], v[t:t + 1], decay[t:t + 1], beta[t:t + 1], state)
                       for t in range(length)])
    assert (chunked - steps).abs().max().item() < 1e-4
    assert (chunked_state - state[0]).abs().max().item() < 1e-4


@pytest.mark.parametrize("family", ["qwen3_5", "granite4_h"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_cpu_decode_step_equals_torchs(family, dtype, tmp_path):
    """Decode rows' gated delta rule (Qwen3.5) and decayed update (Mamba-2: Granite 4.0-H) in place on their state rows
    (flared/_fast/delta.pyx) against the gather, torch's ops and the scatter: the same logits through mixed prefill and
    decode batches, the same greedy tokens."""
    from .test_parity_hf import make_prompts, run_paged_greedy

    source = read_source(build_hf_checkpoint(family, tmp_path))
    model = DecoderModel(source.config, source.tensors, dtype=dtype)
    if not model.cpu_delta_step:
        pytest.skip("flared/_fast/delta.pyx is not built")
    prompts = make_prompts(source.config.vocab_size, seed=5)
    fast = run_paged_greedy(model, prompts, num_new_tokens=12, page_tokens=4, chunk_tokens=5)
    model.cpu_delta_step = False
    plain = run_paged_greedy(model, prompts, num_new_tokens=12, page_tokens=4, chunk_tokens=5)
    for (tokens, logits), (plain_tokens, plain_logits) in zip(fast, plain):
        assert tokens == plain_tokens
        assert (logits - plain_logits).abs().max().item() < (1e-5 if dtype == torch.float32 else 0.1)


def test_a_sequence_starts_from_a_zero_state_whatever_its_row_held(tmp_path):
    """A chunk with no cached tokens starts its sequence: its state row is zeroed first (whoever drives the forward:
    the daemon's INITIALIZE step does the same), and a chunk that continues a sequence reads its row as it is."""
    from flared.model.batch import ForwardBatch, SequenceChunk

    source = read_source(build_hf_checkpoint("qwen3_5", tmp_path))
    model = DecoderModel(source.config, source.tensors)
    kv = model.make_kv_cache(num_pages=8, page_tokens=4, state_rows=2)
    prompt = list(range(5, 17))

    def run(row: int, tokens, start: int = 0):
        return model.forward(ForwardBatch.build([SequenceChunk(tokens, start, list(range(4)), state_row=row)],
                                                page_tokens=4), kv)[0]

    clean = run(0, prompt)
    kv.states.ssm.normal_()  # every row full of another sequence's (here: noise) state
    kv.states.conv.normal_()
    assert torch.equal(run(1, prompt), clean)
    kv.states.ssm[:, 1].normal_()
    assert not torch.allclose(run(1, prompt[-1:], len(prompt) - 1), clean, atol=1e-3)


@pytest.mark.parametrize("family", ["qwen3_5", "qwen3_next"])
def test_the_kv_cache_holds_only_the_attention_layers(family, tmp_path):
    source = read_source(build_hf_checkpoint(family, tmp_path))
    config = source.config
    model = DecoderModel(config, source.tensors)
    kv = model.make_kv_cache(num_pages=4, page_tokens=8, state_rows=3)
    assert kv.keys.shape[0] == len(config.kv_layers) == 1 and kv.states.ssm.shape[:2] == (1, 3)
    assert "layers.0.qkv.weight" not in source.tensors and "layers.1.qkv.weight" in source.tensors
    # q rows, k, v, then the output gate's rows
    assert source.tensors["layers.1.qkv.weight"].shape[0] == 2 * config.q_size + 2 * config.kv_size
    with pytest.raises(ValueError, match="state rows"):
        model.make_kv_cache(num_pages=4, page_tokens=8)


def test_a_qwen3_5_checkpoint_reads_its_decoder_and_tower(tmp_path):
    """Qwen3.5 ships as Qwen3_5ForConditionalGeneration (decoder under model.language_model, a tower under
    model.visual): its decoder's logits on text are the whole model's; its tower is Qwen3-VL's without DeepStack
    (images end to end: tests/api/test_vision_qwen.py)."""
    from transformers import Qwen3_5Config, Qwen3_5ForConditionalGeneration

    from flared_testing.checkpoints import last_logits

    text = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
                head_dim=16, num_hidden_layers=2, layer_types=["linear_attention", "full_attention"],
                linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=8, linear_value_head_dim=16,
                initializer_range=0.1)
    vision = dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64)
    torch.manual_seed(0)
    hf = Qwen3_5ForConditionalGeneration(Qwen3_5Config(text_config=text, vision_config=vision, image_token_id=500,
                                                       video_token_id=501, vision_start_token_id=502,
                                                       vision_end_token_id=503)).eval()
    hf.save_pretrained(tmp_path)
    assert json.loads((tmp_path / "config.json").read_text())["model_type"] == "qwen3_5"
    source = read_source(tmp_path)
    assert source.config.linear_layers == (0,) and not source.config.tie_word_embeddings
    assert source.vision.family == "qwen3_vl" and source.vision.deepstack_layers == ()
    assert source.vision.mrope_section == (11, 11, 10)  # (transformers' default split of the 64 rotated dimensions)
    prompt = torch.randint(3, 500, (24,), generator=torch.Generator().manual_seed(3)).tolist()
    with torch.no_grad():
        expected = hf(input_ids=torch.tensor([prompt])).logits[0, -1]
    ours = last_logits(DecoderModel(source.config, source.tensors), prompt)
    assert (ours - expected).abs().max().item() < 1e-4


def test_adapters_do_not_reach_the_gated_delta_layers_or_the_gated_queries(tmp_path):
    from flared.model.lora import LoraAdapter, merge_adapters

    source = read_source(build_hf_checkpoint("qwen3_5", tmp_path / "hf"))
    write_adapter(tmp_path / "v", {"model.layers.1.self_attn.v_proj": (64, 32, False)})
    tensors = dict(source.tensors)
    merge_adapters(tensors, source.config, [LoraAdapter(tmp_path / "v")])  # v, k, o and the MLP are reached
    for module, what in (("model.layers.0.linear_attn.in_proj_qkv", "Gated DeltaNet"),
                         ("model.layers.1.self_attn.q_proj", "output gate")):
        write_adapter(tmp_path / "bad", {module: (64, 64, False)})
        with pytest.raises(CoreError, match=what) as info:
            merge_adapters(dict(source.tensors), source.config, [LoraAdapter(tmp_path / "bad")])
        assert info.value.kind == ErrorKind.UNSUPPORTED_MODEL


def _greedy(hf, prompt: list[int], count: int) -> list[int]:
    with torch.no_grad():
        out = hf.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                          max_new_tokens=count, do_sample=False, eos_token_id=None, pad_token_id=0)
    return out[0, len(prompt):].tolist()


@pytest.mark.parametrize("family", ["qwen3_next", "lfm2", "granite4_h", "nemotron_h", "falcon_h1", "jamba", "mamba2", "kimi_linear"])
def test_a_hybrid_core_serves_transformers_tokens_from_its_prefix_cache(family, tmp_path):
    """A Qwen3-Next or LFM2 core served by flared run: greedy chat tokens equal transformers'; asked again, the prompt comes
    from the prefix cache (its checkpoint restores the recurrent state beside the KV pages) with the same tokens; a
    follow-up turn resumes from the first turn's checkpoint and still gives transformers' tokens on the whole prompt.
    Prompt-lookup speculation is asked for and not used (a rejected draft would move the recurrent state on)."""
    from flared_testing.served import assert_served_greedy_equals_transformers

    directory = build_hf_checkpoint(family, tmp_path / "hf")
    hf = transformers.AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32).eval()
    first = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Tell me a story about a fox."}]

    def ask(daemon, messages):
        status, body = daemon.chat(messages, max_tokens=12, temperature=0, ignore_eos=True, logprobs=True,
                                   return_tokens_as_token_ids=True)
        assert status == 200, body
        tokens = [int(t["token"].split(":")[1]) for t in body["choices"][0]["logprobs"]["content"]]
        return tokens, body["usage"]["prompt_tokens_details"]["cached_tokens"], body

    def turns(daemon):
        from tokenizers import Tokenizer

        tok = Tokenizer.from_file(str(directory / "tokenizer.json"))

        def prompt_ids(messages):
            text = "".join(f"<{m['role']}>{m['content']}" for m in messages) + "<model>"
            return [2] + tok.encode(text, add_special_tokens=False).ids

        tokens, cached, body = ask(daemon, first)
        assert tokens == _greedy(hf, prompt_ids(first), 12)
        again, cached_again, _ = ask(daemon, first)
        assert again == tokens and cached_again > 0
        follow = first + [{"role": "assistant", "content": body["choices"][0]["message"]["content"]},
                          {"role": "user", "content": "And then?"}]
        more, cached_more, _ = ask(daemon, follow)
        assert cached_more > 0
        assert more == _greedy(hf, prompt_ids(follow), 12)
        status, metrics = daemon.request("GET", "/metrics")
        assert status == 200

    assert_served_greedy_equals_transformers(directory, hf, tmp_path, daemon_args=("--speculative-tokens", "4"),
                                             also=turns)
