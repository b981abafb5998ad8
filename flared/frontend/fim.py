"""Fill-in-the-middle prompts for code models: the text before and after a cursor, and the model writes what
goes between (OpenAI completions' ``suffix``, llama.cpp's /infill, Ollama's ``suffix``).

A model that was trained for it has three special tokens around the prefix, the suffix and the point where its
answer starts; their names differ by family. The prompt is built from ids (the markers are never left to
the tokenizer to find in text): ``PRE prefix SUF suffix MID``, the order every family listed here uses.
"""

from __future__ import annotations

import dataclasses

# (prefix, suffix, middle) token names by family; the first whose three tokens all exist is the model's.
FAMILIES = (
    ("<|fim_prefix|>", "<|fim_suffix|>", "<|fim_middle|>"),  # Qwen2.5-Coder, Qwen3-Coder, Granite, ...
    ("<fim_prefix>", "<fim_suffix>", "<fim_middle>"),  # StarCoder, StarCoder2, SantaCoder
    ("<｜fim▁begin｜>", "<｜fim▁hole｜>", "<｜fim▁end｜>"),  # DeepSeek-Coder
    ("▁<PRE>", "▁<SUF>", "▁<MID>"),  # CodeLlama
    ("<PRE>", "<SUF>", "<MID>"),
)
FILE_SEPARATORS = ("<|file_sep|>", "<file_sep>", "<|file_separator|>")  # repository context: a file's name and
# text after one (CodeGemma's the last)
# Tokens that end a fill where the model has them (llama.cpp's end-of-generation for FIM models: its pad, repository
# and file separator tokens; CodeLlama's end of infill): a model that writes one has left the hole.
FIM_ENDS = ("<|fim_pad|>", "<fim_pad>", "<|repo_name|>", "<reponame>", *FILE_SEPARATORS, "<EOT>", "▁<EOT>")


@dataclasses.dataclass(frozen=True)
class FimTokens:
    prefix: int
    suffix: int
    middle: int
    file_sep: int | None  # marks each extra file of context (llama.cpp's input_extra), where the model has one
    ends: frozenset[int] = frozenset()  # FIM_ENDS the model has: a fill stops at them


def fim_tokens(tokenizer) -> FimTokens | None:
    """The model's fill-in-the-middle tokens (a ``tokenizers.Tokenizer``), or None when it has none."""
    for names in FAMILIES:
        ids = [tokenizer.token_to_id(n) for n in names]
        if all(i is not None for i in ids):
            sep = next((tokenizer.token_to_id(n) for n in FILE_SEPARATORS if tokenizer.token_to_id(n) is not None),
                       None)
            ends = frozenset(t for t in (tokenizer.token_to_id(n) for n in FIM_ENDS) if t is not None)
            return FimTokens(*ids, file_sep=sep, ends=ends)
    return None


def fim_prompt(fim: FimTokens, encode, prefix: str, suffix: str, *, extra: list[tuple[str, str]] = (),
               bos: list[int] = ()) -> list[int]:
    """``bos`` + the extra files' context + ``PRE prefix SUF suffix MID``. ``encode(text)`` gives ids without
    special tokens; ``extra`` is (file name, text) pairs, each after the model's file separator (or as plain
    text before the prefix where it has none)."""
    ids = list(bos)
    for name, text in extra:
        if fim.file_sep is not None:
            ids += [fim.file_sep] + encode(f"{name}\n{text}" if name else text)
        else:
            ids += encode(text if text.endswith("\n") else text + "\n")
    return ids + [fim.prefix] + encode(prefix) + [fim.suffix] + encode(suffix) + [fim.middle]
