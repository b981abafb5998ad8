"""Build a ``tokenizers`` tokenizer.json from the vocabulary a GGUF file carries.

Rules (each one is what Hugging Face transformers does when it loads a
tokenizer with ``AutoTokenizer.from_pretrained(dir, gguf_file=...)``; token ids
must be identical to that, so the rules follow it, not llama.cpp):

- ``tokenizer.ggml.model = gpt2`` (byte-level BPE: SmolLM2, Qwen, Llama 3):
  vocabulary entries written entirely in the GPT-2 byte alphabet are kept as
  they are; any other entry is respelled byte by byte into that alphabet.
  Merges come from ``tokenizer.ggml.merges`` ("left right"). Pre-tokenizer is
  a regex split chosen by ``tokenizer.ggml.pre`` followed by a regex-free
  ByteLevel step, or plain GPT-2 ByteLevel when the name is not known.
- ``tokenizer.ggml.model = llama`` (SentencePiece BPE): vocabulary as written,
  merges from the file or rebuilt from the scores, byte fallback, Metaspace
  pre-tokenizer that prepends "▁" to the first piece only, and BOS added by
  default. Two architectures differ, as transformers rebuilds them:
  Gemma 1-3 (``gemma``, ``gemma2``, ``gemma3``): Gemma's tokenizer (spaces
  normalised to "▁", no prefix space, a decoder that strips nothing), tokens
  of spaces alone respelled as "▁"s, and without merges in the file, merges
  rebuilt best-first by the tokens' order in the file (Gemma's scores do not
  follow its merges); Phi-3 (``phi3``): the prefix "▁" and the spaces from a
  normaliser, no pre-tokenizer.
- ``tokenizer.ggml.model = gemma4``: Gemma's tokenizer over the vocabulary and
  merges as written, and no BOS added (Gemma 4's chat template writes it).
- Tokens typed CONTROL (3) become special added tokens (skipped in a byte-level
  vocabulary when they use characters outside the byte alphabet: llama.cpp
  mislabels those, and adding them would grow the vocabulary); tokens typed
  USER_DEFINED (4) that are in the vocabulary become non-special added tokens;
  bos/eos/unk/pad become special added tokens.
- The post-processor adds BOS/EOS as ``tokenizer.ggml.add_bos_token`` /
  ``add_eos_token`` say.

Any other tokenizer model is a FrontendError(TOKENIZER) naming it.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os

from flared.errors import ErrorKind, FrontendError
from flared.frontend.gguf_metadata import read_gguf_metadata

_TOKEN_TYPE_CONTROL = 3
_TOKEN_TYPE_USER_DEFINED = 4

# Pre-tokenizer splits for the ``tokenizer.ggml.pre`` names whose merges were
# learned on something other than the GPT-2 split.
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN35_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}"
    r"| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_TEKKEN_SPLIT = (
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*"
    r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_GPT4O_SPLIT = (
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# DeepSeek V3's (and Hunyuan dense's): three splits in turn, digits in threes and runs of CJK isolated first
_DEEPSEEK3_SPLITS = (
    r"\p{N}{1,3}",
    r"[一-龥぀-ゟ゠-ヿ]+",
    r"[!\"#$%&'()*+,\-./:;<=>?@\[\\\]^_`{|}~][A-Za-z]+|[^\r\n\p{L}\p{P}\p{S}]?[\p{L}\p{M}]+"
    r"| ?[\p{P}\p{S}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+",
)
# Falcon's: punctuation runs isolated, then GPT-2's pattern, then digits in threes
_FALCON_SPLITS = (
    r"[\p{P}\$\+<=>\^~\|`]+",
    r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)",
    r"[0-9][0-9][0-9]",
)
# tokenizer.ggml.pre -> the regex (or regexes, applied in turn) its merges were learned on
_PRE_TOKENIZER_SPLITS: dict[str, str | tuple[str, ...]] = {
    **dict.fromkeys(
        ("llama3", "llama-v3", "llama-bpe", "falcon3", "falcon-h1", "pixtral", "midm-2.0", "lfm2",
         "jina-v5-nano", "dbrx", "smaug-bpe", "glm4", "chatglm-bpe"),
        _LLAMA3_SPLIT,
    ),
    "tekken": _TEKKEN_SPLIT,
    **dict.fromkeys(("qwen2", "deepseek-r1-qwen", "kormo", "f2llmv2", "megrez", "hunyuan", "stablelm2"), _QWEN2_SPLIT),
    "falcon": _FALCON_SPLITS,
    "qwen35": _QWEN35_SPLIT,
    **dict.fromkeys(("gpt-4o", "llama4", "kanana2", "talkie", "minimax-m2"), _GPT4O_SPLIT),
    **dict.fromkeys(("deepseek-v3", "hunyuan-dense"), _DEEPSEEK3_SPLITS),
}

_SUPPORTED_MODELS = ("gpt2", "llama", "gemma4")
_GEMMA_SENTENCEPIECE = ("gemma", "gemma2", "gemma3")


@dataclasses.dataclass(frozen=True)
class GGUFTokenizerAssets:
    """What a GGUF file says about its tokenizer, ready to serve from."""

    tokenizer_json: str  # a tokenizers tokenizer.json, for tokenizers.Tokenizer.from_str
    chat_template: str | None  # tokenizer.chat_template, exactly as stored
    tokenizer_model: str  # tokenizer.ggml.model ("gpt2", "llama", "gemma4")
    pre_tokenizer: str | None  # tokenizer.ggml.pre
    bos_token: str | None
    eos_token: str | None
    unk_token: str | None
    pad_token: str | None
    bos_token_id: int | None
    eos_token_id: int | None
    unk_token_id: int | None
    pad_token_id: int | None
    add_bos_token: bool
    add_eos_token: bool
    special_tokens: tuple[str, ...]  # every special added token, in id order
    vocab_size: int  # entries in the GGUF vocabulary (added tokens not in it are extra)

    def special_tokens_map(self) -> dict[str, str]:
        """The named special tokens a chat template sees (bos_token, eos_token, ...)."""
        names = {"bos_token": self.bos_token, "eos_token": self.eos_token,
                 "unk_token": self.unk_token, "pad_token": self.pad_token}
        return {name: token for name, token in names.items() if token is not None}


@functools.lru_cache(maxsize=1)
def _byte_alphabet() -> dict[int, str]:
    """GPT-2's reversible byte -> printable character map."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(
        range(ord("®"), ord("ÿ") + 1)
    )
    mapping = {byte: chr(byte) for byte in printable}
    next_code = 256
    for byte in range(256):
        if byte not in mapping:
            mapping[byte] = chr(next_code)
            next_code += 1
    return mapping


def _merges_from_scores(tokens: list[str], scores: list[float]) -> list[tuple[str, str]]:
    """Merges a SentencePiece BPE vocabulary implies: every split of a token into two
    vocabulary tokens, best score first (ties: shorter left, then shorter right, then
    the order transformers meets them in)."""
    index_of = {token: index for index, token in enumerate(tokens)}
    score_of = dict(zip(tokens, scores))
    candidates = []
    for token, score in score_of.items():
        splits = [
            (token[:cut], token[cut:], score)
            for cut in range(1, len(token))
            if token[:cut] in index_of and token[cut:] in index_of
        ]
        splits.sort(key=lambda split: (index_of[split[0]], index_of[split[1]]))
        candidates.extend(splits)
    candidates.sort(key=lambda merge: (merge[2], len(merge[0]), len(merge[1])), reverse=True)
    return [(left, right) for left, right, _ in candidates]


def _require(metadata: dict, key: str, path: str):
    try:
        return metadata[key]
    except KeyError:
        raise FrontendError(f"{path}: GGUF has no {key}", ErrorKind.TOKENIZER) from None


def tokenizer_from_gguf(path: str | os.PathLike) -> GGUFTokenizerAssets:
    """Read a GGUF file's tokenizer metadata and build the equivalent tokenizer.json."""
    path = os.fspath(path)
    return tokenizer_from_gguf_metadata(read_gguf_metadata(path), source=path)


def tokenizer_from_gguf_metadata(metadata: dict, *, source: str = "<gguf>") -> GGUFTokenizerAssets:
    """As :func:`tokenizer_from_gguf`, from metadata already read (see gguf_metadata)."""
    # Imported here: the server process imports flared.frontend without needing tokenizers
    # until a model is loaded.
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors

    tokenizer_model = _require(metadata, "tokenizer.ggml.model", source)
    if tokenizer_model not in _SUPPORTED_MODELS:
        raise FrontendError(
            f"{source}: unsupported GGUF tokenizer model {tokenizer_model!r} "
            f"(supported: {', '.join(_SUPPORTED_MODELS)})",
            ErrorKind.TOKENIZER,
        )
    architecture = metadata.get("general.architecture")
    tokens: list[str] = list(_require(metadata, "tokenizer.ggml.tokens", source))
    gemma_spm = tokenizer_model == "llama" and architecture in _GEMMA_SENTENCEPIECE  # (Gemma 1-3's)
    gemma = gemma_spm or tokenizer_model == "gemma4"
    if gemma_spm:
        # a token of spaces alone is stored as spaces; Gemma's tokenizer looks it up as "▁"s
        tokens = ["▁" * len(t) if " " in t and not t.strip() else t for t in tokens]
    token_types: list[int] = list(metadata.get("tokenizer.ggml.token_type") or ())
    pre_name = metadata.get("tokenizer.ggml.pre")
    byte_level = tokenizer_model == "gpt2"

    if byte_level:
        alphabet = _byte_alphabet()
        alphabet_chars = frozenset(alphabet.values())
        vocab = {
            token if set(token) <= alphabet_chars else "".join(alphabet[b] for b in token.encode("utf-8")): index
            for index, token in enumerate(tokens)
        }
        merges = [tuple(merge.split(" ")) for merge in _require(metadata, "tokenizer.ggml.merges", source)]
        backend = Tokenizer(
            models.BPE(vocab=vocab, merges=merges, dropout=None, continuing_subword_prefix="",
                       end_of_word_suffix="", fuse_unk=False)
        )
        split = _PRE_TOKENIZER_SPLITS.get(pre_name)
        if split is None:
            backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        else:
            splits = (split,) if isinstance(split, str) else split
            backend.pre_tokenizer = pre_tokenizers.Sequence(
                [*(pre_tokenizers.Split(Regex(each), behavior="isolated") for each in splits),
                 pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)]
            )
        backend.decoder = decoders.ByteLevel()
        add_bos_default = False
    else:
        vocab = {token: index for index, token in enumerate(tokens)}
        if "tokenizer.ggml.merges" in metadata:
            merges = [tuple(merge.split(" ")) for merge in metadata["tokenizer.ggml.merges"]]
        elif gemma_spm:  # best first: the file's order
            merges = _merges_from_scores(tokens, [-float(index) for index in range(len(tokens))])
        else:
            merges = _merges_from_scores(tokens, list(_require(metadata, "tokenizer.ggml.scores", source)))
        if gemma:  # Gemma's tokenizer: spaces normalised to "▁", no prefix space, nothing stripped on decode
            backend = Tokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=True, unk_token="<unk>",
                                           byte_fallback=True, dropout=None))
            backend.normalizer = normalizers.Replace(" ", "▁")
            backend.pre_tokenizer = pre_tokenizers.Split(pattern=" ", behavior="merged_with_previous", invert=False)
            backend.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()])
        else:
            backend = Tokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=True, byte_fallback=True,
                                           dropout=None))
            backend.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first", split=False)
            backend.decoder = decoders.Sequence(
                [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                 decoders.Strip(content=" ", left=1)])
            if architecture == "phi3":  # the prefix "▁" from a normaliser (so a leading space doubles it)
                backend.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
                backend.pre_tokenizer = None
        # Older SentencePiece files carry no flag, and such vocabularies expect a BOS.
        add_bos_default = True

    # Control tokens become whole special tokens; see the rules above for the byte-level exception.
    control = [
        AddedToken(token, normalized=False, special=True)
        for token, token_type in zip(tokens, token_types)
        if token_type == _TOKEN_TYPE_CONTROL and (not byte_level or set(token) <= alphabet_chars)
    ]
    if control:
        backend.add_special_tokens(control)
    user_defined = [
        AddedToken(token, normalized=False, special=False)
        for token, token_type in zip(tokens, token_types)
        if token_type == _TOKEN_TYPE_USER_DEFINED and token in vocab
    ]
    if user_defined:
        backend.add_tokens(user_defined)

    def named(key: str) -> tuple[str | None, int | None]:
        token_id = metadata.get(f"tokenizer.ggml.{key}")
        if token_id is None:
            return None, None
        if not 0 <= token_id < len(tokens):
            raise FrontendError(f"{source}: tokenizer.ggml.{key} {token_id} is outside the vocabulary",
                                ErrorKind.TOKENIZER)
        return tokens[token_id], token_id

    bos_token, bos_token_id = named("bos_token_id")
    eos_token, eos_token_id = named("eos_token_id")
    unk_token, unk_token_id = named("unknown_token_id")
    pad_token, pad_token_id = named("padding_token_id")
    named_tokens = [t for t in (bos_token, eos_token, unk_token, pad_token) if t is not None]
    if named_tokens:
        backend.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in named_tokens])
    # The named tokens resolve through the built vocabulary (a byte-level respelling or a
    # newly added token can move them), as transformers resolves them.
    bos_token_id = backend.token_to_id(bos_token) if bos_token is not None else None
    eos_token_id = backend.token_to_id(eos_token) if eos_token is not None else None
    unk_token_id = backend.token_to_id(unk_token) if unk_token is not None else None
    pad_token_id = backend.token_to_id(pad_token) if pad_token is not None else None

    add_bos_token = bool(metadata.get("tokenizer.ggml.add_bos_token", add_bos_default)) and bos_token is not None
    if tokenizer_model == "gemma4":  # (its files ask for one; transformers adds none: the chat template writes it)
        add_bos_token = False
    add_eos_token = bool(metadata.get("tokenizer.ggml.add_eos_token", False)) and eos_token is not None
    single = ([f"{bos_token}:0"] if add_bos_token else []) + ["$A:0"] + ([f"{eos_token}:0"] if add_eos_token else [])
    pair = single + ([f"{bos_token}:1"] if add_bos_token else []) + ["$B:1"] + (
        [f"{eos_token}:1"] if add_eos_token else [])
    post_specials = ([(bos_token, bos_token_id)] if add_bos_token else []) + (
        [(eos_token, eos_token_id)] if add_eos_token else [])
    backend.post_processor = processors.TemplateProcessing(
        single=" ".join(single), pair=" ".join(pair), special_tokens=post_specials
    )

    tokenizer_json = backend.to_str()
    special_tokens = tuple(
        entry["content"] for entry in sorted(json.loads(tokenizer_json)["added_tokens"], key=lambda e: e["id"])
        if entry["special"]
    )
    chat_template = metadata.get("tokenizer.chat_template")
    return GGUFTokenizerAssets(
        tokenizer_json=tokenizer_json,
        chat_template=chat_template if isinstance(chat_template, str) else None,
        tokenizer_model=tokenizer_model,
        pre_tokenizer=pre_name,
        bos_token=bos_token, eos_token=eos_token, unk_token=unk_token, pad_token=pad_token,
        bos_token_id=bos_token_id, eos_token_id=eos_token_id, unk_token_id=unk_token_id, pad_token_id=pad_token_id,
        add_bos_token=add_bos_token,
        add_eos_token=add_eos_token,
        special_tokens=special_tokens,
        vocab_size=len(tokens),
    )
