"""Message endpoints: where in a prompt each complete message ends.

Rules:
- A byte endpoint is a UTF-8 offset into the rendered prompt (internally the
  equivalent code-point offset, which is what tokenizers reports). It becomes a
  token endpoint only if no token crosses it: every token before it ends at or
  before it and every token after starts at or after it.
- Endpoints are sorted, unique and strictly inside the prompt (0 < t < len).
- Annotated templates give byte endpoints with ``{% mark %}``. Ordinary
  templates get them from prefix renders: the conversation cut after message k
  is rendered on its own (no generation prompt, no continuation) and its end
  is an endpoint only if that rendering is an exact byte prefix of the full
  prompt — the property a later, longer request needs to reuse it.
"""

from __future__ import annotations

import bisect


def char_to_byte_offsets(text: str, char_offsets) -> list[int]:
    """UTF-8 byte offsets of ascending code-point offsets into ``text``."""
    if text.isascii():
        return list(char_offsets)
    result = []
    position_bytes, position_chars = 0, 0
    for offset in char_offsets:
        position_bytes += len(text[position_chars:offset].encode("utf-8"))
        position_chars = offset
        result.append(position_bytes)
    return result


def token_endpoints(token_offsets: list[tuple[int, int]], char_endpoints) -> tuple[int, ...]:
    """Token indices at the endpoints that no token crosses (sorted, unique, strictly inside).

    Endpoints and ``token_offsets`` (the tokenizer's (start, end) pairs) are code-point offsets
    into the same text; a code-point boundary is a UTF-8 byte boundary, so this is the byte rule.
    """
    num_tokens = len(token_offsets)
    if num_tokens < 2:
        return ()
    chars = sorted(set(char_endpoints))
    ends = [end for _, end in token_offsets]
    # Offsets are monotone for the tokenizers we build; a running max makes the search safe anyway.
    max_end_before = []
    running = 0
    for end in ends:
        running = max(running, end)
        max_end_before.append(running)
    starts_min_after = [0] * num_tokens
    running = None
    for index in range(num_tokens - 1, -1, -1):
        start = token_offsets[index][0]
        running = start if running is None else min(running, start)
        starts_min_after[index] = running
    result = []
    for char_offset in chars:
        if char_offset is None:
            continue
        # First token that does not end at or before the endpoint.
        cut = bisect.bisect_right(max_end_before, char_offset)
        if not 0 < cut < num_tokens:
            continue
        if starts_min_after[cut] >= char_offset:
            result.append(cut)
    return tuple(sorted(set(result)))
