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

On a GPU the forwards run as captured CUDA graphs (``DraftGraphs``): eager launches of a small model's layers cost
more than its arithmetic, and a draft model is only worth running where its forward is cheap beside the served
model's step. There every depth of a proposal is launched behind the last, each row taking the token its request
drew at the depth before on the device, and the tokens are read back once; a request whose draft stops early (a
p_min miss) is cut after the read-back, its later rows having written only past what it keeps.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

import numpy as np
import torch

from flared.execution.graphs import ExecutionManifest, GraphSet, pack_decode, pack_prefill
from flared.model.batch import ForwardBatch, SequenceChunk
from flared.model.kernels import GREEDY
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
                 p_min: float = 0.0, catch_up_tokens: int = CATCH_UP_TOKENS, graphs: bool | None = None,
                 max_rows: int = 64, max_depth: int = 8):
        """``model``: the draft's DecoderModel (attention layers only: its KV cache takes back a rejected draft by
        writing over it). ``num_pages`` of ``page_tokens``: its KV pool. ``max_context``: the longest sequence it
        drafts for. ``vocab_limit``: the served model's vocabulary size (a draft's logits past it are never
        drafted). ``graphs``: run the forwards as CUDA graphs (DraftGraphs; None: on a CUDA device), for up to
        ``max_rows`` requests a proposal and ``max_depth`` drafts a request."""
        if model.config.linear_layers:
            raise ValueError("a draft model with recurrent layers cannot take back a rejected draft")
        if num_pages < 2:
            raise ValueError("the draft model's KV pool needs at least 2 pages")
        self.model = model
        self.page_tokens = page_tokens
        if graphs is None:
            graphs = model.device.type == "cuda"
        self.max_context = min(max_context, model.max_positions)
        self.graphs = None
        self.kv = None
        if graphs:
            self.graphs = DraftGraphs(model, num_pages=num_pages, page_tokens=page_tokens, max_rows=max_rows,
                                      max_context=self.max_context, max_depth=max_depth,
                                      catch_up_tokens=catch_up_tokens)
        else:
            self.kv = model.make_kv_cache(num_pages=num_pages, page_tokens=page_tokens)
        self.num_pages = num_pages
        self._free = list(range(num_pages - 1, 0, -1))  # page 0 stays out: padding slots point at it
        self._drafts: dict[int, _Draft] = {}
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
        return self.graphs.decoder.kv_bytes if self.graphs is not None else self.kv.num_bytes

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
        if self.graphs is not None:  # the graphs themselves, on padding inputs
            self.cost = RowCost()
            for _ in range(repeats):
                for n in sorted({1, rows}):
                    self.cost.observe(n, self.graphs.time_decode(n))
            return
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
        chunks, owners = [], []  # owners: (request index, its cap; 0: a catch-up that drafts nothing yet)
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
            owners.append((i, cap if wants else 0))
            self.counters["caught_up"] += end - kept - 1 if wants else end - kept
            if not wants:
                d.fed = seq[:end].copy()
        if not chunks:
            return [()] * n, 0
        if self.graphs is not None:
            return self._propose_graphs(handles, drafts, chunks, owners)
        depth = 0
        picked = self._forward(chunks)
        live = []  # (request index, its cap) still drafting
        row = 0
        for (i, cap), chunk in zip(owners, chunks):
            if not cap:
                continue
            d = self._drafts[handles[i]]
            d.fed = np.concatenate([d.fed, chunk.token_ids])
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

    def _propose_graphs(self, handles, drafts, chunks, owners):
        """propose's drafting through DraftGraphs: every depth launched at once, the tokens read back once."""
        caps = [cap for _, cap in owners]
        started = time.perf_counter_ns()
        got, forwards = self.graphs.run(chunks, caps, self.vocab_limit, self.p_min)
        elapsed = time.perf_counter_ns() - started
        self.counters["forwards"] += forwards
        live = sum(1 for cap in caps if cap)
        if live and all(len(c.token_ids) <= SHORT_FEED for c in chunks):  # (a prefill's catch-up would skew the fit)
            self.cost.observe(live, elapsed / forwards)
        for (i, cap), chunk, tokens in zip(owners, chunks, got):
            if not cap:
                continue
            d = self._drafts[handles[i]]
            # fed: the step's tokens, then each draft but the last (a draft past one cut by p_min, though drafted
            # and written, is not kept: the next proposal writes over it)
            d.fed = np.concatenate([d.fed, chunk.token_ids, np.asarray(tokens[:-1], dtype=np.int64)])
            drafts[i] = tokens
        self.counters["drafted"] += sum(len(x) for x in drafts)
        return [tuple(x) for x in drafts], forwards if any(drafts) else 0

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


# A first forward whose every request feeds at most this many tokens runs as a decode graph (a row a token: a
# speculative one where a request feeds more than one); a longer catch-up (a new prompt) takes a prefill graph.
SHORT_FEED = 4


@dataclass
class _Rows:
    """Rows of a draft forward as graphs.pack_decode and pack_prefill read a scheduler plan."""
    num_participants: int
    token_starts: np.ndarray  # each participant's first position
    token_offsets: np.ndarray  # its first row
    token_ids: np.ndarray  # -1: what its state row drew last, read on the device
    state_rows: np.ndarray
    num_tokens: np.ndarray | None = None  # its rows (a prefill's)

    @classmethod
    def decode(cls, positions, tokens, state_rows) -> _Rows:
        """A token a row."""
        n = len(positions)
        return cls(num_participants=n, token_starts=np.asarray(positions, dtype=np.int64),
                   token_offsets=np.arange(n + 1), token_ids=np.asarray(tokens, dtype=np.int64),
                   state_rows=np.asarray(state_rows, dtype=np.int64))


class DraftGraphs:
    """The draft model's forwards on a GPU as captured CUDA graphs (flared.execution.graphs.GraphSet, greedy only):
    a proposal's first forward as a decode graph (a token a request) or a speculative decode graph (each request's
    few unseen tokens a row each; every row's K/V written before any row attends) or, with a long catch-up, a
    prefill graph; then each further depth as a decode graph whose rows take the token their request drew at the
    depth before on the device (token id -1), so every depth is launched behind the last with no host round trip,
    and one read-back at the end gives every depth's tokens. A depth's rows are the requests whose cap reaches it,
    so the pool is written only where their pages reach. The inputs are packed as the executor packs a plan's
    (graphs.pack_decode, pack_prefill)."""

    def __init__(self, model, *, num_pages: int, page_tokens: int, max_rows: int, max_context: int, max_depth: int,
                 catch_up_tokens: int):
        self.page_tokens = page_tokens
        self.max_rows = max_rows
        self.max_depth = max(1, max_depth)
        pow2 = [1]
        while pow2[-1] < max_rows:
            pow2.append(pow2[-1] * 2)
        spec = [2]
        while spec[-1] < max_rows * SHORT_FEED:
            spec.append(spec[-1] * 2)
        self.spec_max = spec[-1]
        # a catch-up feeds at most catch_up_tokens over the cohort, plus a token for each request past the budget
        self.prefill_tokens = -(-(catch_up_tokens + max_rows) // 64) * 64
        manifest = ExecutionManifest.build(
            decode_batch_sizes=sorted(set(pow2) | set(spec)), prefill_token_sizes=(self.prefill_tokens,),
            max_pages_per_sequence=-(-max_context // page_tokens) + 1,
            prefill_batch_shapes=[(b, self.prefill_tokens) for b in pow2 if b > 1])
        self.graphs = GraphSet(model, manifest, num_pages=num_pages, page_tokens=page_tokens,
                               num_state_rows=max(self.spec_max, max_rows) + 1, spec_batch_sizes=spec,
                               samplers=(GREEDY,))
        self.decoder = self.graphs.decoder
        self.stream = torch.cuda.Stream(device=model.device)
        self.graphs.capture(self.stream)
        self.manifest = manifest
        # pinned frames laid out as the device inputs: the first forward's and one a further depth (each is copied
        # while the launches before it run)
        frame = manifest.total_bytes
        self._frames = torch.zeros((self.max_depth, frame), dtype=torch.uint8, pin_memory=True)
        self._views = [manifest.host_views(self._frames[i].numpy()) for i in range(self.max_depth)]
        for v in self._views:
            self._sampler_defaults(v)
        dev = model.device
        self._tokens = torch.zeros((self.max_depth, max_rows), dtype=torch.int64, device=dev)
        self._probs = torch.zeros((self.max_depth, max_rows), dtype=torch.float32, device=dev)
        self._host_tokens = torch.zeros((self.max_depth, max_rows), dtype=torch.int64, pin_memory=True)
        self._host_probs = torch.zeros((self.max_depth, max_rows), dtype=torch.float32, pin_memory=True)
        first = manifest.span("token_ids")
        last = manifest.span("lora_ids")
        self._shared = (first.offset_bytes, last.offset_bytes + last.nbytes)

    def _sampler_defaults(self, v) -> None:
        """The sampler inputs of ``v`` (host views of one frame) left as a greedy draw reads them (the prefill graphs
        draw fully: temperature 0, no top-p, min-p or shaping); the rest every launch packs (pack_decode and
        pack_prefill pad the rows past the draft's)."""
        for p in ("", "decode_"):
            v[p + "top_p"][:] = 1.0
            v[p + "min_p_log"][:] = float("-inf")
            v[p + "shape_slot"][:] = -1

    def _upload(self, depth: int, lo: int, hi: int) -> None:
        self.graphs.input_buffer[lo:hi].copy_(self._frames[depth, lo:hi], non_blocking=True)

    def _launch(self, key) -> None:
        self.graphs.graphs[key].replay()

    def time_decode(self, rows: int, replays: int = 10) -> float:
        """ns a greedy decode graph of ``rows`` rows takes (all padding: context 0)."""
        key = self.graphs.pick_decode(rows, False, 0)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        with torch.cuda.stream(self.stream):
            self._pack_decode(0, _Rows.decode([], [], []), [], key[1])  # every row padding
            self._launch(key)
            start.record(self.stream)
            for _ in range(replays):
                self._launch(key)
            end.record(self.stream)
        end.synchronize()
        return start.elapsed_time(end) * 1e6 / replays

    def run(self, chunks, caps, vocab_limit: int, p_min: float):
        """Drafts for ``chunks`` (SequenceChunk, one a request): up to ``caps[i]`` tokens for chunk i (0: it only
        feeds; fewer where the draft model gives its argmax less than ``p_min`` or draws past ``vocab_limit``).
        Returns (drafts a chunk, forwards launched)."""
        n = len(chunks)
        sizes = [len(c.token_ids) for c in chunks]
        # the live requests, deepest cap first: a depth's rows are then a prefix of them
        live = sorted((i for i in range(n) if caps[i]), key=lambda i: -caps[i])
        with torch.cuda.stream(self.stream):
            if max(sizes) <= SHORT_FEED and sum(sizes) <= self.spec_max:  # a row a token, its own state row
                positions = [c.num_cached_tokens + k for c in chunks for k in range(len(c.token_ids))]
                rows = _Rows.decode(positions, [t for c in chunks for t in c.token_ids],
                                    range(1, len(positions) + 1))
                tables = [c.page_ids for c, k in zip(chunks, sizes) for _ in range(k)]
                last = np.cumsum(sizes) - 1  # each request's logits row (its state row is that + 1)
                if len(positions) == n:  # a token each: a plain decode graph (the megakernel's, where it serves)
                    key = self.graphs.pick_decode(n, False, max(positions) + 1)
                else:
                    key = self.graphs.pick_speculative(len(positions), False)
                self._pack_decode(0, rows, tables, key[1])
            else:
                key = self.graphs.pick("prefill", sum(sizes), batch=n)
                rows = _Rows(num_participants=n, token_starts=[c.num_cached_tokens for c in chunks],
                             num_tokens=sizes, token_offsets=np.concatenate([[0], np.cumsum(sizes)]),
                             token_ids=np.concatenate([np.asarray(c.token_ids, dtype=np.int64) for c in chunks]),
                             state_rows=np.arange(1, n + 1))
                pack_prefill(self._views[0], rows, [c.page_ids for c in chunks], page_tokens=self.page_tokens,
                             scratch_slot=self.decoder.scratch_slot, batch_capacity=key[1], token_capacity=key[2])
                last = np.arange(n)
                self._upload(0, *self._shared)
            self._launch(key)
            m = len(live)
            states = [int(last[i]) + 1 for i in live]
            forwards = 1
            if m:
                idx = torch.as_tensor(last[live], dtype=torch.int64).to(self.decoder.device)
                self._record(0, m, self.decoder.sampled.index_select(0, idx),
                             self.decoder.logits.index_select(0, idx), vocab_limit, p_min)
            fed = [chunks[i].num_cached_tokens + sizes[i] for i in live]
            for depth in range(1, min(caps[live[0]] if live else 0, self.max_depth)):
                rows_now = sum(1 for i in live if caps[i] > depth)  # a prefix of live
                positions = [fed[r] + depth - 1 for r in range(rows_now)]  # where the token drawn before goes
                key = self.graphs.pick_decode(rows_now, False, max(positions) + 1)
                self._pack_decode(depth, _Rows.decode(positions, [-1] * rows_now, states[:rows_now]),
                                  [chunks[i].page_ids for i in live[:rows_now]], key[1])
                self._launch(key)
                self._record(depth, rows_now, self.decoder.sampled[:rows_now], self.decoder.logits[:rows_now],
                             vocab_limit, p_min)
                forwards += 1
            self._host_tokens[:forwards, :m].copy_(self._tokens[:forwards, :m], non_blocking=True)
            self._host_probs[:forwards, :m].copy_(self._probs[:forwards, :m], non_blocking=True)
            done = torch.cuda.Event()
            done.record(self.stream)
        done.synchronize()
        tokens = self._host_tokens[:forwards, :m].tolist()
        probs = self._host_probs[:forwards, :m].tolist()
        drafts = [[] for _ in range(n)]
        for r, i in enumerate(live):
            for depth in range(min(caps[i], forwards)):
                t = tokens[depth][r]
                if t >= vocab_limit or (p_min > 0 and probs[depth][r] < p_min):
                    break
                drafts[i].append(t)
        return drafts, forwards

    def _pack_decode(self, frame: int, rows, tables, capacity: int) -> None:
        """``rows`` (a decode row each) into frame ``frame``'s decode spans, padded to ``capacity``, and copied to the
        device behind the launches before."""
        pack_decode(self._views[frame], rows, tables, page_tokens=self.page_tokens,
                    scratch_slot=self.decoder.scratch_slot, capacity=capacity)
        lo, nb = self.manifest.decode_upload(capacity)
        self._upload(frame, lo, lo + nb)

    def _record(self, depth: int, m: int, tokens, logits, vocab_limit: int, p_min: float) -> None:
        """The depth's tokens for the m live rows (what the graph drew: the argmax of ``logits`` [m, V]) and, with
        ``p_min``, their probabilities over the served vocabulary, on the device."""
        self._tokens[depth, :m].copy_(tokens)
        if p_min > 0:
            probs = torch.softmax(logits[:, :vocab_limit], dim=-1)
            self._probs[depth, :m].copy_(probs.gather(1, tokens.clamp(max=vocab_limit - 1)[:, None])[:, 0])
