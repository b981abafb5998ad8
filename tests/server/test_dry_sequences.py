"""DRY's sequence breakers in tokens (flared.server.openai_routes.dry_sequences) against a literal reading of
llama.cpp's get_overlapping_token_sequences, over a real byte-level BPE vocabulary."""

from __future__ import annotations

import pytest

from tests.conftest import train_tiny_tokenizer


@pytest.fixture(scope="module")
def frontend(tmp_path_factory):
    from tokenizers import Tokenizer

    d = tmp_path_factory.mktemp("dry-tok")
    train_tiny_tokenizer(d)
    return _Frontend(Tokenizer.from_file(str(d / "tokenizer.json")))


class _Frontend:
    """What dry_sequences reads of a frontend: its tokenizer (hashable, as its cache keys on the frontend)."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer


def _llama_cpp(fe, vocab_size, breakers, max_tail_len=20):
    """get_overlapping_token_sequences, position by position as llama.cpp writes it, for each breaker."""
    singles, restarts = set(), []
    texts = fe.tokenizer.decode_batch([[t] for t in range(vocab_size)], skip_special_tokens=False)
    for s in breakers:
        s = s[:40]
        for token, word in enumerate(texts):
            if s in word:
                singles.add(token)
                continue
            pos = word.find(s[0])
            while pos != -1:
                match, i = True, 1
                while i < len(s) and pos + i < len(word):
                    if word[pos + i] != s[i]:
                        match = False
                        break
                    i += 1
                if match:
                    tail = tuple(fe.tokenizer.encode(s[i:], add_special_tokens=False).ids[:max_tail_len])
                    if not tail:
                        singles.add(token)
                    elif (token, tail) not in restarts:
                        restarts.append((token, tail))
                pos = word.find(s[0], pos + 1)
    return singles, restarts


@pytest.mark.parametrize("breakers", [
    ("\n", ":", "\"", "*"),  # llama.cpp's defaults: one character each, so no restart sequences
    ("fox jumps", "\n"),  # spans several tokens: every token ending in its start heads a sequence
    ("return a", "capital of France", "is"),
    ("x" * 60,),  # cut to 40 characters
])
def test_breakers_become_the_tokens_llama_cpp_finds(frontend, breakers):
    from flared.server.openai_routes import dry_sequences

    vocab = frontend.tokenizer.get_vocab_size()
    got = dry_sequences(frontend, vocab, breakers)
    singles, restarts = _llama_cpp(frontend, vocab, breakers)
    assert got["dry_breakers"] == frozenset(singles)
    assert sorted(got["dry_restarts"]) == sorted(restarts)
    if breakers[0] == "fox jumps":
        assert restarts, "a breaker several tokens spell gives restart sequences"
        texts = frontend.tokenizer.decode_batch([[h] for h, _ in restarts])
        assert all(any(t.endswith("fox jumps"[:k]) for k in range(1, 9)) for t in texts)
