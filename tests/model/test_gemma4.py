"""Gemma 4 (gemma4_text) beyond the shared parity tests (test_parity_hf.py runs the family's logits, greedy tokens,
embeddings and prompt logprobs against transformers): the global layers' own geometry in the config and the KV
cache, E2B's shared KV layers, a float8 cache, a vision-language checkpoint served as its text model, and a daemon
serving an exported Gemma 4 core from its prefix cache."""

from __future__ import annotations

import json

import pytest
import torch

transformers = pytest.importorskip("transformers")

from flared.errors import CoreError, ErrorKind  # noqa: E402
from flared.model.config import ModelConfig, from_hf_config  # noqa: E402
from flared.model.decoder import DecoderModel  # noqa: E402
from flared.model.loader import read_source  # noqa: E402

from .conftest import build_hf_checkpoint  # noqa: E402
from .test_parity_hf import make_prompts, run_paged_greedy  # noqa: E402

_TEXT = dict(model_type="gemma4_text", vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=6,
             num_attention_heads=4, num_key_value_heads=2, head_dim=16, global_head_dim=64,
             num_global_key_value_heads=1, attention_k_eq_v=True, sliding_window=8, hidden_size_per_layer_input=0,
             rope_parameters={"full_attention": {"rope_type": "proportional", "partial_rotary_factor": 0.25,
                                                 "rope_theta": 1e6},
                              "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}})


@pytest.fixture(scope="module")
def gemma4(tmp_path_factory):
    from transformers import AutoModelForCausalLM

    directory = build_hf_checkpoint("gemma4", tmp_path_factory.mktemp("gemma4"))
    return directory, AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32).eval()


def test_the_global_layers_have_their_own_geometry():
    """Every sixth layer global (released configs' global_head_dim / num_global_key_value_heads, or the
    per_layer_config transformers writes): wider heads, fewer KV heads, keys as values, proportional rope; the KV cache
    keeps a global layer's heads as head_dim-wide pieces; the config round-trips through a manifest."""
    config = from_hf_config(_TEXT)
    assert config.architecture == "gemma4" and config.layer_windows == (8, 8, 8, 8, 8, 0)
    assert config.layer_geometry(0) == (2, 16) and config.layer_geometry(5) == (1, 64)
    assert config.kv_storage_heads == 4 and config.value_from_key and config.v_norm and config.layer_scalars
    assert config.rope_scaling == {"rope_type": "proportional", "partial_rotary_factor": 0.25}
    assert config.rope_theta == 1e6 and config.local_rope_theta == 1e4 and config.attention_scale == 1.0
    assert not config.graph_capable and ModelConfig.from_dict(json.loads(json.dumps(config.to_dict()))) == config
    written = {k: v for k, v in _TEXT.items() if k not in ("global_head_dim", "num_global_key_value_heads")}
    assert from_hf_config({**written, "per_layer_config": {"5": {"head_dim": 64, "num_key_value_heads": 1}}}) == config


def test_e2b_layers_share_keys_and_values_and_take_inputs_of_their_own():
    """E2B / E4B: the last num_kv_shared_layers attend to the last earlier layer of their kind and keep no KV of their
    own (with use_double_wide_mlp, twice as wide an MLP); every layer takes its own input (hidden_size_per_layer_input);
    a shared layer with no earlier layer of its kind is refused."""
    config = from_hf_config({**_TEXT, "hidden_size_per_layer_input": 8, "vocab_size_per_layer_input": 300,
                             "num_kv_shared_layers": 2, "use_double_wide_mlp": True,
                             "layer_types": ["sliding_attention", "full_attention"] * 3})
    assert [config.kv_source(i) for i in range(6)] == [None, None, None, None, 2, 3]
    assert config.kv_layers == (0, 1, 2, 3) and [config.mlp_width(i) for i in (3, 4)] == [128, 256]
    assert config.per_layer_input_dim == 8 and config.per_layer_vocab == 300
    with pytest.raises(CoreError, match="share the keys and values"):
        from_hf_config({**_TEXT, "num_kv_shared_layers": 5, "layer_types": ["sliding_attention"] * 5 + ["full_attention"]})


def test_bidirectional_attention_is_refused_by_name_but_images_both_ways_are_read():
    """"all" (an encoder's) is refused; 26B-A4B's and 31B's "vision" is read (text alone is causal; their images
    attend both ways through the tower's config, tests/api/test_vision_gemma4.py)."""
    with pytest.raises(CoreError, match="use_bidirectional_attention") as info:
        from_hf_config({**_TEXT, "use_bidirectional_attention": "all"})
    assert info.value.kind == ErrorKind.UNSUPPORTED_MODEL
    assert from_hf_config({**_TEXT, "use_bidirectional_attention": "vision"}) == from_hf_config(_TEXT)


def test_the_26b_layer_has_experts_beside_its_mlp():
    config = from_hf_config({**_TEXT, "enable_moe_block": True, "num_experts": 128, "top_k_experts": 8,
                             "moe_intermediate_size": 704})
    assert config.parallel_experts and config.num_experts == 128 and config.experts_per_token == 8
    assert config.expert_intermediate_size == 704 and config.norm_topk_prob and not config.dense_layers


def test_a_float8_cache_keeps_the_global_layers_pieces(gemma4):
    """A float8 KV cache (kv_cache_dtype fp8) stores a global layer's wider heads as pieces too: greedy tokens and
    logits stay near the bf16 cache's."""
    from flared.model.kv_cache import FP8_KV

    directory, _ = gemma4
    source = read_source(directory)
    model = DecoderModel(source.config, source.tensors, dtype=torch.bfloat16)
    prompts = make_prompts(source.config.vocab_size, seed=2)[:2]
    plain = run_paged_greedy(model, prompts, num_new_tokens=8, page_tokens=4, chunk_tokens=5)
    make = model.make_kv_cache
    model.make_kv_cache = lambda **kw: make(**{**kw, "storage_dtype": FP8_KV})
    narrow = run_paged_greedy(model, prompts, num_new_tokens=8, page_tokens=4, chunk_tokens=5)
    for (tokens, logits), (narrow_tokens, narrow_logits) in zip(plain, narrow):
        same = next((i for i, (a, b) in enumerate(zip(tokens, narrow_tokens)) if a != b), len(tokens))
        assert same >= 2  # (float8's rounding may part them at a near-tie later)
        assert (logits[:same] - narrow_logits[:same]).abs().max().item() < 0.5


def test_a_vision_checkpoint_serves_its_text_model(tmp_path):
    """Gemma 4 ships as gemma4 (vision-language, some with audio) checkpoints: export reads their text model, whose
    logits are transformers' on text, and their image tower (tests/api/test_vision_gemma4.py)."""
    from transformers import Gemma4Config, Gemma4ForConditionalGeneration

    text = {k: v for k, v in _TEXT.items() if k != "model_type"}
    text.update(num_hidden_layers=2, layer_types=["sliding_attention", "full_attention"], initializer_range=0.2)
    vision = dict(hidden_size=32, intermediate_size=48, num_hidden_layers=1, num_attention_heads=2,
                  num_key_value_heads=2, head_dim=16, patch_size=8)
    torch.manual_seed(0)
    hf = Gemma4ForConditionalGeneration(Gemma4Config(text_config=text, vision_config=vision, audio_config=None)).eval()
    hf.save_pretrained(tmp_path)
    source = read_source(tmp_path)
    assert source.config.architecture == "gemma4" and source.vision.family == "gemma4"
    model = DecoderModel(source.config, source.tensors, dtype=torch.float32)
    prompts = make_prompts(512, seed=5)[:2]
    for prompt, (out, logits) in zip(prompts, run_paged_greedy(model, prompts, num_new_tokens=12, page_tokens=4,
                                                               chunk_tokens=5)):
        with torch.no_grad():
            expected = hf(input_ids=torch.tensor([prompt + out[:-1]])).logits[0, len(prompt) - 1:]
        assert (expected - logits).abs().max().item() < 1e-4


def _asked_again(daemon):
    """The served test's question again: its prompt comes from the prefix cache."""
    status, body = daemon.chat([{"role": "user", "content": "Tell me a story about a fox."}], max_tokens=16,
                               temperature=0, ignore_eos=True)
    assert status == 200, body
    assert body["usage"]["prompt_tokens_details"]["cached_tokens"] > 0


def test_a_gemma4_core_serves_transformers_tokens_from_its_prefix_cache(gemma4, tmp_path):
    """Exported with a chat template and served by flared run: greedy chat tokens equal transformers' generate on the
    same prompt ids; the same question again comes from the prefix cache with the same tokens."""
    from flared_testing.served import assert_served_greedy_equals_transformers

    directory, hf_model = gemma4

    assert_served_greedy_equals_transformers(directory, hf_model, tmp_path, also=_asked_again)


def test_an_e2b_core_serves_transformers_tokens_from_its_prefix_cache(tmp_path):
    """E2B's layout (per-layer inputs, shared KV layers, double-wide MLPs) exported and served: transformers' greedy
    tokens, and again from the prefix cache (the shared layers read their source layers' cached pages)."""
    from transformers import AutoModelForCausalLM

    from flared_testing.served import assert_served_greedy_equals_transformers

    directory = build_hf_checkpoint("gemma4_e2b", tmp_path / "hf")
    hf_model = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32).eval()

    assert_served_greedy_equals_transformers(directory, hf_model, tmp_path, also=_asked_again)
