"""Reasoning out of generated text: ``<think>…</think>`` (or Mistral's ``[THINK]…[/THINK]``, Seed-OSS'
``<seed:think>…</seed:think>``, Cohere's ``<|START_THINKING|>…<|END_THINKING|>``, Gemma 4's
``<|channel>thought…<channel|>``, Apertus' ``<|inner_prefix|>…<|inner_suffix|>``)
split from the answer, incrementally (gpt-oss' harmony channels: toolcalls.HarmonyToolParser).

Rules:
- Text arrives in arbitrary chunks (a marker may be split at any character);
  a marker, or any prefix of one that could still become a marker, is held
  back and never reaches either output until it is decided.
- A reasoning block is recognised only at the start of the output (leading
  whitespace allowed), as reasoning models emit it; ``starts_inside`` is for
  templates whose generation prompt already opened the block (Qwen3 with
  thinking, DeepSeek-R1), so the output begins inside the reasoning. Such a
  model sometimes repeats the opening marker: a leading one is dropped.
- Output that ends inside the block (max_tokens) is all reasoning.
- Whitespace between the closing marker and the answer is dropped, as is
  whitespace that opens the reasoning itself; output without a reasoning
  block is passed on unchanged (leading whitespace included).
"""

from __future__ import annotations

import dataclasses


def held_suffix(text: str, marker: str) -> int:
    """Length of the longest proper suffix of ``text`` that is a prefix of ``marker``."""
    for n in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-n:]):
            return n
    return 0


@dataclasses.dataclass(frozen=True)
class ReasoningFormat:
    name: str
    start: str
    end: str
    # True when the markers are special tokens the detokenizer would otherwise skip.
    needs_special_tokens: bool = False


THINK = ReasoningFormat("think", "<think>", "</think>")
MISTRAL_THINK = ReasoningFormat("mistral", "[THINK]", "[/THINK]", needs_special_tokens=True)
SEED_THINK = ReasoningFormat("seed", "<seed:think>", "</seed:think>", needs_special_tokens=True)  # Seed-OSS
COHERE_THINK = ReasoningFormat("cohere", "<|START_THINKING|>", "<|END_THINKING|>", needs_special_tokens=True)
# gpt-oss' harmony: reasoning is the analysis channel's messages, read by toolcalls.HarmonyToolParser with the
# answer and the calls (the markers here name the channel; OutputParser hands the whole text to that parser)
HARMONY = ReasoningFormat("harmony", "<|channel|>analysis<|message|>", "<|end|>", needs_special_tokens=True)
# Gemma 4: a thought channel, <|channel>thought ... <channel|> (a prompt without thinking ends with an empty one)
GEMMA4_THOUGHT = ReasoningFormat("gemma4", "<|channel>thought", "<channel|>", needs_special_tokens=True)
# Apertus: inner thoughts, <|inner_prefix|> ... <|inner_suffix|>
APERTUS_INNER = ReasoningFormat("apertus", "<|inner_prefix|>", "<|inner_suffix|>", needs_special_tokens=True)
FORMATS = {f.name: f for f in (THINK, MISTRAL_THINK, SEED_THINK, COHERE_THINK, HARMONY, GEMMA4_THOUGHT, APERTUS_INNER)}
# vLLM's --reasoning-parser names for the formats above
FORMATS.update({name: THINK for name in ("deepseek_r1", "deepseek_v3", "qwen3", "glm45", "minimax_m2")},
               gpt_oss=HARMONY, seed_oss=SEED_THINK)


def is_harmony_template(source: str) -> bool:
    """A chat template that writes gpt-oss' harmony messages."""
    return "<|channel|>" in source and "<|message|>" in source


def reasoning_format_for_template(source: str | None, override: str = "auto") -> ReasoningFormat | None:
    """The reasoning format a chat template implies (``override``: "auto", "none" or a format name)."""
    if override == "none":
        return None
    if override != "auto":
        return FORMATS[override]
    if source and is_harmony_template(source):
        return HARMONY
    for fmt in (THINK, MISTRAL_THINK, SEED_THINK, COHERE_THINK, GEMMA4_THOUGHT, APERTUS_INNER):
        if source and fmt.start in source and fmt.end in source:
            return fmt
    return None


def opens_reasoning(prompt_text: str, fmt: ReasoningFormat | None) -> bool:
    """Whether a rendered prompt ends inside an opened reasoning block."""
    return fmt is not None and prompt_text.rstrip().endswith(fmt.start)


class ReasoningParser:
    """Splits one choice's text stream into (reasoning, content) deltas."""

    _BEFORE, _INSIDE, _AFTER = range(3)

    def __init__(self, fmt: ReasoningFormat, *, starts_inside: bool = False):
        self.fmt = fmt
        self._state = self._INSIDE if starts_inside else self._BEFORE
        self._at_block_start = True  # strip leading whitespace / a repeated opening marker
        self._at_content_start = True
        self._buf = ""

    def push(self, text: str) -> tuple[str, str]:
        self._buf += text
        reasoning: list[str] = []
        content: list[str] = []
        while True:
            if self._state == self._BEFORE:
                lead = self._buf.lstrip()
                if lead.startswith(self.fmt.start):
                    self._buf = lead[len(self.fmt.start):]
                    self._state = self._INSIDE
                    continue
                if self.fmt.start.startswith(lead):
                    break  # still undecided (empty, whitespace or a prefix of the marker)
                self._state = self._AFTER
                self._at_content_start = False  # no reasoning block: the text is kept as it came
                continue
            if self._state == self._INSIDE:
                if self._at_block_start:
                    lead = self._buf.lstrip()
                    if lead.startswith(self.fmt.start):
                        self._buf = lead[len(self.fmt.start):]
                        continue
                    if not lead or self.fmt.start.startswith(lead):
                        break
                    self._buf = lead
                    self._at_block_start = False
                i = self._buf.find(self.fmt.end)
                if i >= 0:
                    reasoning.append(self._buf[:i])
                    self._buf = self._buf[i + len(self.fmt.end):]
                    self._state = self._AFTER
                    continue
                keep = held_suffix(self._buf, self.fmt.end)
                reasoning.append(self._buf[:len(self._buf) - keep])
                self._buf = self._buf[len(self._buf) - keep:]
                break
            # after the block: plain content
            if self._at_content_start:
                self._buf = self._buf.lstrip()
                if not self._buf:
                    break
                self._at_content_start = False
            content.append(self._buf)
            self._buf = ""
            break
        return "".join(reasoning), "".join(content)

    def finish(self) -> tuple[str, str]:
        rest, self._buf = self._buf, ""
        if self._state == self._INSIDE:
            return ("" if self._at_block_start and not rest.strip() else rest), ""
        if self._state == self._BEFORE:
            return "", rest
        return "", (rest.lstrip() if self._at_content_start else rest)

    def parse(self, text: str) -> tuple[str, str]:
        """The whole text at once: (reasoning, content)."""
        r1, c1 = self.push(text)
        r2, c2 = self.finish()
        return r1 + r2, c1 + c2
