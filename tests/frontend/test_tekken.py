"""Mistral's tekken.json (flared.frontend.tekken) against transformers' converter of it (MistralConverter, what
transformers loads a tekken-only checkpoint with): the same vocabulary and merges, the same ids for texts with control
tokens, unicode and digits; and a checkpoint that ships tekken.json and no tokenizer.json exports and serves."""

from __future__ import annotations

import base64
import json

import pytest

transformers = pytest.importorskip("transformers")

from flared.frontend.gguf_tokenizer import _TEKKEN_SPLIT  # noqa: E402

SPECIALS = ["<unk>", "<s>", "</s>", "[INST]", "[/INST]", "[AVAILABLE_TOOLS]", "[/AVAILABLE_TOOLS]",
            "[TOOL_RESULTS]", "[/TOOL_RESULTS]", "[TOOL_CALLS]", "[IMG]", "<pad>", "[IMG_BREAK]", "[IMG_END]",
            "[PREFIX]", "[MIDDLE]", "[SUFFIX]", "[SYSTEM_PROMPT]", "[/SYSTEM_PROMPT]", "[TOOL_CONTENT]"]
NUM_SPECIAL = 40  # (the named ones, then <SPECIAL_20> .. <SPECIAL_39>)
TEXTS = ["Hello, world!", "[INST]What is 12345 + 678?[/INST]The answer: 13023.</s>",
         "  spaced   out\n\nlines\t", "Ünïcödé — ça marche? 日本語のテキスト",
         "<s>[SYSTEM_PROMPT]be brief[/SYSTEM_PROMPT][INST]hi[/INST]",
         "the quick brown fox jumps over the lazy dog " * 3, "<SPECIAL_33> and <unk>", ""]


def write_tekken(tokenizer_json, path, padding: int = 5) -> int:
    """A tekken.json of a byte-level BPE tokenizer.json (a tiny trained one): its 256 bytes, then each merge's token
    in merge order, as tiktoken ranks; Mistral's control tokens and split pattern; ``padding`` junk entries past
    default_vocab_size, which the readers must drop. Returns the vocabulary size."""
    from flared.frontend.tekken import _byte_chars

    unbyte = {c: b for b, c in enumerate(_byte_chars())}
    tok = json.loads(tokenizer_json.read_text())
    ranks = [bytes([b]) for b in range(256)]
    for merge in tok["model"]["merges"]:
        left, right = merge.split(" ") if isinstance(merge, str) else merge
        token = bytes(unbyte[c] for c in left + right)
        if token not in ranks:
            ranks.append(token)
    vocab = [{"rank": r, "token_bytes": base64.b64encode(t).decode(), "token_str": None} for r, t in enumerate(ranks)]
    vocab += [{"rank": len(ranks) + i, "token_bytes": base64.b64encode(b"\xff\xfe" + bytes([i])).decode(),
               "token_str": None} for i in range(padding)]
    path.write_text(json.dumps({
        "config": {"pattern": _TEKKEN_SPLIT, "num_vocab_tokens": len(vocab) + NUM_SPECIAL,
                   "default_vocab_size": len(ranks) + NUM_SPECIAL, "default_num_special_tokens": NUM_SPECIAL,
                   "version": "v7"},
        "vocab": vocab,
        "special_tokens": [{"rank": i, "token_str": s, "is_control": True} for i, s in enumerate(SPECIALS)]}))
    return len(ranks) + NUM_SPECIAL


@pytest.fixture(scope="module")
def tekken(tmp_path_factory):
    from conftest import train_tiny_tokenizer

    d = tmp_path_factory.mktemp("tekken")
    train_tiny_tokenizer(d)
    size = write_tekken(d / "tokenizer.json", d / "tekken.json")
    return d / "tekken.json", size


def test_the_tokenizer_is_transformers_conversion(tekken):
    from tokenizers import Tokenizer
    from transformers.integrations.mistral.tokenizer import MistralConverter

    from flared.frontend.tekken import tekken_tokenizer_json

    path, size = tekken
    ours = Tokenizer.from_str(tekken_tokenizer_json(path))
    theirs = MistralConverter(vocab_file=str(path)).converted()
    assert ours.get_vocab_size() == theirs.get_vocab_size() == size
    assert ours.get_vocab() == theirs.get_vocab()
    assert json.loads(ours.to_str())["model"]["merges"] == json.loads(theirs.to_str())["model"]["merges"]
    assert ours.token_to_id("<s>") == 1 and ours.token_to_id("<SPECIAL_39>") == 39 and ours.token_to_id("[INST]") == 3
    for text in TEXTS:
        ids = ours.encode(text, add_special_tokens=False).ids
        assert ids == theirs.encode(text, add_special_tokens=False).ids, text
        assert ours.decode(ids, skip_special_tokens=False) == theirs.decode(ids, skip_special_tokens=False)


def test_bad_tekken_files_are_clear_errors(tekken, tmp_path):
    from flared.errors import CoreError
    from flared.frontend.tekken import tekken_tokenizer_json

    raw = json.loads(tekken[0].read_text())
    cases = [({k: v for k, v in raw.items() if k != "special_tokens"}, "without its special_tokens"),
             ({**raw, "special_tokens": [{"rank": 0, "token_str": "<unk>"}, {"rank": 2, "token_str": "<s>"}]},
              "without a gap"),
             ({**raw, "vocab": [{"rank": 0, "token_bytes": "!!"}]}, "not base64")]
    for bad, message in cases:
        (tmp_path / "tekken.json").write_text(json.dumps(bad))
        with pytest.raises(CoreError, match=message):
            tekken_tokenizer_json(tmp_path / "tekken.json")


def test_a_checkpoint_with_tekken_and_no_tokenizer_json_exports_and_serves(tekken, tmp_path, start_daemon):
    """A Mistral-style checkpoint shipping tekken.json (its chat template as chat_template.jinja) exports; the
    served prompt is the template rendered and tokenized as transformers' tekken tokenizer does."""
    import shutil

    import torch
    from transformers import MistralConfig, MistralForCausalLM
    from transformers.integrations.mistral.tokenizer import convert_tekken_tokenizer

    from flared.core.export import ExportOptions, export_core

    path, size = tekken
    d = tmp_path / "ckpt"
    d.mkdir()
    shutil.copy(path, d / "tekken.json")
    template = ("{{ bos_token }}{% for m in messages %}{% if m['role'] == 'user' %}[INST]{{ m['content'] }}[/INST]"
                "{% else %}{{ m['content'] }}{{ eos_token }}{% endif %}{% endfor %}")
    (d / "chat_template.jinja").write_text(template)
    torch.manual_seed(0)
    MistralForCausalLM(MistralConfig(vocab_size=size, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                     num_attention_heads=4, num_key_value_heads=2, bos_token_id=1, eos_token_id=2,
                                     initializer_range=0.2)).save_pretrained(d)
    core = tmp_path / "core"
    export_core(d, core, ExportOptions(concurrency=2, context_tokens=256))
    daemon = start_daemon(core)
    status, body = daemon.chat([{"role": "user", "content": "What is 12 + 30?"}], max_tokens=3, temperature=0)
    assert status == 200, body
    theirs = convert_tekken_tokenizer(str(d / "tekken.json"), chat_template=template)
    prompt = theirs.apply_chat_template([{"role": "user", "content": "What is 12 + 30?"}], tokenize=False)
    assert body["usage"]["prompt_tokens"] == len(theirs(prompt, add_special_tokens=False)["input_ids"])
    assert prompt.startswith("<s>[INST]")
