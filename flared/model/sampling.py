"""Batched sampling with per-request parameters.

``Sampler.sample(logits, states)`` picks one token per row of a float32
``[B, vocab]`` logits tensor, each row under its own ``SamplingParams``, in
one vectorised pass. The order follows vLLM: log-probabilities are taken from
the raw logits; then logit bias; then vLLM's allowed_token_ids (every other
id to -inf) and min_tokens (EOS and the stop ids to -inf until that many
tokens were drawn), bad_words (a sequence's last token where the output
ends with the rest of it) and a thinking budget (past it, only the
reasoning's end token while it is open); then repetition (prompt + output), frequency
and presence (output only) penalties, or with penalty_last_n all three over
the last N tokens (llama.cpp's repeat_last_n); then llama.cpp's DRY; greedy
rows take the argmax here; other rows are divided by their temperature,
filtered by top-n-sigma, min-p, typical-p, top-k, top-p and XTC, and drawn
(vLLM's order); rows with a ``sampler_order`` (llama.cpp's chain, its
``samplers``) run their filters and temperature in that order instead; mirostat
rows (v1, v2) are drawn by mirostat after their temperature.

Rules:
- Reproducible draws: a row's randomness comes only from its own seed, the
  number of tokens it has drawn so far and the token's id, never from its
  place in the batch or from other rows. On the CPU the draw's noise is the
  GPU graphs' counter hash (flared._fast.race), so a seeded request draws the
  same tokens on either backend where the logits and the kept tokens agree;
  rows a GPU executor leaves to this Sampler draw from a generator reseeded
  per row per step.
- Penalty state lives on the device in a slot table (output counts, prompt
  mask) owned by the sampler; a sequence holds a slot only if it uses a
  penalty (or, where the sampler keeps graph tables for a GPU executor, a
  logit bias: ``ShapeTables``), from ``add_sequence`` to ``release``.
- ``sample`` advances each state (step counter, output counts) itself, on the
  device, without a host sync; reading the chosen ids back is the caller's one
  sync per step.
- Grammar masks (flared.model.grammar) touch only rows whose state holds a
  matcher: their disallowed ids go to -inf after bias and penalties, before
  the greedy argmax and the draw. Unconstrained rows pay nothing. The caller
  advances the matcher with the chosen token; a matcher already in its error
  state is left unmasked here and reported by the caller's ``consume``.
  Where a grammar allows only ids that min_tokens bans (its output is
  complete), the grammar wins and the output ends.
"""

from __future__ import annotations

import bisect
import contextlib
import dataclasses
import math
import secrets
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np
import torch

from flared._fast.penalties import apply_penalties
from flared._fast.race import race_draw, race_top_p
from flared.errors import AdmissionError, ErrorKind, ExecutionError

_MASK64 = (1 << 64) - 1
_MASK63 = (1 << 63) - 1  # a seed as the race's hash takes it (the GPU executor uploads the same)
DRY_MAX_MATCH = 64  # DRY's repeat lengths are counted to this many tokens (the default base makes that ~1e15)
_XTC_SALT = 0x5854435F434F494E  # a second stream per (seed, step) for XTC's coin
# The least exponential a race draws (Sampler._race; kernels.sampling.E_FLOOR takes it for the GPU): a uniform
# of 0 would give E = 0, and its token would win whatever its probability.
E_FLOOR = 2.0 ** -24

# llama.cpp's sampler names (its ``samplers``) as SamplingParams.sampler_order takes them. "penalties" and "dry" are
# listed for the record: they shape the logits before any filter wherever they stand (Sampler.sample).
SAMPLER_STAGES = ("penalties", "dry", "top_n_sigma", "top_k", "typ_p", "top_p", "min_p", "xtc", "temperature",
                  "infill", "adaptive_p")
# llama.cpp's default chain: every filter at temperature 1, the temperature last
LLAMA_CPP_ORDER = ("penalties", "dry", "top_n_sigma", "top_k", "typ_p", "top_p", "min_p", "xtc", "temperature")
# vLLM's order (the batched path's) under llama.cpp's names: the temperature first
VLLM_ORDER = ("penalties", "dry", "temperature", "top_n_sigma", "min_p", "typ_p", "top_k", "top_p", "xtc")
INFILL_THRESHOLD = 0.2  # llama.cpp's infill stage: text candidates less likely than this go (after merging)
# llama.cpp's adaptive-p draw: each candidate's logit becomes PEAK - SHARPNESS * d^2 / (1 + d), d its probability's
# distance from the adapted target in WIDTHs
ADAPTIVE_P_WIDTH, ADAPTIVE_P_PEAK, ADAPTIVE_P_SHARPNESS = 0.3, 5.0, 10.0


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 1.0  # 0 = greedy
    top_k: int = 0  # 0 = off
    top_p: float = 1.0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[int, float] | None = None
    seed: int | None = None
    max_tokens: int = 16
    logprobs: int | None = None  # top-n log-probabilities per token (0 = only the chosen token's)
    # vLLM's min_tokens: these ids (EOS and the request's stop ids) cannot be drawn before that many tokens.
    min_tokens: int = 0
    min_tokens_banned: frozenset[int] = frozenset()
    # vLLM's allowed_token_ids: only these ids can be drawn (None: any).
    allowed_token_ids: tuple[int, ...] | None = None
    # Penalties' memory: 0 is vLLM's (repetition over prompt + output, frequency and presence over the output);
    # N > 0 is llama.cpp's and Ollama's repeat_last_n: all three over the last N tokens, prompt included.
    penalty_last_n: int = 0
    typical_p: float = 1.0  # locally typical sampling (llama.cpp, Ollama, transformers); 1 = off
    # vLLM's bad_words as token sequences: a sequence's last token cannot be drawn where the output so far
    # ends with the rest of it (a one-token sequence is never drawn)
    bad_words: tuple[tuple[int, ...], ...] = ()
    # A thinking budget (Anthropic's budget_tokens): once this many tokens are out and the reasoning's end token
    # (thinking_end) has not been drawn, it is the only token that can be
    thinking_budget: int | None = None
    thinking_end: int | None = None
    thinking_start: int | None = None  # the start marker: reasoning is open after it (None: open from the start)
    # llama.cpp's samplers (its /completion and Ollama's options):
    # mirostat 1 or 2 (v1, v2): after temperature, the draw keeps the observed surprise near mirostat_tau (bits),
    # a learning rate of mirostat_eta; top-k, top-p, min-p, typical-p and XTC do not apply, as in llama.cpp
    mirostat: int = 0
    mirostat_tau: float = 5.0
    mirostat_eta: float = 0.1
    # XTC: with probability xtc_probability, every token at least xtc_threshold likely but the least likely of
    # them is excluded (where there are two or more)
    xtc_probability: float = 0.0
    xtc_threshold: float = 0.1
    # DRY: a token that would extend a repeat of dry_allowed_length tokens or more (within the last
    # dry_penalty_last_n tokens, prompt included) loses dry_multiplier * dry_base ** (length - dry_allowed_length);
    # a repeat cannot reach back over a sequence-breaker token (dry_breakers), nor is a breaker penalised; nor
    # over a breaker spelled by several tokens (dry_restarts: (head, tail) pairs, the tail the tokens that must
    # follow the head; llama.cpp's restart sequences)
    dry_multiplier: float = 0.0
    dry_base: float = 1.75
    dry_allowed_length: int = 2
    dry_penalty_last_n: int = 0  # 0: the whole context
    dry_breakers: frozenset[int] = frozenset()
    dry_restarts: tuple[tuple[int, tuple[int, ...]], ...] = ()
    # llama.cpp's top-n-sigma: only tokens whose logit is within top_n_sigma standard deviations (over the
    # candidates' logits) of the largest stay; <= 0 = off. The temperature does not change what it keeps.
    top_n_sigma: float = -1.0
    # llama.cpp's dynamic temperature: with dynatemp_range > 0 the temperature stage scales by
    # max(0, temperature - range) + (2 range or less) * (entropy / its maximum) ** dynatemp_exponent, the entropy of
    # the candidates it sees (a row with it runs the chain, in vLLM's order where it has none)
    dynatemp_range: float = 0.0
    dynatemp_exponent: float = 1.0
    # llama.cpp's adaptive-p (``adaptive_p`` in sampler_order, wherever it stands: it is the draw, after every
    # stage): with adaptive_target in [0, 1], the draw favours candidates whose probability is near a target that
    # moves against the recent picks' (an average decaying by adaptive_decay a token); a negative target: a plain
    # draw
    adaptive_target: float = -1.0
    adaptive_decay: float = 0.9
    # llama.cpp's post_sampling_probs: the logprobs (when asked) describe the distribution the draw was made from,
    # after every stage of the chain, not the model's (a greedy row's: its token, certain)
    post_sampling_probs: bool = False
    # llama.cpp's sampler chain (SAMPLER_STAGES names; its /completion's ``samplers``): the filters and the
    # temperature run in this order, each on what the ones before kept (LLAMA_CPP_ORDER: every filter at
    # temperature 1, the temperature scaling only what they kept). Empty (vLLM's and OpenAI's order): the
    # temperature first, then top-n-sigma, min-p, typical-p, top-k, top-p and XTC on the scaled distribution.
    sampler_order: tuple[str, ...] = ()
    # llama.cpp's infill stage (``infill`` in sampler_order, for fill-in-the-middle): the end-of-generation
    # tokens (infill_eog), the one it falls back to (infill_eot), and every token's text as bytes (token_pieces,
    # b"" for special tokens; shared per model, so left out of comparisons)
    infill_eog: frozenset[int] = frozenset()
    infill_eot: int = -1
    token_pieces: tuple[bytes, ...] | None = dataclasses.field(default=None, compare=False, repr=False)

    def __post_init__(self) -> None:
        def bad(what: str) -> AdmissionError:
            return AdmissionError(what, ErrorKind.VALIDATION)

        for name in ("temperature", "top_p", "min_p", "repetition_penalty", "presence_penalty", "frequency_penalty",
                     "typical_p", "top_n_sigma", "mirostat_tau", "mirostat_eta", "xtc_probability", "xtc_threshold",
                     "dry_multiplier", "dry_base", "dynatemp_range", "dynatemp_exponent", "adaptive_target",
                     "adaptive_decay"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or isinstance(value, bool) or not math.isfinite(value):
                raise bad(f"{name} must be a finite number, got {value!r}")
        if self.temperature < 0:
            raise bad(f"temperature must be >= 0, got {self.temperature}")
        if self.dynatemp_range < 0:
            raise bad(f"dynatemp_range must be >= 0, got {self.dynatemp_range}")
        if self.dynatemp_range > 0 and not self.sampler_order:
            raise bad("dynatemp_range needs a sampler order (VLLM_ORDER where the request has none)")
        if not 0 < self.top_p <= 1:
            raise bad(f"top_p must be in (0, 1], got {self.top_p}")
        if not 0 <= self.min_p <= 1:
            raise bad(f"min_p must be in [0, 1], got {self.min_p}")
        if not 0 < self.typical_p <= 1:
            raise bad(f"typical_p must be in (0, 1], got {self.typical_p}")
        unknown = [n for n in self.sampler_order if n not in SAMPLER_STAGES]
        if unknown:
            raise bad(f"unknown sampler {unknown[0]!r}; the samplers are {', '.join(SAMPLER_STAGES)}")
        if self.post_sampling_probs and (not self.sampler_order or self.mirostat):
            raise bad("post_sampling_probs needs a sampler chain (sampler_order) and no mirostat")
        if not 0 <= self.adaptive_decay <= 1:
            raise bad(f"adaptive_decay must be in [0, 1], got {self.adaptive_decay}")
        if "infill" in self.sampler_order and (self.token_pieces is None or self.infill_eot < 0):
            raise bad("the infill sampler needs the model's token texts and its end-of-text token")
        if not isinstance(self.penalty_last_n, int) or isinstance(self.penalty_last_n, bool) or self.penalty_last_n < 0:
            raise bad(f"penalty_last_n must be an integer >= 0, got {self.penalty_last_n!r}")
        if self.repetition_penalty <= 0:
            raise bad(f"repetition_penalty must be > 0, got {self.repetition_penalty}")
        if not isinstance(self.top_k, int) or isinstance(self.top_k, bool) or self.top_k < 0:
            raise bad(f"top_k must be an integer >= 0, got {self.top_k!r}")
        if not isinstance(self.max_tokens, int) or isinstance(self.max_tokens, bool) or self.max_tokens < 1:
            raise bad(f"max_tokens must be an integer >= 1, got {self.max_tokens!r}")
        if self.seed is not None and (not isinstance(self.seed, int) or isinstance(self.seed, bool)):
            raise bad(f"seed must be an integer, got {self.seed!r}")
        if self.logprobs is not None and (not isinstance(self.logprobs, int) or isinstance(self.logprobs, bool)
                                          or self.logprobs < 0):
            raise bad(f"logprobs must be an integer >= 0, got {self.logprobs!r}")
        if not isinstance(self.min_tokens, int) or isinstance(self.min_tokens, bool) or self.min_tokens < 0:
            raise bad(f"min_tokens must be an integer >= 0, got {self.min_tokens!r}")
        if self.min_tokens > self.max_tokens:
            raise bad(f"min_tokens ({self.min_tokens}) must be <= max_tokens ({self.max_tokens})")
        if self.mirostat not in (0, 1, 2) or isinstance(self.mirostat, bool):
            raise bad(f"mirostat must be 0, 1 or 2, got {self.mirostat!r}")
        if self.mirostat_tau < 0 or self.mirostat_eta < 0:
            raise bad("mirostat_tau and mirostat_eta must be >= 0")
        if not 0 <= self.xtc_probability <= 1 or not 0 <= self.xtc_threshold <= 1:
            raise bad("xtc_probability and xtc_threshold must be in [0, 1]")
        if self.dry_multiplier < 0:
            raise bad(f"dry_multiplier must be >= 0, got {self.dry_multiplier}")
        if self.dry_multiplier > 0 and self.dry_base < 1:
            raise bad(f"dry_base must be >= 1, got {self.dry_base}")
        for name in ("dry_allowed_length", "dry_penalty_last_n"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise bad(f"{name} must be an integer >= 0, got {value!r}")
        if (self.thinking_budget is None) != (self.thinking_end is None):
            raise bad("thinking_budget and thinking_end come together")
        if self.thinking_budget is not None and (not isinstance(self.thinking_budget, int) or self.thinking_budget < 0):
            raise bad(f"thinking_budget must be an integer >= 0, got {self.thinking_budget!r}")
        for seq in self.bad_words:
            if not seq or not all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in seq):
                raise bad(f"bad_words must be non-empty token sequences, got {seq!r}")
        if self.allowed_token_ids is not None:
            if not self.allowed_token_ids:
                raise bad("allowed_token_ids must not be empty")
            for token in self.allowed_token_ids:
                if not isinstance(token, int) or isinstance(token, bool) or token < 0:
                    raise bad(f"allowed_token_ids entries must be token ids, got {token!r}")
        if self.logit_bias is not None:
            for token, bias in self.logit_bias.items():
                if not isinstance(token, int) or isinstance(token, bool) or token < 0:
                    raise bad(f"logit_bias key must be a token id, got {token!r}")
                if not isinstance(bias, (int, float)) or isinstance(bias, bool) or not math.isfinite(bias):
                    raise bad(f"logit_bias value for token {token} must be a finite number, got {bias!r}")

    @property
    def greedy(self) -> bool:
        """The argmax: temperature 0, where the temperature applies (a llama.cpp chain without its temperature
        stage draws at temperature 1 whatever the temperature, as llama.cpp's does)."""
        return (self.temperature == 0 and self.dynatemp_range == 0
                and (not self.sampler_order or "temperature" in self.sampler_order))

    @property
    def uses_penalties(self) -> bool:
        return self.repetition_penalty != 1.0 or self.presence_penalty != 0.0 or self.frequency_penalty != 0.0

    @property
    def uses_dry(self) -> bool:
        return self.dry_multiplier > 0

    @property
    def argmax_only(self) -> bool:
        """Each token is the argmax of the model's logits and nothing else: greedy, with nothing that shapes the
        logits (bias, penalties, allowed ids, min_tokens, bad words, a thinking budget, DRY) and no log-probabilities
        to report. Speculative decoding may verify such a request's drafts against a plain argmax."""
        return (self.greedy and not self.logit_bias and not self.uses_penalties and self.allowed_token_ids is None
                and self.min_tokens == 0 and not self.bad_words and self.thinking_budget is None
                and not self.uses_dry and self.logprobs is None)

    @property
    def position_only(self) -> bool:
        """Each token depends only on its own position: that position's logits, the seed and the count of tokens
        drawn before it, nothing the earlier tokens leave behind (penalties, bad words, DRY, a thinking budget,
        mirostat's or adaptive-p's running state). Speculative decoding may verify such a request's draft by
        drawing at the position before it, with that position's count, and keep the draft where the draw equals
        it: the tokens (and their log-probabilities) are plain decoding's, draw for draw (with a draft proposed as
        certain, drawing and comparing is the rejection step of speculative sampling)."""
        return (self.replayable and not self.uses_penalties and not self.bad_words and self.thinking_budget is None
                and not self.uses_dry)

    @property
    def replayable(self) -> bool:
        """A draw ahead of the state can be made given the tokens in between (Sampler.at_position): the earlier
        tokens shape a draw only through what they are (penalty counts, bad words' and DRY's history, whether a
        thinking budget's reasoning is open), not through what earlier draws computed (mirostat's and
        adaptive-p's running sums)."""
        return self.mirostat == 0 and not ("adaptive_p" in self.sampler_order and self.adaptive_target >= 0)

    @property
    def basic_filters(self) -> bool:
        """The only filters at work are the temperature, min-p, top-k and top-p, in vLLM's order or llama.cpp's
        default chain (another chain may leave out the temperature or top-k, or run them twice): what the GPU
        graphs' sampler and Sampler._draw_default_chain draw from."""
        return (self.typical_p == 1.0 and self.xtc_probability == 0 and self.top_n_sigma <= 0
                and self.dynatemp_range == 0 and self.mirostat == 0
                and (not self.sampler_order or self.sampler_order == LLAMA_CPP_ORDER))

    @property
    def graph_drawable(self) -> bool:
        """A decode graph's own sampler draws every token of this request (basic_filters, on logits nothing
        shapes), whatever its state: SequenceSamplingState.graph_samples holds at every position."""
        return (self.position_only and self.logprobs is None and not self.logit_bias and self.allowed_token_ids is None
                and self.min_tokens == 0 and self.basic_filters)


@dataclass
class SequenceSamplingState:
    params: SamplingParams
    seed: int  # resolved: the request's seed, or a random one
    num_output_tokens: int = 0  # tokens drawn so far; the counter of the per-row RNG
    penalty_slot: int | None = None  # row of the sampler's penalty tables, when penalties are used
    # the slot's tables hold the row's logit bias and penalties (Sampler graph_tables): a graph may shape the row
    tabled: bool = False
    # the slot's bias row also holds the row's bans (-inf): allowed_token_ids' complement and bad words of one token
    bans_tabled: bool = False
    # the slot's tables hold min_tokens and the ids it bans (slot_params, slot_bans)
    min_tabled: bool = False
    # a tabled row's llama.cpp window that slides within the request (its ring's length; 0: none)
    ring_window: int = 0
    grammar: object | None = None  # flared.model.grammar.GrammarMatcher of a constrained request
    # the grammar's mask goes through the slot's tables (Sampler.stage_grammar_masks): a graph's sampler applies it
    grammar_tabled: bool = False
    allowed_ids: torch.Tensor | None = None  # params.allowed_token_ids on the sampler's device
    banned_ids: torch.Tensor | None = None  # params.min_tokens_banned on the sampler's device
    # The prompt's and output's tokens in order on the device, their count known on the host (one more per drawn
    # token, so keeping it costs no sync): what penalty_last_n's window, bad_words and DRY look back at
    history: torch.Tensor | None = None
    history_len: int = 0
    bad: list | None = None  # bad_words: (prefix on the device, last token) per sequence
    thinking_open: torch.Tensor | None = None  # thinking budget: no end token drawn yet (a device bool)
    mirostat_mu: torch.Tensor | None = None  # mirostat's running surprise bound (a device float, 2 tau at first)
    # adaptive-p's decaying sums of the picked tokens' probabilities and of the weights (device floats)
    adaptive_sums: torch.Tensor | None = None
    # post_sampling_probs: the last draw's candidates and their log-probabilities (device tensors [C])
    drawn_from: tuple[torch.Tensor, torch.Tensor] | None = None
    dry_breaker_ids: torch.Tensor | None = None
    # dry_restarts on the device: heads [S], tails [S, longest] (-1 past each tail's length), lengths [S]
    dry_restart_heads: torch.Tensor | None = None
    dry_restart_tails: torch.Tensor | None = None
    dry_restart_lens: torch.Tensor | None = None
    # The request's per-request LoRA adapter (DecoderModel.lora_modules index + 1; 0: the base weights), which
    # the eager executor groups the forward's rows by (not a sampling setting, but this is the row's state).
    lora: int = 0
    # The request's image rows (flared.runtime.request.VisionInput): the eager executor puts them in place of the
    # image tokens' embeddings when a forward feeds those positions (like lora, the row's state, not a setting).
    vision: object = None
    # Sampler.at_position's copies: the tokens between the state's tables and the copy's row (a speculative step's
    # drafts before it), which its penalties count; a copy's draw changes no table or history (None: a state)
    ahead: tuple[int, ...] | None = None

    @property
    def shapes_logits(self) -> bool:
        """The row's logits change before its argmax or draw (bias, penalties, allowed ids, min_tokens, bad words,
        a thinking budget, DRY)."""
        p = self.params
        return (bool(p.logit_bias) or self.penalty_slot is not None or self.allowed_ids is not None
                or bool(p.bad_words) or self.thinking_open is not None or p.uses_dry
                or (self.banned_ids is not None and self.num_output_tokens < p.min_tokens))

    @property
    def graph_shaped(self) -> bool:
        """The row's logits change before its draw, and only by what its slot's tables hold (logit bias, allowed
        ids and bad words of one token as -inf in the bias row, min_tokens' bans, and penalties over the whole
        prompt and output or over llama.cpp's window): a graph's sampler shapes it (kernels.sampling)."""
        p = self.params
        return (self.tabled and (self.bans_tabled or (self.allowed_ids is None and not p.bad_words))
                and self.thinking_open is None and not p.uses_dry and self.graph_grammar is not False
                and (self.min_tabled or not (self.banned_ids is not None and self.num_output_tokens < p.min_tokens)))

    @property
    def graph_samples(self) -> bool:
        """A decode graph's own sampler can draw this row's token: it takes temperature, min-p, top-k and top-p in
        vLLM's order (the temperature first) or in llama.cpp's default chain (the filters on the unscaled logits,
        the temperature last), on logits nothing shaped but the slot tables' bias and penalties (graph_shaped);
        log-probabilities of the model's own distribution are taken beside it (not post_sampling_probs: the
        distribution drawn from); everything else runs in this Sampler after the graph (the GPU executor's eager
        rows)."""
        p = self.params
        return p.basic_filters and not (self.graph_grammar is False or (self.shapes_logits and not self.graph_shaped)
                                        or (p.logprobs is not None and p.post_sampling_probs))

    @property
    def graph_grammar(self) -> bool | None:
        """None: no grammar; True: a grammar whose mask for the step the executor stages in the slot's tables
        (Sampler.stage_grammar_masks), so a graph's sampler shapes and draws the row; False: one the torch Sampler
        masks after the graph (not tabled, or a speculative step's copy, whose drafts each need their own mask)."""
        if self.grammar is None:
            return None
        return self.grammar_tabled and self.ahead is None


def plain_default_chain(p: SamplingParams) -> bool:
    """A row of llama.cpp's default chain whose only stages at work are top-k, top-p, min-p and the temperature
    (Sampler._draw_default_chain draws such rows batched; the GPU graphs' sampler takes them too)."""
    return p.sampler_order == LLAMA_CPP_ORDER and p.basic_filters and not p.post_sampling_probs


def graph_step_rows(states, sample_flags) -> tuple[list[bool], list[int], list[int], list[int]]:
    """How a GPU step's rows are drawn, each row's properties read once: (per row, whether the graph's sampler draws
    it; the rows of those it shapes from the slot tables (graph_shaped); the rows the torch Sampler draws after the
    graph; the rows of the graph's whose log-probabilities the executor takes beside the draw). A row that samples
    nothing, or has no state, is in none of them."""
    in_graph, shaped, eager, logprobs = [], [], [], []
    for i, (state, flag) in enumerate(zip(states, sample_flags)):
        drawn = bool(flag) and state is not None
        graph = drawn and state.graph_samples
        in_graph.append(graph)
        if graph:
            if state.graph_shaped:
                shaped.append(i)
            if state.params.logprobs is not None:
                logprobs.append(i)
        elif drawn:
            eager.append(i)
    return in_graph, shaped, eager, logprobs


@dataclass
class SampleOutput:
    token_ids: torch.Tensor  # [B] int64
    # Present when any row asked for logprobs; rows that did not ask hold values too (ignore them).
    chosen_logprobs: torch.Tensor | None = None  # [B] float32, log-softmax of the raw logits
    chosen_ranks: torch.Tensor | None = None  # [B] int64, 1 = most likely
    top_logprobs: torch.Tensor | None = None  # [B, n] float32, descending
    top_token_ids: torch.Tensor | None = None  # [B, n] int64


def typical_filter(logits: torch.Tensor, mass: torch.Tensor) -> torch.Tensor:
    """Locally typical sampling (Meister et al.; transformers' TypicalLogitsWarper, llama.cpp's typical_p): keep
    the tokens whose surprisal is closest to the distribution's entropy until they hold ``mass`` [rows, 1] of the
    probability (at least one); rows with mass 1 are left whole."""
    logp = torch.log_softmax(logits, dim=-1)
    p = logp.exp()
    entropy = -(p * logp).nan_to_num().sum(dim=-1, keepdim=True)  # -inf logits: 0 * -inf
    order = (-logp - entropy).abs().argsort(dim=-1)
    sorted_p = p.gather(-1, order)
    before = sorted_p.cumsum(dim=-1) - sorted_p
    drop_sorted = (before >= mass) & (mass < 1.0)
    drop_sorted[:, 0] = False
    drop = torch.zeros_like(drop_sorted).scatter_(-1, order, drop_sorted)
    return logits.masked_fill(drop, float("-inf"))


def top_n_sigma_filter(logits: torch.Tensor, n: torch.Tensor) -> torch.Tensor:
    """llama.cpp's top-n-sigma: keep the tokens whose logit is at least max - n * std, the mean and standard
    deviation over each row's finite logits; rows with n <= 0 ([rows, 1]) are left whole."""
    finite = torch.isfinite(logits)
    count = finite.sum(dim=-1, keepdim=True).clamp_min(1)
    vals = torch.where(finite, logits, 0.0)
    mean = vals.sum(dim=-1, keepdim=True) / count
    std = (torch.where(finite, (logits - mean) ** 2, 0.0).sum(dim=-1, keepdim=True) / count).sqrt()
    top = logits.max(dim=-1, keepdim=True).values
    return logits.masked_fill((logits < top - n * std) & (n > 0), float("-inf"))


def adaptive_p_logits(logits: torch.Tensor, probs: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """adaptive-p's reshaped logits: ADAPTIVE_P_PEAK - ADAPTIVE_P_SHARPNESS d^2 / (1 + d) for each finite
    candidate, d = |p - target| / ADAPTIVE_P_WIDTH (quadratic near the target, linear in the tails)."""
    d = (probs - target).abs() / ADAPTIVE_P_WIDTH
    return torch.where(torch.isfinite(logits), ADAPTIVE_P_PEAK - ADAPTIVE_P_SHARPNESS * d * d / (1 + d),
                       torch.full_like(d, float("-inf")))


def dynamic_temperature(logits: torch.Tensor, p: SamplingParams) -> torch.Tensor:
    """llama.cpp's temperature stage with dynatemp_range > 0 on one row [1, C]: over its n finite candidates, the
    temperature is min + (max - min) * (H / log n) ** dynatemp_exponent, with min = max(0, temperature - range),
    max = temperature + range and H the entropy of their softmax; at 0 only the likeliest stays. One candidate or
    none: unchanged."""
    finite = torch.isfinite(logits)
    n = int(finite.sum())
    if n <= 1:
        return logits
    lo, hi = max(0.0, p.temperature - p.dynatemp_range), p.temperature + p.dynatemp_range
    probs = torch.softmax(logits.float(), dim=-1)
    entropy = -(probs * torch.where(probs > 0, probs.log(), torch.zeros_like(probs))).sum().item()
    t = lo + (hi - lo) * (entropy / math.log(n)) ** p.dynatemp_exponent
    scaled = logits / t if t > 0 else None
    if scaled is None or bool(torch.isinf(scaled[finite]).any()):
        # temperature 0 (llama.cpp's: only the first maximal logit stays), or one so small the scaled logits
        # overflow float: its limit, the same
        keep = torch.zeros_like(finite)
        keep[0, int(logits.argmax(dim=-1))] = True
        return logits.masked_fill(~keep, float("-inf"))
    return scaled


def infill_filter(logits: torch.Tensor, ids: torch.Tensor | None,
                  p: SamplingParams) -> tuple[torch.Tensor, torch.Tensor]:
    """llama.cpp's infill stage on one row's candidates (logits [1, C] of ``ids`` [1, C], or the whole row where
    ``ids`` is None), for fill-in-the-middle: returns the filtered logits and their ids. Over the kept
    candidates' probabilities at the current temperature:
    - where 3 * P(end of generation) * (candidates kept) > P(text), only the end-of-generation tokens stay;
    - else each candidate whose text begins another's merges into the likelier of the two (in order of
      likelihood, as llama.cpp walks its sorted candidates), the other going; text candidates below
      INFILL_THRESHOLD go; with none left, only infill_eot stays; then, renormalised, text candidates below
      1 / (text candidates + 1) go too.
    End-of-generation tokens always stay. The draw after it is by the kept candidates' logits, as llama.cpp's."""
    row = logits[0]
    if ids is None:  # the candidates still in play, likeliest first (llama.cpp's sorted array)
        order = row.sort(descending=True, stable=True).indices
        order = order[torch.isfinite(row[order])]
        ids, row = order[None, :], row[order]
    cand = ids[0].tolist()
    vals = row.tolist()
    live = [i for i, v in enumerate(vals) if v != float("-inf")]
    if not live:
        return row[None, :], ids
    live.sort(key=lambda i: -vals[i])  # stable: ties keep their order
    probs = torch.softmax(row[live].float(), dim=0).tolist()
    prob = dict(zip(live, probs))
    eog = {i for i in live if cand[i] in p.infill_eog}
    p_eog = sum(prob[i] for i in live if i in eog)
    p_txt = sum(prob[i] for i in live if i not in eog)
    keep: list[int]
    if 3 * p_eog * len(live) > p_txt:
        keep = [i for i in live if i in eog]
    else:
        pieces = p.token_pieces
        text = {i: pieces[cand[i]] if cand[i] < len(pieces) else b"" for i in live}
        alive = dict.fromkeys(live, True)
        by_text = sorted(live, key=lambda i: text[i])  # a text's extensions sit right after it
        keys = [text[i] for i in by_text]
        rank = {i: r for r, i in enumerate(live)}
        for a in live:
            t = text[a]
            if not t:
                continue
            lo = bisect.bisect_left(keys, t)
            hi = lo
            while hi < len(keys) and keys[hi].startswith(t):
                hi += 1
            for b in sorted((by_text[k] for k in range(lo, hi) if by_text[k] != a), key=rank.__getitem__):
                if not alive[a]:
                    break
                if not alive[b]:
                    continue
                dst, src = (b, a) if prob[b] > prob[a] else (a, b)
                prob[dst] += prob[src]
                prob[src] = 0.0
                alive[src] = False
        first = [i for i in live if i in eog or prob[i] >= INFILL_THRESHOLD]
        texts = sum(1 for i in first if i not in eog)
        if texts == 0:  # only the end-of-text token
            one = torch.ones(1, 1, dtype=logits.dtype, device=logits.device)
            return one, torch.full((1, 1), p.infill_eot, dtype=torch.int64, device=logits.device)
        total = sum(prob[i] for i in first)
        keep = [i for i in first if i in eog or prob[i] / total >= 1.0 / (texts + 1)]
        keep = [i for i in keep if alive[i]]  # a merged-away end token stays at -inf (no weight)
    out = torch.full_like(row, float("-inf"))
    if keep:
        idx = torch.tensor(keep, dtype=torch.int64, device=row.device)
        out[idx] = row[idx]
    return out[None, :], ids


def min_p_filter(logits: torch.Tensor, min_p: torch.Tensor | float) -> torch.Tensor:
    """Min-p: a token stays when its probability is at least min_p times the most likely one's."""
    probs = torch.softmax(logits, dim=-1)
    return logits.masked_fill(probs < probs.max(dim=-1, keepdim=True).values * min_p, float("-inf"))


def top_p_cut(sorted_probs: torch.Tensor, top_p: torch.Tensor | float) -> torch.Tensor:
    """Top-p over probabilities sorted descending: True where a token goes, because the more likely ones hold
    top_p already; the first always stays."""
    cut = sorted_probs.cumsum(dim=-1) - sorted_probs >= top_p
    cut[:, 0] = False
    return cut


# Top-p on the CPU, where a row of the batch also has a top-k or XTC (else the walk, Sampler._walk_top_p) and in
# llama.cpp's chain, first tries the rows' SHORTLIST most likely tokens: where they hold every token top-k and top-p
# keep (nearly always), that is a top-k instead of a sort of the whole vocabulary (tools/bench_sampler.py, 8 rows of
# SmolLM2's 49,152 ids: 8.4 ms a step against 19.8 in vLLM's order, 9.1 against 38.4 in llama.cpp's chain). On a
# GPU deciding it would cost a host sync, so the vocabulary is sorted there.
SHORTLIST = 1024


def shortlist(logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor):
    """(logits, ids, log normaliser) of each row's SHORTLIST most likely tokens, descending, where for every row
    they hold all that top-k (1..SHORTLIST) or else top-p (< 1, over the whole row's probabilities) keeps; else
    None (and on a GPU, or a row short enough to sort). top_k, top_p: [rows, 1]."""
    if logits.device.type != "cpu" or logits.shape[-1] <= 2 * SHORTLIST:
        return None
    vals, ids = logits.topk(SHORTLIST, dim=-1)
    lse = torch.logsumexp(logits, dim=-1, keepdim=True)
    held = torch.exp(vals - lse).sum(dim=-1, keepdim=True)  # the row's probability the shortlist holds
    ok = torch.where(top_k > 0, top_k <= SHORTLIST, (top_p < 1.0) & (held >= top_p))
    return (vals, ids, lse) if bool(ok.all()) else None


def on_device(values, device: torch.device, dtype: torch.dtype | None = None) -> torch.Tensor:
    """``torch.tensor(values, dtype=dtype, device=device)`` without waiting for the device: to a GPU through pinned
    memory and a copy queued on the current stream (torch.tensor(..., device=cuda) copies synchronously, so the
    host would wait for the step's graph before each of the sampler's small tensors)."""
    host = torch.from_numpy(values).to(dtype) if isinstance(values, np.ndarray) else torch.tensor(values, dtype=dtype)
    if device.type != "cuda":
        return host
    if not host.numel() and host.dim():  # nothing to copy (and no empty pinned block)
        return torch.empty(0, dtype=dtype, device=device)
    return host.pin_memory().to(device, non_blocking=True)


def _row_seed(seed: int, step: int) -> int:
    # splitmix64 of (seed, step): decorrelates neighbouring steps and seeds, stays in 63 bits for manual_seed.
    z = (seed * 0x9E3779B97F4A7C15 + step * 0xBF58476D1CE4E5B9 + 0x94D049BB133111EB) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return (z ^ (z >> 31)) >> 1


# The longest llama.cpp penalty window (repeat_last_n) a GPU graph's sampler keeps in its ring; a longer window
# that slides within the request leaves its rows to the torch Sampler (its history).
GRAPH_WINDOW = 1024
# The most ids min_tokens bans (EOS and the stop ids) that a GPU graph's sampler keeps for a slot; a request banning
# more is drawn by the torch Sampler until it has its min_tokens.
GRAPH_BANS = 8


class ShapeTables(NamedTuple):
    """A Sampler's slot tables that a GPU graph's sampler shapes rows from (``Sampler.shape_tables``;
    flared.model.kernels.sampling): ``counts`` [S, V] int32 (each output token's count; with a window, each count
    over the window's tokens, prompt included), ``prompt`` [S, V] uint8 (1: in the prompt), ``bias`` [S, V]
    float32 (the request's logit bias; -inf where allowed_token_ids or a bad word of one token bans the token),
    ``params`` [S, 4] float32 (repetition, frequency and presence penalties, and min_tokens: while a row has
    drawn fewer, the ids in ``bans`` [S, GRAPH_BANS] int32, -1 past them, are -inf), and for llama.cpp's window
    (repeat_last_n): ``window`` [S] int32 (its length N, 0: none or one that never slides), ``ring`` [S,
    GRAPH_WINDOW] int32 (the window's tokens, position p at p % N) and ``lens`` [S] int64 (the tokens so far,
    prompt included); ``grammar`` [S] int32 (1: the slot's request is grammar-constrained, its mask for the step
    in ``masks`` [S, ceil(V / 32)] int32, token 32 w + b allowed where bit b of word w is set)."""
    counts: torch.Tensor
    prompt: torch.Tensor
    bias: torch.Tensor
    params: torch.Tensor
    window: torch.Tensor
    ring: torch.Tensor
    lens: torch.Tensor
    bans: torch.Tensor
    grammar: torch.Tensor
    masks: torch.Tensor


class Sampler:
    def __init__(self, vocab_size: int, *, device: torch.device | str = "cpu", max_penalty_slots: int = 32,
                 graph_tables: bool = False, stream=None):
        """``graph_tables``: also keep each slot's logit bias and penalties as tables a GPU graph's sampler reads
        (``shape_tables``; kernels.sampling): then a request with logit bias alone holds a slot too. ``stream``:
        the stream add_sequence writes the tables on (the GPU executor's model stream, so that a graph launched
        after it sees them); None: the current one."""
        self.vocab_size = vocab_size
        self.device = torch.device(device)
        self.stream = stream
        self.output_counts = torch.zeros(max_penalty_slots, vocab_size, dtype=torch.int32, device=self.device)
        self.prompt_mask = torch.zeros(max_penalty_slots, vocab_size, dtype=torch.bool, device=self.device)
        self.bias_table = self.slot_params = self.slot_window = self.ring = self.slot_lens = self.slot_bans = None
        self.slot_grammar = self.grammar_masks = self._masks_host = None
        if graph_tables:
            slots = max_penalty_slots
            self.bias_table = torch.zeros(slots, vocab_size, dtype=torch.float32, device=self.device)
            self.slot_params = torch.zeros(slots, 4, dtype=torch.float32, device=self.device)
            self.slot_bans = torch.full((slots, GRAPH_BANS), -1, dtype=torch.int32, device=self.device)
            self.slot_window = torch.zeros(slots, dtype=torch.int32, device=self.device)
            self.ring = torch.zeros(slots, GRAPH_WINDOW, dtype=torch.int32, device=self.device)
            self.slot_lens = torch.zeros(slots, dtype=torch.int64, device=self.device)
            words = (vocab_size + 31) // 32
            self.slot_grammar = torch.zeros(slots, dtype=torch.int32, device=self.device)
            self.grammar_masks = torch.zeros(slots, words, dtype=torch.int32, device=self.device)
            # staged here (llguidance writes through a pointer), copied to grammar_masks on ``stream``
            self._masks_host = torch.zeros(slots, words, dtype=torch.int32,
                                           pin_memory=self.device.type == "cuda")
        self._free_slots = list(range(max_penalty_slots - 1, -1, -1))
        self._generator = torch.Generator(device=self.device)

    def shape_tables(self) -> ShapeTables | None:
        """The tables a graph's sampler shapes slot rows from, or None without ``graph_tables``."""
        if self.bias_table is None:
            return None
        return ShapeTables(self.output_counts, self.prompt_mask.view(torch.uint8), self.bias_table, self.slot_params,
                           self.slot_window, self.ring, self.slot_lens, self.slot_bans, self.slot_grammar,
                           self.grammar_masks)

    def add_sequence(self, params: SamplingParams, prompt_token_ids, grammar=None) -> SequenceSamplingState:
        if self.stream is None:
            return self._add_sequence(params, prompt_token_ids, grammar)
        with torch.cuda.stream(self.stream):
            return self._add_sequence(params, prompt_token_ids, grammar)

    def _add_sequence(self, params: SamplingParams, prompt_token_ids, grammar=None) -> SequenceSamplingState:
        # (numpy converts and checks thousands of ids 3x faster than Python's loops; repeats are harmless to the
        # masks built from them)
        allowed = None if params.allowed_token_ids is None else np.asarray(params.allowed_token_ids, dtype=np.int64)
        if allowed is not None and len(allowed) and allowed.max() >= self.vocab_size:
            raise AdmissionError(f"allowed_token_ids token {allowed[allowed >= self.vocab_size][0]} is outside the "
                                 f"vocabulary of {self.vocab_size}", ErrorKind.VALIDATION)
        for field, ids in (("logit_bias", params.logit_bias or ()),
                           ("min_tokens_banned", params.min_tokens_banned),
                           ("bad_words", [t for seq in params.bad_words for t in seq]),
                           ("dry_sequence_breakers", params.dry_breakers),
                           ("dry_sequence_breakers", [t for head, tail in params.dry_restarts for t in (head, *tail)])):
            if ids and max(ids) >= self.vocab_size:
                too_big = next(t for t in ids if t >= self.vocab_size)
                raise AdmissionError(f"{field} token {too_big} is outside the vocabulary of {self.vocab_size}",
                                     ErrorKind.VALIDATION)
        seed = params.seed if params.seed is not None else secrets.randbits(63)
        state = SequenceSamplingState(params=params, seed=seed, grammar=grammar)
        if allowed is not None:
            state.allowed_ids = on_device(allowed, self.device, torch.int64)
        if params.min_tokens > 0 and params.min_tokens_banned:
            state.banned_ids = on_device(sorted(params.min_tokens_banned), self.device, torch.int64)
        if params.thinking_budget is not None:
            # open from the start, or only where the prompt (its last marker) or the output opened it
            prompt = list(prompt_token_ids)
            last = {t: i for i, t in enumerate(prompt) if t in (params.thinking_start, params.thinking_end)}
            is_open = params.thinking_start is None or (last.get(params.thinking_start, -1)
                                                        > last.get(params.thinking_end, -1))
            state.thinking_open = on_device(is_open, self.device, torch.bool)
        if params.mirostat:
            state.mirostat_mu = on_device(2.0 * params.mirostat_tau, self.device, torch.float32)
        if "adaptive_p" in params.sampler_order and params.adaptive_target >= 0:
            decay = min(max(params.adaptive_decay, 0.0), 0.99)  # llama.cpp's clamp
            state.adaptive_sums = on_device([params.adaptive_target / (1 - decay), 1 / (1 - decay)], self.device,
                                            torch.float32)
        windowed = params.uses_penalties and params.penalty_last_n > 0
        if params.uses_dry or params.bad_words or windowed:
            prompt = list(prompt_token_ids)
            state.history = torch.zeros(len(prompt) + params.max_tokens, dtype=torch.int64, device=self.device)
            if prompt:
                state.history[:len(prompt)] = on_device(prompt, self.device, torch.int64)
            state.history_len = len(prompt)
        if params.uses_dry:
            state.dry_breaker_ids = on_device(sorted(params.dry_breakers), self.device, torch.int64)
            if params.dry_restarts:
                longest = max(len(tail) for _, tail in params.dry_restarts)
                state.dry_restart_heads = on_device([h for h, _ in params.dry_restarts], self.device, torch.int64)
                state.dry_restart_tails = on_device([list(t) + [-1] * (longest - len(t))
                                                     for _, t in params.dry_restarts], self.device, torch.int64)
                state.dry_restart_lens = on_device([len(t) for _, t in params.dry_restarts], self.device,
                                                   torch.int64)
        if params.bad_words:
            state.bad = [(on_device(list(seq[:-1]), self.device, torch.int64), seq[-1])
                         for seq in params.bad_words]
        # a graph shapes a row from the tables where they hold everything the row's bias, bans and penalties need:
        # a window that slides is kept in the slot's ring, up to GRAPH_WINDOW tokens; allowed ids and bad words of
        # one token are bans for good (-inf in the bias row), a longer bad word depends on the output (eager)
        prompt_len = len(prompt_token_ids)
        slides = windowed and params.penalty_last_n < prompt_len + params.max_tokens
        bans = params.allowed_token_ids is not None or bool(params.bad_words)
        bans_tabled = bans and all(len(seq) == 1 for seq in params.bad_words)
        min_tabled = state.banned_ids is not None and len(params.min_tokens_banned) <= GRAPH_BANS
        # a grammar with min_tokens' bans stays with the torch Sampler: where the grammar allows only banned ids
        # (the output is complete) it redoes the row without the bans (_yield_to_grammar)
        grammar_tabled = grammar is not None and state.banned_ids is None
        tabled = (self.bias_table is not None
                  and (params.uses_penalties or bool(params.logit_bias) or bans_tabled or min_tabled or grammar_tabled)
                  and not (slides and params.penalty_last_n > GRAPH_WINDOW))
        if params.uses_penalties or tabled:
            if not self._free_slots:
                raise ExecutionError("no free penalty slot in the sampler", ErrorKind.MODEL_CAPACITY)
            slot = self._free_slots.pop()
            state.penalty_slot = slot
            state.tabled = tabled
            state.bans_tabled = tabled and bans_tabled
            state.min_tabled = tabled and min_tabled
            state.grammar_tabled = tabled and grammar_tabled
            self.output_counts[slot].zero_()
            self.prompt_mask[slot].zero_()
            if tabled:
                self.slot_params[slot] = on_device([params.repetition_penalty, params.frequency_penalty,
                                                    params.presence_penalty,
                                                    float(params.min_tokens) if state.min_tabled else 0.0],
                                                   self.device, dtype=torch.float32)
                banned = sorted(params.min_tokens_banned) if state.min_tabled else []
                self.slot_bans[slot] = on_device(banned + [-1] * (GRAPH_BANS - len(banned)), self.device,
                                                 dtype=torch.int32)
                state.ring_window = params.penalty_last_n if slides else 0
                self.slot_window[slot] = state.ring_window
                self.slot_grammar[slot] = int(state.grammar_tabled)
                self.slot_lens[slot] = prompt_len
                if slides:  # the prompt's last N tokens, position p at p % N
                    first = max(0, prompt_len - params.penalty_last_n)
                    at = torch.arange(first, prompt_len, dtype=torch.int64, device=self.device) % params.penalty_last_n
                    self.ring[slot].index_copy_(0, at, state.history[first:prompt_len].to(torch.int32))
                self.bias_table[slot].zero_()
                if params.logit_bias:
                    tokens = list(params.logit_bias)
                    self.bias_table[slot].index_put_(
                        (on_device(tokens, self.device, dtype=torch.int64),),
                        on_device([float(params.logit_bias[t]) for t in tokens], self.device, dtype=torch.float32),
                        accumulate=True)
                if state.bans_tabled:
                    if state.allowed_ids is not None:
                        kept = torch.zeros(self.vocab_size, dtype=torch.bool, device=self.device)
                        kept[state.allowed_ids] = True
                        self.bias_table[slot].masked_fill_(~kept, float("-inf"))
                    if params.bad_words:
                        ids = on_device([seq[0] for seq in params.bad_words], self.device, dtype=torch.int64)
                        self.bias_table[slot].index_fill_(0, ids, float("-inf"))
            if windowed:
                # llama.cpp's window: the counts cover the prompt's last N tokens and then the output's
                ids = state.history[max(0, state.history_len - params.penalty_last_n):state.history_len]
                if ids.numel():
                    self.output_counts[slot].index_add_(0, ids, torch.ones_like(ids, dtype=torch.int32))
                return state
            ids = on_device(list(prompt_token_ids), self.device, torch.int64)
            if ids.numel():
                self.prompt_mask[slot].index_fill_(0, ids, True)
        return state

    @staticmethod
    def _post_sampling_logprobs(out: SampleOutput, i: int, state: SequenceSamplingState, token: torch.Tensor,
                                max_logprobs: int) -> None:
        """Row i's logprobs from the distribution its draw was made from (post_sampling_probs): the chosen token's,
        and the likeliest candidates' (ids -1 and -inf past the candidates). A greedy row's token is certain."""
        if state.params.greedy or state.drawn_from is None:
            ids, lps = token[None], torch.zeros(1, dtype=torch.float32, device=token.device)
        else:
            ids, lps = state.drawn_from
        state.drawn_from = None
        picked = lps[ids == token]
        chosen = picked[0] if picked.numel() else torch.tensor(float("-inf"), device=lps.device)
        out.chosen_logprobs[i] = chosen
        out.chosen_ranks[i] = (lps > chosen).sum() + 1
        if max_logprobs > 0:
            k = min(max_logprobs, lps.numel())
            top_v, top_at = lps.float().topk(k)
            out.top_logprobs[i] = float("-inf")
            out.top_token_ids[i] = -1
            out.top_logprobs[i, :k] = top_v
            out.top_token_ids[i, :k] = ids[top_at]

    def stage_grammar_masks(self, states: list[SequenceSamplingState]) -> None:
        """The step's masks of ``states`` (rows a graph's sampler draws under a grammar: graph_grammar) into their
        slots' rows of ``grammar_masks``: computed in parallel into pinned memory (grammar.fill_bitmasks), then one
        copy on ``stream``, ahead of the step's graph launched after it there. The step must have nothing in flight
        before it (its masks need every earlier token consumed; the staging rows are rewritten each step)."""
        if not states:
            return
        from flared.model.grammar import fill_bitmasks

        slots = [s.penalty_slot for s in states]
        host = self._masks_host
        fill_bitmasks([(s.grammar, slot) for s, slot in zip(states, slots)], host.data_ptr(), 4 * host.shape[1],
                      host.shape[0])
        lo, hi = min(slots), max(slots) + 1  # one copy (rows between hold other slots' stale masks: unread)
        with torch.cuda.stream(self.stream) if self.stream is not None else contextlib.nullcontext():
            self.grammar_masks[lo:hi].copy_(host[lo:hi], non_blocking=True)

    def release(self, state: SequenceSamplingState) -> None:
        if state.penalty_slot is not None:
            self._free_slots.append(state.penalty_slot)
            state.penalty_slot = None

    @torch.inference_mode()
    def sample(self, logits: torch.Tensor, states: list[SequenceSamplingState]) -> SampleOutput:
        """logits [B, vocab] float32 (not modified); one state per row, advanced by one token."""
        num_rows = logits.shape[0]
        if num_rows != len(states):
            raise ValueError(f"{num_rows} logits rows for {len(states)} states")
        params = [s.params for s in states]
        out = SampleOutput(token_ids=torch.empty(0))

        max_logprobs = max((p.logprobs for p in params if p.logprobs is not None), default=None)
        raw_logprobs = torch.log_softmax(logits, dim=-1) if max_logprobs is not None else None

        biased = self.apply_bias_and_penalties(logits, states)
        raw_logits, logits = logits, self._apply_grammar_masks(biased, states, owned=biased is not logits)
        self._yield_to_grammar(raw_logits, logits, states)

        sampled_rows = [i for i, p in enumerate(params) if not p.greedy and not p.mirostat]
        if len(sampled_rows) == num_rows:  # every row draws: no argmax, no copy of the rows
            token_ids = self._draw(logits, states)
        else:
            token_ids = logits.argmax(dim=-1)
            if sampled_rows:
                rows = on_device(sampled_rows, self.device, dtype=torch.int64)
                drawn = self._draw(logits.index_select(0, rows), [states[i] for i in sampled_rows])
                token_ids.index_copy_(0, rows, drawn)
        for i, p in enumerate(params):
            if p.mirostat and not p.greedy:
                token_ids[i] = self._draw_mirostat(logits[i], states[i])
        out.token_ids = token_ids

        if raw_logprobs is not None:
            chosen = raw_logprobs.gather(1, token_ids[:, None])
            out.chosen_logprobs = chosen[:, 0]
            out.chosen_ranks = (raw_logprobs > chosen).sum(dim=-1) + 1
            if max_logprobs > 0:
                out.top_logprobs, out.top_token_ids = raw_logprobs.topk(max_logprobs, dim=-1)
            for i, s in enumerate(states):
                if s.params.post_sampling_probs and s.params.logprobs is not None:
                    self._post_sampling_logprobs(out, i, s, token_ids[i], max_logprobs)

        kept = [i for i, s in enumerate(states) if s.ahead is None]  # at_position's copies change nothing
        if kept:
            self._record_drawn([states[i] for i in kept], token_ids if len(kept) == len(states) else
                               token_ids.index_select(0, on_device(kept, self.device)))
        return out

    def _advance_ring(self, slot: int, n: int, token: torch.Tensor) -> None:
        """A window's ring after drawing ``token`` ([1]): the token n places back leaves the counts (once the window
        is full) and the new one takes its place (kernels.sampling's _count_drawn does the same in a graph; the
        caller counts the new token)."""
        length = self.slot_lens[slot:slot + 1]
        at = length % n
        leaving = self.ring[slot].index_select(0, at).to(torch.int64)
        self.output_counts[slot].index_add_(0, leaving, -(length >= n).to(torch.int32))
        self.ring[slot].index_copy_(0, at, token.to(torch.int32))
        self.slot_lens[slot] += 1

    @staticmethod
    def _follow_thinking(is_open: torch.Tensor, params: SamplingParams, token) -> None:
        """A thinking budget's open flag after ``token`` (an id, or a 0-d device tensor: no sync): the start marker
        opens the reasoning, the end marker closes it."""
        if params.thinking_start is not None:
            is_open |= token == params.thinking_start
        is_open &= token != params.thinking_end

    def _record_drawn(self, states: list[SequenceSamplingState], token_ids: torch.Tensor) -> None:
        """Each state after drawing its token (``token_ids`` [len(states)]): its thinking budget's flag, its penalty
        counts (a full window forgets its oldest token as the new one enters), its history and its draw count."""
        for i, s in enumerate(states):
            if s.thinking_open is not None:
                self._follow_thinking(s.thinking_open, s.params, token_ids[i])
        penalty_rows = [i for i, s in enumerate(states) if s.penalty_slot is not None]
        if penalty_rows:
            for i in penalty_rows:
                s, n = states[i], states[i].params.penalty_last_n
                if s.ring_window:  # the slot's ring, as a graph's sampler keeps it (no sync: all on the device)
                    self._advance_ring(s.penalty_slot, s.ring_window, token_ids[i:i + 1])
                elif n and s.history_len >= n:
                    oldest = s.history[s.history_len - n:s.history_len - n + 1]
                    self.output_counts[s.penalty_slot].index_add_(0, oldest, torch.full_like(oldest, -1,
                                                                                             dtype=torch.int32))
            slots = on_device([states[i].penalty_slot for i in penalty_rows], self.device, dtype=torch.int64)
            chosen_tokens = token_ids.index_select(0, on_device(penalty_rows, self.device, dtype=torch.int64))
            self.output_counts.index_put_((slots, chosen_tokens),
                                          torch.ones_like(chosen_tokens, dtype=torch.int32), accumulate=True)
        for i, s in enumerate(states):
            if s.history is not None and s.history_len < s.history.numel():
                s.history[s.history_len:s.history_len + 1] = token_ids[i:i + 1]
                s.history_len += 1
            s.num_output_tokens += 1

    def at_position(self, state: SequenceSamplingState, before) -> SequenceSamplingState:
        """A throwaway copy of a row's state as it will be once the tokens ``before`` are drawn (its params
        SamplingParams.replayable): ``sample`` on it draws what ``state`` would draw there, from that position's
        logits. Its penalties count ``before`` too; its history (bad words, DRY, a penalty window) ends with them;
        a thinking budget's reasoning is open or closed after them; its grammar's mask is the one after them
        (GrammarMatcher.ahead). Neither ``state``, its grammar, nor the sampler's tables change (speculative steps
        draw at every fed position)."""
        if not state.params.replayable:
            raise ValueError("at_position() serves rows whose draws depend on earlier tokens only through what "
                             "they are")
        before = tuple(int(t) for t in before)
        changes = dict(num_output_tokens=state.num_output_tokens + len(before), ahead=before)
        if state.grammar is not None and not state.grammar.failed:
            changes["grammar"] = state.grammar.ahead(before, (self.vocab_size + 31) // 32)
        if before and state.history is not None:
            history = state.history.clone()
            end = min(state.history_len + len(before), history.numel())
            history[state.history_len:end] = torch.as_tensor(before[:end - state.history_len], dtype=torch.int64)
            changes.update(history=history, history_len=end)
        if before and state.thinking_open is not None:
            is_open = state.thinking_open.clone()
            for t in before:
                self._follow_thinking(is_open, state.params, t)
            changes["thinking_open"] = is_open
        return dataclasses.replace(state, **changes)

    def advance(self, state: SequenceSamplingState, token_ids: list[int]) -> None:
        """``state`` as ``sample`` leaves it after drawing ``token_ids`` one by one, for a row whose tokens were
        drawn outside it (its argmax, or ``sample`` on ``at_position`` copies; SamplingParams.replayable): its
        penalty counts, history, thinking budget and draw counter. (A grammar follows the tokens where the model
        thread consumes them.)"""
        if not state.params.replayable or state.ahead is not None:
            raise ValueError("advance() serves replayable rows; sample() keeps every other row's state")
        tokens = torch.as_tensor([int(t) for t in token_ids], dtype=torch.int64, device=self.device)
        for k in range(tokens.numel()):  # one at a time, as sample() draws them (a penalty window's order)
            self._record_drawn([state], tokens[k:k + 1])

    def apply_bias_and_penalties(self, logits: torch.Tensor, states: list[SequenceSamplingState]) -> torch.Tensor:
        """``logits`` after logit bias, then repetition/frequency/presence penalties: a copy, or the
        input itself when no row has any (the input is never modified). Greedy rows take their argmax
        from this."""
        if not any(s.shapes_logits for s in states):
            return logits
        logits = logits.clone()
        self._apply_logit_bias(logits, [s.params for s in states])
        for i, s in enumerate(states):
            if s.allowed_ids is not None:  # everything else to -inf
                kept = logits[i].index_select(0, s.allowed_ids)
                logits[i].fill_(float("-inf")).index_copy_(0, s.allowed_ids, kept)
            if s.banned_ids is not None and s.num_output_tokens < s.params.min_tokens:
                logits[i].index_fill_(0, s.banned_ids, float("-inf"))
            if s.bad is not None:
                self._ban_bad_words(logits[i], s)
            if s.thinking_open is not None and s.num_output_tokens >= s.params.thinking_budget:
                # over budget and still thinking: the end token only (compared on the device: no sync)
                forced = torch.full_like(logits[i], float("-inf"))
                forced[s.params.thinking_end] = 0.0
                logits[i] = torch.where(s.thinking_open, forced, logits[i])
        penalty_rows = [i for i, s in enumerate(states) if s.penalty_slot is not None]
        if penalty_rows:
            self._apply_penalties(logits, states, penalty_rows)
        for i, s in enumerate(states):
            if s.params.uses_dry:
                self._apply_dry(logits[i], s)
        return logits

    @staticmethod
    def _apply_dry(row: torch.Tensor, state: SequenceSamplingState) -> None:
        """llama.cpp's DRY on one row (on the device, no sync). Over the window w (the last dry_penalty_last_n
        tokens, prompt included), each earlier position j gets the length of the longest suffix of w[:j+1] that is
        also a suffix of w (at most DRY_MAX_MATCH, and never reaching back over the last breaker); the token after
        j, w[j+1], would extend that repeat. Each token takes its longest such repeat; from dry_allowed_length on
        it loses dry_multiplier * dry_base ** (length - dry_allowed_length), unless it is a breaker itself.

        The last breaker, as llama.cpp finds it: the nearest position to the end holding a breaker token, or the
        head of a restart sequence whose tail follows it in full; a repeat reaches back to just after the breaker
        (after the longest tail that matched there)."""
        p = state.params
        n = state.history_len if p.dry_penalty_last_n == 0 else min(state.history_len, p.dry_penalty_last_n)
        if n < 2:
            return
        dev = row.device
        w = state.history[state.history_len - n:state.history_len]
        idx = torch.arange(n, device=dev)
        # per position: the longest breaker starting there in tokens after the first (0: a breaker token, -1: none)
        extra = torch.where(torch.isin(w, state.dry_breaker_ids), 0, -1)
        if state.dry_restart_heads is not None:
            extra = torch.maximum(extra, Sampler._restart_tails_at(w, state))
        last = torch.where(extra >= 0, idx, -1).max()  # the breaker nearest the end (-1: none)
        rep_limit = torch.where(last >= 0, n - 1 - last - extra[last.clamp_min(0)], n)
        j = idx[:n - 1]
        if dev.type == "cpu" and p.dry_allowed_length > 0:
            # only positions holding the last token start a repeat (a 4,000-token window: 1.3 ms a step, not 7)
            j = torch.nonzero(w[:n - 1] == w[n - 1]).flatten()
        k = torch.arange(min(n - 1, DRY_MAX_MATCH), device=dev)
        src = j[:, None] - k[None, :]  # [positions, K]: position j - k
        eq = (w[src.clamp_min(0)] == w[n - 1 - k][None, :]) & (src >= 0)
        length = torch.minimum(eq.to(torch.int32).cumprod(dim=1).sum(dim=1), rep_limit).to(torch.int32)
        longest = torch.full((row.shape[-1],), -1, dtype=torch.int32, device=dev).scatter_reduce_(
            0, w[j + 1], length, reduce="amax")  # -1: never follows a position of the window
        exponent = (longest - p.dry_allowed_length).clamp_min(0).to(row.dtype)
        if p.dry_base > 1.000001:  # llama.cpp's clamp: base ** exponent stays a finite float
            exponent = exponent.clamp_max(float(int(88.7228391 / math.log(p.dry_base))))
        penalty = p.dry_multiplier * torch.pow(on_device(p.dry_base, dev, dtype=row.dtype), exponent)
        hit = longest >= p.dry_allowed_length
        if state.dry_breaker_ids.numel():
            hit[state.dry_breaker_ids] = False
        row.sub_(torch.where(hit, penalty, torch.zeros((), dtype=row.dtype, device=dev)))

    @staticmethod
    def _restart_tails_at(w: torch.Tensor, state: SequenceSamplingState) -> torch.Tensor:
        """For each position of w, the length of the longest restart-sequence tail that follows it there with the
        position holding that sequence's head (-1: none). On the CPU only positions holding a head are compared."""
        heads, tails, lens = state.dry_restart_heads, state.dry_restart_tails, state.dry_restart_lens
        n, longest = w.numel(), tails.shape[1]
        out = torch.full((n,), -1, dtype=torch.int64, device=w.device)
        pos = torch.arange(n, device=w.device)
        if w.device.type == "cpu":
            pos = torch.nonzero(torch.isin(w, heads)).flatten()
            if not pos.numel():
                return out
        # the `longest` tokens after each position (-2 past the window: never a tail token)
        padded = torch.cat([w, torch.full((longest,), -2, dtype=w.dtype, device=w.device)])
        after = padded[pos[:, None] + 1 + torch.arange(longest, device=w.device)[None, :]]  # [P, longest]
        same = (after[:, None, :] == tails[None, :, :]) | (tails[None, :, :] < 0)  # [P, S, longest]
        hit = same.all(dim=2) & (w[pos][:, None] == heads[None, :])
        out[pos] = torch.where(hit, lens[None, :], -1).amax(dim=1)
        return out

    @staticmethod
    def _ban_bad_words(row: torch.Tensor, state: SequenceSamplingState) -> None:
        """vLLM's bad_words on one row: each sequence's last token to -inf where the output ends with the rest
        (compared on the device: no sync)."""
        for prefix, last in state.bad:
            n = prefix.numel()
            if n == 0:
                row[last] = float("-inf")
            elif n <= state.num_output_tokens:  # the output's last n tokens
                hit = (state.history[state.history_len - n:state.history_len] == prefix).all()
                row[last] = torch.where(hit, torch.full((), float("-inf"), device=row.device), row[last])

    def _yield_to_grammar(self, raw: torch.Tensor, logits: torch.Tensor, states: list[SequenceSamplingState]) -> None:
        """A constrained row whose grammar allows only the ids that min_tokens bans (the output is complete)
        would have nothing left to draw: it is redone without the ban, so the grammar ends the output."""
        rows = [i for i, s in enumerate(states) if s.grammar is not None and not s.grammar.failed
                and s.banned_ids is not None and s.num_output_tokens < s.params.min_tokens]
        if not rows:
            return
        index = on_device(rows, logits.device, dtype=torch.int64)
        dead = torch.isneginf(logits.index_select(0, index)).all(dim=-1).tolist()  # a sync, for such rows only
        for i, is_dead in zip(rows, dead):
            if is_dead:
                state = dataclasses.replace(states[i], banned_ids=None)
                row = self.apply_bias_and_penalties(raw[i:i + 1], [state])
                logits[i] = self._apply_grammar_masks(row, [state], owned=False)[0]

    def _apply_grammar_masks(self, logits: torch.Tensor, states: list[SequenceSamplingState], *,
                             owned: bool) -> torch.Tensor:
        """``logits`` with each constrained row's disallowed ids at -inf: written in place when ``owned``
        (the sampler's own copy), else into a new tensor (the caller's logits are never modified)."""
        rows = [i for i, s in enumerate(states) if s.grammar is not None and not s.grammar.failed]
        if not rows:
            return logits
        from flared.model.grammar import fill_bitmasks

        vocab = logits.shape[-1]
        num_words = (vocab + 31) // 32
        # Host bitmask (llguidance writes through a pointer), one row per constrained request.
        bitmask = torch.empty(len(rows), num_words, dtype=torch.int32)
        row_bytes = num_words * 4
        fill_bitmasks([(states[i].grammar, k) for k, i in enumerate(rows)], bitmask.data_ptr(), row_bytes, len(rows))
        # [R, W] int32 words -> [R, W * 32] bits: id = 32 * word + bit, and on a little-endian host that is
        # byte order with LSB-first bits. numpy's unpackbits does it in one pass; torch's int32 shifts with
        # broadcasting were ~100x slower on the CPU.
        # Inverting the packed words (vocab / 8 bytes) is cheaper than inverting the expanded mask, and the
        # unpacked 0/1 bytes are valid bools, so the mask reaches torch without another pass.
        banned_bits = np.unpackbits(~bitmask.numpy().view(np.uint8), axis=-1, bitorder="little")[:, :vocab]
        if len(rows) == logits.shape[0] and logits.device.type == "cpu":
            # numpy, single-threaded: a torch copy or fill this size wakes the intra-op thread pool, which
            # on a busy 2-core host cost ~10 ms a step, far more than the work.
            banned = banned_bits.view(np.bool_)
            if owned:
                np.copyto(logits.numpy(), -np.inf, where=banned)
                return logits
            return torch.from_numpy(np.where(banned, np.float32(-np.inf), logits.numpy()))
        banned = torch.from_numpy(banned_bits.view(np.bool_)).to(logits.device)
        if not owned:
            logits = logits.clone()
        if len(rows) == logits.shape[0]:
            return logits.masked_fill_(banned, float("-inf"))
        index = on_device(rows, logits.device, dtype=torch.int64)
        logits.index_copy_(0, index, logits.index_select(0, index).masked_fill_(banned, float("-inf")))
        return logits

    def _apply_logit_bias(self, logits: torch.Tensor, params: list[SamplingParams]) -> None:
        rows, cols, values = [], [], []
        for i, p in enumerate(params):
            if p.logit_bias:
                for token, bias in p.logit_bias.items():
                    rows.append(i)
                    cols.append(token)
                    values.append(float(bias))
        if rows:
            index = (on_device(rows, self.device), on_device(cols, self.device))
            logits.index_put_(index, on_device(values, self.device, dtype=logits.dtype), accumulate=True)

    def _apply_penalties(self, logits: torch.Tensor, states: list[SequenceSamplingState], rows: list[int]) -> None:
        """The penalties of ``rows`` (their states' slots) in ``logits``, in place: on the CPU one pass a row
        (flared._fast.penalties, the same float32 operations as _penalties_torch); on a GPU, or for at_position's
        copies (whose counts also take the tokens between), _penalties_torch."""
        if (self.device.type == "cpu" and logits.dtype == torch.float32 and logits.is_contiguous()
                and not any(states[i].ahead for i in rows)):
            apply_penalties(logits.numpy(), self.output_counts.numpy(), self.prompt_mask.numpy().view(np.uint8),
                            np.asarray(rows, dtype=np.int64),
                            np.asarray([states[i].penalty_slot for i in rows], dtype=np.int64),
                            *(np.asarray([getattr(states[i].params, name) for i in rows], dtype=np.float32)
                              for name in ("repetition_penalty", "frequency_penalty", "presence_penalty")))
            return
        self._penalties_torch(logits, states, rows)

    def _penalties_torch(self, logits: torch.Tensor, states: list[SequenceSamplingState], rows: list[int]) -> None:
        dev = self.device
        row_ids = on_device(rows, dev, dtype=torch.int64)
        slots = on_device([states[i].penalty_slot for i in rows], dev, dtype=torch.int64)
        counts = self.output_counts.index_select(0, slots)  # [P, V]
        for k, i in enumerate(rows):  # at_position's copies also count the tokens between their state and them
            if states[i].ahead:
                self._count_ahead(counts[k], states[i])
        seen_in_output = counts > 0
        seen = seen_in_output | self.prompt_mask.index_select(0, slots)
        rep = on_device([states[i].params.repetition_penalty for i in rows], dev)[:, None]
        freq = on_device([states[i].params.frequency_penalty for i in rows], dev)[:, None]
        pres = on_device([states[i].params.presence_penalty for i in rows], dev)[:, None]
        sub = logits.index_select(0, row_ids)
        penalised = torch.where(sub > 0, sub / rep, sub * rep)
        sub = torch.where(seen, penalised, sub)
        sub = sub - freq * counts.to(sub.dtype) - pres * seen_in_output.to(sub.dtype)
        logits.index_copy_(0, row_ids, sub)

    @staticmethod
    def _count_ahead(counts: torch.Tensor, state: SequenceSamplingState) -> None:
        """``counts`` [V] (a copy of the state's penalty counts) as ``_record_drawn`` leaves them after drawing
        ``state.ahead`` one by one: each token counted, and with a window (penalty_last_n) its oldest token
        forgotten as each enters."""
        ahead = torch.as_tensor(state.ahead, dtype=torch.int64, device=counts.device)
        counts.index_add_(0, ahead, torch.ones_like(ahead, dtype=torch.int32))
        n = state.params.penalty_last_n
        if n:  # the copy's history ends with its ahead tokens (at_position): the state's ended before them
            h = state.history_len - len(state.ahead)
            leaving = [p for p in range(h - n, h - n + len(state.ahead)) if p >= 0]
            if leaving:
                ids = state.history[leaving]
                counts.index_add_(0, ids, torch.full_like(ids, -1, dtype=torch.int32))

    def _uniform(self, state: SequenceSamplingState, out: torch.Tensor) -> torch.Tensor:
        """``out`` (one per vocabulary id) filled with the row's uniforms for this step, from its own seed and
        step."""
        self._generator.manual_seed(_row_seed(state.seed, state.num_output_tokens))
        return out.uniform_(generator=self._generator)

    def _draw_mirostat(self, logits: torch.Tensor, state: SequenceSamplingState) -> torch.Tensor:
        """One row's mirostat draw (llama.cpp's v1 and v2; on the device, no sync): keep the tokens whose surprise
        (-log2 p, after temperature) fits mu, by a bound on surprise (v2) or a top-k estimated from the top 100
        probabilities' Zipf exponent (v1); draw among them; then move mu by eta times the drawn token's surprise
        (in the kept distribution) minus tau."""
        p = state.params
        mu = state.mirostat_mu
        x = logits / p.temperature
        probs = torch.softmax(x, dim=-1)
        vocab = x.shape[-1]
        if p.mirostat == 2:
            keep = (-torch.log2(probs) <= mu) | (probs == probs.max())
        else:
            top, order = probs.sort(descending=True)
            m = min(100, vocab)
            head = top[:m].clamp_min(torch.finfo(probs.dtype).tiny)
            i = torch.arange(m - 1, device=x.device, dtype=probs.dtype)
            t = torch.log((i + 2) / (i + 1))
            b = torch.log(head[:-1] / head[1:])
            s_hat = (t * b).sum() / (t * t).sum()
            eps = s_hat - 1
            n = on_device(float(vocab), x.device)
            k = ((eps * torch.exp2(mu)) / (1 - torch.pow(n, -eps))) ** (1 / s_hat)
            k = torch.nan_to_num(k, nan=1.0, posinf=float(vocab)).clamp(1, vocab).floor()
            keep_sorted = torch.arange(vocab, device=x.device) < k
            keep = torch.zeros_like(keep_sorted).scatter_(0, order, keep_sorted)
        kept = torch.softmax(x.masked_fill(~keep, float("-inf")), dim=-1)
        uniform = self._uniform(state, torch.empty(vocab, dtype=torch.float32, device=x.device))
        exponential = (-torch.log1p(-uniform)).clamp_min_(E_FLOOR)  # as _race
        token = (kept / exponential).argmax()
        surprise = -torch.log2(kept[token])
        mu.sub_(p.mirostat_eta * (surprise - p.mirostat_tau))
        return token

    def _xtc(self, logits: torch.Tensor, states: list[SequenceSamplingState]) -> torch.Tensor:
        """XTC over the candidates' probabilities: on rows whose coin (from their seed and step) falls under
        xtc_probability, the tokens at least xtc_threshold likely go, but the least likely of them, where there are
        two or more."""
        dev = self.device
        params = [s.params for s in states]
        coins = torch.ones(len(states), 1, device=dev)
        for i, s in enumerate(states):
            if s.params.xtc_probability > 0:
                self._generator.manual_seed(_row_seed(s.seed ^ _XTC_SALT, s.num_output_tokens))
                coins[i] = torch.rand((), generator=self._generator, device=dev)
        chance = on_device([p.xtc_probability for p in params], dev)[:, None]
        threshold = on_device([p.xtc_threshold for p in params], dev)[:, None]
        probs = torch.softmax(logits, dim=-1)
        above = probs >= threshold
        least = torch.where(above, probs, float("inf")).min(dim=-1, keepdim=True).values
        remove = above & (probs > least) & (above.sum(dim=-1, keepdim=True) >= 2) & (coins < chance)
        return logits.masked_fill(remove, float("-inf"))

    def _draw(self, logits: torch.Tensor, states: list[SequenceSamplingState]) -> torch.Tensor:
        """logits [S, V] after bias/penalties -> drawn token ids [S]."""
        dev = self.device
        params = [s.params for s in states]
        chained = [i for i, p in enumerate(params) if p.sampler_order]
        if chained:  # rows with their own order apart (llama.cpp's plain default chain batched); the rest below
            out = torch.empty(len(states), dtype=torch.int64, device=dev)
            plain = []
            for i in chained:
                if plain_default_chain(params[i]):
                    plain.append(i)
                else:
                    out[i] = self._draw_chain(logits[i:i + 1], states[i])
            for rows, draw in ((plain, self._draw_default_chain),
                               ([i for i in range(len(states)) if not params[i].sampler_order], self._draw)):
                if rows:
                    idx = on_device(rows, dev, dtype=torch.int64)
                    out.index_copy_(0, idx, draw(logits.index_select(0, idx), [states[i] for i in rows]))
            return out
        temperature = on_device([p.temperature for p in params], dev)[:, None]
        logits = logits / temperature
        if any(p.top_n_sigma > 0 for p in params):
            logits = top_n_sigma_filter(logits, on_device([p.top_n_sigma for p in params], dev)[:, None])
        if any(p.min_p > 0 for p in params):
            logits = min_p_filter(logits, on_device([p.min_p for p in params], dev)[:, None])
        if any(p.typical_p < 1.0 for p in params):
            typical = on_device([p.typical_p for p in params], dev)[:, None]
            logits = typical_filter(logits, typical)
        vocab = logits.shape[-1]
        if self._walks(params):
            return self._walk_top_p(logits, states)
        logits, candidate_ids = self._top_k_top_p(logits, params)
        if any(p.xtc_probability > 0 for p in params):
            logits = self._xtc(logits, states)
        return self._race(logits, states, candidate_ids, vocab)

    def _draw_default_chain(self, logits: torch.Tensor, states: list[SequenceSamplingState]) -> torch.Tensor:
        """Rows of llama.cpp's default chain with nothing but top-k, top-p, min-p and the temperature
        (plain_default_chain), batched: what _draw_chain draws for each, every filter on the unscaled logits (top-k;
        top-p on shares of what top-k kept; min-p against the likeliest), then the temperature and the draw. On the
        CPU with no top-k in the batch, the walk up the ranking (_walk_top_p) instead of a shortlist."""
        params = [s.params for s in states]
        vocab = logits.shape[-1]
        temperature = [p.temperature for p in params]
        if self.device.type == "cpu" and not any(p.top_k > 0 for p in params):
            x = logits.float()
            floor = x.max(dim=-1).values.double().numpy() + np.array(
                [math.log(p.min_p) if p.min_p > 0 else -math.inf for p in params], dtype=np.float64)
            return self._walk_top_p(x / torch.tensor(temperature)[:, None], states,
                                    log_z=torch.logsumexp(x, dim=-1).double().numpy(),
                                    judge=np.array(temperature, dtype=np.float64), floor=floor)
        logits, candidate_ids = self._top_k_top_p(logits, params)
        if any(p.min_p > 0 for p in params):
            logits = min_p_filter(logits, on_device([p.min_p for p in params], self.device)[:, None])
        logits = logits / on_device(temperature, self.device)[:, None]
        return self._race(logits, states, candidate_ids, vocab)

    def _top_k_top_p(self, logits: torch.Tensor, params: list[SamplingParams]):
        """(logits, candidate ids or None) after each row's top-k and top-p, top-p on shares of what top-k kept
        (and of what the filters before kept: their -inf logits hold no share). The candidates, sorted by logit:
        a top-k when every row has one (much cheaper than sorting the vocabulary), else the rows' shortlist or the
        whole sorted vocabulary; either way a row keeps the same tokens. Rows with neither: as they are."""
        if not any(p.top_k > 0 or p.top_p < 1.0 for p in params):
            return logits, None
        dev = self.device
        vocab = logits.shape[-1]
        top_p = on_device([p.top_p for p in params], dev)[:, None]
        whole = None  # with a shortlist: each row's log normaliser over the whole vocabulary
        if all(p.top_k > 0 for p in params):
            logits, candidate_ids = logits.topk(min(max(p.top_k for p in params), vocab), dim=-1)
        else:
            short = shortlist(logits, on_device([p.top_k for p in params], dev)[:, None], top_p)
            if short is not None:
                logits, candidate_ids, whole = short
            else:
                logits, candidate_ids = logits.sort(dim=-1, descending=True)
        num_candidates = logits.shape[-1]
        top_k = on_device([min(p.top_k, num_candidates) if p.top_k > 0 else num_candidates for p in params],
                          dev)[:, None]
        ranks = torch.arange(num_candidates, device=dev)[None, :]
        logits = logits.masked_fill(ranks >= top_k, float("-inf"))
        if whole is None:
            sorted_probs = torch.softmax(logits, dim=-1)
        else:  # rows without a top-k judge the whole vocabulary's probabilities; the others their k tokens'
            has_k = on_device([p.top_k > 0 for p in params], dev)[:, None]
            norm = torch.where(has_k, torch.logsumexp(logits, dim=-1, keepdim=True), whole)
            sorted_probs = torch.exp(logits - norm)
        return logits.masked_fill(top_p_cut(sorted_probs, top_p), float("-inf")), candidate_ids

    def _race(self, logits: torch.Tensor, states: list[SequenceSamplingState],
              candidate_ids: torch.Tensor | None = None, vocab: int | None = None) -> torch.Tensor:
        """The draw from filtered logits [S, C]: C candidates (``candidate_ids`` [S, C] of a ``vocab``-wide row), or
        the whole row.
        Exponential race: argmax(p / E) with E ~ Exp(1) draws from p. A token's E is a function of the row's seed,
        its draw count and the token's id, so a token's noise never depends on the candidate set, the batch or the
        order the filters ran in. On the CPU E comes from the GPU graphs' counter hash (flared._fast.race, in
        log space: the argmax of x - log E), so a seeded row draws what the graphs' sampler draws from the same
        logits; on a GPU (the rows its graphs do not sample) from the row's own generator."""
        if self.device.type == "cpu":
            return self._race_hashed(logits, states, candidate_ids)
        return self._race_generator(logits, states, candidate_ids, vocab)

    @staticmethod
    def _seeds_and_steps(states: list[SequenceSamplingState]) -> tuple[np.ndarray, np.ndarray]:
        """The rows' seeds and draw counts as flared._fast.race's hash takes them."""
        seeds = np.fromiter((s.seed & _MASK63 for s in states), dtype=np.int64, count=len(states))
        steps = np.fromiter((s.num_output_tokens for s in states), dtype=np.int64, count=len(states))
        return seeds, steps

    def _race_hashed(self, logits: torch.Tensor, states: list[SequenceSamplingState],
                     candidate_ids: torch.Tensor | None) -> torch.Tensor:
        """_race on the CPU: flared._fast.race over the scores, the GPU graphs' noise."""
        ids = None if candidate_ids is None else candidate_ids.contiguous().numpy()
        return torch.from_numpy(race_draw(logits.float().contiguous().numpy(), ids, *self._seeds_and_steps(states)))

    def _walks(self, params: list[SamplingParams]) -> bool:
        """Whether _draw takes _walk_top_p: on the CPU, where a row has a top-p and none a top-k or XTC."""
        return (self.device.type == "cpu" and any(p.top_p < 1.0 for p in params)
                and not any(p.top_k > 0 or p.xtc_probability > 0 for p in params))

    def _walk_top_p(self, logits: torch.Tensor, states: list[SequenceSamplingState], log_z=None, judge=None,
                    floor=None) -> torch.Tensor:
        """Top-p rows without a top-k or XTC on the CPU (scaled, filtered logits [S, V]): flared._fast.race's walk
        up the ranking from the race's winner (no sort, no shortlist), judging each candidate by the mass ranked
        before it, a share of what the earlier filters kept; the masked race's token, as the sorted path gives
        it (and the GPU graphs' walk). llama.cpp's chain rows (_draw_default_chain) judge the logits before the
        temperature: ``judge`` (each row's T), ``log_z`` (their normaliser) and ``floor`` (min-p's least logit,
        after top-p) as race_top_p takes them."""
        x = logits.float().contiguous()
        if log_z is None:
            log_z = torch.logsumexp(x, dim=-1).double().numpy()
        top_p = np.fromiter((s.params.top_p for s in states), dtype=np.float64, count=len(states))
        return torch.from_numpy(race_top_p(x.numpy(), log_z, top_p, *self._seeds_and_steps(states), judge=judge,
                                           floor=floor))

    def _race_generator(self, logits: torch.Tensor, states: list[SequenceSamplingState],
                        candidate_ids: torch.Tensor | None = None, vocab: int | None = None) -> torch.Tensor:
        """_race on a GPU: E from the row's generator, reseeded from (seed, draw count), for every vocabulary id
        (its uniforms gathered at the candidates), so a token's E does not depend on the candidates either."""
        probs = torch.softmax(logits, dim=-1)
        uniform = torch.empty(len(states), vocab or logits.shape[-1], dtype=probs.dtype, device=self.device)
        for i, s in enumerate(states):
            self._uniform(s, uniform[i])  # in place: no vocabulary-sized copy per row and token
        if candidate_ids is not None:
            uniform = uniform.gather(1, candidate_ids)
        # uniform in [0, 1) -> E in [0, inf). A uniform of 0 (2^-24 a token) gives E = 0, which would make its
        # token win whatever its probability (and 0/0 = NaN for a masked one): E stops at 2^-24, the E of the
        # next uniform up (kernels.sampling.E_FLOOR, the GPU race's floor).
        exponential = (-torch.log1p(-uniform)).clamp_min_(E_FLOOR)
        choice = (probs / exponential).argmax(dim=-1)
        if candidate_ids is None:
            return choice
        return candidate_ids.gather(1, choice[:, None])[:, 0]

    def _draw_chain(self, logits: torch.Tensor, state: SequenceSamplingState) -> torch.Tensor:
        """One row [1, V] through its own sampler_order (llama.cpp's chain): each filter judges what the ones
        before it kept, at the temperature applied so far; then the draw. Returns a one-element id tensor.
        From top-k on the row shrinks to its k candidates (``ids``), sorted by logit, which the filters after it
        keep (they only mask), so top-p then needs no sort of the vocabulary."""
        p = state.params
        dev = self.device
        vocab = logits.shape[-1]
        ids = None  # the candidates' token ids once top-k has run (descending logits), else the whole row
        for stage in p.sampler_order:
            if stage == "temperature":
                logits = dynamic_temperature(logits, p) if p.dynatemp_range > 0 else logits / p.temperature
            elif stage == "top_n_sigma" and p.top_n_sigma > 0:
                logits = top_n_sigma_filter(logits, on_device([[p.top_n_sigma]], dev))
            elif stage == "top_k" and p.top_k > 0:
                logits, keep = logits.topk(min(p.top_k, logits.shape[-1]), dim=-1)
                ids = keep if ids is None else ids.gather(1, keep)
            elif stage == "typ_p" and p.typical_p < 1.0:
                logits = typical_filter(logits, on_device([[p.typical_p]], dev))
            elif stage == "top_p" and p.top_p < 1.0:
                short = None if ids is not None else shortlist(logits, torch.zeros(1, 1, dtype=torch.int64),
                                                               torch.tensor([[p.top_p]]))
                order = None  # where the sorted probabilities' cut goes back to: None, in place (sorted already)
                if short is not None:  # the row shrinks to its shortlist, as top-k shrinks it
                    logits, ids, whole = short
                    probs = torch.exp(logits - whole)
                elif ids is not None:
                    probs = torch.softmax(logits, dim=-1)
                else:
                    ordered, order = logits.sort(dim=-1, descending=True)
                    probs = torch.softmax(ordered, dim=-1)
                cut = top_p_cut(probs, p.top_p)
                if order is not None:
                    cut = torch.zeros_like(cut).scatter_(1, order, cut)
                logits = logits.masked_fill(cut, float("-inf"))
            elif stage == "min_p" and p.min_p > 0:
                logits = min_p_filter(logits, p.min_p)
            elif stage == "xtc" and p.xtc_probability > 0:
                logits = self._xtc(logits, [state])
            elif stage == "infill":
                logits, ids = infill_filter(logits, ids, p)
        if state.adaptive_sums is not None:  # adaptive-p is the draw
            return self._adaptive_p(logits, state, ids, vocab)
        self._keep_drawn_from(state, logits, ids)
        return self._race(logits, [state], ids, vocab)[0]

    @staticmethod
    def _keep_drawn_from(state: SequenceSamplingState, logits: torch.Tensor, ids: torch.Tensor | None) -> None:
        """post_sampling_probs: the candidates the draw is made from, with their log-probabilities."""
        if state.params.post_sampling_probs:
            row = logits[0].float()
            cand = ids[0] if ids is not None else torch.arange(row.numel(), device=row.device)
            keep = torch.isfinite(row)
            state.drawn_from = (cand[keep], torch.log_softmax(row[keep], dim=0))

    def _adaptive_p(self, logits: torch.Tensor, state: SequenceSamplingState, ids: torch.Tensor | None,
                    vocab: int) -> torch.Tensor:
        """llama.cpp's adaptive-p draw on one row's candidates, on the device: the target is 2 adaptive_target
        minus the picks' decaying average probability (clamped to [0, 1]); each finite candidate's logit becomes
        ADAPTIVE_P_PEAK - ADAPTIVE_P_SHARPNESS d^2 / (1 + d), d = |p - target| / ADAPTIVE_P_WIDTH; then the draw,
        and the pick's probability before the change joins the average."""
        p = state.params
        decay = min(max(p.adaptive_decay, 0.0), 0.99)
        sums = state.adaptive_sums
        probs = torch.softmax(logits.float(), dim=-1)
        target = (2 * min(max(p.adaptive_target, 0.0), 1.0) - sums[0] / sums[1]).clamp(0.0, 1.0)
        shaped = adaptive_p_logits(logits, probs, target)
        self._keep_drawn_from(state, shaped, ids)
        token = self._race(shaped, [state], ids, vocab)[0]
        picked = probs[0, token] if ids is None else probs[0][ids[0] == token].sum()
        sums.mul_(decay).add_(torch.stack([picked, torch.ones_like(picked)]))
        return token
