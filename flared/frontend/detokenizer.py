"""Turning sampled token ids back into text, one token at a time.

Rules:
- Incremental decoding emits, over a whole stream, exactly the text that a
  full ``decode`` of the same ids gives; no chunk ever ends inside a UTF-8
  sequence (an incomplete sequence is held until it completes or the stream
  ends; at the end it becomes U+FFFD, as the full decode makes it).
- Byte-level vocabularies (GPT-2 style) decode through a per-token byte table
  and Python's incremental UTF-8 decoder: O(1) per token, exact.
- Other vocabularies (SentencePiece with byte fallback) decode a sliding window
  of ids and emit only what later ids can no longer change: a run of
  byte-fallback pieces is decoded all or nothing (one invalid byte turns the
  whole run into U+FFFDs), so a run is held until a non-byte piece closes it;
  the window keeps the cost O(1) amortised.
- Stop strings: the stream ends where a stop string first becomes complete
  (the occurrence that ends first; on a tie the longer one); the text of the
  match and everything after are never emitted; text that
  could still be the start of a stop string is held back until it cannot, and
  released at the end. The result does not depend on how the text was chunked.
"""

from __future__ import annotations

import codecs
import dataclasses
import functools
import json

from flared.errors import ErrorKind, FrontendError


@functools.lru_cache(maxsize=1)
def _byte_level_inverse() -> dict[str, int]:
    from flared.frontend.gguf_tokenizer import _byte_alphabet

    return {char: byte for byte, char in _byte_alphabet().items()}


class TokenBytes:
    """Per-token byte strings of a byte-level BPE tokenizer (None when the tokenizer is not one)."""

    def __init__(self, table: list[bytes], special_ids: frozenset[int]):
        self.table = table  # token id -> the bytes it decodes to
        self.special_ids = special_ids  # ids skipped by skip_special_tokens

    @classmethod
    def from_tokenizer(cls, tokenizer) -> TokenBytes | None:
        spec = json.loads(tokenizer.to_str())
        decoder = spec.get("decoder") or {}
        if decoder.get("type") != "ByteLevel" or (spec.get("model") or {}).get("type") != "BPE":
            return None
        inverse = _byte_level_inverse()
        vocab_size = tokenizer.get_vocab_size(with_added_tokens=True)
        table: list[bytes] = [b""] * vocab_size
        for token, token_id in spec["model"]["vocab"].items():
            if token_id < vocab_size:
                try:
                    table[token_id] = bytes(inverse[char] for char in token)
                except KeyError:
                    # Not spelled in the byte alphabet: the decoder passes such characters through.
                    table[token_id] = b"".join(
                        bytes([inverse[c]]) if c in inverse else c.encode("utf-8") for c in token
                    )
        special_ids = set()
        # Added tokens decode to their content verbatim, never through the byte alphabet.
        for entry in spec.get("added_tokens", ()):
            if entry["id"] < vocab_size:
                table[entry["id"]] = entry["content"].encode("utf-8")
            if entry["special"]:
                special_ids.add(entry["id"])
        return cls(table, frozenset(special_ids))


@dataclasses.dataclass(frozen=True)
class WindowPieceIds:
    """Token ids the windowed decoder must treat specially, computed once per tokenizer."""

    byte_fallback_ids: frozenset[int]  # "<0xNN>" pieces
    special_ids: frozenset[int]  # special added tokens (dropped by skip_special_tokens)

    @classmethod
    def from_tokenizer(cls, tokenizer) -> WindowPieceIds:
        return cls(
            byte_fallback_ids=frozenset(
                token_id for token, token_id in tokenizer.get_vocab(with_added_tokens=False).items()
                if len(token) == 6 and token.startswith("<0x") and token.endswith(">")
            ),
            special_ids=frozenset(
                token_id for token_id, token in tokenizer.get_added_tokens_decoder().items() if token.special
            ),
        )


class IncrementalDecoder:
    """Feed token ids, get text deltas that are always whole UTF-8 characters; ``flush`` at the end."""

    def __init__(self, tokenizer, *, skip_special_tokens: bool = False, token_bytes: TokenBytes | None = None,
                 piece_ids: WindowPieceIds | None = None, window_tokens: int = 6):
        """``token_bytes``: the byte table of a byte-level tokenizer (exact O(1) path); otherwise the
        windowed path, with ``piece_ids`` (computed from the vocabulary when not given: pass the
        cached one, a vocabulary scan per stream is slow)."""
        self._tokenizer = tokenizer
        self._skip_special = skip_special_tokens
        self._token_bytes = token_bytes
        if token_bytes is not None:
            self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")
        else:
            self._ids: list[int] = []
            self._prefix_start = 0  # window start: ids before it are settled
            self._read_start = 0  # ids before it have been emitted
            self._window_tokens = window_tokens
            if piece_ids is None:
                piece_ids = WindowPieceIds.from_tokenizer(tokenizer)
            # Ids that may still change text already decoded: byte-fallback pieces (a run of them is
            # decoded as one UTF-8 sequence, all or nothing) and, when skipped, special tokens
            # (invisible, so the runs on either side of them join).
            self._open_ids = (piece_ids.byte_fallback_ids | piece_ids.special_ids if skip_special_tokens
                              else piece_ids.byte_fallback_ids)
        self._done = False

    def push(self, token_id: int) -> str:
        """Add one token; the text it completes (possibly empty)."""
        return self.push_many((token_id,))

    def push_many(self, token_ids) -> str:
        if self._done:
            raise FrontendError("incremental decoder used after flush", ErrorKind.EXECUTION)
        if self._token_bytes is not None:
            table = self._token_bytes.table
            skip = self._token_bytes.special_ids if self._skip_special else ()
            try:
                data = b"".join(table[i] for i in token_ids if i not in skip)
            except (IndexError, TypeError):
                raise FrontendError(f"token id out of range in {list(token_ids)!r}", ErrorKind.VALIDATION) from None
            return self._utf8.decode(data, False)
        self._ids.extend(token_ids)
        return self._advance(final=False)

    def flush(self) -> str:
        """End of stream: whatever was held back (an incomplete sequence becomes U+FFFD)."""
        if self._done:
            return ""
        self._done = True
        if self._token_bytes is not None:
            return self._utf8.decode(b"", True)
        return self._advance(final=True)

    def _decode(self, ids) -> str:
        return self._tokenizer.decode(ids, skip_special_tokens=self._skip_special)

    def _advance(self, *, final: bool) -> str:
        # Decode the window twice: up to what was already emitted, and up to the last id that can no
        # longer change it. The difference is new text unless it ends in U+FFFD (held: it may be an
        # incomplete sequence).
        ids = self._ids
        end = len(ids)
        if not final:
            while end > self._read_start and ids[end - 1] in self._open_ids:
                end -= 1
        if end <= self._read_start and not final:
            return ""
        start = self._prefix_start
        prefix_text = self._decode(ids[start:self._read_start])
        if start > 0 and not prefix_text:
            # Without settled text on the left, a decoder's leading-space strip would hit new text.
            start = 0
            prefix_text = self._decode(ids[:self._read_start])
        full_text = self._decode(ids[start:end])
        if not full_text.startswith(prefix_text):
            # A decoder that rewrites text across the window edge: decode from the start.
            start = 0
            prefix_text = self._decode(ids[:self._read_start])
            full_text = self._decode(ids[:end])
        self._prefix_start = start
        if len(full_text) <= len(prefix_text) or (full_text.endswith("\ufffd") and not final):
            return ""
        delta = full_text[len(prefix_text):]
        self._read_start = end
        # Keep a few settled ids as left context, so the next window decodes them the same way.
        self._prefix_start = max(self._prefix_start, end - self._window_tokens)
        return delta


class StopStringMatcher:
    """Withholds text until it cannot be part of a stop string; stops at the first match."""

    def __init__(self, stop_strings, *, include_match: bool = False):
        self.include_match = include_match  # the match itself is emitted (vLLM's include_stop_str_in_output)
        stops = tuple(stop_strings)
        for stop in stops:
            if not isinstance(stop, str) or not stop:
                raise FrontendError(f"stop strings must be non-empty strings, got {stop!r}", ErrorKind.VALIDATION)
        self.stop_strings = stops
        self._held = ""
        self.matched: str | None = None  # the stop string that ended the stream, if any

    @property
    def stopped(self) -> bool:
        return self.matched is not None

    def push(self, text: str) -> str:
        """Add text; the part that is now safe to emit. After a match, always ''."""
        if self.matched is not None or not self.stop_strings:
            return "" if self.matched is not None else text
        buffer = self._held + text
        # Generation stops when a stop string is complete, so the match that ends first wins
        # (ties: the longer one, which starts first). A stop string's first occurrence is its
        # earliest-ending one.
        best_end, best_start, matched = -1, -1, None
        for stop in self.stop_strings:
            at = buffer.find(stop)
            if at == -1:
                continue
            end = at + len(stop)
            if matched is None or end < best_end or (end == best_end and at < best_start):
                best_end, best_start, matched = end, at, stop
        if matched is not None:
            self.matched = matched
            self._held = ""
            return buffer[:best_end] if self.include_match else buffer[:best_start]
        hold_from = len(buffer)
        # The earliest position whose suffix could still grow into a stop string.
        for stop in self.stop_strings:
            for length in range(min(len(stop) - 1, len(buffer)), 0, -1):
                if buffer.endswith(stop[:length]):
                    hold_from = min(hold_from, len(buffer) - length)
                    break
        self._held = buffer[hold_from:]
        return buffer[:hold_from]

    def flush(self) -> str:
        """End of stream without a match: release what was held."""
        held, self._held = self._held, ""
        return "" if self.matched is not None else held


@dataclasses.dataclass(frozen=True)
class TextDelta:
    text: str  # text to send to the client now
    stopped: bool  # a stop string matched; the request should finish (its tokens still count)


class Detokenizer:
    """Incremental decoding plus stop strings, for one generation stream."""

    def __init__(self, decoder: IncrementalDecoder, stop_strings=(), *, include_stop_str: bool = False):
        self._decoder = decoder
        self._stops = StopStringMatcher(stop_strings, include_match=include_stop_str)

    @property
    def matched_stop(self) -> str | None:
        return self._stops.matched

    def push(self, token_id: int, *, match_stops: bool = True) -> TextDelta:
        """``match_stops=False`` passes the token's text by the stop strings (vLLM's min_tokens: none is
        looked for before that many tokens). Only a stream's first tokens may skip them: the matcher then
        holds nothing, so the text stays in order."""
        if self._stops.stopped:
            return TextDelta("", True)
        text = self._decoder.push(token_id)
        if match_stops:
            text = self._stops.push(text)
        return TextDelta(text, self._stops.stopped)

    def finish(self) -> TextDelta:
        if self._stops.stopped:
            return TextDelta("", True)
        text = self._stops.push(self._decoder.flush())
        if self._stops.stopped:
            return TextDelta(text, True)
        return TextDelta(text + self._stops.flush(), False)
