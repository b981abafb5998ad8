"""Workloads: sessions of turns, synthesised from a seed.

A session is a list of turns sent one after another on one conversation; the
single-shot workloads are sessions of one turn. Multi-turn sessions resend
the whole conversation each turn, so every turn shares the previous turns as
a prefix (what a prefix cache should reuse).

Prompt text is drawn from a fixed word list; with a tokenizer the text is cut
to the exact token count, without one a word is taken as one token (common
lowercase words with a leading space are one token in BPE vocabularies).
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass
from enum import Enum

_WORDS = (
    "time year people way day man thing woman life child world school state family student group country "
    "problem hand part place case week company system program question work government number night point "
    "home water room mother area money story fact month lot right study book eye job word business issue "
    "side kind head house service friend father power hour game line end member law car city community name "
    "president team minute idea kid body information back parent face others level office door health person "
    "art war history party result change morning reason research girl guy moment air teacher force education "
    "river mountain garden window street table letter music paper picture market price summer winter light "
    "small large early young important few public bad same able last long great little own other old big high "
    "different local sure free better true whole real best open simple clear full short easy strong "
    "make know think take see come want look use find give tell work call try ask need feel become leave put "
    "mean keep let begin seem help talk turn start show hear play run move like live believe hold bring write"
).split()


class WorkloadKind(Enum):
    RANDOM = "random"  # uniform input/output lengths in [min, max]
    FIXED = "fixed"  # every request input_tokens in, output_tokens out
    SHAREGPT = "sharegpt"  # log-normal lengths shaped like ShareGPT conversations
    MULTI_TURN = "multi-turn"  # conversations whose turns share prefixes


@dataclass(frozen=True)
class WorkloadSpec:
    kind: WorkloadKind
    num_sessions: int
    seed: int = 0
    input_tokens: int = 256  # fixed; the mean for random
    output_tokens: int = 128
    input_tokens_min: int = 16  # random
    input_tokens_max: int = 512
    output_tokens_min: int = 16
    output_tokens_max: int = 256
    turns: int = 4  # multi-turn: turns per conversation
    turn_input_tokens: int = 64  # multi-turn: a later turn's new user text
    length_scale: float = 1.0  # sharegpt: scales both lengths (small-context models)

    def __post_init__(self):
        if self.num_sessions < 1:
            raise ValueError("num_sessions must be >= 1")
        if min(self.input_tokens, self.output_tokens, self.input_tokens_min, self.output_tokens_min) < 1:
            raise ValueError("token counts must be >= 1")
        if self.input_tokens_min > self.input_tokens_max or self.output_tokens_min > self.output_tokens_max:
            raise ValueError("min above max")
        if self.turns < 1:
            raise ValueError("turns must be >= 1")


@dataclass(frozen=True)
class Turn:
    user_text: str
    input_tokens: int  # the user text's length as generated (the server adds its template)
    max_tokens: int


class TextSource:
    """Seeded filler text of a given token length."""

    def __init__(self, rng: random.Random, tokenizer=None):
        self.rng = rng
        self.tokenizer = tokenizer  # a `tokenizers.Tokenizer` or None

    def text(self, num_tokens: int) -> str:
        words = [self.rng.choice(_WORDS) for _ in range(num_tokens)]
        if self.tokenizer is None:
            return " ".join(words)
        # Add words until the count is reached, then cut the ids and decode.
        text = " ".join(words)
        ids = self.tokenizer.encode(text, add_special_tokens=False).ids
        while len(ids) < num_tokens:
            text += " " + " ".join(self.rng.choice(_WORDS) for _ in range(num_tokens - len(ids)))
            ids = self.tokenizer.encode(text, add_special_tokens=False).ids
        return self.tokenizer.decode(ids[:num_tokens])


def _lognormal(rng: random.Random, median: float, sigma: float, lo: int, hi: int) -> int:
    return int(min(hi, max(lo, round(rng.lognormvariate(math.log(median), sigma)))))


def build_sessions(spec: WorkloadSpec, tokenizer=None) -> list[list[Turn]]:
    rng = random.Random(spec.seed)
    text = TextSource(random.Random(spec.seed + 1), tokenizer)
    sessions: list[list[Turn]] = []
    for _ in range(spec.num_sessions):
        if spec.kind is WorkloadKind.FIXED:
            isl, osl = spec.input_tokens, spec.output_tokens
        elif spec.kind is WorkloadKind.RANDOM:
            isl = rng.randint(spec.input_tokens_min, spec.input_tokens_max)
            osl = rng.randint(spec.output_tokens_min, spec.output_tokens_max)
        elif spec.kind is WorkloadKind.SHAREGPT:
            # ShareGPT's first-turn prompts have a median near 70 words with a
            # long tail; replies a median near 200 with a shorter one.
            isl = _lognormal(rng, 70 * spec.length_scale, 1.1, 4, max(4, int(2048 * spec.length_scale)))
            osl = _lognormal(rng, 200 * spec.length_scale, 0.8, 4, max(4, int(1024 * spec.length_scale)))
        else:
            turns = []
            for t in range(spec.turns):
                n = spec.input_tokens if t == 0 else spec.turn_input_tokens
                turns.append(Turn(text.text(n), n, spec.output_tokens))
            sessions.append(turns)
            continue
        sessions.append([Turn(text.text(isl), isl, osl)])
    return sessions
