"""The eager executor: runs a ScheduledPlan with torch, synchronously, on the model's device: the CPU, or a GPU for
the models the CUDA graphs' kernels do not run (Gemma 3, mixtures of experts).

It owns the device state the scheduler's logical ids refer to:
- the paged KV cache (page ids are the scheduler's page ids);
- per state row (slot + 1; row 0 is padding) the logits of the row's last
  computed position, so a snapshot can later resume sampling from it;
- per snapshot id a copy of one partial KV page and of those logits;
- for a model with recurrent layers (Qwen3-Next, Qwen3.5, LFM2, Granite 4.0-H), the recurrent
  state of every state row and snapshot (flared.model.recurrent): state row r
  is recurrent row r, snapshot s recurrent row num_state_rows + s.

Plan kinds on this backend:
- PREFILL / DECODE: one forward over every participant's tokens (a token id
  of -1 means "the token this row sampled last": the CPU never has a decode
  in flight when it plans, but the contract allows it). Sampled rows draw
  with the request's sampler state. Every participant's last-position logits
  are kept in its state row.
- SNAPSHOT: state row logits (and recurrent state) -> snapshot; partial page -> snapshot page.
- RESTORE: snapshot -> state row; snapshot page -> the request's page.
- RESUME_SAMPLING: sample from the state row's logits (a full prompt hit).
- INITIALIZE: a fresh request's recurrent state zeroed (the scheduler plans it
  for models with recurrent layers: SchedulerConfig.initialize_state).
- SCORED_PREFILL: a PREFILL that also scores every fed token (position >= 1).

A recurrent model's state row must hold the state after exactly the tokens a
request's KV pages hold, so its requests never feed drafts (``speculates``:
rejected drafts would have advanced the state past the kept tokens).

Scoring (``score_from[i]`` set, or a SCORED_PREFILL plan): participant i also
gets log P(token[p] | tokens[:p]) for each token p >= score_from it feeds. The
forward returns logits at every position of that participant's chunk; the
token at the chunk's first position is scored from the state row's logits,
which hold the position before it (the previous chunk's last position, or
the snapshot a prefix hit restored), so a prompt taken from the prefix cache
is never recomputed to score its continuation.

``run`` returns the scheduler's CompletionRecords, the measured duration,
per-participant log-probabilities for rows that asked for them, and
per-participant scores (None for rows that do not score).
"""

from __future__ import annotations

import time

import numpy as np
import torch

from flared.errors import ErrorKind, ExecutionError
from flared.execution.images import place_images
from flared.model.batch import ForwardBatch, SequenceChunk
from flared.model.kv_cache import kv_pool_dtype
from flared.model.sampling import Sampler, SequenceSamplingState
from flared.runtime.request import TokenLogprob
from flared.scheduler import CompletionRecords, GraphKind, plan_records, scored_participants


class EagerExecutor:
    def __init__(self, model, *, num_pages: int, page_tokens: int, num_state_rows: int, num_snapshots: int,
                 vocab_size: int, max_live: int, kv_cache_dtype: str = "auto"):
        """``kv_cache_dtype``: "auto" (the model's dtype) or "fp8" / "fp8_e4m3": the pool and the snapshots in float8
        e4m3 (PagedKVCache's storage_dtype), which the Cython decode attention (and a bf16 model's one-call decode
        step) reads in place."""
        self.model = model
        self.page_tokens = page_tokens
        self.kv = model.make_kv_cache(num_pages=num_pages, page_tokens=page_tokens,
                                      storage_dtype=kv_pool_dtype(kv_cache_dtype, model.dtype),
                                      state_rows=num_state_rows + num_snapshots)
        self.num_state_rows = num_state_rows
        # Rows = slots + 1 (row 0 pads). float32: sampling reads these directly.
        # On the model's device (a GPU for models the CUDA graphs do not run): the logits never leave it.
        self.device = model.device
        self.state_logits = torch.zeros(num_state_rows, vocab_size, dtype=torch.float32, device=self.device)
        self.state_last_token = np.full(num_state_rows, -1, dtype=np.int64)
        # A snapshot page holds what kv.gather returns for one page's slots, per layer, at the pool's precision
        # (a float8 pool's values widen and narrow back exactly).
        page_shape = (self.kv.keys.shape[1], page_tokens, self.kv.keys.shape[3])  # (a Mamba model's: no layers)
        kv_shape = (num_snapshots, self.kv.num_layers, *page_shape)
        self.snap_keys = torch.zeros(kv_shape, dtype=self.kv.storage_dtype, device=self.device)
        # (none where the cache keeps no value rows: latent attention served absorbed)
        value_shape = (num_snapshots, self.kv.num_layers, self.kv.values.shape[1], *page_shape[1:])
        self.snap_values = torch.zeros(value_shape, dtype=self.kv.storage_dtype, device=self.device)
        self.snap_logits = torch.zeros(num_snapshots, vocab_size, dtype=torch.float32, device=self.device)
        self.sampler = Sampler(vocab_size, device=model.device, max_penalty_slots=max_live)

    @property
    def num_bytes(self) -> int:
        return self.kv_cache[1] + 4 * (self.state_logits.numel() + self.snap_logits.numel()) + self.recurrent_bytes

    @property
    def recurrent_bytes(self) -> int:
        """The recurrent state's bytes (state rows and snapshots; 0 for an attention-only model)."""
        return 0 if self.kv.states is None else self.kv.states.num_bytes

    @property
    def kv_cache(self) -> tuple[str, int]:
        """(element type, bytes) of the KV cache: the pool and the prefix cache's K/V snapshots."""
        return (str(self.kv.storage_dtype).removeprefix("torch."),
                self.kv.num_bytes + (self.snap_keys.numel() + self.snap_values.numel()) * self.snap_keys.element_size())

    # -- plan execution --------------------------------------------------------------------------

    @torch.inference_mode()
    def run(self, plan, block_tables: list[np.ndarray], states: list[SequenceSamplingState | None],
            score_from: list[int | None] | None = None):
        """Execute ``plan``. ``block_tables[i]`` / ``states[i]`` / ``score_from[i]``:
        participant i's whole block table, sampler state and first scored position.
        Returns (records, duration_ns, logprobs, scores); ``logprobs[i]``: participant i's TokenLogprob, None, or
        (a speculative step's participant with drafts) a tuple of them, one a token it emits: its kept drafts',
        then its own."""
        started = time.perf_counter_ns()
        n = plan.num_participants
        kind = plan.kind
        sampled = np.full(n, -1, dtype=np.int64)
        snapshot_ns = 0
        logprobs: list[TokenLogprob | tuple[TokenLogprob, ...] | None] = [None] * n
        rows = np.asarray(plan.state_rows, dtype=np.int64)
        scores: list[list[float] | None] = [None] * n
        if kind in (GraphKind.PREFILL, GraphKind.DECODE, GraphKind.SCORED_PREFILL):
            self._forward(plan, block_tables, states, rows, sampled, logprobs,
                          scored_participants(plan, score_from), scores)
            if len(plan.copies):  # checkpoints at the chunks' ends, copied after the forward
                copy_started = time.perf_counter_ns()
                self._copy(plan.copies, to_snapshot=True)
                snapshot_ns = time.perf_counter_ns() - copy_started
        elif kind == GraphKind.SPECULATIVE:
            records = self._speculate(plan, block_tables, states, rows, sampled, logprobs)
            return records, time.perf_counter_ns() - started, logprobs, scores
        elif kind == GraphKind.RESUME_SAMPLING:
            sample_idx = [i for i in range(n) if plan.sample[i]]
            if sample_idx:
                logits = self.state_logits.index_select(0, self._index(rows[sample_idx]))
                self._sample(logits, sample_idx, rows, states, sampled, logprobs)
        elif kind == GraphKind.SNAPSHOT:
            self._copy(plan.copies, to_snapshot=True)
        elif kind == GraphKind.RESTORE:
            self._copy(plan.copies, to_snapshot=False)
        elif kind == GraphKind.INITIALIZE:
            self.state_last_token[rows] = -1
            if self.kv.states is not None:
                self.kv.states.reset(rows)
        else:
            raise ExecutionError(f"the eager executor cannot run {plan.kind_name} steps", ErrorKind.UNSUPPORTED)
        return plan_records(plan, sampled, snapshot_ns), time.perf_counter_ns() - started, logprobs, scores

    def _forward(self, plan, block_tables, states, rows, sampled, logprobs, scoring, scores) -> None:
        """``scoring``: (participant, first position it scores), as scored_participants gives them."""
        n = plan.num_participants
        chunks = [SequenceChunk(self._fed_tokens(plan, i, rows), int(plan.token_starts[i]), block_tables[i],
                                needs_logits=True, state_row=int(rows[i])) for i in range(n)]
        batch = ForwardBatch.build(chunks, page_tokens=self.page_tokens, device=self.model.device,
                                   sliding_window=self.model.config.sliding_window)
        bounds = np.cumsum([0] + [len(c.token_ids) for c in chunks])
        self._group_lora_rows(batch, states, bounds)
        self._place_images(batch, states, chunks, bounds)
        if not scoring:
            logits = self.model.forward(batch, self.kv)  # [n, vocab]: every participant's last position
        else:
            logits = self._forward_scoring(batch, chunks, plan, rows, scoring, scores)
        self.state_logits.index_copy_(0, self._index(rows), logits)
        sample_idx = [i for i in range(n) if plan.sample[i]]
        if sample_idx:
            self._sample(logits.index_select(0, self._index(sample_idx)), sample_idx, rows, states,
                         sampled, logprobs)

    def _index(self, values) -> torch.Tensor:
        """int64 indices on the model's device."""
        return torch.as_tensor(np.asarray(values, dtype=np.int64), device=self.device)

    def _fed_tokens(self, plan, i: int, rows) -> np.ndarray:
        """Participant i's tokens to feed: the plan's, a -1 (its state row's last sampled token, not yet known
        when the plan was made) replaced from ``state_last_token``."""
        tokens = np.asarray(plan.tokens(i), dtype=np.int64)
        if (tokens < 0).any():
            tokens = tokens.copy()
            tokens[tokens < 0] = self.state_last_token[rows[i]]
            if (tokens < 0).any():
                raise ExecutionError(f"plan {plan.plan_id}: participant {i} has no previous token to feed")
        return tokens

    def _place_images(self, batch, states, chunks, bounds) -> None:
        """Image rows: where participant i's chunk feeds positions of its request's image tokens, those rows take
        the request's image rows (VisionInput.features) in place of the tokens' embeddings. A request with 3D
        rope positions (Qwen VL) gives its rows theirs: the prompt's own, index + delta after it
        (flared.execution.images)."""
        if all(getattr(state, "vision", None) is None for state in states):
            return
        starts = [c.num_cached_tokens for c in chunks]
        counts = [len(c.token_ids) for c in chunks]
        positions = np.concatenate([np.arange(s, s + k) for s, k in zip(starts, counts)])
        placed = place_images(states, starts, counts, bounds, positions, hidden=self.model.config.hidden_size,
                              device=self.model.device)
        if placed is not None:
            placed.apply(batch)

    def _group_lora_rows(self, batch, states, bounds) -> None:
        """Per-request LoRA: each adapter's token rows into ``batch.lora_groups``; participant i owns the batch's
        rows bounds[i]..bounds[i + 1] (its rows are contiguous, in participant order)."""
        adapters = [s.lora if s is not None else 0 for s in states]
        for adapter in sorted(set(adapters) - {0}):
            token_rows = np.concatenate([np.arange(bounds[i], bounds[i + 1]) for i in range(len(adapters))
                                         if adapters[i] == adapter])
            batch.lora_groups.append((adapter, torch.as_tensor(token_rows, dtype=torch.int64,
                                                               device=self.model.device)))

    def _speculate(self, plan, block_tables, states, rows, sampled, logprobs) -> CompletionRecords:
        """A speculative step: participant i feeds its last token and its drafts (plan.tokens(i)[1:]), each token a
        decode row of its own at its position (ForwardBatch.shared_sequences: the rows of one request see each
        other's keys; the bf16 one-call decode step takes up to 64 rows). The drafts are kept while each equals
        the token drawn at the row before it (_draw_fed: the argmax, or the request's own draw at that position);
        the first drawn token that differs (or the one after the last draft) is the step's own token, so the
        tokens are those plain decoding draws. Participants without drafts sample as in a decode step. The state
        row keeps the logits of its last kept position, as after a decode step there."""
        n = plan.num_participants
        fed = [self._fed_tokens(plan, i, rows) for i in range(n)]
        chunks = [SequenceChunk(tokens[j:j + 1], int(plan.token_starts[i]) + j, block_tables[i], needs_logits=True)
                  for i, tokens in enumerate(fed) for j in range(tokens.shape[0])]
        batch = ForwardBatch.build(chunks, page_tokens=self.page_tokens, device=self.model.device,
                                   sliding_window=self.model.config.sliding_window)
        batch.shared_sequences = True
        # rows of requests with 3D rope positions (Qwen VL with images) take theirs: index + the prompt's delta
        self._place_images(batch, [states[i] for i, tokens in enumerate(fed) for _ in range(tokens.shape[0])],
                           chunks, np.arange(len(chunks) + 1))
        bounds = np.cumsum([0] + [t.shape[0] for t in fed])
        self._group_lora_rows(batch, states, bounds)
        logits = self.model.forward(batch, self.kv)  # [every fed token, vocab]
        drawn_rows, out, at, owners = self._draw_fed(logits, states, bounds, fed)
        drawn = drawn_rows.tolist()  # SYNC: the step's one read-back
        row_logprobs = {}  # the rows of requests that ask for log-probabilities
        if out is not None and out.chosen_logprobs is not None:
            row_logprobs = self._token_logprobs(out, drawn, at, [states[i] for i in owners])
        kept: list[tuple[int, ...]] = []
        last_rows = []
        plain = []
        for i in range(n):
            lo, hi = int(bounds[i]), int(bounds[i + 1])
            drafts = fed[i][1:]
            a = 0
            while a < len(drafts) and drawn[lo + a] == int(drafts[a]):
                a += 1
            kept.append(tuple(int(t) for t in drafts[:a]))
            last_rows.append(lo + a)
            if hi - lo == 1:
                plain.append(i)
                continue
            token = drawn[lo + a]
            sampled[i] = token
            self.state_last_token[rows[i]] = token
            if states[i] is not None:
                self.sampler.advance(states[i], drafts[:a].tolist() + [token])
                if states[i].params.logprobs is not None:  # one a token: the kept drafts', then its own
                    logprobs[i] = tuple(row_logprobs[r] for r in range(lo, lo + a + 1))
        last = logits.index_select(0, self._index(last_rows))
        self.state_logits.index_copy_(0, self._index(rows), last.float())
        if plain:
            self._sample(last.index_select(0, self._index(plain)), plain, rows, states, sampled, logprobs)
        starts = np.asarray(plan.token_starts, dtype=np.int64)
        accepted = np.asarray([len(k) for k in kept], dtype=np.int64)
        return CompletionRecords(handles=np.asarray(plan.handles, dtype=np.int64),
                                 consumed_tokens=starts + 1 + accepted,
                                 generated_tokens=np.asarray(plan.generated_ends, dtype=np.int64) + accepted,
                                 token_ids=sampled.copy(), accepted_drafts=kept)

    def speculates(self, params, grammar: bool = False) -> bool:
        """Whether a request with these sampling params (and a grammar, or not) may feed drafts: _speculate draws
        at every fed position through the sampler, with what the drafts before it change: penalty counts, history,
        a thinking budget, the grammar's mask (SamplingParams.replayable, Sampler.at_position). Never on a model with
        recurrent layers, whose state a rejected draft would have moved on."""
        return params.replayable and self.kv.states is None

    def _draw_fed(self, logits, states, bounds, fed):
        """The token drawn at every fed row of a speculative step [rows]: the argmax for a greedy request's rows
        (SamplingParams.argmax_only, no grammar), else the sampler's draw at the row's own position
        (Sampler.at_position: row j of a request draws as its state will once the j drafts before the row are
        drawn, its draw count, penalty counts, history and grammar mask moved on by them). A lone row's entry is
        unused (it samples as a decode row does). Returns (tokens, the sampler's SampleOutput or None, the rows it
        drew, their participants)."""
        drawn = logits.argmax(dim=-1)
        rows, owners, row_states = [], [], []
        for i, s in enumerate(states):
            lo, hi = int(bounds[i]), int(bounds[i + 1])
            if hi - lo > 1 and s is not None and (not s.params.argmax_only or s.grammar is not None):
                rows.extend(range(lo, hi))
                owners.extend([i] * (hi - lo))
                row_states.extend(self.sampler.at_position(s, fed[i][1:1 + j]) for j in range(hi - lo))
        if not rows:
            return drawn, None, rows, owners
        at = torch.as_tensor(rows, dtype=torch.int64, device=logits.device)
        out = self.sampler.sample(logits.index_select(0, at).float(), row_states)
        drawn.index_copy_(0, at, out.token_ids)
        return drawn, out, rows, owners

    @staticmethod
    def _token_logprobs(out, tokens, rows, states) -> dict:
        """{rows[k]: TokenLogprob of tokens[rows[k]]} from a SampleOutput's k-th row, for the rows whose state asks
        for log-probabilities (states[k]; the top ``logprobs`` alternatives)."""
        chosen = out.chosen_logprobs.tolist()
        top_v = out.top_logprobs.tolist() if out.top_logprobs is not None else None
        top_i = out.top_token_ids.tolist() if out.top_token_ids is not None else None
        got = {}
        for k, (r, s) in enumerate(zip(rows, states)):
            if s is not None and s.params.logprobs is not None:
                top_n = s.params.logprobs
                top = tuple(zip(top_i[k][:top_n], top_v[k][:top_n])) if top_n and top_i is not None else ()
                got[r] = TokenLogprob(tokens[r], chosen[k], top)
        return got

    def _forward_scoring(self, batch, chunks, plan, rows, scoring, scores) -> torch.Tensor:
        """Forward with logits at every position of the scoring participants' chunks;
        fills ``scores`` and returns each participant's last-position logits [n, vocab]."""
        n = len(chunks)
        bounds = np.cumsum([0] + [len(c.token_ids) for c in chunks])  # chunk rows are contiguous, in order
        scoring_set = {i for i, _ in scoring}
        row_ids, last_at = [], []
        for i in range(n):
            if i in scoring_set:
                row_ids.extend(range(int(bounds[i]), int(bounds[i + 1])))
            else:
                row_ids.append(int(bounds[i + 1]) - 1)
            last_at.append(len(row_ids) - 1)
        # SequenceChunk asks only for last-position logits; widen the rows this forward returns.
        batch.logit_row_ids = torch.as_tensor(row_ids, dtype=torch.int64, device=batch.logit_row_ids.device)
        all_logits = self.model.forward(batch, self.kv)  # [len(row_ids), vocab]
        for i, first in scoring:
            start = int(plan.token_starts[i])
            tokens = self._index(chunks[i].token_ids)
            first_row = last_at[i] - len(tokens) + 1
            # Logits predicting positions start .. start+len-1: the row state before this chunk, then
            # the chunk's own positions except its last.
            predictors = torch.cat([self.state_logits[rows[i]][None, :].to(all_logits.dtype),
                                    all_logits[first_row:last_at[i]]])
            lp = torch.log_softmax(predictors.float(), dim=-1).gather(1, tokens[:, None])[:, 0]
            skip = max(0, first - start)
            scores[i] = lp[skip:].tolist()
        return all_logits.index_select(0, torch.as_tensor(last_at, dtype=torch.int64, device=all_logits.device))

    def _sample(self, logits, sample_idx, rows, states, sampled, logprobs) -> None:
        row_states = [states[i] for i in sample_idx]
        if any(s is None for s in row_states):
            raise ExecutionError("a sampling participant has no sampler state")
        out = self.sampler.sample(logits, row_states)
        tokens = out.token_ids.tolist()  # SYNC: the step's one read-back
        if out.chosen_logprobs is not None:
            for k, lp in self._token_logprobs(out, tokens, range(len(sample_idx)), row_states).items():
                logprobs[sample_idx[k]] = lp
        for k, i in enumerate(sample_idx):
            sampled[i] = tokens[k]
            self.state_last_token[rows[i]] = tokens[k]

    def _copy(self, copies, *, to_snapshot: bool) -> None:
        """Snapshot/restore rows (snapshot_id, state_row, page_id or -1, tokens in the page).

        Goes through the cache's public gather/write per layer, so it does not
        depend on the pool's memory layout; copies are rare (once per
        checkpoint endpoint a prefill reaches, and restores), so the
        per-layer loop is not on the hot path."""
        P = self.page_tokens
        for snapshot_id, state_row, page_id, _partial in np.asarray(copies, dtype=np.int64).reshape(-1, 4):
            if to_snapshot:
                self.snap_logits[snapshot_id] = self.state_logits[state_row]
            else:
                self.state_logits[state_row] = self.snap_logits[snapshot_id]
                self.state_last_token[state_row] = -1
            if self.kv.states is not None:  # the recurrent state goes with them
                snapshot_row = self.num_state_rows + int(snapshot_id)
                self.kv.states.copy(*((int(state_row), snapshot_row) if to_snapshot else
                                      (snapshot_row, int(state_row))))
            if page_id < 0:
                continue
            slots = torch.arange(page_id * P, (page_id + 1) * P, dtype=torch.int64, device=self.kv.device)
            for layer in range(self.kv.num_layers):
                if to_snapshot:
                    k, v = self.kv.gather(layer, slots)
                    self.snap_keys[snapshot_id, layer] = k
                    if v is not None:
                        self.snap_values[snapshot_id, layer] = v
                else:
                    # gather yields [kv_heads, tokens, head_dim]; write takes [tokens, kv_heads, head_dim].
                    self.kv.write(layer, slots, self.snap_keys[snapshot_id, layer].transpose(0, 1),
                                  self.snap_values[snapshot_id, layer].transpose(0, 1) if self.kv.has_values else None)
