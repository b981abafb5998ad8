"""``ModelRunner``: offline continuous batching over the public pieces.

``generate`` is a thin loop over ``ForwardBatch.build`` -> ``DecoderModel.forward``
-> ``Sampler.sample``, with pages from ``PageAllocator``. The daemon's model
thread drives the same pieces itself with the scheduler's plans; this loop is
the reference driver (tests, benchmarks, ``flarectl generate``).

Rules of the loop:
- First come, first served. A waiting sequence is admitted when a batch row is
  free and the pool can reserve pages for its whole worst case (prompt +
  max_tokens); pages are then taken lazily as its context grows, so an
  admitted sequence never waits for pages and nothing is ever preempted.
- Every step runs all decoding sequences (one token each) plus prefill chunks
  up to ``prefill_chunk_tokens`` prompt tokens, in one forward.
- A sequence finishes on a stop token (kept as its last token, reason "stop")
  or at max_tokens (reason "length"); its pages and sampler slot are returned
  in the step it finishes.
- One host sync per step: reading the sampled ids (plus one more when a row
  asked for logprobs).
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field

import numpy as np
import torch

from flared._fast.pages import PageAllocator
from flared.errors import AdmissionError, ErrorKind
from flared.model.batch import ForwardBatch, SequenceChunk
from flared.model.config import ModelConfig
from flared.model.decoder import DecoderModel
from flared.model.sampling import Sampler, SamplingParams, SequenceSamplingState


@dataclass
class TokenLogprobs:
    token_id: int
    logprob: float  # of the chosen token, from the raw logits
    rank: int  # 1 = the most likely token
    top: list[tuple[int, float]]  # (token id, logprob), most likely first; len = params.logprobs


@dataclass
class GenerationTimings:
    prefill_s: float = 0.0  # wall time of the steps that ran this sequence's prompt
    decode_s: float = 0.0  # wall time of the steps that ran its decode tokens
    num_prompt_tokens: int = 0


@dataclass
class GenerationResult:
    token_ids: list[int]
    finish_reason: str  # "stop" | "length"
    logprobs: list[TokenLogprobs] | None
    timings: GenerationTimings


@dataclass
class _Sequence:
    index: int  # position in the caller's prompt list
    prompt: np.ndarray
    params: SamplingParams
    num_reserved_pages: int
    state: SequenceSamplingState | None = None
    page_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0  # tokens whose K/V are in the cache
    state_row: int = -1  # its row of the cache's recurrent state (a model with recurrent layers), while running
    output: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprobs] | None = None
    timings: GenerationTimings = field(default_factory=GenerationTimings)


class ModelRunner:
    def __init__(self, config: ModelConfig, tensors: dict[str, torch.Tensor], *, dtype: torch.dtype = torch.float32,
                 device: str | torch.device = "cpu", num_pages: int, page_tokens: int = 64, max_batch: int = 32,
                 prefill_chunk_tokens: int = 512, quantization: "str | QuantPlan | None" = None):
        """``quantization``: DecoderModel's (a format for every product, or a QuantPlan's for each)."""
        if max_batch < 1 or prefill_chunk_tokens < 1:
            raise ValueError("max_batch and prefill_chunk_tokens must be positive")
        self.config = config
        self.page_tokens = page_tokens
        self.max_batch = max_batch
        self.prefill_chunk_tokens = prefill_chunk_tokens
        self.num_pages = num_pages
        self.max_context_tokens = min(num_pages * page_tokens, config.max_position_embeddings)
        self.model = DecoderModel(config, tensors, dtype=dtype, device=device, max_positions=self.max_context_tokens,
                                  quantization=quantization)
        self.kv = self.model.make_kv_cache(num_pages=num_pages, page_tokens=page_tokens, state_rows=max_batch)
        self._free_state_rows = list(range(max_batch))  # (a running sequence holds one; at most max_batch run)
        self.allocator = PageAllocator(num_pages)
        self.sampler = Sampler(config.vocab_size, device=self.model.device, max_penalty_slots=max_batch)
        self._num_reserved_pages = 0

    def _pages_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.page_tokens)

    def generate(self, prompts: list[list[int]], params: list[SamplingParams], *,
                 stop_token_ids: set[int] | frozenset[int] = frozenset()) -> list[GenerationResult]:
        if len(prompts) != len(params):
            raise ValueError(f"{len(prompts)} prompts but {len(params)} sampling params")
        waiting: deque[_Sequence] = deque()
        for index, (prompt, p) in enumerate(zip(prompts, params)):
            prompt_ids = np.asarray(prompt, dtype=np.int64)
            if prompt_ids.ndim != 1 or prompt_ids.shape[0] == 0:
                raise AdmissionError(f"prompt {index} must be a non-empty list of token ids", ErrorKind.VALIDATION)
            if prompt_ids.min() < 0 or prompt_ids.max() >= self.config.vocab_size:
                raise AdmissionError(f"prompt {index} has a token id outside the vocabulary", ErrorKind.VALIDATION)
            # The last sampled token is never run through the model, so it needs no slot.
            total = prompt_ids.shape[0] + p.max_tokens - 1
            if total > self.max_context_tokens:
                raise AdmissionError(f"prompt {index}: {prompt_ids.shape[0]} prompt tokens + {p.max_tokens} max_tokens "
                                     f"exceed the context capacity of {self.max_context_tokens}", ErrorKind.CONTEXT_LENGTH)
            waiting.append(_Sequence(index, prompt_ids, p, self._pages_for(total)))
        results: list[GenerationResult | None] = [None] * len(prompts)
        running: list[_Sequence] = []
        try:
            while waiting or running:
                self._admit(waiting, running)
                finished = self.step(running, stop_token_ids)
                for seq in finished:
                    running.remove(seq)
                    results[seq.index] = GenerationResult(
                        token_ids=seq.output,
                        finish_reason="stop" if seq.output[-1] in stop_token_ids else "length",
                        logprobs=seq.logprobs, timings=seq.timings)
        finally:
            for seq in running:
                self._retire(seq)
        return results  # type: ignore[return-value]

    def _admit(self, waiting: deque[_Sequence], running: list[_Sequence]) -> None:
        while waiting and len(running) < self.max_batch:
            seq = waiting[0]
            if self._num_reserved_pages + seq.num_reserved_pages > self.num_pages:
                break
            waiting.popleft()
            self._num_reserved_pages += seq.num_reserved_pages
            seq.state = self.sampler.add_sequence(seq.params, seq.prompt)
            seq.state_row = self._free_state_rows.pop()
            if self.kv.states is not None:
                self.kv.states.reset([seq.state_row])
            seq.timings.num_prompt_tokens = int(seq.prompt.shape[0])
            if seq.params.logprobs is not None:
                seq.logprobs = []
            running.append(seq)

    def _retire(self, seq: _Sequence) -> None:
        if seq.page_ids:
            self.allocator.free(np.asarray(seq.page_ids, dtype=np.int32))
            seq.page_ids = []
        self._num_reserved_pages -= seq.num_reserved_pages
        seq.num_reserved_pages = 0
        if seq.state is not None:
            self.sampler.release(seq.state)
        if seq.state_row >= 0:
            self._free_state_rows.append(seq.state_row)
            seq.state_row = -1

    def step(self, running: list[_Sequence], stop_token_ids) -> list[_Sequence]:
        """One forward + sample over ``running``; returns the sequences that finished (already retired)."""
        started = time.perf_counter()
        chunks: list[SequenceChunk] = []
        scheduled: list[tuple[_Sequence, bool]] = []  # (sequence, is_prefill)
        prefill_budget = self.prefill_chunk_tokens
        for seq in running:
            num_prompt = seq.prompt.shape[0]
            if seq.num_computed_tokens < num_prompt:
                if prefill_budget == 0:
                    continue
                n = min(prefill_budget, num_prompt - seq.num_computed_tokens)
                prefill_budget -= n
                new_tokens = seq.prompt[seq.num_computed_tokens:seq.num_computed_tokens + n]
                needs_logits = seq.num_computed_tokens + n == num_prompt
                scheduled.append((seq, True))
            else:
                new_tokens = np.asarray(seq.output[-1:], dtype=np.int64)
                needs_logits = True
                scheduled.append((seq, False))
            context_len = seq.num_computed_tokens + new_tokens.shape[0]
            missing_pages = self._pages_for(context_len) - len(seq.page_ids)
            if missing_pages > 0:
                seq.page_ids.extend(self.allocator.allocate(missing_pages).tolist())
            chunks.append(SequenceChunk(new_tokens, seq.num_computed_tokens, seq.page_ids, needs_logits,
                                        state_row=seq.state_row))
        batch = ForwardBatch.build(chunks, page_tokens=self.page_tokens, device=self.model.device,
                                   sliding_window=self.config.sliding_window)
        logits = self.model.forward(batch, self.kv)
        sampling = [seq for (seq, _), chunk in zip(scheduled, chunks) if chunk.needs_logits]
        for (seq, _), chunk in zip(scheduled, chunks):
            seq.num_computed_tokens += len(chunk.token_ids)
        finished: list[_Sequence] = []
        if sampling:
            out = self.sampler.sample(logits, [seq.state for seq in sampling])
            token_ids = out.token_ids.tolist()  # SYNC: the step's one read-back
            logprob_rows = None
            if out.chosen_logprobs is not None:
                # SYNC: only when a row asked for logprobs
                logprob_rows = (out.chosen_logprobs.tolist(), out.chosen_ranks.tolist(),
                                out.top_logprobs.tolist() if out.top_logprobs is not None else None,
                                out.top_token_ids.tolist() if out.top_token_ids is not None else None)
            for row, (seq, token) in enumerate(zip(sampling, token_ids)):
                seq.output.append(token)
                if seq.logprobs is not None and logprob_rows is not None:
                    chosen, ranks, top_values, top_ids = logprob_rows
                    n = seq.params.logprobs
                    top = list(zip(top_ids[row][:n], top_values[row][:n])) if n else []
                    seq.logprobs.append(TokenLogprobs(token, chosen[row], ranks[row], top))
                if token in stop_token_ids or len(seq.output) >= seq.params.max_tokens:
                    finished.append(seq)
        elapsed = time.perf_counter() - started
        for seq, is_prefill in scheduled:
            if is_prefill:
                seq.timings.prefill_s += elapsed
            else:
                seq.timings.decode_s += elapsed
        for seq in finished:
            self._retire(seq)
        return finished
