"""Incremental decoding equals full decoding; stop-string matching does not depend on chunking."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer

from flared.errors import FrontendError
from flared.frontend import StopStringMatcher
from flared.frontend.detokenizer import Detokenizer, IncrementalDecoder, TokenBytes, WindowPieceIds

PROPERTY_SETTINGS = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@pytest.fixture(scope="module")
def smollm2_tokenizer(smollm2_assets):
    return Tokenizer.from_str(smollm2_assets.tokenizer_json)


@pytest.fixture(scope="module")
def token_bytes(smollm2_tokenizer):
    table = TokenBytes.from_tokenizer(smollm2_tokenizer)
    assert table is not None
    return table


@pytest.fixture(scope="module")
def smollm2_pool(smollm2_tokenizer):
    return _interesting_ids(smollm2_tokenizer)


@pytest.fixture(scope="module")
def smollm2_piece_ids(smollm2_tokenizer):
    return WindowPieceIds.from_tokenizer(smollm2_tokenizer)


def _interesting_ids(tokenizer) -> list[int]:
    """Single-byte tokens (broken UTF-8 when alone), specials, CJK/emoji pieces, ordinary words."""
    vocab = tokenizer.get_vocab(with_added_tokens=True)
    ids = list(range(0, 17))  # special tokens
    ids += [vocab[token] for token in ("Ã", "Â", "ð", "Ł", "¤", "ł", "Ġ", "Ċ", "ĠĠ")]
    ids += tokenizer.encode("東京 😀👍🏽 naïve \n\n  def x():", add_special_tokens=False).ids
    return sorted(set(ids))


def _decode_incrementally(decoder: IncrementalDecoder, ids, chunk_sizes) -> list[str]:
    pieces, position = [], 0
    for size in chunk_sizes:
        if position >= len(ids):
            break
        pieces.append(decoder.push_many(ids[position:position + size]))
        position += size
    for token_id in ids[position:]:
        pieces.append(decoder.push(token_id))
    pieces.append(decoder.flush())
    return pieces


def _assert_whole_characters(pieces):
    # Every emitted chunk is a valid str (Python strs cannot hold half a UTF-8 sequence);
    # the check that matters is that no lone replacement shows up that the full decode lacks.
    for piece in pieces:
        piece.encode("utf-8")


@PROPERTY_SETTINGS
@given(data=st.data(), skip_special=st.booleans())
def test_incremental_equals_full_byte_level(smollm2_tokenizer, token_bytes, smollm2_pool, data, skip_special):
    pool = smollm2_pool
    ids = data.draw(st.lists(st.one_of(st.sampled_from(pool), st.integers(0, 49151)), max_size=40))
    chunks = data.draw(st.lists(st.integers(1, 4), max_size=20))
    decoder = IncrementalDecoder(smollm2_tokenizer, skip_special_tokens=skip_special, token_bytes=token_bytes)
    pieces = _decode_incrementally(decoder, ids, chunks)
    _assert_whole_characters(pieces)
    assert "".join(pieces) == smollm2_tokenizer.decode(ids, skip_special_tokens=skip_special)


@PROPERTY_SETTINGS
@given(data=st.data())
def test_incremental_equals_full_windowed_fallback(smollm2_tokenizer, smollm2_pool, smollm2_piece_ids, data):
    """The tokenizer-agnostic path (used for SentencePiece vocabularies) on the same ids."""
    ids = data.draw(st.lists(st.sampled_from(smollm2_pool), max_size=30))
    decoder = IncrementalDecoder(smollm2_tokenizer, token_bytes=None, piece_ids=smollm2_piece_ids)
    pieces = _decode_incrementally(decoder, ids, [])
    assert "".join(pieces) == smollm2_tokenizer.decode(ids, skip_special_tokens=False)


def test_emoji_split_over_byte_tokens_is_held_until_complete(smollm2_tokenizer, token_bytes):
    ids = smollm2_tokenizer.encode("😀", add_special_tokens=False).ids
    assert len(ids) > 1  # the emoji's four bytes span several tokens
    decoder = IncrementalDecoder(smollm2_tokenizer, token_bytes=token_bytes)
    pieces = [decoder.push(i) for i in ids]
    assert pieces[:-1] == [""] * (len(ids) - 1) and pieces[-1] == "😀"
    dangling = IncrementalDecoder(smollm2_tokenizer, token_bytes=token_bytes)
    assert dangling.push(ids[0]) == ""
    assert dangling.flush() == smollm2_tokenizer.decode(ids[:1])


def test_sentencepiece_tokenizer_windowed(tmp_path, write_sentencepiece_gguf):
    from flared.frontend import tokenizer_from_gguf

    path = tmp_path / "spm.gguf"
    write_sentencepiece_gguf(path, with_merges=False, add_bos=None)
    tokenizer = Tokenizer.from_str(tokenizer_from_gguf(path).tokenizer_json)
    assert TokenBytes.from_tokenizer(tokenizer) is None
    for text in ["hello world the quick", " lazy dog 你好 😀 world", "<|user|>hi there"]:
        ids = tokenizer.encode(text).ids
        for skip in (False, True):
            decoder = IncrementalDecoder(tokenizer, skip_special_tokens=skip)
            pieces = [decoder.push(i) for i in ids] + [decoder.flush()]
            assert "".join(pieces) == tokenizer.decode(ids, skip_special_tokens=skip), text


def _reference_stop(text: str, stops: list[str]) -> tuple[str, bool]:
    """Over the whole text at once: the occurrence that ends first (ties: starts first) stops it."""
    hits = [(text.find(stop) + len(stop), text.find(stop)) for stop in stops if stop in text]
    if not hits:
        return text, False
    _, start = min(hits)
    return text[:start], True


def _split(text: str, cuts: list[int]) -> list[str]:
    points = sorted({c % (len(text) + 1) for c in cuts} | {0, len(text)})
    return [text[a:b] for a, b in zip(points, points[1:])]


@settings(max_examples=300, deadline=None)
@given(
    text=st.text(alphabet="abc<|>東\n ", max_size=40),
    stops=st.lists(st.text(alphabet="abc<|>東\n ", min_size=1, max_size=5), max_size=3),
    cuts=st.lists(st.integers(0, 60), max_size=10),
)
def test_stop_strings_do_not_depend_on_chunking(text, stops, cuts):
    matcher = StopStringMatcher(stops)
    emitted = "".join(matcher.push(chunk) for chunk in _split(text, cuts)) + matcher.flush()
    assert (emitted, matcher.stopped) == _reference_stop(text, stops)


def test_stop_string_across_chunks_is_withheld():
    matcher = StopStringMatcher(["</answer>"])
    assert matcher.push("The result is 4</ans") == "The result is 4"
    assert matcher.push("wer> trailing") == ""
    assert matcher.matched == "</answer>" and matcher.flush() == ""
    released = StopStringMatcher(["</answer>"])
    assert released.push("a </an") == "a "
    assert released.push("d more") == "</and more"
    assert released.flush() == ""
    first_complete = StopStringMatcher(["<|<", "|"])
    assert first_complete.push("<|<") == "<"  # "|" completes before "<|<" does
    with pytest.raises(FrontendError):
        StopStringMatcher([""])


def test_detokenizer_stops_mid_token_stream(smollm2_tokenizer, token_bytes):
    ids = smollm2_tokenizer.encode("Paris is nice. STOP here and more", add_special_tokens=False).ids
    detokenizer = Detokenizer(IncrementalDecoder(smollm2_tokenizer, token_bytes=token_bytes), ["STOP"])
    texts, num_tokens = [], 0
    for token_id in ids:
        num_tokens += 1  # the tokens of a matched stop still count as generated
        delta = detokenizer.push(token_id)
        texts.append(delta.text)
        if delta.stopped:
            break
    assert "".join(texts) == "Paris is nice. "
    assert detokenizer.matched_stop == "STOP" and num_tokens < len(ids)
    unstopped = Detokenizer(IncrementalDecoder(smollm2_tokenizer, token_bytes=token_bytes), ["never"])
    out = "".join(unstopped.push(i).text for i in ids) + unstopped.finish().text
    assert out == "Paris is nice. STOP here and more"


@pytest.fixture(scope="module")
def sentencepiece_tokenizer(tmp_path_factory, write_sentencepiece_gguf):
    from flared.frontend import tokenizer_from_gguf

    path = tmp_path_factory.mktemp("spm") / "spm.gguf"
    write_sentencepiece_gguf(path, with_merges=False, add_bos=None)
    return Tokenizer.from_str(tokenizer_from_gguf(path).tokenizer_json)


@PROPERTY_SETTINGS
@given(data=st.data(), skip_special=st.booleans())
def test_incremental_equals_full_sentencepiece(sentencepiece_tokenizer, data, skip_special):
    """Byte-fallback pieces (<0xNN>), "▁" word starts and specials, in any order."""
    vocab_size = sentencepiece_tokenizer.get_vocab_size(with_added_tokens=True)
    utf8_pieces = [259 - 256 + b for b in "😀é東".encode()]  # byte tokens of multi-byte characters
    ids = data.draw(st.lists(st.one_of(st.integers(0, vocab_size - 1), st.sampled_from(utf8_pieces)), max_size=30))
    decoder = IncrementalDecoder(sentencepiece_tokenizer, skip_special_tokens=skip_special)
    pieces = _decode_incrementally(decoder, ids, data.draw(st.lists(st.integers(1, 4), max_size=10)))
    assert "".join(pieces) == sentencepiece_tokenizer.decode(ids, skip_special_tokens=skip_special)
