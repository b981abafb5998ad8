"""Speculative decoding's learned proposals: a draft model that shares the served model's vocabulary continues each
speculating request greedily, and the served model verifies what it drafted.

The scheduler asks for drafts where prompt lookup would look them up (SchedulerConfig.drafter): when it plans a
speculative step, each speculating request of the cohort hands over its tokens so far (prompt, outputs, and the
token the step feeds) and its draft cap. ``DraftModel.propose`` feeds the draft model what it has not seen of each
sequence, in one batched forward, then drafts one depth a forward: the argmax of the draft's logits, fed back for
the next depth. The step verifies those drafts exactly as it verifies prompt lookup's (a row per fed token, each
draft kept while it equals the token the served model draws at its position), so the output is plain decoding's,
whatever the draft model says; a better draft model only keeps more of them.

The draft keeps its own paged KV cache. A request's pages hold the tokens it has fed the draft model (``_Draft``).
At each proposal the request's tokens are compared with those: the common prefix stays, the rest (outputs since
the last proposal, and after a rejection the tokens past the last kept draft) is fed again over the old slots.
When the pool runs short, the requests drafted for least recently give their pages back (the scheduler releases a
retired request's at once: ``release``). A request's catch-up is bounded (``catch_up_tokens`` a proposal in all):
a long new prompt goes in over several steps, without drafts until it is in, rather than holding up one step.

``p_min`` is llama.cpp's --draft-p-min: a request's drafting stops at the first depth whose argmax the draft model
gives less than this probability (that token is not offered), where a rejection is likely.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

import numpy as np
import torch

from flared.model.batch import ForwardBatch, SequenceChunk
from flared.scheduler import RowCost

log = logging.getLogger("flared.drafter")

# Tokens a proposal feeds the draft model to catch requests up (new prompts, mostly), over its whole cohort.
CATCH_UP_TOKENS = 512


@dataclass
class _Draft:
    fed: np.ndarray = field(default_factory=lambda: np.empty(0, np.int64))  # tokens whose K/V the pages hold
    pages: list[int] = field(default_factory=list)
    used: int = 0  # the proposal that last drafted for it (least recent gives its pages back first)


class DraftModel:
    def __init__(self, model, *, num_pages: int, page_tokens: int, max_context: int, vocab_limit: int,
                 p_min: float = 0.0, catch_up_tokens: int = CATCH_UP_TOKENS):
        """``model``: the draft's DecoderModel (attention layers only: its KV cache takes back a rejected draft by
        writing over it). ``num_pages`` of ``page_tokens``: its KV pool. ``max_context``: the longest sequence it
        drafts for. ``vocab_limit``: the served model's vocabulary size (a draft's logits past it are never
        drafted)."""
        if model.config.linear_layers:
            raise ValueError("a draft model with recurrent layers cannot take back a rejected draft")
        if num_pages < 2:
            raise ValueError("the draft model's KV pool needs at least 2 pages")
        self.model = model
        self.page_tokens = page_tokens
        self.kv = model.make_kv_cache(num_pages=num_pages, page_tokens=page_tokens)
        self.num_pages = num_pages
        self._free = list(range(num_pages - 1, 0, -1))  # page 0 stays out: padding slots point at it
        self._drafts: dict[int, _Draft] = {}
        self.max_context = min(max_context, model.max_positions)
        self.vocab_limit = min(vocab_limit, model.config.vocab_size)
        self.p_min = p_min
        self.catch_up_tokens = catch_up_tokens
        self._tick = 0
        # What it did (tests, logs): forwards run, tokens fed to catch up, drafts proposed
        self.counters = {"forwards": 0, "caught_up": 0, "drafted": 0, "evicted": 0}
        # A forward's duration against its rows, one token each (the scheduler prices drafts with it before they
        # are drafted)
        self.cost = RowCost()

    @property
    def num_bytes(self) -> int:
        return self.kv.num_bytes

    def forward_cost(self) -> tuple[float, float] | None:
        """(a, b): ns a forward of decode rows, ns a row (``cost``'s fit; while the rows have not varied, a forward's
        mean time and 0 a row); None before the first such forward."""
        fit = self.cost.fit()
        if fit is None and self.cost.w > 0:
            return self.cost.y / self.cost.w, 0.0
        return fit

    @torch.inference_mode()
    def warm_up(self, rows: int, repeats: int = 3) -> None:
        """Time forwards of one and of ``rows`` decode rows (on scratch pages, given back) so that
        ``forward_cost`` knows what drafting costs before the first request: the scheduler then prices a draft
        model's first drafts too, instead of drafting blindly until the step fit forms."""
        rows = max(1, min(rows, len(self._free)))
        pages = [self._free.pop() for _ in range(rows)]
        try:
            chunks = [SequenceChunk([0], 0, [page]) for page in pages]
            self._forward(chunks[:1])  # (a first forward pays for what torch sets up once)
            self.cost = RowCost()
            for _ in range(repeats):
                for n in sorted({1, rows}):
                    self._forward(chunks[:n])
            self.counters["forwards"] = 0
        finally:
            self._free.extend(reversed(pages))

    def release(self, handle: int) -> None:
        """The request ``handle`` is gone: its pages go back to the pool."""
        d = self._drafts.pop(handle, None)
        if d is not None:
            self._free.extend(d.pages)

    @torch.inference_mode()
    def propose(self, handles, sequences, caps) -> tuple[list[tuple[int, ...]], int]:
        """Drafts for each request: ``handles[i]``, its tokens ``sequences[i]`` (prompt, outputs and the token the
        step feeds) and its cap ``caps[i]`` (0: none). Returns (drafts, depth): a tuple of token ids a request, and
        how many drafting forwards ran (the deepest draft; the reference's drafter steps)."""
        self._tick += 1
        n = len(handles)
        drafts: list[list[int]] = [[] for _ in range(n)]
        P = self.page_tokens
        budget = self.catch_up_tokens
        chunks, owners, ends = [], [], []
        for i in range(n):
            seq = np.asarray(sequences[i], dtype=np.int64)
            L = seq.shape[0]
            cap = min(int(caps[i]), self.max_context - L)
            if cap <= 0 or L == 0:
                continue
            d = self._drafts.get(handles[i])
            if d is None:
                d = self._drafts[handles[i]] = _Draft()
            d.used = self._tick
            m = min(d.fed.shape[0], L - 1)  # the step's token is always fed: its logits give the first draft
            differ = np.flatnonzero(d.fed[:m] != seq[:m])
            kept = int(differ[0]) if differ.size else m
            d.fed = d.fed[:kept]
            feed = L - kept
            if feed > 1 and feed > budget:  # a long catch-up: part of it now, drafts once it is in
                if budget <= 0:
                    continue
                end, wants = kept + budget, False
            else:
                end, wants = L, True
            if not self._reserve(d, (end + (cap - 1 if wants else 0) + P - 1) // P, handles):
                continue
            budget -= end - kept
            chunks.append(SequenceChunk(seq[kept:end], kept, d.pages, needs_logits=wants))
            owners.append((i, wants))
            ends.append(seq[kept:end])
            self.counters["caught_up"] += end - kept - 1 if wants else end - kept
            if not wants:
                d.fed = seq[:end].copy()
        if not chunks:
            return [()] * n, 0
        depth = 0
        picked = self._forward(chunks)
        live = []  # (request index, its cap) still drafting
        row = 0
        for (i, wants), fed in zip(owners, ends):
            if not wants:
                continue
            d = self._drafts[handles[i]]
            d.fed = np.concatenate([d.fed, fed])
            cap = min(int(caps[i]), self.max_context - d.fed.shape[0])
            token = picked[row]
            row += 1
            if token is not None:
                drafts[i].append(token)
                if cap > 1:
                    live.append((i, cap))
        if any(drafts):
            depth = 1
        while live:
            chunks = []
            for i, _ in live:
                d = self._drafts[handles[i]]
                chunks.append(SequenceChunk([drafts[i][-1]], d.fed.shape[0], d.pages))
                d.fed = np.append(d.fed, drafts[i][-1])
            picked = self._forward(chunks)
            depth += 1
            rest = []
            for (i, cap), token in zip(live, picked):
                if token is not None:
                    drafts[i].append(token)
                    if len(drafts[i]) < cap:
                        rest.append((i, cap))
            live = rest
        self.counters["drafted"] += sum(len(x) for x in drafts)
        return [tuple(x) for x in drafts], depth

    def _forward(self, chunks) -> list[int | None]:
        """The draft at each chunk's last position that asks for logits: the argmax of the draft model's logits
        over the served vocabulary, or None where it gives that token less than p_min."""
        batch = ForwardBatch.build(chunks, page_tokens=self.page_tokens, device=self.model.device,
                                   sliding_window=self.model.config.sliding_window)
        self.counters["forwards"] += 1
        started = time.perf_counter_ns()
        logits = self.model.forward(batch, self.kv)[:, :self.vocab_limit].float()
        tokens = logits.argmax(dim=-1)
        if self.p_min > 0:
            probs = torch.softmax(logits, dim=-1).gather(1, tokens[:, None])[:, 0]
            picked = [t if p >= self.p_min else None for t, p in zip(tokens.tolist(), probs.tolist())]
        else:
            picked = tokens.tolist()  # (the read-back waits for the forward: its time is whole)
        if batch.num_tokens == len(chunks):  # (a catch-up's prefill rows would skew a fit of decode rows)
            self.cost.observe(batch.num_tokens, time.perf_counter_ns() - started)
        return picked

    def _reserve(self, d: _Draft, pages: int, handles) -> bool:
        """Pages for ``d`` to hold ``pages`` pages' tokens; the least recently drafted requests outside this proposal
        give theirs back where the pool is short. False: no room (it drafts nothing this time)."""
        need = pages - len(d.pages)
        if need <= 0:
            return True
        if need > len(self._free):
            busy = set(handles)
            for h, other in sorted(self._drafts.items(), key=lambda kv: kv[1].used):
                if len(self._free) >= need:
                    break
                if h in busy or other is d:
                    continue
                self.release(h)
                self.counters["evicted"] += 1
        if need > len(self._free):
            return False
        d.pages.extend(self._free.pop() for _ in range(need))
        return True
