"""tokenizer_from_gguf builds the same tokenizer transformers builds from the same GGUF."""

from __future__ import annotations

import json
import os

import pytest
from tokenizers import Tokenizer

from flared.errors import ErrorKind, FrontendError
from flared.frontend.gguf_tokenizer import tokenizer_from_gguf, tokenizer_from_gguf_metadata

CORPUS = [
    "Hello, world!",
    "",
    " ",
    "    leading and trailing spaces    ",
    "tabs\tand\nnewlines\r\n\r\nand\n\n\n\nruns",
    "def fib(n: int) -> int:\n    return n if n < 2 else fib(n - 1) + fib(n - 2)\n",
    'for (int i = 0; i < 10; ++i) { printf("%d\\n", i); }',
    "你好，世界！这是一个测试。日本語のテキストも。한국어 문장.",
    "emoji: 😀👍🏽🇫🇷 👨‍👩‍👧‍👦 and ✨sparkles✨",
    "numbers 1234567890 3.14159 1e-10 0x1F",
    "don't won't I'm you're we've they'll he'd",
    "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n",
    "text<|endoftext|>more text<|im_end|>",
    "<|im_start|><|im_start|>nested<|im_end|>",
    "half tokens <|im_start and im_end|> <| |>",
    "Ünïcödé àccénts ñ ß ø æ œ",
    "\u00a0non-breaking\u2003em-space\u200bzero-width",
    "a" * 300,
    "mixed 中文 and English with emoji 🚀 in one line.\n\n```python\nprint('x')\n```",
]


def test_tokenizer_json_loads_and_matches_transformers_ids(smollm2_assets, hf_smollm2_tokenizer):
    ours = Tokenizer.from_str(smollm2_assets.tokenizer_json)
    for text in CORPUS:
        expected = hf_smollm2_tokenizer.encode(text, add_special_tokens=True)
        assert ours.encode(text, add_special_tokens=True).ids == expected, text
        expected_plain = hf_smollm2_tokenizer.encode(text, add_special_tokens=False)
        assert ours.encode(text, add_special_tokens=False).ids == expected_plain, text
        assert ours.decode(expected, skip_special_tokens=False) == hf_smollm2_tokenizer.decode(expected), text


def test_tokenizer_json_equals_transformers_backend(smollm2_assets, hf_smollm2_tokenizer):
    ours = json.loads(smollm2_assets.tokenizer_json)
    theirs = json.loads(hf_smollm2_tokenizer.backend_tokenizer.to_str())
    assert ours == theirs


def test_smollm2_settings(smollm2_assets, hf_smollm2_tokenizer):
    a = smollm2_assets
    assert (a.bos_token, a.eos_token) == (hf_smollm2_tokenizer.bos_token, hf_smollm2_tokenizer.eos_token)
    assert (a.bos_token_id, a.eos_token_id) == (hf_smollm2_tokenizer.bos_token_id, hf_smollm2_tokenizer.eos_token_id)
    assert a.add_bos_token is False
    assert a.tokenizer_model == "gpt2" and a.pre_tokenizer == "smollm"
    assert a.chat_template is not None and "<|im_start|>" in a.chat_template
    assert a.special_tokens_map() == {
        key: hf_smollm2_tokenizer.special_tokens_map[key] for key in ("bos_token", "eos_token", "unk_token", "pad_token")
    }
    assert "<|im_start|>" in a.special_tokens


@pytest.mark.parametrize("with_merges,add_bos", [(False, None), (True, False)])
def test_sentencepiece_gguf_matches_transformers(tmp_path, write_sentencepiece_gguf, with_merges, add_bos):
    transformers = pytest.importorskip("transformers")
    path = tmp_path / "spm.gguf"
    write_sentencepiece_gguf(path, with_merges=with_merges, add_bos=add_bos)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    theirs = transformers.AutoTokenizer.from_pretrained(str(tmp_path), gguf_file=path.name)
    assets = tokenizer_from_gguf(path)
    assert json.loads(assets.tokenizer_json) == json.loads(theirs.backend_tokenizer.to_str())
    assert assets.add_bos_token is (add_bos is None)
    ours = Tokenizer.from_str(assets.tokenizer_json)
    for text in ["hello world", " the quick", "你好世界 x", "<|user|>hi<think>", "  lazy  dog\n", "zz😀", ""]:
        assert ours.encode(text).ids == theirs.encode(text), text
        ids = ours.encode(text).ids
        assert ours.decode(ids, skip_special_tokens=False) == theirs.decode(ids), text


@pytest.mark.parametrize("arch,tokenizer_model,with_merges", [
    ("gemma2", "llama", False), ("gemma3", "llama", False),
    ("phi3", "llama", False), ("gemma4", "gemma4", True)])
def test_gemma_and_phi3_sentencepiece_ggufs_match_transformers(tmp_path, write_sentencepiece_gguf, arch,
                                                               tokenizer_model, with_merges):
    """Gemma 1-3 (spaces as "▁" by a normaliser, space tokens respelled, merges by the file's order), Phi-3 (the
    prefix from a normaliser) and Gemma 4 (its own tokenizer model, no BOS added though the file asks): the
    tokenizer transformers builds from the same file, the same ids and text back."""
    transformers = pytest.importorskip("transformers")
    path = tmp_path / "spm.gguf"
    write_sentencepiece_gguf(path, with_merges=with_merges, add_bos=True if arch == "gemma4" else None, arch=arch,
                             tokenizer_model=tokenizer_model)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    theirs = transformers.AutoTokenizer.from_pretrained(str(tmp_path), gguf_file=path.name)
    assets = tokenizer_from_gguf(path)
    assert json.loads(assets.tokenizer_json) == json.loads(theirs.backend_tokenizer.to_str())
    assert assets.add_bos_token is (arch != "gemma4")
    ours = Tokenizer.from_str(assets.tokenizer_json)
    for text in ["hello world", " the quick", "你好世界 x", "<|user|>hi<think>", "  lazy  dog\n", "zz😀", "",
                 "the   quick    fox", "   "]:
        assert ours.encode(text).ids == theirs.encode(text), text
        ids = ours.encode(text).ids
        assert ours.decode(ids, skip_special_tokens=False) == theirs.decode(ids), text


def test_unsupported_model_names_it(tmp_path):
    gguf = pytest.importorskip("gguf")
    path = tmp_path / "bert.gguf"
    writer = gguf.GGUFWriter(str(path), "bert")
    writer.add_tokenizer_model("bert")
    writer.add_token_list(["[PAD]", "a"])
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(FrontendError) as info:
        tokenizer_from_gguf(path)
    assert info.value.kind is ErrorKind.TOKENIZER
    assert "'bert'" in str(info.value)


def test_unreadable_file_is_tokenizer_error(tmp_path):
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"GGUF\x03\x00\x00\x00" + b"\x00" * 7)
    with pytest.raises(FrontendError) as info:
        tokenizer_from_gguf(bad)
    assert info.value.kind is ErrorKind.TOKENIZER and "truncated" in str(info.value)
    with pytest.raises(FrontendError):
        tokenizer_from_gguf(tmp_path / "missing.gguf")


def test_render_chat_adds_the_bos_only_when_asked(tmp_path, write_sentencepiece_gguf):
    """vLLM's chat add_special_tokens: the rendered text's tokens, with the tokenizer's BOS in front only when
    asked (templates usually write their BOS themselves); the message endpoints move with it."""
    from flared.frontend import ChatTemplate, Frontend, TokenSettings

    path = tmp_path / "spm.gguf"
    write_sentencepiece_gguf(path, with_merges=True, add_bos=None)  # SentencePiece's default: a BOS
    assets = tokenizer_from_gguf(path)
    template = ChatTemplate("{% for m in messages %}<|user|>{{ m['content'] }}{% endfor %}")
    fe = Frontend(Tokenizer.from_str(assets.tokenizer_json), template, TokenSettings.from_gguf_assets(assets))
    chat = [{"role": "user", "content": "hello world"}, {"role": "user", "content": "the quick"}]
    plain = fe.render_chat(chat, add_generation_prompt=False)
    with_bos = fe.render_chat(chat, add_generation_prompt=False, add_special_tokens=True)
    assert with_bos.token_ids == [assets.bos_token_id] + plain.token_ids and with_bos.text == plain.text
    assert plain.message_endpoints and with_bos.message_endpoints == tuple(e + 1 for e in plain.message_endpoints)


@pytest.mark.parametrize("pre", ["deepseek-v3", "hunyuan-dense"])
def test_deepseek_v3_files_split_as_its_tokenizer_does(pre):
    """DeepSeek V3's pre-tokenizer (GLM-4.7-Flash and Kimi files name others): three splits in turn, as its
    tokenizer.json has them: digits in threes, runs of CJK isolated, then its main pattern (punctuation leading a
    word, letters with marks, punctuation runs). A byte-level vocabulary with no merges shows the pieces; text
    round-trips."""
    from flared.frontend.gguf_tokenizer import _byte_alphabet

    alphabet = list(_byte_alphabet().values())
    metadata = {"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.pre": pre, "tokenizer.ggml.tokens": alphabet,
                "tokenizer.ggml.token_type": [1] * len(alphabet), "tokenizer.ggml.merges": []}
    assets = tokenizer_from_gguf_metadata(metadata, source="ds.gguf")
    tokenizer = Tokenizer.from_str(assets.tokenizer_json)
    text = "Hello, world! 1234567 你好世界 (x.y) don't \n\n  end"
    pieces = [piece for piece, _ in tokenizer.pre_tokenizer.pre_tokenize_str(text)]
    byte_text = "".join(_byte_alphabet()[b] for b in text.encode())
    assert "".join(pieces) == byte_text
    expected = ["Hello", ",", " world", "!", " ", "123", "456", "7", " ", "你好世界", " (", "x", ".y", ")", " don",
                "'t", " \n\n", " ", " end"]
    assert pieces == ["".join(_byte_alphabet()[b] for b in piece.encode()) for piece in expected]
    assert tokenizer.decode(tokenizer.encode(text).ids) == text


def test_falcon_files_split_as_its_tokenizer_does():
    """Falcon's pre-tokenizer (tokenizer.ggml.pre "falcon", as llama.cpp and its tokenizer.json split): punctuation
    runs isolated, GPT-2's pattern, then digits in threes. A byte-level vocabulary with no merges shows the pieces;
    text round-trips."""
    from flared.frontend.gguf_tokenizer import _byte_alphabet

    alphabet = list(_byte_alphabet().values())
    metadata = {"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.pre": "falcon", "tokenizer.ggml.tokens": alphabet,
                "tokenizer.ggml.token_type": [1] * len(alphabet), "tokenizer.ggml.merges": []}
    tokenizer = Tokenizer.from_str(tokenizer_from_gguf_metadata(metadata, source="falcon.gguf").tokenizer_json)
    text = "Hello, world! 1234567 (x.y) don't"
    pieces = [piece for piece, _ in tokenizer.pre_tokenizer.pre_tokenize_str(text)]
    expected = ["Hello", ",", " world", "!", " ", "123", "456", "7", " ", "(", "x", ".", "y", ")", " don", "'", "t"]
    assert pieces == ["".join(_byte_alphabet()[b] for b in piece.encode()) for piece in expected]
    assert tokenizer.decode(tokenizer.encode(text).ids) == text
