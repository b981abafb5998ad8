"""One HTTP response's generation: its n choices, their text, their end.

A ``Generation`` submits one model request per choice, reads the model
thread's events from one queue, and turns sampled ids into text deltas with
the frontend's detokenizer and the request's stop strings. Every route
adapter (OpenAI chat and completions; later Anthropic, Responses, Ollama)
consumes the same ``ChoiceDelta`` stream and only formats it.

Rules:
- A token in the request's stop ids (EOS included) ends its choice; its text
  is never shown, but it counts as a generated token.
- A stop string ends its choice at the token that completes it: the text of
  the stop string (unless ``include_stop_str``) and anything after it are
  withheld; the model request is cancelled; the tokens up to that one count as
  generated. No stop string is looked for before the request's min_tokens.
- ``cancel()`` (client gone, or error) cancels every choice still running;
  it is idempotent.
- Choices that share a prompt of at least ``SHARED_PROMPT_MIN_TOKENS`` (n > 1)
  share its prefill: the first is submitted at once, the others when its first
  event arrives, by which time its prompt is in the prefix cache, so they
  prefill only what the cache lacks (vLLM's parallel sampling shares the
  prompt the same way). Without the prefix cache all go at once.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections.abc import AsyncIterator

from flared.errors import FlareError
from flared.runtime.request import (
    ErrorEvent,
    EventSink,
    FinishEvent,
    GenerateRequest,
    TokenEvent,
    TokenLogprob,
)


@dataclasses.dataclass
class ChoiceDelta:
    index: int
    text: str  # new visible text (may be empty)
    token_ids: list[int]  # tokens this delta covers (visible or withheld)
    logprobs: list[TokenLogprob]  # one per visible token, when asked
    finish_reason: str | None  # set on the choice's last delta


@dataclasses.dataclass
class ChoiceUsage:
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0
    num_generated_tokens: int = 0
    num_drafted: int = 0  # speculative draft tokens fed (FinishEvent.num_drafted), and kept
    num_accepted_drafts: int = 0


class _Choice:
    __slots__ = ("request", "detok", "usage", "finish_reason", "final_sent", "done")

    def __init__(self, request: GenerateRequest, detok):
        self.request = request
        self.detok = detok
        self.usage = ChoiceUsage(num_prompt_tokens=len(request.prompt_token_ids))
        self.finish_reason: str | None = None  # known reason; later tokens are ignored
        self.final_sent = False  # the delta with finish_reason went out
        self.done = False  # the model thread's terminal event arrived


SHARED_PROMPT_MIN_TOKENS = 64  # shorter shared prompts all go at once: waiting would cost more than it saves


class Generation:
    def __init__(self, runtime, frontend, requests: list[GenerateRequest], stop_strings: tuple[str, ...],
                 metrics=None, *, skip_special_tokens: bool = True, include_stop_str: bool = False):
        self._runtime = runtime
        # One latency/size observer per choice (flared.server.metrics), or None.
        self._observers = [metrics.observer() for _ in requests] if metrics is not None else None
        self._loop = asyncio.get_running_loop()
        self._queue: asyncio.Queue = asyncio.Queue()
        # skip_special_tokens=False keeps special-token markers (Mistral's [TOOL_CALLS]) for a tool parser.
        self._choices = [_Choice(r, frontend.detokenizer(stop_strings, skip_special_tokens=skip_special_tokens,
                                                         include_stop_str=include_stop_str))
                         for r in requests]
        self._include_stop_str = include_stop_str
        self.created = int(time.time())
        self._cancelled = False
        # leader choice -> the choices with the same prompt that wait for its prefill (see the rules)
        self._held: dict[int, list[int]] = {}
        share = getattr(runtime, "prefix_cache", False)
        leaders: dict[tuple[int, ...], int] = {}
        submitted = []
        try:
            for i, r in enumerate(requests):
                key = r.prompt_token_ids
                if share and len(key) >= SHARED_PROMPT_MIN_TOKENS and key in leaders:
                    self._held.setdefault(leaders[key], []).append(i)
                    continue
                leaders.setdefault(key, i)
                runtime.submit(r, EventSink(self._loop, self._queue, i))
                submitted.append(r)
        except BaseException:
            for r in submitted:
                runtime.cancel(r.request_id)
            raise

    def _release(self, leader: int) -> None:
        """Submit the choices that waited for ``leader``'s prefill."""
        for i in self._held.pop(leader, ()):
            if self._cancelled or self._choices[i].final_sent:
                self._skip(i)
                continue
            try:
                self._runtime.submit(self._choices[i].request, EventSink(self._loop, self._queue, i))
            except FlareError as exc:  # shutting down, say: this choice ends with that error
                self._queue.put_nowait((i, ErrorEvent(exc)))

    def _skip(self, i: int) -> None:
        """A waiting choice cancelled before it was submitted ends without a model request."""
        r = self._choices[i].request
        self._queue.put_nowait((i, FinishEvent("cancelled", len(r.prompt_token_ids), 0, 0, 0, 0)))

    @property
    def num_choices(self) -> int:
        return len(self._choices)

    def request(self, index: int) -> GenerateRequest:
        return self._choices[index].request

    def usage(self) -> ChoiceUsage:
        total = ChoiceUsage()
        for c in self._choices:
            total.num_generated_tokens += c.usage.num_generated_tokens
            total.num_drafted += c.usage.num_drafted
            total.num_accepted_drafts += c.usage.num_accepted_drafts
        # Choices of one prompt share it: report it once per distinct prompt.
        seen: set[tuple[int, ...]] = set()
        for c in self._choices:
            key = c.request.prompt_token_ids
            if key not in seen:
                seen.add(key)
                total.num_prompt_tokens += c.usage.num_prompt_tokens
                total.num_cached_tokens += c.usage.num_cached_tokens
        return total

    def choice_usage(self, index: int) -> ChoiceUsage:
        """Choice ``index``'s own prompt, cached and generated token counts."""
        return self._choices[index].usage

    def end_choice(self, index: int, reason: str) -> None:
        """End choice ``index`` now with ``reason`` (a route's own limit): its model request is cancelled and its
        later tokens and finish are dropped, as after a stop string."""
        choice = self._choices[index]
        if choice.final_sent:
            return
        choice.finish_reason = reason
        choice.final_sent = True
        if not choice.done and not any(index in held for held in self._held.values()):
            self._runtime.cancel(choice.request.request_id)

    def matched_stop(self, index: int) -> str | None:
        """The stop string that ended choice ``index``, if one did (Anthropic's stop_sequence)."""
        return self._choices[index].detok.matched_stop

    def cancel(self) -> None:
        if self._cancelled:
            return
        self._cancelled = True
        waiting = {i for held in self._held.values() for i in held}
        for held in list(self._held.values()):
            for i in held:
                self._skip(i)
        self._held.clear()
        for i, c in enumerate(self._choices):
            if not c.done and i not in waiting:
                self._runtime.cancel(c.request.request_id)

    async def deltas(self) -> AsyncIterator[ChoiceDelta]:
        """Deltas of all choices, interleaved as the model produces them.

        Raises the model's FlareError if any choice fails (after cancelling
        the others)."""
        remaining = len(self._choices)
        while remaining:
            index, event = await self._queue.get()
            if index in self._held and not isinstance(event, ErrorEvent):
                self._release(index)  # its prefill is done (or it ended): the prompt is cached for the others
            choice = self._choices[index]
            if isinstance(event, TokenEvent):
                if self._observers is not None:
                    self._observers[index].token()
                delta = self._on_tokens(index, choice, event)
            elif isinstance(event, FinishEvent):
                if self._observers is not None:
                    self._observers[index].finish(event.num_prompt_tokens, event.num_generated_tokens,
                                                  event.queue_ns)
                delta = self._on_finish(index, choice, event)
            elif isinstance(event, ErrorEvent):
                self.cancel()
                raise event.error
            else:  # pragma: no cover - the event types are closed
                raise TypeError(f"unexpected event {event!r}")
            if choice.done:
                remaining -= 1
            if delta is not None:
                yield delta

    def _on_tokens(self, index: int, choice: _Choice, event: TokenEvent) -> ChoiceDelta | None:
        if choice.finish_reason is not None:
            return None  # tokens in flight when a stop string matched
        text_parts: list[str] = []
        covered: list[int] = []
        logprobs: list[TokenLogprob] = []
        min_tokens = choice.request.params.min_tokens
        for k, token in enumerate(event.token_ids):
            covered.append(token)
            choice.usage.num_generated_tokens += 1
            if token in choice.request.stop_token_ids:
                # The model thread ends the request on this token itself.
                choice.finish_reason = "stop"
                if self._include_stop_str:  # its text (none for a skipped special token) stays
                    text_parts.append(choice.detok.push(token).text)
                break
            d = choice.detok.push(token, match_stops=choice.usage.num_generated_tokens >= min_tokens)
            text_parts.append(d.text)
            if event.logprobs is not None:
                logprobs.append(event.logprobs[k])
            if d.stopped:
                choice.finish_reason = "stop"
                choice.final_sent = True
                self._runtime.cancel(choice.request.request_id)
                break
        return ChoiceDelta(index, "".join(text_parts), covered, logprobs,
                           choice.finish_reason if choice.final_sent else None)

    def _on_finish(self, index: int, choice: _Choice, event: FinishEvent) -> ChoiceDelta | None:
        choice.done = True
        choice.usage.num_cached_tokens = event.num_cached_tokens
        choice.usage.num_drafted = event.num_drafted
        choice.usage.num_accepted_drafts = event.num_accepted_drafts
        if choice.final_sent:
            return None
        tail = choice.detok.finish()
        if choice.finish_reason is None:
            choice.finish_reason = "stop" if (tail.stopped or event.reason == "stop") else "length"
        choice.final_sent = True
        return ChoiceDelta(index, tail.text, [], [], choice.finish_reason)

    async def collect(self) -> list[tuple[str, list[int], list[TokenLogprob], str]]:
        """Run to the end; per choice (text, token ids, logprobs, finish reason).

        A cancelled generation still ends: the model thread sends every
        request a terminal event."""
        texts: list[list[str]] = [[] for _ in self._choices]
        ids: list[list[int]] = [[] for _ in self._choices]
        lps: list[list[TokenLogprob]] = [[] for _ in self._choices]
        finish = [""] * len(self._choices)
        async for d in self.deltas():
            texts[d.index].append(d.text)
            ids[d.index].extend(d.token_ids)
            lps[d.index].extend(d.logprobs)
            if d.finish_reason is not None:
                finish[d.index] = d.finish_reason
        return [("".join(texts[i]), ids[i], lps[i], finish[i]) for i in range(len(self._choices))]
