"""What crosses between the event loop and the model thread.

The event loop hands the model thread a ``GenerateRequest`` (already rendered
and tokenized by a frontend worker) and an ``EventSink``; the model thread
pushes ``TokenEvent``s, then exactly one ``FinishEvent`` or ``ErrorEvent``,
through the sink. The sink is the only place the two threads meet: it posts
to an asyncio queue with ``loop.call_soon_threadsafe``.

Rules:
- Every submitted request gets exactly one terminal event (finish or error),
  including when the model thread dies or the server shuts down.
- A token event carries the sampled ids of one completed step (usually one
  id); the detokenizer and stop strings run on the consumer's side.
- The queue is unbounded by design: its size is bounded by the request's own
  output budget (max_tokens), which admission has already accepted, so a
  paused reader keeps its response without blocking the model thread.
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
from typing import TYPE_CHECKING

from flared.errors import FlareError
from flared.model.sampling import SamplingParams

if TYPE_CHECKING:
    import numpy as np
    import torch

_request_ids = itertools.count(1)


@dataclasses.dataclass(frozen=True)
class VisionInput:
    """A prompt's images, ready for the decoder: the rows the image tower made for each image token."""
    positions: np.ndarray  # int64 [N]: prompt indices of the image tokens, ascending
    # [N, hidden]: row i replaces the embedding at positions[i] (Qwen3-VL: [N, (1 + k) * hidden], its k DeepStack
    # layers' rows after the embedding's); None until the tower has made them
    features: torch.Tensor | None
    # (index of each image's first image token, its 32-byte identity): prefix-cache conditioning, so a cached
    # prompt is reused only up to the first image that differs
    spans: tuple[tuple[int, bytes], ...]
    # Qwen VL's 3D rope: the prompt's (temporal, row, column) positions [3, L] int64, and what a later token
    # adds to its index (flared.model.vision.mrope_positions); None: plain positions
    mrope: np.ndarray | None = None
    mrope_delta: int = 0

    def shifted(self, cut: int) -> "VisionInput | None":
        """The same images after the prompt's first ``cut`` tokens are dropped, or, for a negative cut, after
        -cut text tokens are put before it (None: a cut into an image)."""
        if cut == 0:
            return self
        if len(self.positions) and self.positions[0] < cut:
            return None
        mrope = self.mrope
        if mrope is not None:  # the tokens dropped or added are text: one position each
            if cut > 0:
                mrope = mrope[:, cut:] - cut
            else:
                import numpy as np

                mrope = np.concatenate([np.broadcast_to(np.arange(-cut), (3, -cut)), mrope - cut], axis=1)
        return dataclasses.replace(self, positions=self.positions - cut,
                                   spans=tuple((p - cut, i) for p, i in self.spans), mrope=mrope)


@dataclasses.dataclass(frozen=True)
class GenerateRequest:
    prompt_token_ids: tuple[int, ...]
    # Token index after each complete chat message: prefix-cache checkpoint candidates.
    message_endpoints: tuple[int, ...]
    params: SamplingParams  # includes max_tokens
    stop_token_ids: frozenset[int]  # EOS ids (unless ignore_eos) + the request's own stop ids
    request_id: int = dataclasses.field(default_factory=lambda: next(_request_ids))
    # flared.model.grammar.CompiledGrammar: every sampled token must keep the output inside it.
    grammar: object | None = None
    # Scoring request: the model thread reports the log-probability of every
    # prompt token at a position >= score_from (teacher-forced, no sampling
    # shown) in one ScoredEvent, then finishes. Positions before it are the
    # shared context and may come from the prefix cache.
    score_from: int | None = None
    # vLLM's cache_salt: the prefix cache reuses this request's prefixes only for requests with the same salt
    # (a conditioning identity at position 0), so tenants that do not share it cannot probe each other's prompts.
    cache_salt: str | None = None
    # vLLM's priority: lower runs sooner (its value counts 2 ** -priority times; FCFS orders by it), and a lower
    # value is admitted to a free slot before the waiting requests of higher values
    priority: int = 0
    # vLLM's --lora-modules: the adapter the request's model name picked (1-based, ServerConfig.lora_modules
    # order); 0 = the base weights.
    lora: int = 0
    # OpenAI's predicted output (chat ``prediction``) as token ids: with speculative decoding on, the scheduler
    # looks up this request's drafts there first (the tokens are the same with it or without it)
    prediction: tuple[int, ...] = ()
    # A vision-language model's images (VisionInput); None: a text prompt
    vision: VisionInput | None = None


@dataclasses.dataclass(frozen=True)
class TokenLogprob:
    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...]  # (token id, logprob), most likely first


@dataclasses.dataclass(frozen=True)
class TokenEvent:
    token_ids: tuple[int, ...]
    logprobs: tuple[TokenLogprob, ...] | None


@dataclasses.dataclass(frozen=True)
class FinishEvent:
    reason: str  # "stop" (a stop token) | "length" (max_tokens or context) | "cancelled"
    num_prompt_tokens: int
    num_cached_tokens: int  # prompt tokens reused from the prefix cache
    num_generated_tokens: int
    queue_ns: int  # admission to first scheduled step
    first_token_ns: int  # admission to first token (0 when none)
    num_drafted: int = 0  # draft tokens speculative steps fed this request
    num_accepted_drafts: int = 0  # ... of which it kept (the rest were computed and dropped)


@dataclasses.dataclass(frozen=True)
class ScoredEvent:
    # log P(token[p] | tokens[:p]) for p = score_from .. len(prompt) - 1, in order.
    logprobs: tuple[float, ...]


@dataclasses.dataclass(frozen=True)
class ErrorEvent:
    error: FlareError


Event = TokenEvent | ScoredEvent | FinishEvent | ErrorEvent


class EventSink:
    """Model thread -> the asyncio queue of the HTTP response that owns the request.

    The n choices of one response share a queue; each sink tags its events
    with its choice index.
    """

    __slots__ = ("_loop", "_queue", "index", "closed")

    def __init__(self, loop: asyncio.AbstractEventLoop, queue: asyncio.Queue, index: int = 0):
        self._loop = loop
        self._queue = queue
        self.index = index
        self.closed = False  # set after the terminal event

    def put(self, event: Event) -> None:
        """Called from the model thread."""
        if self.closed:
            return
        if isinstance(event, (FinishEvent, ErrorEvent)):
            self.closed = True
        try:
            self._loop.call_soon_threadsafe(self._queue.put_nowait, (self.index, event))
        except RuntimeError:
            # The loop is closed (process shutting down): nobody is left to read.
            pass


def as_error(exc: BaseException) -> FlareError:
    from flared.errors import ErrorKind, ExecutionError

    if isinstance(exc, FlareError):
        return exc
    return ExecutionError(f"model execution failed: {type(exc).__name__}: {exc}", ErrorKind.EXECUTION)

