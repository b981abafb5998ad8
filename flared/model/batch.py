"""One forward's inputs: a batch of sequences, each with its own number of new tokens.

A ``SequenceChunk`` says, for one sequence: the new token ids to run, how many
of its tokens are already in the KV cache (so the new ones start at that
position), its block table, and whether the caller wants logits for its last
new token (a decode step or the final prefill chunk do; an earlier prefill
chunk does not). ``ForwardBatch.build`` turns a list of them into the index
tensors the forward needs, all built on the host in one place so the forward
itself does no Python work per sequence except one attention call per prefill
chunk.

Rules:
- Rows of the flattened token tensors follow the order of the chunks, and the
  rows of one chunk are contiguous.
- Chunks with exactly one new token are decode rows: their attention is one
  batched call over a padded [num_decode, max_context] gather. Chunks with more
  tokens are prefill rows: one attention call each (causal, with the cached
  prefix visible).
- Padding slots in a gather point at slot 0 and are masked out; they are never
  read into a result.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch


@dataclass
class SequenceChunk:
    token_ids: list[int] | np.ndarray  # new tokens to run, >= 1
    num_cached_tokens: int  # tokens of this sequence already in the KV cache
    page_ids: list[int] | np.ndarray  # block table; must cover num_cached_tokens + len(token_ids)
    needs_logits: bool = True  # logits for the last new token
    # The sequence's row of the cache's recurrent state (a model with recurrent layers; flared.model.recurrent):
    # it holds the state after the num_cached_tokens tokens, and the forward advances it past these. -1: none.
    state_row: int = -1


@dataclass
class ImageRows:
    """A step's image rows (flared.execution.images.place_images): row ``rows[i]`` takes ``values[i]`` in place of
    its token's embedding."""
    rows: torch.Tensor  # [k] int64, on the model's device
    values: torch.Tensor | None  # [k, hidden]; None without rows
    # Qwen3-VL's DeepStack: after decoder layer j, deepstack[j] [k, hidden] is added to the same rows; None: none
    deepstack: list[torch.Tensor] | None
    # [3, T] int64 every row's (temporal, row, column) rope position, where a request has 3D positions; else None
    mrope: torch.Tensor | None

    def apply(self, batch) -> None:
        """Into a ForwardBatch (DecoderModel's forward places them)."""
        if self.rows.numel():
            batch.embed_rows, batch.embed_values, batch.deepstack_values = self.rows, self.values, self.deepstack
        if self.mrope is not None:
            batch.mrope_positions = self.mrope


@dataclass
class PrefillGroup:
    row_start: int  # first row of this chunk in the flattened batch
    row_end: int
    gather_slot_ids: torch.Tensor  # [context_len] slots of every token 0..context_len-1
    # None when the plain causal mask applies (no cached prefix, no window); else bool [q_len, context_len]
    attn_mask: torch.Tensor | None
    state_row: int = -1  # the sequence's recurrent state row (SequenceChunk.state_row)


@dataclass
class ForwardBatch:
    input_ids: torch.Tensor  # [T] int64
    positions: torch.Tensor  # [T] int64
    write_slot_ids: torch.Tensor  # [T] int64, where each new token's K/V goes
    logit_row_ids: torch.Tensor  # [R] int64 rows whose logits are returned, in chunk order
    decode_row_ids: torch.Tensor | None  # [B_dec] int64
    decode_gather_slot_ids: torch.Tensor | None  # [B_dec * max_context] int64
    decode_attn_mask: torch.Tensor | None  # [B_dec, 1, 1, max_context] bool, True = attend
    decode_max_context: int
    decode_context_lens: torch.Tensor | None = None  # [B_dec] int64: each decode row's context length
    decode_state_rows: torch.Tensor | None = None  # [B_dec] int64: each decode row's recurrent state row
    has_state_rows: bool = False  # every chunk named its state row
    # The state rows of the chunks that start a sequence (no cached tokens): the forward zeroes them first, so a
    # sequence's recurrent state starts from nothing whatever its row held before (whoever drives the forward)
    fresh_state_rows: torch.Tensor | None = None
    prefill_groups: list[PrefillGroup] = field(default_factory=list)
    num_tokens: int = 0
    # Per-request LoRA adapters (DecoderModel.lora_modules): (adapter index >= 1, its token rows [k] int64);
    # rows of no group run the base weights alone.
    lora_groups: list[tuple[int, torch.Tensor]] = field(default_factory=list)
    # Decode rows may be consecutive positions of one sequence (a speculative step feeds a request's last token and
    # its drafts as rows of their own): every row's K/V is written before any row attends.
    shared_sequences: bool = False
    # Image rows (a vision-language model): the forward puts embed_values[i] in place of token row embed_rows[i]'s
    # embedding (the rows of an image's tokens; flared.model.vision); None: every row embeds its token.
    embed_rows: torch.Tensor | None = None  # [k] int64
    embed_values: torch.Tensor | None = None  # [k, hidden]
    # Qwen3-VL's DeepStack: after decoder layer j, deepstack_values[j] [k, hidden] is added to rows embed_rows
    deepstack_values: list[torch.Tensor] | None = None
    # Per-layer windows (Gemma 3) and chunks (Llama 4): their masks, made once a batch by DecoderModel._masks
    window_masks: dict = field(default_factory=dict)
    # Qwen VL's 3D rope (DecoderModel.set_mrope): every row's (temporal, row, column) position [3, T] int64, where
    # a row of a prompt with images needs them; None: each row's position on all three.
    mrope_positions: torch.Tensor | None = None

    @classmethod
    def build(cls, chunks: list[SequenceChunk], *, page_tokens: int, device: torch.device | str = "cpu",
              sliding_window: int | None = None) -> ForwardBatch:
        if not chunks:
            raise ValueError("a forward batch needs at least one sequence")
        ids_parts, pos_parts, slot_parts = [], [], []
        logit_rows: list[int] = []
        decode_rows: list[int] = []
        decode_slots: list[np.ndarray] = []
        decode_lens: list[int] = []
        decode_states: list[int] = []
        prefill: list[tuple[int, int, np.ndarray, int, int]] = []
        row = 0
        for chunk in chunks:
            tokens = np.asarray(chunk.token_ids, dtype=np.int64)
            num_new = tokens.shape[0]
            if num_new == 0:
                raise ValueError("a sequence chunk needs at least one new token")
            start = chunk.num_cached_tokens
            context_len = start + num_new
            pages = np.asarray(chunk.page_ids, dtype=np.int64)
            if pages.shape[0] * page_tokens < context_len:
                raise ValueError(f"block table of {pages.shape[0]} pages cannot hold {context_len} tokens")
            all_positions = np.arange(context_len, dtype=np.int64)
            all_slots = pages[all_positions // page_tokens] * page_tokens + all_positions % page_tokens
            ids_parts.append(tokens)
            pos_parts.append(all_positions[start:])
            slot_parts.append(all_slots[start:])
            if chunk.needs_logits:
                logit_rows.append(row + num_new - 1)
            if num_new == 1:
                decode_rows.append(row)
                decode_slots.append(all_slots)
                decode_lens.append(context_len)
                decode_states.append(chunk.state_row)
            else:
                prefill.append((row, row + num_new, all_slots, start, chunk.state_row))
            row += num_new

        def t(a) -> torch.Tensor:
            return torch.as_tensor(np.ascontiguousarray(a), dtype=torch.int64).to(device)

        batch = cls(
            input_ids=t(np.concatenate(ids_parts)),
            positions=t(np.concatenate(pos_parts)),
            write_slot_ids=t(np.concatenate(slot_parts)),
            logit_row_ids=t(np.asarray(logit_rows, dtype=np.int64)),
            decode_row_ids=None, decode_gather_slot_ids=None, decode_attn_mask=None, decode_max_context=0,
            num_tokens=row,
            has_state_rows=all(chunk.state_row >= 0 for chunk in chunks),
        )
        fresh = [chunk.state_row for chunk in chunks if chunk.num_cached_tokens == 0 and chunk.state_row >= 0]
        if fresh:
            batch.fresh_state_rows = t(np.asarray(fresh, dtype=np.int64))
        if decode_rows:
            max_context = max(decode_lens)
            gather = np.zeros((len(decode_rows), max_context), dtype=np.int64)
            key_pos = np.arange(max_context)
            lens = np.asarray(decode_lens)[:, None]
            mask = key_pos[None, :] < lens
            if sliding_window is not None:
                mask &= key_pos[None, :] > (lens - 1) - sliding_window
            for i, slots in enumerate(decode_slots):
                gather[i, : slots.shape[0]] = slots
            batch.decode_row_ids = t(np.asarray(decode_rows, dtype=np.int64))
            batch.decode_gather_slot_ids = t(gather.reshape(-1))
            batch.decode_attn_mask = torch.as_tensor(mask[:, None, None, :]).to(device)
            batch.decode_max_context = max_context
            batch.decode_context_lens = t(np.asarray(decode_lens, dtype=np.int64))
            batch.decode_state_rows = t(np.asarray(decode_states, dtype=np.int64))
        for row_start, row_end, slots, start, state_row in prefill:
            context_len = slots.shape[0]
            attn_mask = None
            if start > 0 or sliding_window is not None:
                q_pos = np.arange(start, context_len)[:, None]
                k_pos = np.arange(context_len)[None, :]
                m = k_pos <= q_pos
                if sliding_window is not None:
                    m &= k_pos > q_pos - sliding_window
                attn_mask = torch.as_tensor(m).to(device)
            batch.prefill_groups.append(PrefillGroup(row_start, row_end, t(slots), attn_mask, state_row))
        return batch
