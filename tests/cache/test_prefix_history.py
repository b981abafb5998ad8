"""Key-stability rules of PrefixHistory, one test per rule of the reference."""

import hashlib

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from flared.cache import BLOCK_TOKENS, KEY_BYTES, PrefixHistory

MODEL_A = bytes(range(32))
MODEL_B = bytes(range(1, 33))
IMAGE_1 = b"\x11" * 32
IMAGE_2 = b"\x22" * 32


def history(tokens, identity=MODEL_A):
    return PrefixHistory(identity, np.asarray(tokens, dtype=np.int32))


def all_keys(h):
    return [h.key_at(t) for t in range(h.num_tokens + 1)]


def test_keys_are_blake2b_128_and_blocks_follow_the_documented_layout():
    tokens = np.arange(130, dtype=np.int32)
    h = history(tokens)
    assert len(h.key_at(0)) == KEY_BYTES
    root = hashlib.blake2b(MODEL_A + b"flared.prefix.root", digest_size=16).digest()
    assert h.root_key == root == h.key_at(0)
    block0 = hashlib.blake2b(MODEL_A + root + b"B" + tokens[:64].astype("<i4").tobytes(), digest_size=16).digest()
    assert h.key_at(64) == block0
    block1 = hashlib.blake2b(MODEL_A + block0 + b"B" + tokens[64:128].astype("<i4").tobytes(), digest_size=16).digest()
    assert h.key_at(128) == block1
    partial = hashlib.blake2b(
        MODEL_A + block1 + b"P" + (2).to_bytes(4, "little") + tokens[128:130].astype("<i4").tobytes(), digest_size=16
    ).digest()
    assert h.key_at(130) == partial
    assert h.num_blocks == 2


def test_appending_tokens_never_changes_an_earlier_key():
    tokens = np.random.default_rng(0).integers(0, 50000, 300, dtype=np.int32)
    h = history(tokens[:100])
    before = all_keys(h)
    h.append_tokens(tokens[100:200])
    h.append_token(int(tokens[200]))
    assert all_keys(h)[:101] == before
    assert all_keys(h) == all_keys(history(tokens[:201]))


def test_every_endpoint_key_is_distinct():
    h = history(np.zeros(200, dtype=np.int32))
    keys = all_keys(h)
    assert len(set(keys)) == len(keys)


def test_partial_keys_do_not_feed_complete_block_keys():
    tokens = np.arange(64, dtype=np.int32)
    grown = history(tokens[:10])
    grown.key_at(10)  # computing a partial key must leave no trace
    grown.append_tokens(tokens[10:])
    assert grown.key_at(64) == history(tokens).key_at(64)


def test_model_identity_enters_root_and_every_block():
    tokens = np.arange(200, dtype=np.int32)
    a, b = history(tokens, MODEL_A), history(tokens, MODEL_B)
    for t in range(0, 201, 7):
        assert a.key_at(t) != b.key_at(t)


def test_a_token_change_changes_its_endpoint_and_every_later_one():
    tokens = np.arange(200, dtype=np.int32)
    changed = tokens.copy()
    changed[70] = 9999
    a, b = history(tokens), history(changed)
    assert all_keys(a)[:71] == all_keys(b)[:71]
    assert all(x != y for x, y in zip(all_keys(a)[71:], all_keys(b)[71:]))


def test_conditioning_first_affects_prefixes_that_consume_its_position():
    tokens = np.arange(150, dtype=np.int32)
    plain = history(tokens)
    h = history(tokens[:70])
    h.append_conditioning(70, IMAGE_1)
    h.append_tokens(tokens[70:])
    keys, plain_keys = all_keys(h), all_keys(plain)
    assert keys[:71] == plain_keys[:71]
    assert all(x != y for x, y in zip(keys[71:], plain_keys[71:]))


def test_appending_a_later_image_preserves_earlier_keys():
    tokens = np.arange(100, dtype=np.int32)
    h = history(tokens)
    before = all_keys(h)
    h.append_conditioning(100, IMAGE_1)
    assert all_keys(h) == before
    h.append_tokens(np.arange(30, dtype=np.int32))
    assert all_keys(h)[:101] == before


def test_same_conditioning_at_a_different_position_changes_the_key():
    tokens = np.arange(128, dtype=np.int32)
    keys = []
    for position in (10, 11, 70):
        h = history(tokens[:position])
        h.append_conditioning(position, IMAGE_1)
        h.append_tokens(tokens[position:])
        keys.append(h.key_at(128))
        assert h.key_at(position + 1) != history(tokens).key_at(position + 1)
    assert len(set(keys)) == 3


def test_events_at_one_position_keep_their_order():
    tokens = np.arange(80, dtype=np.int32)

    def with_events(order):
        h = history(tokens[:5])
        for ident in order:
            h.append_conditioning(5, ident)
        h.append_tokens(tokens[5:])
        return h

    ab, ba = with_events([IMAGE_1, IMAGE_2]), with_events([IMAGE_2, IMAGE_1])
    assert ab.key_at(5) == ba.key_at(5)
    assert ab.key_at(6) != ba.key_at(6)
    assert ab.key_at(64) != ba.key_at(64)
    assert with_events([IMAGE_1, IMAGE_2]).key_at(80) == ab.key_at(80)


def test_conditioning_cannot_rewrite_consumed_history():
    h = history(np.arange(10, dtype=np.int32))
    with pytest.raises(ValueError):
        h.append_conditioning(9, IMAGE_1)
    h.append_conditioning(12, IMAGE_1)
    with pytest.raises(ValueError):
        h.append_conditioning(11, IMAGE_2)
    with pytest.raises(ValueError):
        h.append_conditioning(20, b"short")
    with pytest.raises(ValueError):
        h.key_at(11)
    with pytest.raises(ValueError):
        PrefixHistory(b"too short")


@settings(max_examples=40, deadline=None)
@given(
    tokens=st.lists(st.integers(0, 2**31 - 1), min_size=0, max_size=200),
    cuts=st.lists(st.integers(0, 200), max_size=4),
    events=st.lists(st.tuples(st.integers(0, 200), st.sampled_from([IMAGE_1, IMAGE_2])), max_size=3),
)
def test_piecewise_build_equals_minimal_build_and_keys_never_move(tokens, cuts, events):
    """However the tokens are split into appends, the keys match a build that
    appends only at event positions, and no key changes once computable."""
    tokens = np.asarray(tokens, dtype=np.int32)
    events = sorted(((min(p, len(tokens)), i, ident) for i, (p, ident) in enumerate(events)))

    def build(extra_cuts, check_stability):
        stops = sorted({min(c, len(tokens)) for c in extra_cuts} | {p for p, _, _ in events} | {len(tokens)})
        h = PrefixHistory(MODEL_A)
        seen_keys = {}
        pending = list(events)
        for stop in stops:
            h.append_tokens(tokens[h.num_tokens : stop])
            while pending and pending[0][0] == stop:
                h.append_conditioning(stop, pending.pop(0)[2])
            if check_stability:
                for t, key in seen_keys.items():
                    assert h.key_at(t) == key
                for t in range(h.num_tokens + 1):
                    seen_keys.setdefault(t, h.key_at(t))
        return h

    piecewise = build(cuts, True)
    minimal = build([], False)
    assert all_keys(piecewise) == all_keys(minimal)
    assert piecewise.num_blocks == len(tokens) // BLOCK_TOKENS
    assert piecewise.num_events == len(events)
