"""A random-weight checkpoint served end to end: a one-character-a-token tokenizer of its vocabulary and a plain
chat template written beside it, exported to a core, run by `flared run`, and its greedy chat tokens compared with
transformers' generate on the same prompt ids."""

from __future__ import annotations

import json
from pathlib import Path

CHAT_TEMPLATE = ("{{ bos_token }}{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}{% endfor %}"
                 "{% if add_generation_prompt %}<model>{% endif %}")


def write_char_tokenizer(directory: Path, vocab: int):
    """tokenizer.json (<pad> 0, <eos> 1, <bos> 2, then one printable character a token) and tokenizer_config.json
    with CHAT_TEMPLATE; returns the tokenizer."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    chars = [chr(c) for c in range(33, 33 + vocab - 3)]
    tok = Tokenizer(models.WordLevel({"<pad>": 0, "<eos>": 1, "<bos>": 2, **{c: i + 3 for i, c in enumerate(chars)}},
                                     unk_token="<pad>"))
    tok.pre_tokenizer = pre_tokenizers.Split("", "isolated")
    tok.decoder = decoders.Fuse()
    tok.add_special_tokens(["<pad>", "<eos>", "<bos>"])
    tok.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(json.dumps({
        "bos_token": "<bos>", "eos_token": "<eos>", "chat_template": CHAT_TEMPLATE}))
    return tok


def assert_served_greedy_equals_transformers(directory: Path, hf_model, tmp_path: Path, *, max_tokens: int = 16,
                                             daemon_args: tuple[str, ...] = (), also=None) -> list[int]:
    """Export ``directory`` (a checkpoint of ``hf_model``'s weights), serve it, ask one greedy chat question; the
    tokens must be transformers' greedy continuation of the same prompt ids. ``also(daemon)``: more checks on the
    running daemon. Returns the tokens."""
    import numpy as np
    import torch
    from flared_testing.daemon import Daemon

    from flared.core.export import ExportOptions, export_core

    tok = write_char_tokenizer(directory, hf_model.config.vocab_size)
    core = tmp_path / "core"
    export_core(directory, core, ExportOptions(concurrency=2, context_tokens=256, prefill_chunk_tokens=64))
    d = Daemon(core, tmp_path, *daemon_args)
    try:
        status, body = d.chat([{"role": "user", "content": "Tell me a story about a fox."}], max_tokens=max_tokens,
                              temperature=0, ignore_eos=True, logprobs=True, return_tokens_as_token_ids=True)
        if also is not None:
            also(d)
    finally:
        d.kill()
    assert status == 200, body
    got = [int(t["token"].split(":")[1]) for t in body["choices"][0]["logprobs"]["content"]]
    prompt = [2] + tok.encode("<user>Tell me a story about a fox.<model>", add_special_tokens=False).ids
    assert body["usage"]["prompt_tokens"] == len(prompt)
    with torch.no_grad():
        expected = hf_model.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                                     max_new_tokens=max_tokens, do_sample=False, eos_token_id=None, pad_token_id=0)
    assert got == expected[0, len(prompt):].tolist()
    assert np.unique(got).size > 1
    return got
