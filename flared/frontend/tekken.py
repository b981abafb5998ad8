"""Mistral's tekken tokenizer (``tekken.json``, what mistral-common reads) as a ``tokenizers`` tokenizer.

Mistral's recent checkpoints (Mistral Small 3.x, Magistral, Devstral, Ministral 3, Voxtral) ship ``tekken.json`` and
no ``tokenizer.json``: vLLM reads them with ``--tokenizer-mode mistral`` (mistral-common), transformers converts the
file. The file is tiktoken's format: a regex ``pattern``, the byte strings of the vocabulary in rank order
(``vocab``: base64 ``token_bytes``), and the control tokens (``special_tokens``, ranks 0.. of the ids). Ids: the
control tokens first (``default_num_special_tokens`` of them, the unnamed ones ``<SPECIAL_i>``), then the
vocabulary's ranks after them, the vocabulary cut to ``default_vocab_size`` in all (the file pads it).

tiktoken merges the pair whose merged token ranks lowest; a BPE over the same vocabulary whose merges are listed in
the rank order of the token they make, each token's splits into two tokens of the vocabulary ordered by their
pieces' ranks (and ``ignore_merges``: a whole word in the vocabulary is taken as it is, as tiktoken does) encodes
alike. That is how transformers and llama.cpp convert it too; ``tests/frontend/test_tekken.py`` checks ours against
transformers' converter.
"""

from __future__ import annotations

import base64
import json
from functools import lru_cache
from pathlib import Path

from flared.errors import CoreError, ErrorKind

BOS, EOS, UNK, PAD = "<s>", "</s>", "<unk>", "<pad>"


@lru_cache(maxsize=1)
def _byte_chars() -> tuple[str, ...]:
    """GPT-2's byte -> printable character table (the ByteLevel pre-tokenizer's alphabet)."""
    keep = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), 256))
    table, extra = {}, 0
    for b in range(256):
        if b in keep:
            table[b] = chr(b)
        else:
            table[b] = chr(256 + extra)
            extra += 1
    return tuple(table[b] for b in range(256))


def _text(token: bytes) -> str:
    chars = _byte_chars()
    return "".join(chars[b] for b in token)


def tekken_specials(raw: dict, where: str) -> list[str]:
    """The control tokens' strings in id order: the file's named ones, then ``<SPECIAL_i>`` up to
    ``default_num_special_tokens``."""
    entries = raw.get("special_tokens")
    if not isinstance(entries, list):
        raise CoreError(f"{where}: a tekken.json without its special_tokens list (the first tekken format) is not "
                        "supported", ErrorKind.SOURCE_FORMAT)
    try:
        ranked = sorted((int(e["rank"]), str(e["token_str"])) for e in entries)
    except (KeyError, TypeError, ValueError):
        raise CoreError(f"{where}: tekken.json special_tokens entries need a rank and a token_str",
                        ErrorKind.SOURCE_FORMAT) from None
    if [r for r, _ in ranked] != list(range(len(ranked))):
        raise CoreError(f"{where}: tekken.json special_tokens ranks must run 0, 1, ... without a gap",
                        ErrorKind.SOURCE_FORMAT)
    count = raw.get("config", {}).get("default_num_special_tokens") or len(ranked)
    return [s for _, s in ranked] + [f"<SPECIAL_{i}>" for i in range(len(ranked), int(count))]


def tekken_tokenizer_json(path: str | Path) -> str:
    """``tekken.json`` at ``path`` as a tokenizer.json (a byte-level BPE with the file's split pattern, its control
    tokens as special added tokens)."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, processors

    where = str(path)
    try:
        raw = json.loads(Path(path).read_text(encoding="utf-8"))
        config = raw["config"]
        pattern = str(config["pattern"])
        entries = raw["vocab"]
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise CoreError(f"{where}: not a readable tekken.json: {exc}", ErrorKind.SOURCE_FORMAT) from None
    specials = tekken_specials(raw, where)
    size = config.get("default_vocab_size")
    if size is not None:
        entries = entries[:max(0, int(size) - len(specials))]
    try:
        ranks = {base64.b64decode(e["token_bytes"], validate=True): rank for rank, e in enumerate(entries)}
    except (KeyError, TypeError, ValueError) as exc:
        raise CoreError(f"{where}: a tekken.json vocab entry is not base64 token_bytes: {exc}",
                        ErrorKind.SOURCE_FORMAT) from None
    if len(ranks) != len(entries) or b"" in ranks:
        raise CoreError(f"{where}: tekken.json's vocab repeats a token or holds an empty one", ErrorKind.SOURCE_FORMAT)

    offset = len(specials)
    vocab = {_text(token): rank + offset for token, rank in ranks.items()}
    vocab.update({s: i for i, s in enumerate(specials)})
    merges = []
    for token, rank in ranks.items():  # (in rank order: the file lists them so)
        splits = [(ranks[token[:k]], ranks[token[k:]], k) for k in range(1, len(token))
                  if token[:k] in ranks and token[k:] in ranks]
        merges.extend((_text(token[:k]), _text(token[k:])) for _, _, k in sorted(splits))
    tokenizer = Tokenizer(models.BPE(vocab, merges, fuse_unk=False, ignore_merges=True))
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(pattern), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.add_special_tokens([AddedToken(s, special=True) for s in specials])
    tokenizer.post_processor = processors.ByteLevel(trim_offsets=False)
    return tokenizer.to_str()
