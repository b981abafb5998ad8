"""The decoder forward on a CUDA GPU over static inputs, capturable in a CUDA graph.

``PagedCudaDecoder`` reuses a ``DecoderModel``'s weights (already on the GPU)
and adds what graph capture needs: a KV pool with a scratch page, static
input tensors that every captured graph reads (``StaticInputs``), and two
forwards with fixed shapes:

- ``decode(batch_capacity, full_sampling, mega=None)``: one token per row for
  rows 0..B-1; a token id < 0 means "the token this state row sampled last",
  read on the device, so a decode step can be submitted before the previous
  step's tokens reach the host. Few-row decode runs the layers as cuBLAS +
  fused kernels, the skinny kernels, or the megakernel (kernels/megakernel.py),
  whichever ``calibrate`` found fastest; batches of 32 rows and up may run
  their products through cuBLASLt (``lt_batches``) or, on Hopper, flared's own
  product kernel (kernels/products64.py, ``p64_batches``), both calibrated.
- ``prefill(batch_capacity, token_capacity)``: the chunks of up to B
  sequences packed back to back in rows 0..T-1 (sequence s's rows follow
  those of sequences 0..s-1), ``chunk_meta[s] = (num_cached_tokens,
  num_new_tokens)``; one logits row per sequence, ``logit_rows[s]`` (its
  chunk's last real row), sampled into ``sampled[s]`` for state row
  ``state_rows[s]``. Padding sequences have meta (0, 0), state row 0 (the
  scratch row no request owns) and logit row 0: they attend to nothing and
  what they sample lands in the scratch row.

With per-request LoRA adapters (``lora``, a kernels/lora_rows.StackedLora) every product of the prefill forward
adds the adapter terms of the rows that name one (``lora_ids``), and so does a decode step run with ``adapters``
(the layered forward through cuBLAS: the skinny kernels, the megakernel and products64 have no place for the
extra products). A decode step without ``adapters`` runs the fastest path as if no adapter were loaded; the
executor takes it for every step in which no row names an adapter (GraphSet's "decode_lora" graphs).

Shapes: T = token capacity, B = batch capacity, nh/nkv = heads, d = head dim,
V = vocab. Pool: per layer [slots + page_tokens, nkv, d].

Rules:
- No host<->device sync and no allocation that depends on input values: every
  length is read on the device (see triton_attention), padding rows write
  their K/V to the scratch page and have context length 0.
- Each forward writes its sampled tokens to ``sampled`` and to
  ``last_token[state_rows]``; the logits stay in ``logits`` for the rows that
  need the eager sampler (penalties, logprobs).
- float32 runs use IEEE attention and match the CPU path's greedy tokens.
"""

from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from flared.model.graph_layers import (ImageBlocks, attention_sinks, generic_layers, generic_reason, layer_pool,
                                      write_kv)
from flared.model.kernels import FULL, TEMPERATURE, decode_attention, fused, megakernel, products64, skinny
from flared.model.kernels.sampling import sample_full, sample_greedy, sample_race
from flared.model.kv_cache import FP8_KV
from flared.model.triton_attention import (decode_splits, paged_decode_attention,
                                           paged_decode_attention_rope, paged_decode_attention_split,
                                           paged_prefill_attention_varlen, supports_pdl)
from flared.model.triton_mla import decode_splits as mla_decode_splits
from flared.model.triton_mla import mla_decode_attention, mla_prefill_attention_varlen


LT_MIN_ROWS = 32  # smallest decode batch calibrate tries on cuBLASLt (16 rows measured 2% slower on the H200)


def fp8_kv_unsupported(device) -> str | None:
    """Why a float8 KV pool cannot run on ``device`` (Triton converts float8 e4m3 from compute capability 8.9:
    Ada, Hopper and later), or None."""
    major, minor = torch.cuda.get_device_capability(device)
    if (major, minor) < (8, 9):
        return (f"a float8 KV cache needs compute capability 8.9 or newer (Ada, Hopper); "
                f"{torch.cuda.get_device_name(device)} is {major}.{minor}")
    return None


@dataclass
class StaticInputs:
    """Device tensors every graph reads; the executor uploads into them. Views of one buffer. GraphSet's
    decode views have no chunk_meta or logit_rows (None)."""

    token_ids: torch.Tensor  # [T_max] int64, -1 = last sampled token of the row's state row (decode)
    positions: torch.Tensor  # [T_max] int64
    slot_ids: torch.Tensor  # [T_max] int64, KV slot each new token writes
    state_rows: torch.Tensor  # [B_max] int64
    block_tables: torch.Tensor  # [B_max, max_pages] int32 (prefill: one row per sequence)
    context_lens: torch.Tensor  # [B_max] int32, decode rows' context including the new token; 0 = padding
    chunk_meta: torch.Tensor | None  # [B_max, 2] int32: prefill (num_cached_tokens, num_new_tokens) per sequence
    logit_rows: torch.Tensor | None  # [B_max] int64: prefill, each sequence's row whose logits are sampled
    temperature: torch.Tensor  # [B_max] float32, 0 = greedy
    top_k: torch.Tensor  # [B_max] int32, 0 = off
    top_p: torch.Tensor  # [B_max] float32
    seeds: torch.Tensor  # [B_max] int64
    steps: torch.Tensor  # [B_max] int64, tokens drawn so far by the row
    # [T_max] int32: each token row's per-request LoRA adapter (0 = the base weights); read only with ``lora``
    lora_ids: torch.Tensor | None = None
    # [B_max] float32: each row's min-p as kernels.min_p_log_threshold (-inf = off); None: no min-p
    min_p_log: torch.Tensor | None = None
    # [B_max] int32: 1 where the row follows llama.cpp's default sampler chain (sample_full's ``chain``); None: none
    chain: torch.Tensor | None = None
    # [B_max] int32: the Sampler slot whose tables shape the row (PagedCudaDecoder.shape_tables; -1 = none)
    shape_slot: torch.Tensor | None = None


class PagedCudaDecoder:
    def __init__(self, model, inputs: StaticInputs, *, num_pages: int, page_tokens: int, num_state_rows: int,
                 max_batch: int, max_tokens: int, decode_inputs: StaticInputs | None = None, lora=None,
                 kv_dtype: torch.dtype | None = None):
        """``lora``: per-request LoRA adapters (kernels/lora_rows.StackedLora), fixed for the decoder's life (the
        graphs capture it); None: none, and the forwards are what they are without adapters. ``kv_dtype``: the KV
        pool's element type, the model's (None) or torch.float8_e4m3fn (``kv_pool_dtype``: half the bytes, read by
        the Triton attention kernels only; the megakernel and the CUDA attention stay off)."""
        c = model.config
        if model.device.type != "cuda":
            raise ValueError("PagedCudaDecoder needs a DecoderModel on a CUDA device")
        self.model = model
        self.config = c
        # A model outside the Llama layer (kernels_obstacle: Gemma 3, mixtures of experts, partial rotary, OLMo's
        # post-norms, latent attention, a head dim not a power of two, ...) runs its own torch layers
        # (DecoderModel._layer_stack) with the paged Triton attention in place of their gathers: every op a static
        # shape and no host sync, so it captures like the Llama forwards (no fused kernels, megakernel, products64
        # or adapters). ModelConfig.torch_graphs_obstacle names what even this cannot run. Layer matrices kept
        # quantised (DecoderModel's quantization on a GPU: kernels/wquant.py's products) run so too.
        obstacle = generic_reason(c, model.quantization)
        self.generic = obstacle is not None
        if self.generic:
            problem = c.torch_graphs_obstacle(str(model.dtype).removeprefix("torch."))
            if problem is not None:
                raise ValueError(f"the CUDA graphs cannot run this model: {problem}")
            if c.num_experts and not model.grouped_experts:
                raise ValueError("the CUDA graphs run routed experts as grouped products (bf16 on a GPU)")
            if lora is not None:
                raise ValueError(f"per-request LoRA adapters run on the Llama kernels only, not {obstacle}")
        # (each layer's sinks as the kernels read them, made once: not a cast in every replay)
        self.sinks = attention_sinks(model) if self.generic else None
        # A sliding window's keys (Mistral): the Triton attention kernels see only the last ``window`` keys of a
        # query; 0 without one. The megakernel has no window: it serves such a model's steps while every context is
        # inside the window (mega_max_context below). The CUDA attention stays off for them.
        self.window = c.sliding_window or 0
        self.inputs = inputs
        # Decode steps read their own views (GraphSet: the decode spans, one upload per step); else ``inputs``.
        self.decode_inputs = decode_inputs if decode_inputs is not None else inputs
        self.page_tokens = page_tokens
        self.num_pages = num_pages
        self.device = model.device
        dtype = model.dtype
        # One extra page: padding rows write their K/V there, never into a live page.
        self.scratch_slot = num_pages * page_tokens
        # (the layers that keep keys and values: all of a Llama's; DecoderModel's kv_index numbers them)
        # (Gemma 4: a slot holds a global layer's wider heads as head_dim-wide rows, kv_storage_heads of them)
        # (latent attention served absorbed, ModelConfig.latent_kv: one latent row a slot, no value rows)
        pool_shape = (len(c.kv_layers), (num_pages + 1) * page_tokens, c.kv_storage_heads, c.kv_row_dim)
        self.kv_dtype = dtype if kv_dtype is None else kv_dtype
        if self.kv_dtype not in (dtype, FP8_KV):
            raise ValueError(f"a KV pool holds {dtype} or {FP8_KV}, not {self.kv_dtype}")
        if self.kv_dtype == FP8_KV:
            if dtype not in (torch.bfloat16, torch.float16):
                raise ValueError(f"a float8 KV pool serves half-precision models, not {dtype}")
            problem = fp8_kv_unsupported(self.device)
            if problem is not None:
                raise ValueError(problem)
        self.k_pool = torch.zeros(pool_shape, dtype=self.kv_dtype, device=self.device)
        self.v_pool = torch.zeros((*pool_shape[:2], c.kv_value_rows, c.kv_row_dim), dtype=self.kv_dtype,
                                  device=self.device)
        self.last_token = torch.zeros(num_state_rows, dtype=torch.int64, device=self.device)
        self.logits = torch.zeros(max_batch, c.vocab_size, dtype=torch.float32, device=self.device)
        # The Sampler's bias and penalty tables (kernels.sampling.ShapeTables) the graphs' samplers shape rows
        # from; set before capture (GraphExecutor), None: no row is shaped.
        self.shape_tables = None
        # Per state row, the logits of its last computed position (snapshots and full-prompt hits read them).
        self.state_logits = torch.zeros(num_state_rows, c.vocab_size, dtype=torch.float32, device=self.device)
        self.sampled = torch.zeros(max_batch, dtype=torch.int64, device=self.device)
        # Half precision: the LM head's logits are widened, stored and (greedy) reduced in one pass
        # (fused.head_epilogue); its per-program partial maxima live here.
        self.head_fused = dtype in (torch.bfloat16, torch.float16) and not self.generic
        parts = max_batch * fused.head_parts(1, c.vocab_size)[1] if self.head_fused else 0
        self.head_partials = (torch.zeros(parts, dtype=torch.float32, device=self.device),
                              torch.zeros(parts, dtype=torch.int32, device=self.device))
        # Decode steps of the layered fused forward rope their q and k and write the KV slot inside the attention
        # kernel (paged_decode_attention_rope); FLARED_ROPE_ATTENTION=0 keeps the separate kernel (benchmarks).
        self.rope_in_attention = os.environ.get("FLARED_ROPE_ATTENTION") != "0"
        # FLARED_CUDA_ATTENTION=1: where a decode step's attention is one share per (row, kv head)
        # (decode_splits), the tensor-core CUDA kernel (kernels/decode_attention.cu) runs it instead of the Triton
        # one. Off by default: it matches Triton alone but made the 8B 64-row step slower (docs/benchmarks.md,
        # twenty-sixth session). ``attn_build`` is the build it runs (None: Triton).
        self.attn_build = None
        if self.rope_in_attention and os.environ.get("FLARED_CUDA_ATTENTION") == "1" and not self.generic:
            self.attn_build = self.cuda_attention_build()

        self.max_batch = max_batch
        self.max_tokens = max_tokens
        # Per-request LoRA adapters: prefill and the decode steps run with ``adapters`` add each product's adapter
        # terms (_with_lora), through the layered forward; the other decode steps keep the paths chosen below.
        self.lora = lora
        # Fused kernels for half precision; float32 keeps the torch ops (exact parity with transformers).
        self.fused = dtype in (torch.bfloat16, torch.float16) and not c.qk_norm and not self.generic
        # Decode batches up to this many rows run five fused kernels per layer (kernels/skinny.py);
        # FLARED_SKINNY_MAX_ROWS=0 turns them off (benchmarks compare both).
        self.skinny_max_rows = 0
        if self.fused and c.head_dim % 32 == 0:
            pinned = int(os.environ.get("FLARED_SKINNY_MAX_ROWS", skinny.MAX_ROWS))
            self.skinny_max_rows = min(skinny.MAX_ROWS, pinned)
        # Half-precision decode at small batch splits each row's context over several programs
        # (flash-decoding); float32 keeps the one-pass kernel (its summation order is the parity one).
        self.calibration: dict = {}
        self.num_sms = torch.cuda.get_device_properties(self.device).multi_processor_count
        split = self.fused or (self.generic and dtype in (torch.bfloat16, torch.float16))
        self.max_splits = int(os.environ.get("FLARED_DECODE_MAX_SPLITS", 16)) if split else 1
        scratch = max_batch * c.num_heads * max(1, self.max_splits)
        self.part_m = torch.empty(scratch, dtype=torch.float32, device=self.device)
        self.part_l = torch.empty(scratch, dtype=torch.float32, device=self.device)
        widest = max(d for _, d in map(c.layer_geometry, range(c.num_layers)))  # (Gemma 4's global heads)
        widest = max(widest, c.kv_lora_rank if c.latent_kv else 0)  # (absorbed latent attention's outputs)
        self.part_acc = torch.empty(scratch * widest, dtype=torch.float32, device=self.device)
        # Decode batches up to mega_max_rows run every layer as one persistent kernel (kernels/megakernel.py),
        # where calibrate finds it faster; FLARED_MEGAKERNEL=0 turns it off, =1 uses it wherever it can run.
        self.mega: dict[tuple[int, bool], megakernel.DecodeLayers] = {}
        self.mega_max_rows = 0
        self.mega_limit = 0
        # Steps whose longest context is longer run the plain graphs (GraphSet.pick_decode): the megakernel's
        # attention is one block per (row, head), the split kernels spread long contexts wider.
        self.mega_max_context = int(os.environ.get("FLARED_MEGAKERNEL_MAX_CONTEXT", megakernel.MAX_CONTEXT))
        if self.window:  # a query at p with p + 1 <= window sees every key: the window masks nothing yet
            self.mega_max_context = min(self.mega_max_context, self.window)
        # The LM head, logits writes and greedy argmax inside the megakernel too (megakernel.HEAD_INSIDE);
        # FLARED_MEGAKERNEL_HEAD=0/1 pins it.
        pinned_head = os.environ.get("FLARED_MEGAKERNEL_HEAD")
        self.mega_head = megakernel.HEAD_INSIDE if pinned_head is None else pinned_head != "0"
        # Decode batches of at least LT_MIN_ROWS rows whose products run through cuBLASLt instead of cuBLAS, where
        # calibrate finds it faster (8B at 64 rows on the H200: 5,480 vs 5,717 us a step). Half precision only (float32
        # keeps cuBLAS, the parity one). FLARED_BLAS_LT=0 never, =1 at every such batch.
        self.lt_batches: set[int] = set()
        pinned_lt = os.environ.get("FLARED_BLAS_LT")
        self.lt_candidates = [b for b in (1 << i for i in range(max_batch.bit_length()))
                              if LT_MIN_ROWS <= b <= max_batch] if self.fused and pinned_lt != "0" else []
        if pinned_lt == "1":
            self.lt_batches = set(self.lt_candidates)
        # Decode batches of 32 or 64 rows whose products run flared's Hopper kernel (kernels/products64.py: every
        # multiprocessor streams one tile of weight rows; gate_up with the SiLU-mul in its epilogue), where
        # calibrate finds it at least 1% faster than the cuBLAS(Lt) path. bf16 Llama-shaped layers on sm_90;
        # FLARED_PRODUCTS64=0 never, =1 at every such batch.
        self.p64_batches: set[int] = set()
        self._p64: products64.DecoderProducts | None = None
        pinned_p64 = os.environ.get("FLARED_PRODUCTS64")
        self.p64_candidates = []
        if (self.fused and pinned_p64 != "0" and products64.available()
                and products64.unsupported(model) is None):
            self.p64_candidates = [b for b in (32, 64) if b <= max_batch]
        if pinned_p64 == "1":
            self.p64_batches = set(self.p64_candidates)
        # FLARED_PRODUCTS64_TILED=1: qkv, o and down read tile-by-tile copies of their weights (more memory).
        self.p64_tiled = os.environ.get("FLARED_PRODUCTS64_TILED") == "1"
        # Products launched as programmatic dependent launches (each streams its first weights while the kernel
        # before it finishes), with the layers' add_rms_norm launches folded into them (products64.DecoderProducts).
        # 8B 64-row step on the H200: 5,202 us plainly, 5,044-5,055 with PDL, 4,960-5,014 with both (docs/
        # benchmarks.md, twenty-fourth session). FLARED_PRODUCTS64_PDL=0 / FLARED_PRODUCTS64_NORMS=0 turn them off.
        self.p64_pdl = os.environ.get("FLARED_PRODUCTS64_PDL", "1") != "0"
        self.p64_fold = os.environ.get("FLARED_PRODUCTS64_NORMS", "1") != "0"
        # The decode attention between the qkv and o products launched the same way (Triton's launch_pdl): 4,857 /
        # 4,867 against 4,918 / 4,915 us (8B, 64 rows, H200). FLARED_ATTENTION_PDL=0 launches it plainly.
        self.attn_pdl = os.environ.get("FLARED_ATTENTION_PDL", "1") != "0" and supports_pdl()
        pinned_mega = os.environ.get("FLARED_MEGAKERNEL")
        if (self.fused and pinned_mega != "0" and megakernel.unsupported(model) is None
                and self.kv_dtype == dtype):  # the megakernel reads and writes the pool in the model's dtype
            self.mega_limit = min(max_batch, megakernel.max_rows(model))
            if pinned_mega == "1":
                self.mega_max_rows = self.mega_limit
        # Megakernel batches whose phases exchange tagged words instead of meeting at grid barriers
        # (DecodeLayers low_latency), where calibrate finds it faster: batches up to
        # megakernel.low_latency_rows(model) are tried.
        # FLARED_MEGAKERNEL_LL=0 never, =1 at every megakernel batch.
        self.mega_ll_rows: set[int] = set()
        self.pinned_ll = os.environ.get("FLARED_MEGAKERNEL_LL")
        if self.pinned_ll == "1":
            self.mega_ll_rows = {1 << i for i in range(self.mega_limit.bit_length())}

    def cuda_attention_build(self):
        """The CUDA decode attention's build for this model, loaded (never inside a graph capture); None where it
        cannot run (it says why in ``decode_attention.unsupported``; it has no sliding window either, and reads
        no float8 pool)."""
        c = self.config
        if self.window or self.kv_dtype != self.model.dtype:
            return None
        if (decode_attention.unsupported(c.num_heads, c.num_kv_heads, c.head_dim, self.model.dtype,
                                         self.page_tokens) is not None or not decode_attention.available()):
            return None
        build = decode_attention.default_build(c.num_heads // c.num_kv_heads, c.head_dim, self.page_tokens)
        decode_attention.load(build)
        return build

    def calibrate(self, stream) -> None:
        """Pick the few-row decode path for this model and GPU by timing captured graphs (before the real
        captures; inputs must be the padding defaults, so contexts are 0 and attention costs nothing):
        the skinny kernels against cuBLAS + the small fused kernels at batch 1, then the megakernel against
        that pick batch by batch (``_calibrate_mega``). ``calibration`` records the times.
        FLARED_SKINNY_MAX_ROWS and FLARED_MEGAKERNEL pin the choices."""
        from flared.execution.graphs import time_graph_us

        if self.skinny_max_rows and "FLARED_SKINNY_MAX_ROWS" not in os.environ:
            skinny_rows = self.skinny_max_rows
            times = {}
            for rows in (skinny_rows, 0):
                self.skinny_max_rows = rows
                times[rows] = time_graph_us(lambda: self.decode(1, False, mega=False), stream)
            self.skinny_max_rows = skinny_rows if times[skinny_rows] < times[0] else 0
            self.calibration = {"skinny_us": times[skinny_rows], "cublas_us": times[0],
                                "skinny_max_rows": self.skinny_max_rows}
        if self.mega_limit and "FLARED_MEGAKERNEL" not in os.environ:
            self._calibrate_mega(stream, time_graph_us)
        if self.lt_candidates and "FLARED_BLAS_LT" not in os.environ:
            self._calibrate_lt(stream, time_graph_us)
        if self.p64_candidates and "FLARED_PRODUCTS64" not in os.environ:
            self._calibrate_p64(stream, time_graph_us)

    def _calibrate_lt(self, stream, time_graph_us) -> None:
        """Each candidate batch's decode graph with its products through cuBLAS and through cuBLASLt; cuBLASLt
        serves the batches where it is at least 1% faster."""
        lt_us, blas_us = self._calibrate_choice(self.lt_candidates, self.lt_batches, stream, time_graph_us)
        self.calibration.update({"lt_us": lt_us, "blas_us": blas_us, "lt_batches": sorted(self.lt_batches)})

    def _calibrate_p64(self, stream, time_graph_us) -> None:
        """Each candidate batch's decode graph with its products through the BLAS path calibrated above and through
        products64; products64 serves the batches where it is at least 1% faster. An error on the way (an NVRTC
        build, a tensor map the driver refuses) leaves it off and is recorded as ``products64_error``."""
        p64_us, other_us = {}, {}
        try:
            p64_us, other_us = self._calibrate_choice(self.p64_candidates, self.p64_batches, stream, time_graph_us)
        except Exception as exc:  # noqa: BLE001 - NVRTC, CuPy and the driver raise many types
            self.calibration["products64_error"] = f"{type(exc).__name__}: {exc}"
            self.p64_batches.clear()
        self.calibration.update({"p64_us": p64_us, "p64_other_us": other_us, "p64_batches": sorted(self.p64_batches)})

    def _calibrate_choice(self, candidates, chosen: set, stream, time_graph_us) -> tuple[dict, dict]:
        """Each candidate batch (past the megakernel's) timed out of ``chosen`` and in it; it stays in where that is
        at least 1% faster. Returns (us in, us out) by batch."""
        in_us, out_us = {}, {}
        for batch in candidates:
            if batch <= self.mega_max_rows:
                continue
            chosen.discard(batch)
            out_us[batch] = time_graph_us(lambda: self.decode(batch, False, mega=False), stream)
            chosen.add(batch)
            in_us[batch] = time_graph_us(lambda: self.decode(batch, False, mega=False), stream)
            if in_us[batch] > 0.99 * out_us[batch]:
                chosen.discard(batch)
        return in_us, out_us

    def products(self) -> products64.DecoderProducts:
        """The layers' products64 builds and weight maps (made on first use, outside any capture)."""
        if self._p64 is None:
            self._p64 = products64.DecoderProducts(self.model, self.num_sms, self.p64_tiled, self.p64_fold,
                                                   self.p64_pdl)
        return self._p64

    @contextlib.contextmanager
    def _blas(self, batch: int):
        """The BLAS library a decode step of ``batch`` rows dispatches its products to (captured graphs keep it)."""
        if batch not in self.lt_batches:
            yield
            return
        previous = torch.backends.cuda.preferred_blas_library()
        torch.backends.cuda.preferred_blas_library("cublaslt")
        try:
            yield
        finally:
            torch.backends.cuda.preferred_blas_library(previous)

    def _calibrate_mega(self, stream, time_graph_us) -> None:
        """Batch by batch (1, 2, 4, ...), the megakernel against the path chosen without it; it serves up to
        the last batch where it is faster. Up to ``megakernel.low_latency_rows`` rows (unless
        FLARED_MEGAKERNEL_LL pins it) the tagged-word build is timed too and kept where it is at least 1%
        faster than the barrier build; a batch's time is then its faster build's. An error raised on the
        way (an NVRTC build failure, say) leaves the megakernel off and is recorded as ``megakernel_error``;
        one from the tagged-word build alone leaves that build off (``megakernel_ll_error``)."""
        mega_us, other_us, ll_us, barrier_us = {}, {}, {}, {}
        chosen = 0
        try:
            batch = 1
            while batch <= self.mega_limit:
                other_us[batch] = time_graph_us(lambda: self.decode(batch, False, mega=False), stream)
                mega_us[batch] = time_graph_us(lambda: self.decode(batch, False, mega=True), stream)
                if self.pinned_ll is None and batch <= megakernel.low_latency_rows(self.model):
                    barrier_us[batch] = mega_us[batch]
                    self._set_low_latency(batch, True)
                    try:
                        ll_us[batch] = time_graph_us(lambda: self.decode(batch, False, mega=True), stream)
                    except Exception as exc:  # noqa: BLE001 - its build alone failed (registers, NVRTC): barriers
                        self.calibration["megakernel_ll_error"] = f"{type(exc).__name__}: {exc}"
                        ll_us[batch] = float("inf")
                    if ll_us[batch] < 0.99 * barrier_us[batch]:
                        mega_us[batch] = ll_us[batch]
                    else:
                        self._set_low_latency(batch, False)
                if mega_us[batch] >= other_us[batch]:
                    break
                chosen = batch
                batch *= 2
        except Exception as exc:  # noqa: BLE001 - NVRTC, CuPy and the driver raise many types
            self.calibration["megakernel_error"] = f"{type(exc).__name__}: {exc}"
            chosen = 0
        self.mega_max_rows = chosen
        self.mega_ll_rows = {b for b in self.mega_ll_rows if b <= chosen}
        self.calibration.update({"mega_us": mega_us, "mega_other_us": other_us, "mega_max_rows": chosen,
                                 "mega_ll_us": ll_us, "mega_barrier_us": barrier_us,
                                 "mega_ll_rows": sorted(self.mega_ll_rows)})

    def _set_low_latency(self, batch: int, on: bool) -> None:
        """Serve ``batch``-row megakernel steps with the tagged-word build (``on``) or the barrier build; the
        other build's kernels are dropped (built again on next use)."""
        if on:
            self.mega_ll_rows.add(batch)
        else:
            self.mega_ll_rows.discard(batch)
        for head in (False, True):
            self.mega.pop((batch, head), None)

    @property
    def kv_bytes(self) -> int:
        return (self.k_pool.numel() + self.v_pool.numel()) * self.k_pool.element_size()

    # -- forwards (capturable) ---------------------------------------------------------------------

    def decode(self, batch: int, full_sampling: int, mega: bool | None = None, adapters: bool = False,
               speculative: bool = False) -> None:
        """``full_sampling``: the sampler (flared.model.kernels' graph variants): GREEDY (0/False), FULL (1/True)
        or TEMPERATURE (2). ``mega``: run the layers as the megakernel (True), not (False), or where ``mega_max_rows``
        allows (None).
        ``adapters``: add the per-request LoRA adapters' terms of the rows that name one (``lora_ids``), through the
        layered forward on cuBLAS (no megakernel, skinny kernels or products64); False: the rows run the base
        weights whatever their ids. ``speculative``: rows of one sequence at consecutive positions may share the
        step (a speculative step's last token and drafts), so every row writes its K/V before any row attends
        (the rotary and KV write run apart from the attention; never the megakernel)."""
        if adapters and self.lora is None:
            raise ValueError("a decode step with adapters needs a decoder with per-request LoRA adapters")
        if speculative and mega:
            raise ValueError("the megakernel attends as it writes: it cannot run a speculative step's rows")
        s = self.decode_inputs
        rows = s.state_rows[:batch]
        block_tables = s.block_tables[:batch]
        context_lens = s.context_lens[:batch]

        if mega is None:  # (a window model's contexts are not known here: GraphSet.pick_decode checks them)
            mega = batch <= self.mega_max_rows and not adapters and not self.window and not speculative
        if mega and adapters:
            raise ValueError("the megakernel has no place for LoRA adapter terms")
        tokens, positions, slots = s.token_ids[:batch], s.positions[:batch], s.slot_ids[:batch]
        if mega and self.mega_head:  # the kernel writes the logits and, when greedy, the tokens
            head = (self.logits, self.state_logits, rows, self.sampled, self.last_token, not full_sampling)
            self._layers_mega(batch, tokens, rows, positions, slots, block_tables, context_lens, head)
            if full_sampling:
                self._sample(self.logits[:batch], batch, full_sampling, rows, s)
            return
        if mega:
            x = self._layers_mega(batch, tokens, rows, positions, slots, block_tables, context_lens)
            self._finish(x, batch, full_sampling, rows, s)
            return
        tokens = torch.where(tokens < 0, self.last_token.index_select(0, rows), tokens)
        products = self.products() if batch in self.p64_batches and not adapters else None
        attend = self._decode_attend(batch, block_tables, context_lens, pdl=products is not None and self.attn_pdl,
                                     fused_rope=not speculative)
        with self._blas(batch):
            lora = self._lora_step(s.lora_ids, batch) if adapters else None
            x = self._layers(tokens, positions, slots, attend, products, lora)
            self._finish(x, batch, full_sampling, rows, s)

    def _decode_attend(self, batch, block_tables, context_lens, pdl: bool = False, fused_rope: bool = True):
        """The decode attention of the layered forwards: split over the context where ``decode_splits`` says;
        ``pdl``: the fused rotary-and-attention kernel as a programmatic dependent launch; ``fused_rope`` False:
        never that kernel (each row there writes its K/V as it attends, so no row may read another's)."""
        splits = decode_splits(batch, self.config.num_kv_heads, self.num_sms, self.max_splits)
        latent_splits = (mla_decode_splits(batch, self.config.num_heads, self.num_sms, self.max_splits)
                         if self.config.latent_kv else 1)

        def attend(q, layer, out, window=None, sinks=None, softcap=0.0, geometry=None, alibi=None, latent=0):
            window = self.window if window is None else window
            if latent:  # (the absorbed queries over the latent rows: ModelConfig.latent_kv)
                mla_decode_attention(q, self.k_pool[layer], out, block_tables, context_lens, latent_dim=latent,
                                     page_tokens=self.page_tokens, scale=self.model.scale, num_splits=latent_splits,
                                     part_acc=self.part_acc, part_m=self.part_m, part_l=self.part_l)
                return
            k_pool, v_pool = self._layer_pools(layer, geometry)
            if splits > 1 and sinks is None and alibi is None:  # (the split kernels have neither sinks nor ALiBi:
                # gpt-oss' and BLOOM's rows run one pass)
                paged_decode_attention_split(q, k_pool, v_pool, out, block_tables,
                                             context_lens, self.part_acc, self.part_m, self.part_l,
                                             num_splits=splits, page_tokens=self.page_tokens, scale=self.model.scale,
                                             window=window, softcap=softcap)
            else:
                paged_decode_attention(q, k_pool, v_pool, out, block_tables, context_lens,
                                       page_tokens=self.page_tokens, scale=self.model.scale, window=window,
                                       sinks=sinks, softcap=softcap, alibi=alibi)

        def with_rope(qkv, positions, slots, layer, out):
            """The rotary, the KV write and the attention from the QKV projection's rows, in one kernel."""
            if splits == 1 and self.attn_build is not None:
                decode_attention.decode_attention_rope(
                    qkv, self.model.rope_cos, self.model.rope_sin_signed, positions, slots, self.k_pool[layer],
                    self.v_pool[layer], out, block_tables, context_lens, num_heads=self.config.num_heads,
                    page_tokens=self.page_tokens, scale=self.model.scale, build=self.attn_build, pdl=pdl)
                return
            paged_decode_attention_rope(qkv, self.model.rope_cos, self.model.rope_sin_signed, positions, slots,
                                        self.k_pool[layer], self.v_pool[layer], out, block_tables, context_lens,
                                        num_heads=self.config.num_heads, page_tokens=self.page_tokens,
                                        scale=self.model.scale, num_splits=splits, part_acc=self.part_acc,
                                        part_m=self.part_m, part_l=self.part_l, pdl=pdl, window=self.window)

        if self.rope_in_attention and fused_rope:
            attend.with_rope = with_rope
        return attend

    def _layer_pools(self, layer: int, geometry: tuple[int, int] | None) -> tuple[torch.Tensor, torch.Tensor]:
        """Kv layer ``layer``'s K and V pools as the attention kernels read them: [slots, kv heads, d], or (the generic
        layers' ``geometry``) as that layer's own heads (graph_layers.layer_pool)."""
        if geometry is None:
            return self.k_pool[layer], self.v_pool[layer]
        return layer_pool(self.k_pool[layer], geometry), layer_pool(self.v_pool[layer], geometry)

    def prefill(self, batch: int, capacity: int, images=None) -> torch.Tensor:
        """A prefill chunk of ``capacity`` token rows over ``batch`` sequences from the static inputs; samples each
        sequence's last row and returns the final-normed hidden states [capacity, H] (a scored step reads them).
        ``images``: the chunk's image rows (flared.model.batch.ImageRows), for an eager run only (the graphs take
        token ids only: GraphExecutor._place_images)."""
        s = self.inputs
        block_tables = s.block_tables[:batch]
        meta = s.chunk_meta[:batch]

        def attend(q, layer, out, window=None, sinks=None, softcap=0.0, geometry=None, alibi=None, latent=0):
            if latent:
                mla_prefill_attention_varlen(q, self.k_pool[layer], out, block_tables, meta, latent_dim=latent,
                                             page_tokens=self.page_tokens, scale=self.model.scale)
                return
            k_pool, v_pool = self._layer_pools(layer, geometry)
            paged_prefill_attention_varlen(q, k_pool, v_pool, out, block_tables, meta,
                                           page_tokens=self.page_tokens, scale=self.model.scale,
                                           window=self.window if window is None else window, sinks=sinks,
                                           softcap=softcap, alibi=alibi)

        if images is not None and self.model.image_block_tokens:  # (Gemma 3, 4: their images both ways)
            blocks = ImageBlocks(s.token_ids[:capacity], meta, block_tables, self.model.image_block_tokens,
                                 self.page_tokens, windowed_only=self.model.image_blocks_windowed)
            attend = blocks.wrap(attend, self._layer_pools, self.window, self.model.scale)
        positions, rope = s.positions[:capacity], None
        if images is not None and images.mrope is not None and not self.generic:
            # 3D rope (Qwen VL): each row's own cos and sin rows, made from its three positions, read at row i
            m = self.model
            rope = tuple(m._mrope(table, images.mrope)[:, 0].contiguous() for table in (m.rope_cos, m.rope_sin_signed))
            positions = torch.arange(capacity, dtype=torch.int64, device=self.device)
        x = self._layers(s.token_ids[:capacity], positions, s.slot_ids[:capacity], attend,
                         lora=self._lora_step(s.lora_ids, capacity), images=images, rope=rope)
        self._finish(x.index_select(0, s.logit_rows[:batch]), batch, True, s.state_rows[:batch], s)
        return x

    def _layers_mega(self, batch, tokens, rows, positions, slots, block_tables, context_lens,
                     head=None) -> torch.Tensor:
        """Every layer and the final norm in one persistent kernel, compiled per row count on first use
        (eager warm-up runs before any capture). The kernel gathers the rows' embeddings itself."""
        kernel = self.mega.get((batch, head is not None))
        if kernel is None:
            kernel = megakernel.DecodeLayers(self.model, self.k_pool, self.v_pool, batch, head=head is not None,
                                             low_latency=batch in self.mega_ll_rows)
            kernel.compile(self.page_tokens)
            self.mega[(batch, head is not None)] = kernel
        kernel(kernel.h, kernel.out, positions, slots, block_tables, context_lens, head,
               tokens=(tokens, rows, self.last_token))
        return kernel.out

    # -- shared body -------------------------------------------------------------------------------

    def _lora_step(self, lora_ids: torch.Tensor | None, rows: int) -> torch.Tensor | None:
        """The step's LoRA column mask (StackedLora.masks) from the first ``rows`` of ``lora_ids``, made once a
        forward and read by every product's _with_lora; None without adapters."""
        if self.lora is None:
            return None
        if lora_ids is None:
            raise ValueError("a decoder with per-request LoRA adapters needs the lora_ids input")
        return self.lora.masks(lora_ids[:rows], self.model.dtype)

    def _with_lora(self, lora: torch.Tensor | None, layer: int, product: str, x: torch.Tensor,
                   y: torch.Tensor) -> torch.Tensor:
        """``y`` (``x`` times the layer's ``product`` weight) plus the adapter terms of the rows that name one, in
        place; ``y`` itself when the step has no mask (``lora`` None: no adapters loaded)."""
        if lora is None:
            return y
        return self.lora.add(layer, product, x, y, lora)

    def _layers(self, tokens: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor, attend,
                products: products64.DecoderProducts | None = None, lora: torch.Tensor | None = None,
                images=None, rope=None) -> torch.Tensor:
        """Every layer; returns the final-normed hidden states [T, H]. ``products``: the fused forward's products
        through products64 (decode batches of up to 64 rows). ``lora``: the step's LoRA mask (_lora_step).
        ``images``: the step's image rows (flared.model.batch.ImageRows; eager prefills only, never captured);
        ``rope``: (cos, sin) tables that ``positions`` index in place of the model's (3D rope rows)."""
        if self.generic:
            return self._layers_generic(tokens, positions, slots, attend, images)
        if self.fused:
            return self._layers_fused(tokens, positions, slots, attend, products, lora, images, rope)
        m = self.model
        c = self.config
        num_tokens = tokens.shape[0]
        nh, nkv, d = c.num_heads, c.num_kv_heads, c.head_dim
        q_size, kv_size = c.q_size, c.kv_size
        eps = c.rms_norm_eps
        cos_table, sin_table = rope if rope is not None else (m.rope_cos, m.rope_sin_signed)
        cos = cos_table.index_select(0, positions)[:, None, :]  # [T, 1, d]
        sin = sin_table.index_select(0, positions)[:, None, :]
        h = self._embed(tokens, images)  # [T, H]
        attn = torch.empty(num_tokens, nh, d, dtype=h.dtype, device=h.device)
        for index, layer in enumerate(m.layers):
            x = F.rms_norm(h, (h.shape[-1],), layer.attn_norm, eps)
            qkv = F.linear(x, layer.qkv.weight, layer.qkv.bias)  # [T, q_size + 2 * kv_size]
            qkv = self._with_lora(lora, index, "qkv", x, qkv)
            qk = qkv[:, :q_size + kv_size].reshape(num_tokens, nh + nkv, d)
            if layer.qk_norm is not None:
                qk = F.rms_norm(qk, (d,), None, eps) * layer.qk_norm
            qk = torch.addcmul(qk * cos, qk.roll(d // 2, dims=-1), sin)
            write_kv(self.k_pool[index], slots, qk[:, nh:])
            write_kv(self.v_pool[index], slots, qkv[:, q_size + kv_size:].view(num_tokens, nkv, d))
            attend(qk[:, :nh], index, attn)
            attn_rows = attn.view(num_tokens, nh * d)
            h = h + self._with_lora(lora, index, "o", attn_rows, F.linear(attn_rows, layer.o.weight, layer.o.bias))
            x = F.rms_norm(h, (h.shape[-1],), layer.mlp_norm, eps)
            gate_up = self._with_lora(lora, index, "gate_up", x, F.linear(x, layer.gate_up.weight))
            act = F.silu(gate_up[:, :c.intermediate_size]) * gate_up[:, c.intermediate_size:]
            h = h + self._with_lora(lora, index, "down", act, F.linear(act, layer.down.weight))
            if images is not None and images.deepstack is not None and index < len(images.deepstack):
                h = h.index_add(0, images.rows, images.deepstack[index].to(h.dtype))
        return F.rms_norm(h, (h.shape[-1],), m.final_norm, eps)

    def _layers_generic(self, tokens: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor,
                        attend, images=None) -> torch.Tensor:
        """The model's own torch layers over the static rows (graph_layers.generic_layers); [T, H] final-normed."""
        return generic_layers(self.model, self.k_pool, self.v_pool, tokens, positions, slots, attend, self.sinks,
                              images=images)

    def _embed(self, tokens: torch.Tensor, images=None) -> torch.Tensor:
        """The rows' embeddings [T, H]; ``images``' rows (ImageRows) in place of their image tokens'."""
        h = self.model.embed.index_select(0, tokens)
        if images is not None and images.rows.numel():
            h.index_copy_(0, images.rows, images.values.to(h.dtype))
        return h

    def _activations(self, tokens, images=None):
        """The residual stream [T, H] (the tokens' embeddings, updated in place by the layers), the attention
        input and output [T, nh, d] and the MLP activation [T, I] of the fused forwards."""
        c = self.config
        h = self._embed(tokens, images)
        q = torch.empty(tokens.shape[0], c.num_heads, c.head_dim, dtype=h.dtype, device=h.device)
        act = torch.empty(tokens.shape[0], c.intermediate_size, dtype=h.dtype, device=h.device)
        return h, q, torch.empty_like(q), act

    def _layers_skinny(self, tokens, positions, slots, attend) -> torch.Tensor:
        """Five kernels per layer for a few rows (see kernels/skinny.py)."""
        m = self.model
        c = self.config
        num_tokens = tokens.shape[0]
        nh, nkv, d = c.num_heads, c.num_kv_heads, c.head_dim
        eps = c.rms_norm_eps
        h, q, attn, act = self._activations(tokens)
        for index, layer in enumerate(m.layers):
            skinny.norm_qkv_rope(h, layer.attn_norm, eps, layer.qkv.weight, layer.qkv.bias, m.rope_cos,
                                 m.rope_sin_signed, positions, slots, q, self.k_pool[index], self.v_pool[index],
                                 num_heads=nh, num_kv_heads=nkv, head_dim=d)
            attend(q, index, attn)
            skinny.linear_residual(attn.view(num_tokens, nh * d), layer.o.weight, layer.o.bias, h)
            skinny.norm_gate_up_silu(h, layer.mlp_norm, eps, layer.gate_up.weight, act)
            skinny.linear_residual(act, layer.down.weight, None, h)
        x = torch.empty_like(h)
        fused.add_rms_norm(None, h, m.final_norm, x, eps)
        return x

    def _layers_fused(self, tokens, positions, slots, attend, products=None, lora=None, images=None,
                      rope=None) -> torch.Tensor:
        """``products``: the four products of each layer through products64 (decode, up to 64 rows, no biases; the
        SiLU-mul inside gate_up's epilogue) instead of cuBLAS(Lt); with its ``fold_norms``, the add_rms_norm
        launches inside them too. ``lora``: the step's LoRA mask (_lora_step; never with ``products``, and never
        through the skinny kernels, which have no place for the adapter terms, nor image rows). ``images``,
        ``rope``: as _layers'."""
        if lora is None and images is None and tokens.shape[0] <= self.skinny_max_rows:
            return self._layers_skinny(tokens, positions, slots, attend)
        m = self.model
        c = self.config
        num_tokens = tokens.shape[0]
        nh, nkv, d = c.num_heads, c.num_kv_heads, c.head_dim
        eps = c.rms_norm_eps
        cos_table, sin_table = rope if rope is not None else (m.rope_cos, m.rope_sin_signed)
        deepstack = images.deepstack if images is not None and images.deepstack is not None else ()
        h, q, attn, act = self._activations(tokens, images)
        attn_rows = attn.view(num_tokens, nh * d)
        x = torch.empty_like(h)
        fold = products is not None and products.fold_norms
        if products is not None:
            # tensor maps over the products' inputs (their addresses are fixed for a capture; x feeds qkv and
            # gate_up), and the qkv, o and down results
            x_map, attn_map, act_map = (products.input_map(t) for t in (x, attn_rows, act))
            qkv_out = torch.empty(num_tokens, (nh + 2 * nkv) * d, dtype=h.dtype, device=h.device)
            out = torch.empty_like(h)
        with_rope = getattr(attend, "with_rope", None)  # decode: rotary and KV write inside the attention kernel
        fused.add_rms_norm(None, h, m.layers[0].attn_norm, x, eps)
        for index, layer in enumerate(m.layers):
            if fold and index:  # x = h * attn_norm from down; qkv scales its rows by their inverse RMS
                qkv = products("qkv", index, x_map, qkv_out, normed=True)
            elif products is not None:
                qkv = products("qkv", index, x_map, qkv_out)
            else:
                qkv = self._with_lora(lora, index, "qkv", x, F.linear(x, layer.qkv.weight, layer.qkv.bias))
            if with_rope is not None:
                with_rope(qkv, positions, slots, index, attn)
            else:
                fused.rope_write_kv(qkv, cos_table, sin_table, positions, slots, q, self.k_pool[index],
                                    self.v_pool[index], num_heads=nh, num_kv_heads=nkv, head_dim=d)
                attend(q, index, attn)
            if fold:  # h += o and h += down inside the products, each leaving x = h * the next norm's weight
                after = m.layers[index + 1].attn_norm if index + 1 < len(m.layers) else m.final_norm
                products("o", index, attn_map, h, layer.mlp_norm, x)
                products("gate_up", index, x_map, act)
                products("down", index, act_map, h, after, x)
                if index + 1 == len(m.layers):  # the LM head's input: the final norm in full
                    fused.add_rms_norm(None, h, m.final_norm, x, eps)
                continue
            if products is not None:
                o = products("o", index, attn_map, out)
            else:
                o = self._with_lora(lora, index, "o", attn_rows, F.linear(attn_rows, layer.o.weight, layer.o.bias))
            fused.add_rms_norm(o, h, layer.mlp_norm, x, eps)
            if products is not None:
                products("gate_up", index, x_map, act)
                down = products("down", index, act_map, out)
            else:
                fused.silu_mul(self._with_lora(lora, index, "gate_up", x, F.linear(x, layer.gate_up.weight)), act)
                down = self._with_lora(lora, index, "down", act, F.linear(act, layer.down.weight))
            after = m.layers[index + 1].attn_norm if index + 1 < len(m.layers) else m.final_norm
            fused.add_rms_norm(down, h, after, x, eps)
            if index < len(deepstack):  # Qwen3-VL's DeepStack rows into the image tokens' state, then x again
                h.index_add_(0, images.rows, deepstack[index].to(h.dtype))
                fused.add_rms_norm(None, h, after, x, eps)
        return x

    def _finish(self, h: torch.Tensor, batch: int, full_sampling: int, rows: torch.Tensor, s: StaticInputs) -> None:
        if not self.head_fused:  # float32, or the generic layers: the family's logits (its LM head's bias,
            # Granite's scaling, Gemma 2's cap), float32
            logits = self.model._logits(h)  # [batch, V]; h is already final-normed
            self.logits[:batch].copy_(logits)
            self.state_logits.index_copy_(0, rows, logits)
            self._sample(logits, batch, full_sampling, rows, s)
            return
        logits = F.linear(h, self.model.lm_head)
        if full_sampling:
            fused.head_epilogue(logits, self.logits, self.state_logits, rows)
            self._sample(self.logits[:batch], batch, full_sampling, rows, s)
        else:
            fused.head_epilogue(logits, self.logits, self.state_logits, rows, self.head_partials, self.sampled,
                                self.last_token)

    def _sample(self, logits: torch.Tensor, batch: int, full_sampling: int, rows: torch.Tensor,
                s: StaticInputs) -> None:
        """The step's tokens from its logits [batch, V] (sampling inputs from ``s``) into ``sampled`` and the state
        rows' ``last_token``. ``full_sampling``: the graph variant (flared.model.kernels): GREEDY (0/False), FULL
        (1/True: temperature, min-p, top-k, top-p) or TEMPERATURE (2: temperature alone, no sort). With
        ``shape_tables``, the FULL and TEMPERATURE samplers first shape the rows that name a slot (``shape_slot``)
        by its bias and penalties, in ``logits`` (``state_logits`` keeps the model's), and count their tokens."""
        shape = ((s.shape_slot[:batch], self.shape_tables)
                 if self.shape_tables is not None and s.shape_slot is not None else None)
        if full_sampling == TEMPERATURE:
            tokens = sample_race(logits, s.temperature[:batch], s.seeds[:batch], s.steps[:batch], shape=shape)
        elif full_sampling == FULL:
            tokens = sample_full(logits, s.temperature[:batch], s.top_k[:batch], s.top_p[:batch], s.seeds[:batch],
                                 s.steps[:batch],
                                 min_p_log=s.min_p_log[:batch] if s.min_p_log is not None else None, shape=shape,
                                 chain=s.chain[:batch] if s.chain is not None else None)
        else:
            tokens = sample_greedy(logits)
        self.sampled[:batch].copy_(tokens)
        self.last_token.index_copy_(0, rows, tokens)
