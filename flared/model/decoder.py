"""The decoder forward over a ``ForwardBatch`` and a ``PagedKVCache``.

``DecoderModel.forward(batch, kv)`` runs every new token of every sequence in
one pass and returns float32 logits for ``batch.logit_row_ids`` only. Shapes
below: T = new tokens in the batch, H = hidden size, nh/nkv = query/kv heads,
d = head dim.

Rules:
- No Python work per sequence except one attention call per prefill chunk;
  decode rows share one batched attention per layer, reading the paged cache
  through one gather of keys and one of values per layer.
- No host<->device sync inside the forward: every index it needs was built by
  ``ForwardBatch.build`` before it runs.
- float32 runs match transformers to rounding (the tests hold logits to 1e-4
  and greedy tokens identical); softmax runs in float32 for any dtype.
"""

from __future__ import annotations

import functools
import math
import threading
import time

import torch
import torch.nn.functional as F

from flared.model.batch import ForwardBatch, SequenceChunk
from flared.model.config import ModelConfig
from flared.model.host_memory import host_zeros, huge_pages_wanted
from flared.model.kv_cache import FP8_KV, PagedKVCache
from flared.model.loader import check_serving_tensors, serving_tensor_shapes
from flared.model.quant import (HEAD_QUANTIZATION, Q8_BLOCK, QuantPlan, check_quantization, packed_format,
                                packed_parts, packed_values, q4_1_rows, q8_0_rows, quantize_packed, stored_gpu_layout)
from flared.model.recurrent import (channel_delta_step, chunked_channel_delta, chunked_gated_delta,
                                    chunked_linear_attention, chunked_selective_scan, gated_delta_step,
                                    linear_attention_step, prepare, selective_step)
from flared.model.rope import rope_tables

try:
    from flared._fast.linear import BF16_SUPPORTED, GROUP_FEATURES, bf16_linear, bf16_unpack, flush_denormals
except ImportError:  # linked against a libgomp newer than the one torch loaded: keep torch's bf16 path
    BF16_SUPPORTED, GROUP_FEATURES, bf16_linear, bf16_unpack, flush_denormals = False, 64, None, None, None
try:
    from flared._fast.linear import AMX as _AMX_KERNEL, AMX_CPU as _AMX_CPU
except ImportError:
    _AMX_KERNEL = _AMX_CPU = False
try:
    from flared._fast.linear import q4_linear, q4_widen, q8_linear, q8_widen
except ImportError:  # (a build from before the quantised kernels)
    q4_linear = q4_widen = q8_linear = q8_widen = None
try:
    from flared._fast.linear import bf16_pack
except ImportError:  # (a build from before it: pack_bf16's torch ops)
    bf16_pack = None
try:
    from flared._fast import norm as _cpu_norm
except ImportError:  # not built: torch's rms_norm
    _cpu_norm = None
try:
    from flared._fast import attention as _cpu_attention
except ImportError:  # as above: decode attention keeps the gather + bmm path
    _cpu_attention = None
# torch's grouped product (rows grouped by offsets, one matrix a group): torch >= 2.10's public name, else the
# private one, else none
_grouped_mm = getattr(F, "grouped_mm", None) or getattr(torch, "_grouped_mm", None)


def _cpu_grouped_mm_works() -> bool:
    """Whether this torch runs grouped_mm on the CPU in float32 (older builds have it for CUDA only)."""
    if _grouped_mm is None:
        return False
    try:
        out = _grouped_mm(torch.ones(3, 8), torch.ones(2, 8, 4), offs=torch.tensor([1, 3], dtype=torch.int32))
        return tuple(out.shape) == (3, 4)
    except (RuntimeError, NotImplementedError, TypeError):
        return False


_CPU_GROUPED_MM = _cpu_grouped_mm_works()
try:
    from flared._fast import delta as _cpu_delta
except ImportError:  # as above: the decode step's gated delta rule keeps torch's ops
    _cpu_delta = None
try:
    from flared._fast import decode as _cpu_decode
except ImportError:  # as above: bf16 decode steps keep the per-op path
    _cpu_decode = None


def _softmax_with_sinks(scores: torch.Tensor, sinks: torch.Tensor) -> torch.Tensor:
    """softmax over [scores, sink] along the last axis, the sink's column dropped: float32 scores [..., L] and sinks
    broadcastable to [..., 1] -> probabilities [..., L] that sum to under 1 (gpt-oss)."""
    combined = torch.cat([scores, sinks.expand(*scores.shape[:-1], 1)], dim=-1)
    return torch.softmax(combined, dim=-1)[..., :-1]


def _turn(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rope on x [..., r] (each row's halves turned: x cos + rotate_half(x) sin, ``sin`` signed as rope_sin_signed)."""
    return torch.addcmul(x * cos, x.roll(x.shape[-1] // 2, dims=-1), sin)


def _soft_cap(x: torch.Tensor, cap: float) -> torch.Tensor:
    """cap * tanh(x / cap): Gemma 2's squashing of attention scores and logits into (-cap, cap)."""
    return torch.tanh(x / cap) * cap


def _xielu(x: torch.Tensor, alpha_p: torch.Tensor, alpha_n: torch.Tensor, beta: torch.Tensor,
           eps: torch.Tensor) -> torch.Tensor:
    """xIELU (Apertus' MLP activation) with a layer's effective parameters: alpha_p x^2 + beta x for x > 0, else
    (expm1(min(x, eps)) - x) alpha_n + beta x, as transformers' torch path computes it."""
    return torch.where(x > 0, alpha_p * x * x + beta * x, (torch.expm1(torch.minimum(x, eps)) - x) * alpha_n + beta * x)


def rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    # One fused op (statistics in float32 for every dtype); matches transformers' LlamaRMSNorm to
    # float32 rounding, which the parity tests check. bfloat16 rows on the CPU go through
    # flared/_fast/norm.pyx: torch runs a bf16 rms_norm as ~10 ops (~35 us a call, 61 calls per
    # SmolLM2 decode step); the kernel rounds at the same steps as transformers' LlamaRMSNorm.
    if weight is not None and weight.dtype != x.dtype:
        # Gemma's norms (float32 weights holding 1 + w): normed and scaled in float32, rounded once, as Gemma's
        # RMSNorm computes it
        return F.rms_norm(x.float(), (x.shape[-1],), weight.float(), eps).to(x.dtype)
    if (_cpu_norm is not None and x.dtype == torch.bfloat16 and weight is not None and x.dim() == 2
            and x.device.type == "cpu" and weight.is_contiguous() and weight.shape[0] == x.shape[1]
            and x.shape[0] > 0):  # (no rows: a prefill chunk that keeps no logits)
        x = x.contiguous()
        out = torch.empty_like(x)
        _cpu_norm.bf16_rms_norm(x.data_ptr(), weight.data_ptr(), out.data_ptr(), x.shape[0], x.shape[1], eps)
        return out
    return F.rms_norm(x, (x.shape[-1],), weight, eps)


# A per-request LoRA adapter's entry (DecoderModel.add_lora_module) holds, beside its products' factors, this key:
# the adapter as the one-call decode step's table (decode_kernel.h), or None where that step cannot take it.
FUSED_LORA = "one-call decode table"
_LORA_PRODUCTS = ("qkv", "o", "gate_up", "down")  # decode_kernel.h's order

# Decode-sized matmuls (few rows) are memory-bound matrix-vector products. A plain F.linear runs them on
# one core at about half the memory bandwidth of this kind of CPU; splitting the weight rows into
# _SPLIT_PARTS blocks and running them as one bmm lets ATen spread the blocks over the threads. Only
# float32 gains (measured: SmolLM2 single-stream step 51 ms -> 23 ms). Above _SPLIT_MAX_ROWS rows the GEMM
# kernel is better (measured on SmolLM2's matrices: with 2 threads the split wins up to 8 rows, with 1
# thread up to 4).
_SPLIT_PARTS = 2
_SPLIT_MAX_ROWS = 8
_SPLIT_MAX_ROWS_ONE_THREAD = 4
# Whether the split runs (None: split_pays() probes this CPU once). That measurement was an AMD EPYC's (AVX2), whose
# torch ran sgemv on one core; on an Intel Xeon with AMX torch's F.linear was 2.6x the split instead (SmolLM2's
# float32 products at one row, 2 threads: 21 ms against 54).
SPLIT_DECODE_PRODUCTS: bool | None = None


@functools.lru_cache(maxsize=None)
def _probe_split() -> bool:
    """True when this CPU runs a decode-sized float32 product ([3072, 576], SmolLM2's gate/up, one row) clearly faster
    as the split bmm than as F.linear: best of 7 each, alternating, the split needing a fifth less time."""
    weight = torch.randn(3072, 576)
    split = weight.view(_SPLIT_PARTS, 3072 // _SPLIT_PARTS, 576)
    x = torch.randn(1, 576)
    ways = {"split": lambda: torch.bmm(split, x.t().expand(_SPLIT_PARTS, 576, 1)),
            "linear": lambda: F.linear(x, weight)}
    best = {name: float("inf") for name in ways}
    for _ in range(7):
        for name, way in ways.items():
            started = time.perf_counter()
            for _ in range(8):
                way()
            best[name] = min(best[name], time.perf_counter() - started)
    return best["split"] < 0.8 * best["linear"]


def split_pays() -> bool:
    """Whether decode-sized float32 products on the CPU take the split bmm (SPLIT_DECODE_PRODUCTS, else the probe)."""
    return _probe_split() if SPLIT_DECODE_PRODUCTS is None else SPLIT_DECODE_PRODUCTS


# bfloat16 weights on a CPU with AVX-512 BF16 are packed at load (pack_bf16) and every product runs through
# flared/_fast/linear_kernel.h, at any row count: on SmolLM2's matrices (2 Zen 4 threads, weights streamed from
# memory) it beat torch's bf16 F.linear 2x at 1 row, 2.5x at 8, 1.6x at 32 and 1.1x at 256 (torch re-packs
# the weight on every call); on a CPU with AMX it runs on the tiles (linear.AMX). Only the packed copy is kept.
# Where the CPU has AMX but its tiles cannot be used here (the kernel's grant refused, or FLARED_AMX=0), torch's bf16
# products of many rows (oneDNN) outrun the AVX-512 kernel by far (a [7168, 1024] matrix on 2 threads: 3.1 ms against
# 4.2 at 64 rows, 5.9 against 33.7 at 512, counting unpack_bf16's copy back to [out, in]; at 32 rows and fewer the
# kernel stays ahead): products of UNPACK_MIN_ROWS rows or more take that path; None: never.
UNPACK_MIN_ROWS = 64 if _AMX_CPU and not _AMX_KERNEL else None


_unpacked = threading.local()  # each thread's scratch for unpack_bf16


def unpack_bf16(packed: torch.Tensor, out_features: int) -> torch.Tensor:
    """pack_bf16's layout back to the weight [out_features, in] (flared/_fast/linear.pyx's bf16_unpack, over the
    calling thread's threads: 1.2 ms for a [7168, 1024] matrix on 2 threads, against 2.3 for torch's transpose), in
    the calling thread's scratch buffer, which the next call overwrites: use it at once. (A fresh buffer a call
    cost more than the unpacking: a [16384, 2048] matrix's pages faulted in took 13 of its 18 ms.)"""
    in_features = packed.shape[1] * 2
    scratch = getattr(_unpacked, "buffer", None)
    if scratch is None or scratch.numel() < out_features * in_features:
        scratch = _unpacked.buffer = torch.empty(out_features * in_features, dtype=torch.bfloat16)
    out = scratch[:out_features * in_features].view(out_features, in_features)
    bf16_unpack(packed.data_ptr(), out.data_ptr(), out_features, in_features, torch.get_num_threads())
    return out


_widened = threading.local()  # each thread's scratch for widen_quantised's packed bf16
# Each quantization's kernels over _Linear.quant_tensors: (the product, the widening into pack_bf16's layout, the
# dequantised rows of some output features)
_QUANT_KERNELS = {"q8_0": (q8_linear, q8_widen, q8_0_rows), "q4_1": (q4_linear, q4_widen, q4_1_rows)}


def widen_quantised(lin: "_Linear") -> torch.Tensor:
    """A quantised _Linear's weight back to bf16 [out_features, in] (the kernels' dequantised values): widened into
    pack_bf16's layout by the C kernels, then unpack_bf16; both into the calling thread's scratch, which the next
    call overwrites."""
    groups, in_features = lin.quant.shape[0], lin.in_features
    size = groups * in_features * GROUP_FEATURES
    scratch = getattr(_widened, "buffer", None)
    if scratch is None or scratch.numel() < size:
        scratch = _widened.buffer = torch.empty(size, dtype=torch.bfloat16)
    packed = scratch[:size].view(groups, in_features // 2, GROUP_FEATURES, 2)
    widen = _QUANT_KERNELS[lin.quant_kind][1]
    widen(*(t.data_ptr() for t in lin.quant_tensors), packed.data_ptr(), lin.out_features, in_features,
          torch.get_num_threads())
    return unpack_bf16(packed, lin.out_features)


def pack_bf16(weight: torch.Tensor, arena: "_Arena | None" = None) -> torch.Tensor:
    """[out, in] bf16 (in even) -> linear_kernel.h's layout: groups of GROUP_FEATURES output features, each
    [in / 2, GROUP_FEATURES, 2], zero rows past ``out`` (written into ``arena`` where one is given)."""
    out_features, in_features = weight.shape
    group = GROUP_FEATURES
    padded = -(-out_features // group) * group
    if bf16_pack is not None and weight.dtype == torch.bfloat16 and weight.device.type == "cpu" and out_features \
            and in_features % 2 == 0:  # (the C packer: the same layout, ~8x faster than these torch ops)
        weight = weight.contiguous()
        shape = (padded // group, in_features // 2, group, 2)
        packed = arena.empty(shape, torch.bfloat16) if arena is not None else torch.empty(shape, dtype=torch.bfloat16)
        bf16_pack(weight.data_ptr(), packed.data_ptr(), out_features, in_features, torch.get_num_threads())
        return packed
    if padded != out_features:
        weight = torch.cat([weight, weight.new_zeros(padded - out_features, in_features)])
    return weight.reshape(padded // group, group, in_features // 2, 2).permute(0, 2, 1, 3).contiguous()


def quantisable(weight: torch.Tensor) -> bool:
    """Whether a weight can be kept quantised here: bf16 on a CPU with the kernels, inputs a multiple of 32."""
    return (q8_linear is not None and BF16_SUPPORTED and weight.dtype == torch.bfloat16
            and weight.device.type == "cpu" and weight.shape[1] % Q8_BLOCK == 0)


class _Linear:
    """A weight [out, in] (+ optional bias) with the matmul strategy picked per call by row count.

    bf16 on a CPU with the kernel: ``packed`` holds the weight (``weight`` is None); a quantization ("q8_0", "q4_1")
    there: ``quant`` (the packed values), ``quant_scales`` (Q4_1: its steps) and Q4_1's ``quant_offsets`` hold it
    instead, ``quant_kind`` names it (flared/model/quant.py; a weight the format cannot take stays bf16). On a GPU
    a quantised weight is made by ``stored`` (DecoderModel quantises it on the host), in the GPU's layout
    (quant.gpu_layout; ``on_gpu``), its products kernels/wquant.py's."""

    __slots__ = ("weight", "bias", "split", "packed", "out_features", "in_features", "quant", "quant_scales",
                 "quant_offsets", "quant_kind")

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, quantization: str | None = None,
                 arena: "_Arena | None" = None, grids: bool = False):
        """``arena``: where the packed or quantised weight is written (DecoderModel's, in huge pages); ``grids``: the
        weight's values lie on integer grids (quant.quantize_q4_1's)."""
        self.bias = bias
        self.out_features, self.in_features = weight.shape
        on_cpu = weight.device.type == "cpu"
        self.packed = self.quant = self.quant_scales = self.quant_offsets = self.quant_kind = None
        if quantization is not None and quantisable(weight):
            self.quant, self.quant_scales, self.quant_offsets = (
                *quantize_packed(quantization, weight, empty=arena.empty if arena is not None else None,
                                 grids=grids), None)[:3]
            self.quant_kind = quantization
            weight = None
        elif BF16_SUPPORTED and weight.dtype == torch.bfloat16 and on_cpu and self.in_features % 2 == 0:
            self.packed = pack_bf16(weight, arena)
            weight = None
        self.weight = weight
        can_split = weight is not None and weight.dtype == torch.float32 and on_cpu and \
            self.out_features % _SPLIT_PARTS == 0
        self.split = weight.view(_SPLIT_PARTS, self.out_features // _SPLIT_PARTS, self.in_features) if can_split \
            else None

    @classmethod
    def stored(cls, parts: tuple[torch.Tensor, ...], fmt: str, shape: tuple[int, int],
               bias: torch.Tensor | None, arena: "_Arena | None" = None,
               device: torch.device | None = None) -> "_Linear":
        """A matrix a core holds quantised (quant.pack_layer_matrices' tensors in ``fmt``), kept as it is: copied
        into ``arena`` (DecoderModel's, in huge pages) where given, as the quantiser writes into it; on a GPU
        ``device``, laid out as its products take them (the same blocks)."""
        if device is not None and device.type != "cpu":  # (unpacked into the GPU's layout there)
            parts = stored_gpu_layout(parts, fmt, shape[0], device)
        elif arena is not None:
            parts = tuple(arena.empty(tuple(p.shape), p.dtype).copy_(p) for p in parts)
        lin = cls.__new__(cls)
        lin.bias, lin.weight, lin.split, lin.packed = bias, None, None, None
        lin.out_features, lin.in_features = shape
        lin.quant, lin.quant_scales = parts[0], parts[1]
        lin.quant_offsets = parts[2] if len(parts) > 2 else None
        lin.quant_kind = fmt
        return lin

    @property
    def quant_tensors(self) -> tuple[torch.Tensor, ...]:
        """A quantised weight's tensors, as its kernels take them (_QUANT_KERNELS): values, scales[, offsets]."""
        return tuple(t for t in (self.quant, self.quant_scales, self.quant_offsets) if t is not None)

    @property
    def nbytes(self) -> int:
        """The bytes its weight holds in memory (packed, quantised or plain)."""
        if self.quant is not None:
            return sum(t.nbytes for t in self.quant_tensors)
        return (self.packed if self.packed is not None else self.weight).nbytes

    @property
    def on_gpu(self) -> bool:
        """Whether the weight is kept quantised on a GPU (kernels/wquant.py's products)."""
        return self.quant is not None and self.quant.device.type != "cpu"

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        num_rows = x.shape[0]
        if self.on_gpu:
            from flared.model.kernels import wquant

            return wquant.linear(x, self.quant_kind, self.quant_tensors, self.bias)
        if self.packed is not None or self.quant is not None:  # (the CPU kernels: flared/_fast/linear.pyx)
            if x.dim() != 2 or x.shape[1] != self.in_features or x.dtype != torch.bfloat16:
                raise ValueError(f"linear: input {tuple(x.shape)} {x.dtype} does not match "
                                 f"{(self.quant_kind or 'bf16').upper()} weight "
                                 f"[{self.out_features}, {self.in_features}]")
            if UNPACK_MIN_ROWS is not None and num_rows >= UNPACK_MIN_ROWS:  # (AMX: torch's product, see above)
                dense = (unpack_bf16(self.packed, self.out_features) if self.quant is None
                         else widen_quantised(self))
                return F.linear(x, dense, self.bias)
            y = torch.empty(num_rows, self.out_features, dtype=torch.bfloat16)
            if num_rows:
                x = x.contiguous()  # the kernel reads raw row-major memory
                weights = (self.packed,) if self.quant is None else self.quant_tensors
                product = bf16_linear if self.quant is None else _QUANT_KERNELS[self.quant_kind][0]
                product(*(t.data_ptr() for t in weights), x.data_ptr(), y.data_ptr(), num_rows, self.out_features,
                        self.in_features, torch.get_num_threads())
            return y if self.bias is None else y.add_(self.bias)
        if self.split is None or num_rows > _SPLIT_MAX_ROWS or \
                (num_rows > _SPLIT_MAX_ROWS_ONE_THREAD and torch.get_num_threads() == 1) or not split_pays():
            return F.linear(x, self.weight, self.bias)
        # [parts, out/parts, in] @ [parts, in, rows] -> [out, rows] -> [rows, out] (a view)
        y = torch.bmm(self.split, x.t().expand(_SPLIT_PARTS, self.in_features, num_rows))
        y = y.view(self.out_features, num_rows).t()
        return y if self.bias is None else y + self.bias


class _Arena:
    """Where a CPU model's packed and quantised weights are written as they are made: runs of CHUNK bytes mapped in
    huge pages (``host_memory.host_zeros``), each matrix 64-byte aligned, one after another. A decode step streams
    every one of them, and in 4 KiB pages SmolLM2's 270 MB are ~66k TLB misses a step (shared runs, because a matrix
    under 2 MiB alone gets no huge page): measured 3-6% off the products at 1-4 rows. Written in place, a matrix is
    never made elsewhere first and copied (the copy and the first copy's page faults took 60% of a 1B model's
    load). A run's pages are zero until written (Q4_1's values are OR-ed in); the unused tail of the last run is
    never touched, so it takes no memory. Where huge pages are not wanted (``huge_pages_wanted``), ``empty`` is
    torch.zeros."""

    CHUNK = 256 << 20

    def __init__(self):
        self.huge = huge_pages_wanted()
        self.run: torch.Tensor | None = None
        self.offset = 0
        self.bases: set[int] = set()

    def empty(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """A zeroed tensor of ``shape`` in the arena."""
        nbytes = math.prod(shape) * dtype.itemsize
        if not self.huge or nbytes == 0:
            return torch.zeros(shape, dtype=dtype)
        span = -(-nbytes // 64) * 64
        if span > self.CHUNK:  # (a matrix of its own size: its own mapping)
            t = host_zeros(shape, dtype, prefault=False)
            self.bases.add(t.untyped_storage().data_ptr())
            return t
        if self.run is None or self.offset + span > self.CHUNK:
            self.run, self.offset = host_zeros((self.CHUNK,), torch.uint8, prefault=False), 0
            self.bases.add(self.run.untyped_storage().data_ptr())
        t = self.run[self.offset:self.offset + nbytes].view(dtype).view(shape)
        self.offset += span
        return t

    def holds(self, t: torch.Tensor) -> bool:
        return t.untyped_storage().data_ptr() in self.bases


def _gather_packed(linears: list[_Linear], arena: _Arena | None = None) -> None:
    """Move the packed bf16 weights (and quantised ones with their scales) not already in ``arena`` into one
    mapping in huge pages (see _Arena: its reason). Each matrix's first copy is released once it is moved."""
    slots = [(lin, name) for lin in linears for name in ("packed", "quant", "quant_scales", "quant_offsets")
             if getattr(lin, name) is not None and not (arena is not None and arena.holds(getattr(lin, name)))]
    if not slots or not huge_pages_wanted():  # a plain arena would only cost a second copy
        return
    spans = [-(-getattr(lin, name).nbytes // 64) * 64 for lin, name in slots]  # each matrix 64-byte aligned
    arena = host_zeros((sum(spans),), torch.uint8, prefault=False)
    offset = 0
    for (lin, name), span in zip(slots, spans):
        t = getattr(lin, name)
        setattr(lin, name, arena[offset:offset + t.nbytes].view(t.dtype).view(t.shape).copy_(t))
        offset += span


class _Layer:
    __slots__ = ("attn_norm", "qkv", "qk_norm", "o", "mlp_norm", "gate_up", "down", "post_attn_norm", "post_mlp_norm",
                 "window", "router", "experts", "shared", "expert_stacks", "expert_biases", "rope", "sinks",
                 "correction_bias", "latent", "linear", "kv_index", "has_mixer", "has_mlp", "linear_o", "geometry",
                 "keys_as_values", "scalar", "beside", "kv_source", "per_layer", "xielu", "absorb", "indexer")


class DecoderModel:
    def __init__(self, config: ModelConfig, tensors: dict[str, torch.Tensor], *, dtype: torch.dtype = torch.float32,
                 device: torch.device | str = "cpu", max_positions: int | None = None,
                 quantization: str | QuantPlan | None = None):
        """``quantization`` "q8_0" or "q4_1": the products of every layer and the LM head kept so
        (flared/model/quant.py; a bf16 model on a CPU with the packed kernels); a QuantPlan: each layer matrix it
        names in its own format (None: bf16), the rest in its default; else None."""
        check_serving_tensors(tensors, config, source="serving tensors")
        self.config = config
        self.dtype = dtype
        self.device = torch.device(device)
        self.max_positions = max_positions or config.max_position_embeddings
        plan = quantization if isinstance(quantization, QuantPlan) else None
        self.quantization = check_quantization(plan.default if plan is not None else quantization)
        # On a GPU the layers' matrices (qkv, o, gate_up, down, a shared expert's) are kept quantised; the LM head,
        # a mixture's routed experts (torch's grouped products take bf16 stacks) and the other products stay bf16
        on_gpu = self.device.type == "cuda"
        if self.quantization is not None and (dtype != torch.bfloat16 or not on_gpu and (
                self.device.type != "cpu" or q8_linear is None or not BF16_SUPPORTED)):
            raise ValueError(f"{self.quantization} weights run in bfloat16, on a GPU or on the CPU executor with its "
                             f"packed kernels (AVX-512 BF16 or AVX2); this model is "
                             f"{str(dtype).removeprefix('torch.')} on {self.device.type}"
                             + ("" if self.device.type != "cpu" or BF16_SUPPORTED and q8_linear is not None
                                else ", a CPU without them"))

        arena = _Arena() if self.device.type == "cpu" else None

        grids = plan is not None and plan.grids

        def lin(weight: torch.Tensor, bias: torch.Tensor | None) -> _Linear:
            return _Linear(weight, bias, None if on_gpu else self.quantization, arena, grids)

        def on_host(name: str) -> torch.Tensor:
            """Tensor ``name`` in ``dtype`` where the core holds it (a matrix it stores quantised: its values)."""
            stored = packed_format(tensors, name) if name not in tensors else None
            if stored is not None:  # (a core's matrix stored quantised: its values, where it is not kept so)
                return packed_values(packed_parts(tensors, name, stored), stored, shapes[name][-2], dtype)
            return tensors[name].to(dtype=dtype)

        def w(name: str) -> torch.Tensor:
            return on_host(name).to(device=self.device).contiguous()

        def opt(name: str) -> torch.Tensor | None:
            return w(name) if name in tensors or packed_format(tensors, name) is not None else None

        shapes = serving_tensor_shapes(config)

        def kept_stored(name: str, fmt: str | None) -> tuple[torch.Tensor, ...] | None:
            """Matrix ``name``'s stored tensors where the core holds it quantised in ``fmt`` and this model keeps it
            so: taken as they are (no quantiser run)."""
            stored = packed_format(tensors, name) if name not in tensors else None
            if stored is None or stored != fmt or dtype != torch.bfloat16 or not on_gpu and (
                    self.device.type != "cpu" or q8_linear is None or not BF16_SUPPORTED):
                return None
            return packed_parts(tensors, name, stored)

        def fmt_of(name: str) -> str | None:
            """The format of the product stored as serving tensor ``name`` (a plan's for it, else the one)."""
            return plan.format_of(name) if plan is not None else self.quantization

        def layer_lin(p: str, key: str, bias: bool = True) -> _Linear:
            """A layer's product by its serving name (p + key + ".weight", its bias if it has one and ``bias``), in
            its format."""
            name = p + key + ".weight"
            fmt = fmt_of(name)
            parts = kept_stored(name, fmt)
            if parts is None and on_gpu and fmt is not None and dtype == torch.bfloat16 and \
                    shapes[name][-1] % Q8_BLOCK == 0:
                # (quantised on the host by the CPU's quantiser, the blocks a CPU or a stored core holds: a GPU's
                # division by a constant rounds a Q8_0 scale otherwise; never the bf16 matrix on the GPU first)
                parts = quantize_packed(fmt, on_host(name).contiguous(), grids=grids)
            if parts is not None:
                return _Linear.stored(parts, fmt, shapes[name], opt(p + key + ".bias") if bias else None, arena,
                                      self.device)
            return _Linear(w(name), opt(p + key + ".bias") if bias else None, fmt, arena, grids)

        # Gemma's norm weights (1 + w), gpt-oss' and Cohere's stay float32: their norms scale in float32 and round
        # once (ModelConfig.float_norms)
        float_norms = config.float_norms

        def norm(name: str) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor] | None:
            if name not in tensors:
                return None
            weight = tensors[name].to(device=self.device, dtype=torch.float32 if float_norms else dtype).contiguous()
            bias = name[:-len("weight")] + "bias"
            if bias not in tensors:
                return weight
            # (StarCoder2's LayerNorms: weight and bias, as _norm takes them)
            return weight, tensors[bias].to(device=self.device, dtype=weight.dtype).contiguous()

        self.embed = w("embed.weight")
        self.pos_embed = w("pos_embed.weight") if config.position_embeddings else None  # (GPT-2's learned rows)
        self.embed_norm = norm("embed_norm.weight") if config.embedding_layer_norm else None  # (BLOOM's)
        # ALiBi (BLOOM): each query head's slope, float32 [nh]
        self.alibi = (torch.tensor(config.alibi_slopes, dtype=torch.float32, device=self.device)
                      if config.alibi_slopes else None)
        # Falcon-RW (alibi_bf16_positions): each key's bias bf16(the undivided slope, bf16 as released, * its
        # position) / sqrt(head_dim): (those slopes, sqrt(head_dim))
        self.alibi_bf16 = None
        if config.alibi_bf16_positions:
            root = config.head_dim ** 0.5
            self.alibi_bf16 = ((self.alibi * root).to(torch.bfloat16), root)
        self.lm_head = self.embed if config.tie_word_embeddings else w("lm_head.weight")
        self.final_norm = norm("final_norm.weight")
        # Gemma 4 E2B / E4B: (each token's per-layer rows, the embedding's projection to them, its per-layer norm)
        self.per_layer = None
        if config.per_layer_input_dim:
            self.per_layer = (w("embed_per_layer.weight"), lin(w("per_layer_proj.weight"), None),
                              norm("per_layer_proj_norm.weight"))
        self.layers: list[_Layer] = []
        kv_index = {layer: j for j, layer in enumerate(config.kv_layers)}  # (the KV cache holds these layers')
        for i in range(config.num_layers):
            p = f"layers.{i}."
            layer = _Layer()
            layer.attn_norm = norm(p + "attn_norm.weight")  # (None: OLMo 2, no norm before attention or the MLP)
            layer.latent = layer.linear = layer.absorb = layer.indexer = None
            # (Gemma 4's shared-KV layers attend to their source layer's keys and values, keeping none of their own)
            layer.kv_source = config.kv_source(i)
            layer.kv_index = kv_index.get(i if layer.kv_source is None else layer.kv_source, -1)
            layer.per_layer = None
            if config.per_layer_input_dim:  # (its input's gate, projection and norm)
                layer.per_layer = (lin(w(p + "per_layer_gate.weight"), None),
                                   lin(w(p + "per_layer_out.weight"), None), norm(p + "per_layer_norm.weight"))
            # (Nemotron-H: a layer of an MLP block alone, or of a mixer block alone)
            layer.has_mixer = i not in config.mixerless_layers
            layer.has_mlp = i not in config.mlpless_layers
            # (Gemma 4: a global layer's KV heads and head dim, its values its keys' projection; a scalar a layer)
            layer.geometry = config.layer_geometry(i)
            layer.keys_as_values = config.value_from_key and layer.geometry[1] == config.global_head_dim
            layer.scalar = opt(p + "scalar")
            layer.xielu = None
            if p + "xielu" in tensors:  # Apertus: (softplus(alpha_p), beta + softplus(alpha_n), beta, eps), as computed
                alpha_p, alpha_n, beta, eps = w(p + "xielu").unbind()
                layer.xielu = (F.softplus(alpha_p), beta + F.softplus(alpha_n), beta, eps)
            if not layer.has_mixer:
                layer.qkv = None
            elif i in config.linear_layers and config.short_conv:  # LFM2: (in projection, conv [hidden, K])
                layer.linear = (lin(w(p + "linear_in.weight"), None), w(p + "conv.weight"))
                layer.qkv = None
            elif i in config.linear_layers and config.linear_kind == "kda":
                # (in projection, conv [C, K], f_b, g_b, dt_bias, -exp(A_log), the gated output norm's weight)
                layer.linear = (lin(w(p + "linear_in.weight"), None), w(p + "conv.weight"),
                                lin(w(p + "f_b.weight"), None), lin(w(p + "g_b.weight"), None),
                                tensors[p + "dt_bias"].to(self.device, torch.float32),
                                -tensors[p + "a_log"].to(self.device, torch.float32).exp(),
                                tensors[p + "linear_norm.weight"].to(self.device, torch.float32))
                layer.qkv = None
            elif i in config.linear_layers and config.linear_kind == "mamba1":
                # (in projection, conv [C, K], its bias, x_proj, dt_proj, dt_bias, -exp(A_log) [C, N], D, the dt / B / C
                # norms' weights)
                layer.linear = (lin(w(p + "linear_in.weight"), None), w(p + "conv.weight"), opt(p + "conv.bias"),
                                lin(w(p + "x_proj.weight"), None), lin(w(p + "dt_proj.weight"), None),
                                tensors[p + "dt_bias"].to(self.device, torch.float32),
                                -tensors[p + "a_log"].to(self.device, torch.float32).exp(),
                                tensors[p + "d"].to(self.device, torch.float32), norm(p + "dt_norm.weight"),
                                norm(p + "b_norm.weight"), norm(p + "c_norm.weight"))
                layer.qkv = None
            elif i in config.linear_layers and config.linear_kind == "mamba2":
                # (in projection, conv [C, K], its bias, dt_bias, -exp(A_log), D, the gated norm's weight or None)
                layer.linear = (lin(w(p + "linear_in.weight"), None), w(p + "conv.weight"), opt(p + "conv.bias"),
                                tensors[p + "dt_bias"].to(self.device, torch.float32),
                                -tensors[p + "a_log"].to(self.device, torch.float32).exp(),
                                tensors[p + "d"].to(self.device, torch.float32), opt(p + "linear_norm.weight"))
                layer.qkv = None
            elif i in config.linear_layers:  # Gated DeltaNet: (in projection, conv [C, K], dt_bias, -exp(A_log), norm)
                layer.linear = (lin(w(p + "linear_in.weight"), None), w(p + "conv.weight"), w(p + "dt_bias"),
                                -tensors[p + "a_log"].to(self.device, torch.float32).exp(),
                                w(p + "linear_norm.weight"))
                layer.qkv = None
            if i in config.linear_layers and config.parallel_mixers:  # Falcon-H1: attention beside the mixer
                layer.qkv = layer_lin(p, "qkv")
            elif layer.linear is not None or not layer.has_mixer:
                pass
            elif config.kv_lora_rank:  # DeepSeek's latent attention: (q or q_a, q_a's norm, q_b), kv_a, its norm, kv_b
                q = (lin(w(p + "q_a.weight"), None), norm(p + "q_a_norm.weight"),
                     lin(w(p + "q_b.weight"), None)) if config.q_lora_rank else \
                    (None, None, lin(w(p + "q.weight"), None))
                kv_b = w(p + "kv_b.weight")
                if config.latent_kv:  # served absorbed: kv_b's key rows [nh, d - r, rank] and value rows as [nh, rank,
                    # v] (each head's), for the queries into the latent and the outputs out of it
                    per_head = kv_b.view(config.num_heads, -1, config.kv_lora_rank)
                    nope = config.head_dim - config.rope_dim
                    layer.absorb = (per_head[:, :nope].contiguous(), per_head[:, nope:].transpose(1, 2).contiguous())
                layer.latent = (*q, lin(w(p + "kv_a.weight"), None), norm(p + "kv_a_norm.weight"),
                                None if config.latent_kv else _Linear(kv_b, None))
                if config.index_topk and i not in config.index_shared_layers:  # DeepSeek V3.2's indexer: queries,
                    # key, its LayerNorm, the heads' weights (GLM-5's shared layers reuse an earlier one's choice)
                    layer.indexer = (lin(w(p + "index_q.weight"), None), lin(w(p + "index_k.weight"), None),
                                     (w(p + "index_k_norm.weight"), w(p + "index_k_norm.bias")),
                                     lin(w(p + "index_weights.weight"), None))
                layer.qkv = None
            else:
                layer.qkv = layer_lin(p, "qkv")
            # q and k heads are normed (and roped) as one [nh + nkv, d] block, so their weights stack per head.
            layer.qk_norm = None
            layer.linear_o = lin(w(p + "linear_o.weight"), None) if p + "linear_o.weight" in tensors else None
            if (layer.linear is not None and not config.parallel_mixers) or not layer.has_mixer:
                pass
            elif config.qk_norm_whole:  # OLMo 2: [q_size] and [kv_size] weights, each normed over all its heads
                layer.qk_norm = (w(p + "q_norm.weight"), w(p + "k_norm.weight"))
            elif config.qk_norm:
                layer.qk_norm = torch.cat([norm(p + "q_norm.weight").expand(config.num_heads, -1)] + (
                    [norm(p + "k_norm.weight").expand(layer.geometry[0], -1)] if layer.kv_source is None else []))
            layer.o = layer_lin(p, "o") if layer.has_mixer else None
            layer.mlp_norm = norm(p + "mlp_norm.weight")
            layer.post_attn_norm = norm(p + "post_attn_norm.weight")  # Gemma's and OLMo's sandwich norms
            layer.post_mlp_norm = norm(p + "post_mlp_norm.weight")
            layer.window = config.window_of(i)
            layer.rope = i not in config.nope_layers
            layer.sinks = opt(p + "sinks")  # gpt-oss' attention sinks [nh]
            layer.router = layer.experts = layer.shared = layer.expert_stacks = layer.expert_biases = None
            layer.correction_bias = None
            layer.beside = None
            if config.parallel_experts:  # Gemma 4 26B-A4B: (router.scale, router.expert_scale, three norms)
                layer.beside = (w(p + "router.scale"), w(p + "router.expert_scale"), norm(p + "post_mlp_norm_1.weight"),
                                norm(p + "pre_mlp_norm_2.weight"), norm(p + "post_mlp_norm_2.weight"))
            if not layer.has_mlp:
                layer.gate_up = layer.down = None
            elif config.num_experts and i not in config.dense_layers:  # a routed MLP: the experts', router's, shared's
                layer.gate_up = layer.down = None
                if config.parallel_experts:  # (the dense MLP beside the experts)
                    layer.gate_up = layer_lin(p, "gate_up")
                    layer.down = layer_lin(p, "down")
                if config.router_float32:  # (DeepSeek's and GLM-4.5's routers, their biases in float32)
                    layer.router = _Linear(tensors[p + "router.weight"].to(self.device, torch.float32), None)
                if config.router_sigmoid or config.router_correction_bias:
                    layer.correction_bias = tensors[p + "router.correction_bias"].to(self.device, torch.float32)
                if not config.router_float32:
                    layer.router = _Linear(w(p + "router.weight"), opt(p + "router.bias"))
                names = p + "experts.gate_up.weight", p + "experts.down.weight"
                formats = (None, None) if on_gpu else (fmt_of(names[0]), fmt_of(names[1]))
                stored = [kept_stored(n, f) for n, f in zip(names, formats)]
                gate_up, down = (w(n) if parts is None else None for n, parts in zip(names, stored))
                if config.expert_bias:  # gpt-oss: [E, 2 I] and [E, H]
                    layer.expert_biases = (w(p + "experts.gate_up.bias"), w(p + "experts.down.bias"))
                biases = layer.expert_biases or (None, None)

                def expert(j: int, e: int) -> _Linear:  # (the stack's matrix j: 0 gate_up, 1 down)
                    bias = None if biases[j] is None else biases[j][e]
                    if stored[j] is not None:
                        return _Linear.stored(tuple(t[e] for t in stored[j]), formats[j], shapes[names[j]][1:], bias,
                                              arena)
                    return _Linear((gate_up, down)[j][e], bias, formats[j], arena, grids)

                layer.experts = [(expert(0, e), expert(1, e)) for e in range(config.num_experts)]
                if layer.experts[0][0].packed is None and layer.experts[0][0].quant is None:
                    # (the experts' weights are views of these: no copy)
                    layer.expert_stacks = (gate_up.transpose(1, 2), down.transpose(1, 2))  # grouped products' layout
                del gate_up, down
                if config.shared_expert_intermediate_size:
                    gate = lin(w(p + "shared.gate.weight"), None) if config.shared_expert_gate else None
                    layer.shared = (layer_lin(p, "shared.gate_up", bias=False), layer_lin(p, "shared.down", bias=False),
                                    gate)
            else:
                layer.gate_up = layer_lin(p, "gate_up")  # (StarCoder2's biases)
                layer.down = layer_lin(p, "down")
            self.layers.append(layer)
        self.lm_head_linear = _Linear(self.lm_head, opt("lm_head.bias"),  # (Phi-2's bias)
                                      None if on_gpu else HEAD_QUANTIZATION.get(self.quantization), arena)
        if self.lm_head_linear.quant is not None and not config.tie_word_embeddings:
            self.lm_head = None  # (token_logits reads its rows from the quantised copy: no second bf16 copy kept)
        if self.device.type == "cpu":
            _gather_packed([lin for layer in self.layers for lin in self._linears(layer)] + [self.lm_head_linear],
                           arena)
        self.rope_cos, rope_sin = rope_tables(config, self.max_positions, dtype=dtype, device=self.device)
        # rotate_half(x) * sin == roll(x, d/2) * [-sin_lo, sin_hi]: folding the sign into the table makes
        # rope three ops (roll, mul, addcmul) on the joint q/k block (on its first rope_dim columns where the
        # rotary embedding is partial).
        half = rope_sin.shape[1] // 2  # (rope_dim; Gemma 4's global layers' whole wider head)
        self.rope_sin_signed = torch.cat((-rope_sin[:, :half], rope_sin[:, half:]), dim=-1)
        self.scale = config.attention_scale or config.head_dim ** -0.5
        # Gemma 3's windowed layers turn by plain rope at local_rope_theta; its embedding rows are scaled by
        # sqrt(hidden) in the model's dtype (as transformers rounds it)
        self.rope_local = None
        if config.local_rope_theta is not None:
            cos_l, sin_l = rope_tables(config, self.max_positions, dtype=dtype, device=self.device, local=True)
            half = sin_l.shape[1] // 2
            self.rope_local = (cos_l, torch.cat((-sin_l[:, :half], sin_l[:, half:]), dim=-1))
        self.embed_scale = (torch.tensor(config.hidden_size ** 0.5, dtype=dtype, device=self.device)
                            if config.embed_scale else None)
        # (Gemma 4 E2B / E4B: the per-layer rows' scale, made once here: a CUDA graph captures no host copy)
        self.per_layer_scale = (torch.tensor(config.per_layer_input_dim ** 0.5, dtype=dtype, device=self.device)
                                if config.per_layer_input_dim else None)
        # Decode rows on the CPU attend through flared/_fast/attention.pyx, which reads the KV pages in
        # place; the torch path first gathers a [rows, context] copy of them (most of a decode step's
        # attention time at 32 rows of long context). False keeps the torch path (A/B, other devices).
        self.cpu_decode_attention = (
            _cpu_attention is not None and self.device.type == "cpu" and dtype in (torch.float32, torch.bfloat16)
            and config.attn_logit_softcapping is None  # (the kernel does not soft-cap scores: Gemma 2 takes torch's)
            and not config.attention_sinks  # (nor weigh sinks: gpt-oss takes torch's)
            and config.num_heads // config.num_kv_heads <= _cpu_attention.MAX_GROUP
            and config.head_dim <= _cpu_attention.MAX_HEAD_DIM)
        # bf16 decode-only steps of up to _cpu_decode.MAX_ROWS (64) rows on a CPU with AVX-512 BF16 run every
        # layer in one call (flared/_fast/decode.pyx): the per-op path spent ~4 ms of SmolLM2's ~12 ms
        # single-stream step dispatching ~15 small torch ops per layer. Rounding follows the per-op path.
        self.fused_decode = (
            _cpu_decode is not None and _cpu_decode.SUPPORTED and self.cpu_decode_attention
            and config.graph_capable  # the one-call step is the Llama-type layer
            and dtype == torch.bfloat16 and config.head_dim % 2 == 0 and config.intermediate_size % GROUP_FEATURES == 0
            and all(lin.packed is not None or lin.quant is not None
                    for l in self.layers for lin in (l.qkv, l.o, l.gate_up, l.down)))
        self._decode_scratch: dict[tuple[int, int], tuple[torch.Tensor, ...]] = {}
        # Routed experts in two grouped products (torch's grouped_mm: every expert's rows at once, no host sync)
        # instead of a loop over the experts hit: on a GPU in bf16, and on the CPU in float32 (1.2x the loop's decode
        # at 1 row, 1.6x at 8: tools/bench_moe.py; CPU bf16 experts take the packed bf16 kernels, faster still).
        # False keeps the loop (the A/B).
        self.grouped_experts = bool(config.num_experts) and _grouped_mm is not None and (
            (self.device.type == "cuda" and dtype == torch.bfloat16)
            or (self.device.type == "cpu" and dtype == torch.float32 and _CPU_GROUPED_MM
                and config.hidden_size % 4 == 0 and config.expert_intermediate_size % 4 == 0))  # (16-byte strides)
        # A Gated DeltaNet state decays by exp(g) every token: in a fast-decaying head its old directions sink into
        # denormal floats, which x86 handles dozens of times slower (a 512-token prefill of Qwen3.5-0.8B's first 8
        # layers: 1.9x slower without the flush; tools/bench_hybrid.py). On the CPU such a model's forwards run with
        # denormals flushed to zero (flared/_fast/linear.pyx: on the model thread and its OpenMP workers, as GPUs
        # do), the threads' previous mode back after each forward.
        decaying = config.linear_kind in ("gated_delta", "mamba2", "mamba1", "kda")  # (Mamba's and KDA's decay too)
        self.flush_denormals = decaying and self.device.type == "cpu" and flush_denormals is not None
        # Decode rows' gated delta rule (and Mamba-2's decayed update) on the CPU in place on their state rows
        # (flared/_fast/delta.pyx), instead of gathering the rows, torch's ops, and scattering them back. False keeps
        # torch's (the A/B).
        self.cpu_delta_step = (config.linear_kind in ("gated_delta", "mamba2") and self.device.type == "cpu"
                               and _cpu_delta is not None
                               and config.linear_value_dim <= _cpu_delta.MAX_VALUE_DIM)
        self.lora_modules: list[dict | None] = []  # add_lora_module
        # A vision-language model's image tower (flared.model.vision.VisionEncoder), set by whoever loads one.
        self.vision = None
        self.audio = None  # (a second tower, for audio clips: Gemma 4's; flared.model.vision.attach_tower)
        self._mrope_sections: torch.Tensor | None = None  # set_mrope
        self.image_block_tokens: tuple[int, ...] = ()  # set_image_blocks
        self.image_blocks_windowed = False
        self.image_identity_token: int | None = None  # set_image_identity
        if self.fused_decode:
            def addr(t: torch.Tensor | None) -> int:
                return 0 if t is None else t.data_ptr()

            def weight(lin: _Linear) -> int:
                return addr(lin.packed if lin.quant is None else lin.quant)

            # Column order is decode_kernel.h's (then the scales, 0 for a bf16 weight, then Q4_1's offsets, else 0);
            # the tensors are owned
            # by self.layers for the model's life.
            self._layer_ptrs = torch.tensor(
                [[addr(l.attn_norm), weight(l.qkv), addr(l.qkv.bias), addr(l.qk_norm), weight(l.o),
                  addr(l.o.bias), addr(l.mlp_norm), weight(l.gate_up), weight(l.down)]
                 + [addr(lin.quant_scales) for lin in (l.qkv, l.o, l.gate_up, l.down)]
                 + [addr(lin.quant_offsets) for lin in (l.qkv, l.o, l.gate_up, l.down)]
                 for l in self.layers], dtype=torch.int64)

    @staticmethod
    def _linears(layer: _Layer) -> list[_Linear]:
        """Every product of a layer."""
        mlp = [layer.gate_up, layer.down] if layer.experts is None else \
            [layer.router, *(lin for pair in layer.experts for lin in pair),
             *(lin for lin in layer.shared or () if lin is not None), layer.gate_up, layer.down]
        attention = [x for x in (*(layer.latent or layer.linear or ()), layer.qkv, layer.linear_o, *(layer.per_layer or ()))
                     if isinstance(x, _Linear)]
        return [lin for lin in (*attention, layer.o, *mlp) if lin is not None]

    def set_mrope(self, section: tuple[int, ...], *, interleaved: bool = False) -> None:
        """Qwen VL's multimodal rope: the rotated dimensions' rope_dim / 2 frequency slots split into (temporal, row,
        column) sections, the same split on both halves of them (rotate-half). Rows whose batch carries mrope_positions turn
        each slot by its section's position; a text row's three positions are equal (plain rope). Qwen2-VL's
        sections are runs of slots; Qwen3-VL's ``interleaved`` ones alternate t, h, w from the first slot (h and
        w for as many slots as their sections, t for the rest)."""
        half = self.config.rope_dim // 2  # (Qwen3.5 rotates a quarter of each head: its sections split that)
        if sum(section) != half:
            raise ValueError(f"mrope sections {section} do not add up to the rotated dimensions / 2 = {half}")
        if interleaved:
            slots = torch.zeros(half, dtype=torch.int64)
            for axis in (1, 2):
                slots[axis:section[axis] * 3:3] = axis
        else:
            slots = torch.repeat_interleave(torch.arange(len(section)), torch.tensor(section))
        self._mrope_sections = torch.cat((slots, slots)).to(self.device)

    def set_image_blocks(self, token_ids, *, windowed_only: bool = False) -> None:
        """Gemma 3's images: in a prefill, each run of ``token_ids`` tokens (one image's, or one video frame's) also
        attends forward within itself, as transformers' token_type_ids mask has it (the full layers causal or the
        image's block, the windowed ones their window and that). ``windowed_only``: on the windowed layers alone,
        the global ones causal (Gemma 4's mm_token_type_ids mask). The scheduler keeps each image inside one
        prefill chunk (RequestScheduler.admit's atomic_spans), so a chunk holds every key of its images."""
        self.image_block_tokens = tuple(int(t) for t in ([token_ids] if isinstance(token_ids, int) else token_ids))
        self.image_blocks_windowed = bool(windowed_only)

    def set_image_identity(self, token_id: int) -> None:
        """Gemma 4 E2B / E4B: an image row's per-layer input takes ``token_id``'s table row (the pad token's), as
        transformers feeds the per-layer embedding the prompt with its image tokens padded out."""
        self.image_identity_token = int(token_id)

    def _image_blocks(self, batch: ForwardBatch) -> list:
        """Each prefill group's [q_len, q_len] True where a query and a later key are image tokens of one image
        (None for a group without image tokens), made once a batch."""
        cache = batch.window_masks
        if "image_blocks" not in cache:
            blocks = []
            tokens = torch.tensor(self.image_block_tokens, dtype=batch.input_ids.dtype, device=batch.input_ids.device)
            for g in batch.prefill_groups:
                image = torch.isin(batch.input_ids[g.row_start:g.row_end], tokens)
                if not bool(image.any()):
                    blocks.append(None)
                    continue
                first = image.clone()
                first[1:] &= ~image[:-1]
                run = torch.cumsum(first.long(), 0)  # (each image's rows share a number)
                same = image[:, None] & image[None, :] & (run[:, None] == run[None, :])
                blocks.append(same.triu(1))
            cache["image_blocks"] = blocks
        return cache["image_blocks"]

    def _mrope(self, table: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """[T, 1, d] rows of a rope table, slot j at positions[section of j]."""
        if self._mrope_sections is None:
            raise ValueError("this model has no mRoPE sections (set_mrope)")
        per_axis = table[positions]  # [3, T, d]
        index = self._mrope_sections.view(1, 1, -1).expand(1, positions.shape[1], -1)
        return per_axis.gather(0, index)[0][:, None, :]

    def make_kv_cache(self, *, num_pages: int, page_tokens: int, storage_dtype: torch.dtype | None = None,
                      state_rows: int = 0) -> PagedKVCache:
        """``storage_dtype``: float8 e4m3 for a kv_cache_dtype fp8 cache (PagedKVCache); None: the model's.
        ``state_rows``: rows of recurrent state beside it, for a model with recurrent layers (whose sequences
        then name theirs: SequenceChunk.state_row)."""
        return PagedKVCache(self.config, num_pages=num_pages, page_tokens=page_tokens, dtype=self.dtype,
                            device=self.device, storage_dtype=storage_dtype,
                            state_rows=state_rows if self.config.linear_layers else 0)

    def add_lora_module(self, factors: dict) -> int:
        """A per-request LoRA adapter (flared.model.lora.lora_factors), kept apart from the weights: a row of
        adapter a (batch.lora_groups) adds (x A^T) B^T to each product the adapter targets. Returns a, its index
        from 1. The entry is whole before it is appended, so a forward on the model thread never sees part of
        it; a dropped adapter's entry becomes None and its index is never reused."""
        entry = {}
        for name, parts in factors.items():
            # One product with every part's A stacked ([sum r, in]) serves the parts of a fused tensor (q and v of
            # qkv): part i then takes its r_i columns of it into its rows.
            a_all = torch.cat([A for _, _, A, _ in parts]).to(self.device, self.dtype)
            offsets = [0]
            for _, _, A, _ in parts:
                offsets.append(offsets[-1] + A.shape[0])
            entry[name] = (a_all.t().contiguous(),
                           [(row, count, offsets[i], offsets[i + 1], B.to(self.device, self.dtype).t().contiguous())
                            for i, (row, count, _, B) in enumerate(parts)])
        if self.fused_decode:
            entry[FUSED_LORA] = self._fused_lora_table(entry)
        self.lora_modules.append(entry)
        return len(self.lora_modules)

    def _fused_lora_table(self, entry: dict):
        """The adapter's factors as decode_kernel.h's LoRA table: (table [num_layers, 4, 4] int64, its widest
        stacked rank (the step's scratch width), the part rows the table points at), or None where the one-call
        step cannot take it (a product other than the four, or more stacked low-rank columns than it holds); its
        rows then take the per-op path."""
        table = torch.zeros(self.config.num_layers, len(_LORA_PRODUCTS), 4, dtype=torch.int64)
        keep = []
        for name, (a_t, parts) in entry.items():
            pieces = name.split(".")
            if (len(pieces) != 4 or pieces[0] != "layers" or pieces[2] not in _LORA_PRODUCTS
                    or a_t.shape[1] > _cpu_decode.LORA_MAX_RANK):
                return None
            rows = torch.tensor([[row, count, begin, end, b_t.data_ptr()] for row, count, begin, end, b_t in parts],
                                dtype=torch.int64)
            keep.append(rows)
            table[int(pieces[1]), _LORA_PRODUCTS.index(pieces[2])] = torch.tensor(
                [a_t.data_ptr(), a_t.shape[1], rows.data_ptr(), len(parts)])
        return table, max(1, int(table[:, :, 1].max())), keep

    def _lora(self, batch: ForwardBatch, name: str, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """``y`` (the product of ``x`` with the serving tensor ``name``) plus each adapter row's low-rank term."""
        for adapter, rows in batch.lora_groups:
            entry = self.lora_modules[adapter - 1].get(name)
            if entry is None:
                continue
            a_t, parts = entry
            whole = rows.shape[0] == x.shape[0]  # every row is this adapter's (one request, or all of one adapter)
            low = (x if whole else x.index_select(0, rows)) @ a_t  # [rows, sum r]
            for row, count, begin, end, b_t in parts:
                term = low[:, begin:end] @ b_t
                if whole:
                    y[:, row:row + count] += term
                else:
                    y[rows, row:row + count] += term
        return y

    @torch.inference_mode()
    def forward(self, batch: ForwardBatch, kv: PagedKVCache) -> torch.Tensor:
        """Returns logits [len(batch.logit_row_ids), vocab] float32."""
        if (self.fused_decode and not batch.prefill_groups and batch.embed_rows is None
                and batch.mrope_positions is None
                and all(self.lora_modules[a - 1].get(FUSED_LORA) is not None for a, _ in batch.lora_groups)
                and batch.decode_row_ids is not None
                and batch.num_tokens <= _cpu_decode.MAX_ROWS and batch.decode_max_context <= self.max_positions
                and kv.storage_dtype in (torch.bfloat16, FP8_KV)):
            return self._forward_fused_decode(batch, kv)
        h = self._layers_forward(batch, kv)
        last = h.index_select(0, batch.logit_row_ids)
        last = self._norm(last, self.final_norm)
        return self._logits(last)

    def _logits(self, x: torch.Tensor) -> torch.Tensor:
        """Final-normed rows -> float32 logits (scaled and capped in the model's dtype, as transformers does)."""
        return self._finish_logits(self.lm_head_linear(x)).float()

    def _finish_logits(self, y: torch.Tensor) -> torch.Tensor:
        """The LM head's products as the family's logits: Granite's divided by logits_scaling, Gemma 2's soft-capped."""
        if self.config.logits_scaling is not None:
            y = y / self.config.logits_scaling
        if self.config.final_logit_softcapping is not None:
            y = _soft_cap(y, self.config.final_logit_softcapping)
        return y

    def token_logits(self, vectors: torch.Tensor, token_ids) -> torch.Tensor:
        """Final-normed hidden vectors [n, hidden] -> float32 logits of only ``token_ids`` [n, len(token_ids)]: those
        rows of the LM head (what rerank and score read)."""
        head = self.lm_head_linear
        rows = (self.lm_head[list(token_ids)] if self.lm_head is not None
                else _QUANT_KERNELS[head.quant_kind][2](*head.quant_tensors, list(token_ids))).float()
        logits = vectors.to(rows.device) @ rows.T
        if self.lm_head_linear.bias is not None:  # (Phi-2's)
            logits = logits + self.lm_head_linear.bias[list(token_ids)].float()
        return self._finish_logits(logits)

    @torch.inference_mode()
    def pooled_embeddings(self, token_lists: list[list[int]], *, pooling: str = "last", normalize: bool = True,
                          page_tokens: int = 16, chunk_tokens: int = 2048) -> torch.Tensor:
        """Sentence embeddings [len(token_lists), hidden] float32: each sequence run on its own (a scratch KV
        cache, nothing shared with serving), its final-normed hidden states pooled, at its last token
        (``last``) or averaged over its tokens (``mean``), then scaled to unit length when ``normalize``.
        Sequences up to ``chunk_tokens`` run together in one forward; a longer one runs alone in chunks of
        that many tokens, so activations stay bounded whatever the context."""
        if pooling not in ("last", "mean"):
            raise ValueError(f"pooling must be 'last' or 'mean', got {pooling!r}")
        if not token_lists or any(len(t) == 0 for t in token_lists):
            raise ValueError("every sequence to embed needs at least one token")
        longest = max(len(t) for t in token_lists)
        if longest > self.max_positions:
            raise ValueError(f"a sequence of {longest} tokens is longer than the model's {self.max_positions}")
        out: list[torch.Tensor | None] = [None] * len(token_lists)
        short = [i for i, t in enumerate(token_lists) if len(t) <= chunk_tokens]
        if short:
            h = self._prefill([list(token_lists[i]) for i in short], page_tokens)
            row = 0
            for i in short:
                n = len(token_lists[i])
                rows = h[row + n - 1:row + n] if pooling == "last" else h[row:row + n]
                out[i] = self._norm(rows.contiguous(), self.final_norm).float().mean(dim=0)
                row += n
        for i, tokens in enumerate(token_lists):
            if out[i] is None:
                *_, out[i] = self.embedding_chunks(tokens, pooling=pooling, page_tokens=page_tokens,
                                                   chunk_tokens=chunk_tokens)
        result = torch.stack(out)
        if normalize:
            result = F.normalize(result, dim=-1)
        return result

    @torch.inference_mode()
    def embedding_chunks(self, tokens: list[int], *, pooling: str = "last", page_tokens: int = 16,
                         chunk_tokens: int = 2048):
        """One sequence's pooled embedding (as ``pooled_embeddings``, not scaled) a prefill chunk at a time:
        yields None after each chunk but the last, then the vector [hidden] float32, so a caller can run other
        work between chunks."""
        total = None
        for start, h in self._chunked_prefill(list(tokens), chunk_tokens, page_tokens):
            if pooling == "last":
                total = h[-1:]
            else:
                part = self._norm(h.contiguous(), self.final_norm).float().sum(dim=0)
                total = part if total is None else total + part
            if start + h.shape[0] < len(tokens):
                yield None
        yield (self._norm(total.contiguous(), self.final_norm).float()[0] if pooling == "last"
               else total / len(tokens))

    def prompt_logprobs(self, token_ids: list[int], top: int = 0, *, page_tokens: int = 16,
                        rows_per_chunk: int = 256, chunk_tokens: int = 2048
                        ) -> list[tuple[float, tuple[tuple[int, float], ...], int]]:
        """For p = 1 .. len(token_ids) - 1: (log P(token[p] | tokens[:p]), the ``top`` most likely tokens at p as
        (id, logprob), most likely first, token[p]'s rank there (1 = most likely)), from the log-softmax of the
        raw float32 logits as the sampler reports generated tokens' logprobs. The sequence runs on its own
        scratch KV cache, ``chunk_tokens`` at a time; the LM head ``rows_per_chunk`` positions at a time."""
        return [entry for part in self.prompt_logprobs_chunks(token_ids, top, page_tokens=page_tokens,
                                                              rows_per_chunk=rows_per_chunk,
                                                              chunk_tokens=chunk_tokens) for entry in part]

    @torch.inference_mode()
    def prompt_logprobs_chunks(self, token_ids: list[int], top: int = 0, *, page_tokens: int = 16,
                               rows_per_chunk: int = 256, chunk_tokens: int = 2048):
        """``prompt_logprobs``' entries, a list per prefill chunk (yielded as each chunk runs)."""
        n = len(token_ids)
        if n == 0 or n > self.max_positions:
            raise ValueError(f"a sequence to score needs 1 to {self.max_positions} tokens, got {n}")
        targets = torch.tensor(list(token_ids[1:]) + [0], dtype=torch.int64, device=self.device)
        for start, h in self._chunked_prefill(list(token_ids), chunk_tokens, page_tokens):
            out = []
            end = min(start + h.shape[0], n - 1)  # positions start .. end - 1 predict a next token
            for a in range(start, end, rows_per_chunk):
                b = min(end, a + rows_per_chunk)
                x = self._norm(h[a - start:b - start].contiguous(), self.final_norm)
                lp = torch.log_softmax(self._logits(x), dim=-1)
                chosen_lp = lp.gather(1, targets[a:b, None])
                ranks = ((lp > chosen_lp).sum(dim=-1) + 1).tolist()
                chosen = chosen_lp[:, 0].tolist()
                if top:
                    values, ids = lp.topk(top, dim=-1)
                    tops = [tuple(zip(i, v)) for i, v in zip(ids.tolist(), values.tolist())]
                else:
                    tops = [()] * (b - a)
                out.extend(zip(chosen, tops, ranks))
            yield out

    def _prefill(self, token_lists: list[list[int]], page_tokens: int) -> torch.Tensor:
        """The residual stream [sum of lengths, hidden] of whole sequences run together on a scratch KV cache."""
        chunks, first_page = [], 0
        for row, tokens in enumerate(token_lists):
            pages = -(-len(tokens) // page_tokens)
            chunks.append(SequenceChunk(tokens, 0, list(range(first_page, first_page + pages)), state_row=row))
            first_page += pages
        kv = self.make_kv_cache(num_pages=first_page, page_tokens=page_tokens, state_rows=len(token_lists))
        batch = ForwardBatch.build(chunks, page_tokens=page_tokens, device=self.device,
                                   sliding_window=self.config.sliding_window)
        return self._layers_forward(batch, kv)

    def _chunked_prefill(self, tokens: list[int], chunk_tokens: int, page_tokens: int):
        """(start, residual stream of tokens[start:start + chunk_tokens]) for one sequence, its chunks run in
        order on one scratch KV cache (each attends to the ones before, as chunked prefill does)."""
        n = len(tokens)
        pages = -(-n // page_tokens)
        kv = self.make_kv_cache(num_pages=pages, page_tokens=page_tokens, state_rows=1)
        for start in range(0, n, chunk_tokens):
            end = min(n, start + chunk_tokens)
            chunk = SequenceChunk(tokens[start:end], start, list(range(-(-end // page_tokens))), state_row=0)
            batch = ForwardBatch.build([chunk], page_tokens=page_tokens, device=self.device,
                                       sliding_window=self.config.sliding_window)
            yield start, self._layers_forward(batch, kv)

    def _layers_forward(self, batch: ForwardBatch, kv: PagedKVCache) -> torch.Tensor:
        """Every decoder layer over the batch's tokens (their K/V written to ``kv``): the residual stream
        [T, hidden] before the final norm."""
        if not self.flush_denormals:
            return self._layer_stack(batch, kv)
        threads = torch.get_num_threads()
        before = flush_denormals(threads, True)
        try:
            return self._layer_stack(batch, kv)
        finally:
            if not before:
                flush_denormals(threads, False)

    def _layer_stack(self, batch: ForwardBatch, kv: PagedKVCache, attend=None) -> torch.Tensor:
        """Every layer over the batch's rows; the residual stream [T, hidden] before the final norm. ``attend``:
        each attention as ``attend(q [T, nh, d], layer, kv_index)`` -> [T, nh * d] over the keys and values ``kv``
        holds (the CUDA graphs' torch layers, kernels/paged_decoder.py: their paged kernels over static inputs),
        instead of _attention's gathers."""
        c = self.config
        num_tokens = batch.num_tokens
        nh, nkv, d = c.num_heads, c.num_kv_heads, c.head_dim
        q_size, kv_size = c.q_size, c.kv_size
        rope_dim = c.rope_dim
        eps = c.rms_norm_eps
        if batch.mrope_positions is None:
            cos = self.rope_cos.index_select(0, batch.positions)[:, None, :]  # [T, 1, d]
            sin = self.rope_sin_signed.index_select(0, batch.positions)[:, None, :]
        else:  # each frequency slot turns by the position its mRoPE section names
            cos = self._mrope(self.rope_cos, batch.mrope_positions)
            sin = self._mrope(self.rope_sin_signed, batch.mrope_positions)
        local = None
        if self.rope_local is not None:  # windowed layers' rope
            local = tuple(t.index_select(0, batch.positions)[:, None, :] for t in self.rope_local)
        h = self.embed.index_select(0, batch.input_ids)  # [T, H]
        if self.pos_embed is not None:  # GPT-2: each position's learned row, added before any layer
            h = h + self.pos_embed.index_select(0, batch.positions)
        if self.embed_norm is not None:  # BLOOM: the embeddings through a LayerNorm of their own
            h = self._norm(h, self.embed_norm)
        if self.embed_scale is not None:  # (Gemma's scaled embedding: an image's rows take its place unscaled)
            h = h * self.embed_scale
        if batch.embed_rows is not None:  # image rows in place of their tokens' embeddings
            h.index_copy_(0, batch.embed_rows, batch.embed_values.to(h.dtype))
        if c.embedding_multiplier is not None:  # Granite's (a Python float, as transformers multiplies), on the
            h = h * c.embedding_multiplier  # model's input: an image's rows too (Granite Vision)
        if c.embedding_norm:  # (nanochat: the embeddings normed before the first layer)
            h = self._norm(h, self.final_norm)
        per_layer_inputs = self._per_layer_inputs(batch, h) if self.per_layer is not None else None

        def position_scale(offset: float, floor: int, beta: float) -> torch.Tensor:
            """Each row's 1 + beta * log(1 + floor((p + offset) / floor)) [T, 1, 1], float32 (made once a forward)."""
            return (torch.log1p(torch.floor((batch.positions.float() + offset) / floor)) * beta + 1.0)[:, None, None]

        # Llama 4's unrotated layers' query temperature ((p + 1), applied in float32) and Ministral 3's every query's
        # (p, rounded to the activations' dtype first), as transformers computes them
        nope_tuning = (position_scale(1.0, c.nope_temperature_floor, c.nope_temperature_scale)
                       if c.nope_temperature_floor else None)
        query_scale = (position_scale(0.0, c.query_position_floor, c.query_position_scale).to(h.dtype)
                       if c.query_position_floor else None)
        produced: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # (Gemma 4: a source layer's keys and values)
        # The Cython decode attention reads pools of the model's dtype and float8 ones (kv_cache_dtype fp8).
        native = self.cpu_decode_attention and kv.storage_dtype in (self.dtype, FP8_KV)
        decode_masked = None
        if batch.decode_attn_mask is not None and (not native or c.global_head_dim or self.alibi is not None):
            # (Gemma 4's global layers and ALiBi's biases: the torch path)
            num_decode = batch.decode_row_ids.shape[0]
            # [1, B, 1, L], True = masked: lines up with scores viewed as [nkv, B, group, L].
            decode_masked = ~batch.decode_attn_mask.view(1, num_decode, 1, batch.decode_max_context)
        lora = bool(batch.lora_groups)
        if c.linear_layers and (kv.states is None or not batch.has_state_rows):
            raise ValueError("a model with recurrent layers needs a cache with state rows (make_kv_cache's "
                             "state_rows) and each sequence's row (SequenceChunk.state_row)")
        if kv.states is not None and batch.fresh_state_rows is not None:  # sequences that start here start at zero
            kv.states.reset(batch.fresh_state_rows)
        for index, layer in enumerate(self.layers):
            if not layer.has_mixer:  # (Nemotron-H's MLP block alone)
                h = self._mlp_residual(index, layer, batch, h, h)
                continue
            x = self._norm(h, layer.attn_norm) if layer.attn_norm is not None else h
            beside = None  # (Falcon-H1: the mixer's output, added to attention's)
            if layer.linear is not None:
                mixer = {"short_conv": self._short_conv, "mamba2": self._mamba2, "mamba1": self._mamba1,
                         "kda": self._kda}.get(c.linear_kind, self._gated_delta)
                beside = mixer(index, layer, batch, kv, x)
                if layer.qkv is None:
                    h = self._residual_and_mlp(index, layer, batch, h, x, beside)
                    continue
            if layer.absorb is not None:  # latent attention served absorbed (ModelConfig.latent_kv)
                o = self._absorbed_attention(index, layer, batch, kv, x, cos, sin, attend)
                h = self._residual_and_mlp(index, layer, batch, h, x, o)
                continue
            qkv = layer.qkv(x) if layer.latent is None else self._latent_qkv(layer, x)  # [T, q_size + 2 * kv_size]
            if c.clip_qkv:  # (OLMo's clamp of every projected q, k and v value)
                qkv = qkv.clamp(-c.clip_qkv, c.clip_qkv)
            layer_cos, layer_sin = local if local is not None and layer.window else (cos, sin)
            nkv, d = layer.geometry  # (Gemma 4's global layers: their own)
            q_size, kv_size = nh * d, nkv * d
            if layer.kv_source is not None:  # (Gemma 4's shared-KV layers: queries alone)
                kv_size = 0
            if lora:
                qkv = self._lora(batch, f"layers.{index}.qkv.weight", x, qkv)
            qk = qkv[:, :q_size + kv_size].reshape(num_tokens, nh + kv_size // d, d)
            # (Gemma 4's global layers: the values are the keys' projection, taken before the key norm and rope)
            v = qkv[:, q_size:q_size + kv_size] if layer.keys_as_values else qkv[:, q_size + kv_size:q_size + 2 * kv_size]
            if c.qk_norm_whole:
                q_weight, k_weight = layer.qk_norm
                qk = torch.cat([rms_norm(qkv[:, :q_size], q_weight, eps),
                                rms_norm(qkv[:, q_size:q_size + kv_size], k_weight, eps)], dim=1)
                qk = qk.view(num_tokens, nh + nkv, d)
            elif c.qk_norm_after_rope:  # (Hunyuan's: below, after rope)
                pass
            elif layer.qk_norm is not None and c.qk_layer_norm_per_head:  # StableLM 2 12B: a LayerNorm a head, in
                # float32 with one rounding
                qk = (F.layer_norm(qk.float(), (d,), None, None, eps) * layer.qk_norm.float()).to(qk.dtype)
            elif layer.qk_norm is not None and layer.qk_norm.dtype != qk.dtype:  # Gemma's: in float32, one rounding
                qk = (rms_norm(qk.float(), None, eps) * layer.qk_norm).to(qk.dtype)
            elif layer.qk_norm is not None:
                qk = rms_norm(qk, None, eps) * layer.qk_norm
            if layer.rope and layer_cos.shape[-1] == d:  # (SmolLM3's NoPE layers attend unrotated)
                qk = _turn(qk, layer_cos, layer_sin)
            elif layer.rope:  # Phi-4-mini's partial rotary: the first rope_dim columns of each head turn
                turned = qk[..., :rope_dim]
                qk = torch.cat((_turn(turned, layer_cos, layer_sin),
                                qk[..., rope_dim:]), dim=-1)
            if c.qk_norm_after_rope:  # Hunyuan: each rotated q and k head normed
                qk = rms_norm(qk, None, eps) * layer.qk_norm
            elif c.qk_l2_norm and layer.rope:  # Llama 4's rotated layers: each q and k head normed, no weight
                qk = F.rms_norm(qk.float(), (d,), None, eps).to(qk.dtype)
            q = qk[:, :nh]
            if nope_tuning is not None and not layer.rope:  # Llama 4's unrotated layers: queries tuned by position
                q = (q.float() * nope_tuning).to(q.dtype)
            if query_scale is not None:  # Ministral 3: every query scaled by its position
                q = q * query_scale
            if layer.kv_source is not None:  # this forward's keys and values of the layer it shares them with
                k, v = produced[layer.kv_source]
            else:
                k = qk[:, nh:]
                v = v.view(num_tokens, nkv, d)
                if c.v_norm:  # Gemma 4: each value head RMS-normed in float32, no weight
                    v = F.rms_norm(v.float(), (d,), None, eps).to(v.dtype)
                kv.write(layer.kv_index, batch.write_slot_ids, k, v)
                if c.kv_shared_layers:
                    produced[index] = (k, v)
            if attend is not None:
                attn = attend(q, index, layer.kv_index)
            else:
                attn = self._attention(index, batch, kv, q, k, v, decode_masked, native)  # [T, nh * d]
            if c.v_head_dim:  # (latent attention's values fill the first v_head_dim of each head's d)
                attn = attn.view(num_tokens, nh, d)[..., :c.v_head_dim].reshape(num_tokens, nh * c.v_head_dim)
            if c.attn_output_gate:  # Qwen3-Next: the output times sigmoid of the gate's rows (after v's)
                attn = attn * torch.sigmoid(qkv[:, q_size + 2 * kv_size:])
            o = layer.o(attn)
            if lora:
                o = self._lora(batch, f"layers.{index}.o.weight", attn, o)
            if beside is not None:
                o = beside + o
            h = self._residual_and_mlp(index, layer, batch, h, x, o)
            if layer.per_layer is not None:  # Gemma 4 E2B / E4B: the layer's own input, gated by the residual
                gate, out, norm = layer.per_layer
                gated = F.gelu(gate(h), approximate="tanh") * per_layer_inputs[:, index]
                h = h + self._norm(out(gated), norm)
            if layer.scalar is not None:  # (Gemma 4's layer_scalar)
                h = h * layer.scalar
        return h

    def _per_layer_inputs(self, batch: ForwardBatch, h: torch.Tensor) -> torch.Tensor:
        """Gemma 4 E2B / E4B: every layer's input [T, layers, per_layer_input_dim] from the tokens' rows of
        embed_per_layer (times sqrt of its width) and the scaled embedding h through per_layer_proj (times
        hidden^-0.5, normed per layer), their sum times 2^-0.5, as transformers rounds them."""
        c = self.config
        table, proj, norm = self.per_layer
        shape = (h.shape[0], c.num_layers, c.per_layer_input_dim)
        ids = batch.input_ids
        if self.image_identity_token is not None and batch.embed_rows is not None:  # (an image row: the pad token's)
            ids = ids.index_fill(0, batch.embed_rows, self.image_identity_token)
        own = table.index_select(0, ids) * self.per_layer_scale
        projected = self._norm((proj(h) * c.hidden_size ** -0.5).view(shape), norm)
        return (projected + own.view(shape)) * 2.0 ** -0.5

    def _residual_and_mlp(self, index: int, layer: _Layer, batch: ForwardBatch, h: torch.Tensor, x: torch.Tensor,
                          o: torch.Tensor) -> torch.Tensor:
        """The rest of layer ``index`` after its token mixer (attention or Gated DeltaNet) gave ``o`` from the normed
        input ``x``: o added to the residual ``h`` (normed, scaled as the family does), then the MLP's (or the
        experts') output likewise. Returns the new residual."""
        c = self.config
        if layer.post_attn_norm is not None:
            o = self._norm(o, layer.post_attn_norm)
        if c.residual_multiplier is not None:  # Granite's residual branches are scaled before they are added
            o = o * c.residual_multiplier
        if c.parallel_norms and layer.mlp_norm is not None:  # GPT-NeoX: the MLP's own norm of the layer's input
            x = self._norm(h, layer.mlp_norm)
        h = h + o
        if not layer.has_mlp:  # (Nemotron-H's mixer block alone)
            return h
        return self._mlp_residual(index, layer, batch, h, x)

    def _mlp_residual(self, index: int, layer: _Layer, batch: ForwardBatch, h: torch.Tensor,
                      x: torch.Tensor) -> torch.Tensor:
        """Layer ``index``'s MLP (or experts) over the residual ``h`` (normed by mlp_norm; Cohere's parallel block
        reads the mixer's normed input ``x``), its output added to h. Returns the new residual."""
        c = self.config
        lora = bool(batch.lora_groups)
        if not c.parallel_block:  # (Cohere's MLP reads the attention's normed input x)
            x = self._norm(h, layer.mlp_norm) if layer.mlp_norm is not None else h
        if layer.beside is not None:
            down = self._mlp_beside_experts(layer, h, x)
        elif layer.experts is not None:
            down = self._routed_mlp(layer, x)
        else:
            gate_up = layer.gate_up(x)
            if lora:
                gate_up = self._lora(batch, f"layers.{index}.gate_up.weight", x, gate_up)
            act = self._activation(gate_up) if layer.xielu is None else _xielu(gate_up, *layer.xielu)
            down = layer.down(act)
            if lora:
                down = self._lora(batch, f"layers.{index}.down.weight", act, down)
        if layer.post_mlp_norm is not None:
            down = self._norm(down, layer.post_mlp_norm)
        if c.residual_multiplier is not None:
            down = down * c.residual_multiplier
        h = h + down
        if batch.deepstack_values is not None and index < len(batch.deepstack_values):
            # Qwen3-VL's DeepStack: a tower layer's rows added to the image tokens' state after this layer
            h.index_add_(0, batch.embed_rows, batch.deepstack_values[index].to(h.dtype))
        return h

    def _gated_delta(self, index: int, layer: _Layer, batch: ForwardBatch, kv: PagedKVCache,
                     x: torch.Tensor) -> torch.Tensor:
        """A Gated DeltaNet layer over the normed rows x [T, H] -> its output projection's [T, H]: the input
        projection's q, k, v through the causal convolution (each sequence's last kernel - 1 inputs before its
        tokens from its state row) and SiLU, then the gated delta rule from the row's state matrix (decode rows one
        step each, batched; a prefill chunk in the chunked form), the outputs RMS-normed per head, times SiLU(z),
        through o. Each sequence's row is left holding its state after these tokens."""
        c = self.config
        project, conv_weight, dt_bias, decay_scale, norm_weight = layer.linear
        states = kv.states
        j = states.layer_index[index]
        nk, nv, dk, dv = c.linear_key_heads, c.linear_value_heads, c.linear_key_dim, c.linear_value_dim
        channels, value = c.linear_conv_dim, nv * dv
        mixed = project(x)  # [T, q k v | z | b | a]
        z = mixed[:, channels:channels + value]
        b = mixed[:, channels + value:channels + value + nv]
        a = mixed[:, channels + value + nv:]
        g = decay_scale * F.softplus(a.float() + dt_bias.float())  # [T, nv], log decays <= 0
        beta = torch.sigmoid(b).float()
        if c.linear_neg_eigval:  # (OLMo Hybrid's: beta in [0, 2])
            beta = beta * 2.0
        qkv = mixed[:, :channels]
        out = x.new_empty(x.shape[0], nv, dv)

        def split(conv_out: torch.Tensor):  # [rows, C] -> prepared q, k [rows, nv, dk], v [rows, nv, dv]
            q, k, v = conv_out.split([nk * dk, nk * dk, value], dim=-1)
            q, k = prepare(q.reshape(-1, nk, dk), k.reshape(-1, nk, dk), nv)
            return q, k, v.reshape(-1, nv, dv)

        convolved = F.silu(self._causal_conv(states.conv[j], batch, qkv, conv_weight))  # [T, C] row-major
        if batch.decode_row_ids is not None:
            rows, state_rows = batch.decode_row_ids, batch.decode_state_rows
            conv_out = convolved.index_select(0, rows)
            if self.cpu_delta_step:  # in place on the rows (the layer's state [rows, nv, dk, dv] is contiguous)
                q, k, v = split(conv_out)
                q, k = q.contiguous(), k.contiguous()
                v = v.float().contiguous()
                step_g, step_beta = g.index_select(0, rows), beta.index_select(0, rows)
                o = torch.empty(rows.shape[0], nv, dv, dtype=torch.float32)
                _cpu_delta.gated_delta_step(
                    states.ssm[j].data_ptr(), state_rows.data_ptr(), q.data_ptr(), k.data_ptr(), v.data_ptr(),
                    step_g.data_ptr(), step_beta.data_ptr(), o.data_ptr(), rows.shape[0], nv, dk, dv,
                    torch.get_num_threads())
            else:
                state = states.ssm[j].index_select(0, state_rows)
                o = gated_delta_step(*split(conv_out), g.index_select(0, rows), beta.index_select(0, rows), state)
                states.ssm[j].index_copy_(0, state_rows, state)
            out.index_copy_(0, rows, o.to(out.dtype))
        for group in batch.prefill_groups:
            lo, hi, row = group.row_start, group.row_end, group.state_row
            o = chunked_gated_delta(*split(convolved[lo:hi]), g[lo:hi], beta[lo:hi], states.ssm[j, row])
            out[lo:hi] = o.to(out.dtype)
        # Qwen3-Next's gated RMSNorm: normed in float32, times the weight in the model's dtype, times SiLU(z) in float32
        eps = c.rms_norm_eps if c.linear_norm_eps is None else c.linear_norm_eps  # (OLMo Hybrid's: FLA's 1e-5)
        normed = F.rms_norm(out.float(), (dv,), None, eps).to(x.dtype) * norm_weight
        gated = (normed.float() * F.silu(z.float().view(-1, nv, dv))).to(x.dtype)
        return layer.o(gated.view(-1, value))

    def _kda(self, index: int, layer: _Layer, batch: ForwardBatch, kv: PagedKVCache, x: torch.Tensor) -> torch.Tensor:
        """A Kimi Delta Attention layer over the normed rows x [T, H] -> [T, H], as transformers' torch path computes
        it: q, k and v through the causal convolution and SiLU (q and k L2-normed, q scaled by head_dim ** -0.5), the
        gated delta rule with a decay per key channel (-exp(A_log) softplus(f_b(f_a x) + dt_bias)) and beta =
        sigmoid(b x), from each sequence's state row (prefill in chunks, decode a step a row); the output RMS-normed per head (float32, its
        weight float32) times sigmoid(g_b(g_a x)), through o."""
        c = self.config
        project, conv_weight, f_b, g_b, dt_bias, decay_scale, norm_weight = layer.linear
        states = kv.states
        j = states.layer_index[index]
        heads, head = c.linear_value_heads, c.linear_value_dim
        channels = c.linear_conv_dim
        rows = x.shape[0]
        mixed = project(x)  # [T, q k v | b | f_a | g_a]
        b, f_a, g_a = mixed[:, channels:].split([heads, head, head], dim=-1)
        g = (decay_scale[:, None] * F.softplus(f_b(f_a).float() + dt_bias).view(rows, heads, head))  # [T, h, dk]
        beta = torch.sigmoid(b.float())
        convolved = F.silu(self._causal_conv(states.conv[j], batch, mixed[:, :channels], conv_weight))
        q, k, v = convolved.view(rows, 3, heads, head).unbind(1)
        q, k = prepare(q, k, heads)
        out = torch.empty(rows, heads, head, dtype=torch.float32, device=x.device)
        if batch.decode_row_ids is not None:
            decode, state_rows = batch.decode_row_ids, batch.decode_state_rows
            state = states.ssm[j].index_select(0, state_rows)
            out.index_copy_(0, decode, channel_delta_step(q[decode], k[decode], v[decode], g[decode], beta[decode],
                                                          state))
            states.ssm[j].index_copy_(0, state_rows, state)
        for group in batch.prefill_groups:
            lo, hi = group.row_start, group.row_end
            out[lo:hi] = chunked_channel_delta(q[lo:hi], k[lo:hi], v[lo:hi], g[lo:hi], beta[lo:hi],
                                               states.ssm[j, group.state_row])
        gate = torch.sigmoid(g_b(g_a).float()).view(rows, heads, head)
        normed = F.rms_norm(out, (head,), norm_weight, c.rms_norm_eps) * gate
        return layer.o(normed.to(x.dtype).view(rows, heads * head))

    def _short_conv(self, index: int, layer: _Layer, batch: ForwardBatch, kv: PagedKVCache,
                    x: torch.Tensor) -> torch.Tensor:
        """LFM2's gated short convolution over the normed rows x [T, H] -> [T, H]: the projection's B, C and x, B * x
        through the causal convolution (each sequence's last kernel - 1 inputs from its state row), times C, through
        o."""
        project, conv_weight = layer.linear
        gate_b, gate_c, values = project(x).chunk(3, dim=-1)
        convolved = self._causal_conv(kv.states.conv[kv.states.layer_index[index]], batch, gate_b * values,
                                      conv_weight)
        return layer.o(gate_c * convolved)

    def _mamba2(self, index: int, layer: _Layer, batch: ForwardBatch, kv: PagedKVCache,
                x: torch.Tensor) -> torch.Tensor:
        """A Mamba-2 mixer over the normed rows x [T, H] -> [T, H], as transformers' torch path computes it: the
        projection's z, x B C (through the causal convolution, its bias and SiLU) and dt (softplus(dt + dt_bias)); the
        state space scan in float32 (each head's state decayed by exp(dt A), fed dt x B^T, read by C: linear attention
        with B, C shared by the heads of a group), plus D x; y times SiLU(z), RMS-normed in groups, times the norm's
        weight, through o."""
        c = self.config
        project, conv_weight, conv_bias, dt_bias, decay_scale, skip, norm_weight = layer.linear
        states = kv.states
        j = states.layer_index[index]
        heads, head, groups, size = c.linear_value_heads, c.linear_value_dim, c.linear_key_heads, c.linear_key_dim
        inner, rows = heads * head, x.shape[0]
        z, xbc, dt = project(x).split([inner, c.linear_conv_dim, heads], dim=-1)
        convolved = self._causal_conv(states.conv[j], batch, xbc, conv_weight)
        if conv_bias is not None:
            convolved = convolved + conv_bias
        xs, b, cq = F.silu(convolved).split([inner, groups * size, groups * size], dim=-1)
        dt = F.softplus(dt.float() + dt_bias)  # [T, heads]
        xs = xs.float().view(rows, heads, head)
        q = cq.float().view(rows, groups, size).repeat_interleave(heads // groups, dim=1)
        k = b.float().view(rows, groups, size).repeat_interleave(heads // groups, dim=1)
        v = xs * dt[..., None]
        g = dt * decay_scale
        out = torch.empty(rows, heads, head, dtype=torch.float32, device=x.device)
        if batch.decode_row_ids is not None and self.cpu_delta_step:  # in place on the rows (flared/_fast/delta.pyx)
            decode, state_rows = batch.decode_row_ids, batch.decode_state_rows
            q_rows, k_rows, v_rows, g_rows = (t.index_select(0, decode).contiguous() for t in (q, k, v, g))
            step = torch.empty(decode.shape[0], heads, head, dtype=torch.float32)
            _cpu_delta.decay_step(states.ssm[j].data_ptr(), state_rows.data_ptr(), q_rows.data_ptr(),
                                  k_rows.data_ptr(), v_rows.data_ptr(), g_rows.data_ptr(), step.data_ptr(),
                                  decode.shape[0], heads, size, head, torch.get_num_threads())
            out.index_copy_(0, decode, step)
        elif batch.decode_row_ids is not None:
            decode, state_rows = batch.decode_row_ids, batch.decode_state_rows
            state = states.ssm[j].index_select(0, state_rows)
            out.index_copy_(0, decode, linear_attention_step(q[decode], k[decode], v[decode], g[decode], state))
            states.ssm[j].index_copy_(0, state_rows, state)
        for group in batch.prefill_groups:
            lo, hi = group.row_start, group.row_end
            out[lo:hi] = chunked_linear_attention(q[lo:hi], k[lo:hi], v[lo:hi], g[lo:hi],
                                                  states.ssm[j, group.state_row])
        y = (out + skip[:, None] * xs).to(x.dtype).view(rows, inner)
        out_proj = layer.linear_o or layer.o  # (Falcon-H1's mixer beside attention has its own)
        gated = y.float() * F.silu(z.float())
        if norm_weight is None:  # (Falcon-H1 without mamba_rms_norm: no norm)
            return out_proj(gated.to(x.dtype))
        normed = F.rms_norm(gated.view(rows, groups, inner // groups), (inner // groups,), None,
                            c.rms_norm_eps).view(rows, inner)
        return out_proj(norm_weight * normed.to(x.dtype))

    def _mamba1(self, index: int, layer: _Layer, batch: ForwardBatch, kv: PagedKVCache,
                x: torch.Tensor) -> torch.Tensor:
        """A Mamba-1 mixer (Jamba's) over the normed rows x [T, H] -> [T, H], as transformers' torch path computes it:
        the projection's x (through the causal convolution, its bias and SiLU) and z; x_proj's dt input, B and C, each
        RMS-normed; dt = softplus(dt_proj(dt input) + dt_bias); the selective scan in float32 (each channel's state
        decayed per state by exp(dt A), fed dt x B, read by C), plus D x; y times SiLU(z), through o."""
        c = self.config
        project, conv_weight, conv_bias, x_proj, dt_proj, dt_bias, decay, skip, dt_norm, b_norm, c_norm = layer.linear
        states = kv.states
        j = states.layer_index[index]
        channels, size, rank = c.linear_value_heads, c.linear_key_dim, c.linear_dt_rank
        xs, z = project(x).chunk(2, dim=-1)
        convolved = self._causal_conv(states.conv[j], batch, xs, conv_weight)
        if conv_bias is not None:
            convolved = convolved + conv_bias
        xs = F.silu(convolved)
        dt, b, cq = x_proj(xs).split([rank, size, size], dim=-1)
        if dt_norm is not None:  # (Jamba's, Falcon-Mamba's of its own epsilon; a Mamba language model's mixers have none)
            eps = c.rms_norm_eps if c.linear_norm_eps is None else c.linear_norm_eps
            dt, b, cq = rms_norm(dt, dt_norm, eps), rms_norm(b, b_norm, eps), rms_norm(cq, c_norm, eps)
        dt = F.softplus(dt_proj(dt).float() + dt_bias)  # [T, C]
        u = dt * xs.float()
        log_decay = dt[:, :, None] * decay  # [T, C, N]
        out = torch.empty(x.shape[0], channels, dtype=torch.float32, device=x.device)
        ssm = states.ssm[j].view(states.rows, channels, size)  # (each row's [C, N, 1] state)
        if batch.decode_row_ids is not None:
            rows, state_rows = batch.decode_row_ids, batch.decode_state_rows
            state = ssm.index_select(0, state_rows)
            out.index_copy_(0, rows, selective_step(u[rows], b[rows].float(), cq[rows].float(), log_decay[rows], state))
            ssm.index_copy_(0, state_rows, state)
        for group in batch.prefill_groups:
            lo, hi = group.row_start, group.row_end
            out[lo:hi] = chunked_selective_scan(u[lo:hi], b[lo:hi], cq[lo:hi], log_decay[lo:hi], ssm[group.state_row])
        y = (out + skip * xs.float()).to(x.dtype)
        return layer.o((y.float() * F.silu(z.float())).to(x.dtype))

    @staticmethod
    def _causal_conv(conv_state: torch.Tensor, batch: ForwardBatch, inputs: torch.Tensor,
                     weight: torch.Tensor) -> torch.Tensor:
        """A causal depthwise convolution over each sequence's rows of inputs [T, C] (weight [C, K]), each sequence's
        last K - 1 inputs before its rows from its state row of ``conv_state`` [rows, C, K - 1], which is left holding
        the last K - 1 inputs after them -> [T, C] row-major, in the inputs' dtype (transformers' causal_conv1d)."""
        kernel = weight.shape[1]
        out = torch.empty_like(inputs)
        if batch.decode_row_ids is not None:  # one input each: the state's K - 1 and it, times the weight
            rows, state_rows = batch.decode_row_ids, batch.decode_state_rows
            window = torch.cat([conv_state.index_select(0, state_rows), inputs.index_select(0, rows)[:, :, None]],
                               dim=-1)  # [B, C, K]
            conv_state.index_copy_(0, state_rows, window[:, :, 1:])
            out.index_copy_(0, rows, (window * weight).sum(dim=-1))
        for group in batch.prefill_groups:
            lo, hi, row = group.row_start, group.row_end, group.state_row
            joined = torch.cat([conv_state[row], inputs[lo:hi].t()], dim=-1)  # [C, K - 1 + L]
            conv_state[row] = joined[:, -(kernel - 1):]
            out[lo:hi] = F.conv1d(joined[None], weight[:, None, :], groups=weight.shape[0])[0].t()
        return out

    def _absorbed_attention(self, index: int, layer: _Layer, batch: ForwardBatch, kv: PagedKVCache, x: torch.Tensor,
                            cos: torch.Tensor, sin: torch.Tensor, attend) -> torch.Tensor:
        """DeepSeek's latent attention over the normed rows x [T, H] -> the o projection's [T, H], absorbed: each
        token keeps one row in the cache, its normed latent (kv_a's first kv_lora_rank) then the shared rotated key
        part (kv_a's last rope_dim); each head's query is its unrotated part through the head's key rows of kv_b
        (into the latent) beside its rotated part, so q . row is the expanded form's q . k; the attention's output
        [T, nh, rank] (the latent as the values) goes through the head's value rows of kv_b to v_head_dim."""
        c = self.config
        q_a, q_a_norm, q_b, kv_a, kv_a_norm, _ = layer.latent
        key_rows, value_rows = layer.absorb  # [nh, d - r, rank], [nh, rank, v]
        rows, nh, d, r, rank = x.shape[0], c.num_heads, c.head_dim, c.rope_dim, c.kv_lora_rank
        bottleneck = rms_norm(q_a(x), q_a_norm, c.rms_norm_eps) if q_a is not None else None
        q = q_b(x if bottleneck is None else bottleneck).view(rows, nh, d)
        compressed = kv_a(x)
        latent = rms_norm(compressed[:, :rank].contiguous(), kv_a_norm, c.rms_norm_eps)
        turned = torch.cat([q[..., :r], compressed[:, None, rank:]], dim=1)  # [T, nh + 1, r]: the queries', the key's
        if layer.rope:  # (Kimi Linear's latent layers are unrotated)
            turned = _turn(turned, cos, sin)
        q_latent = torch.bmm(q[..., r:].transpose(0, 1), key_rows).transpose(0, 1)  # [T, nh, rank]
        row = [latent, turned[:, nh]]
        sparse = None
        if layer.indexer is not None:  # (DeepSeek V3.2: the indexer's queries and head weights; its key in the row)
            *sparse, index_keys = self._index_queries(layer, x, bottleneck, cos, sin)
            row.append(index_keys)
        elif c.index_topk:  # (GLM-5's shared layers: the last indexer's choice; no key of their own)
            sparse = "shared"
            row.append(latent.new_zeros(rows, c.index_head_dim))
        k = torch.cat(row, dim=-1)[:, None]  # [T, 1, rank + r (+ the indexer's key)]
        kv.write(layer.kv_index, batch.write_slot_ids, k, None)
        absorbed = torch.cat([q_latent, turned[:, :nh]], dim=-1)  # [T, nh, rank + r]
        if attend is not None:
            out = attend(absorbed, index, layer.kv_index).view(rows, nh, rank)
            heads = torch.bmm(out.transpose(0, 1), value_rows).transpose(0, 1)  # [T, nh, v]
        else:  # (the expanded form's queries: the rotated part first, as the prefill may expand the keys for them)
            heads = self._latent_attention(layer, batch, kv, absorbed, k, torch.cat([turned[:, :nh], q[..., r:]], dim=-1),
                                           sparse)
        return layer.o(heads.reshape(rows, nh * c.v_head_dim))

    def _index_queries(self, layer: _Layer, x: torch.Tensor, bottleneck: torch.Tensor, cos: torch.Tensor,
                       sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """DeepSeek V3.2's indexer for the rows x [T, H]: its queries [T, index heads, index dim] from the query
        bottleneck, each head's weight [T, index heads] (float32, times heads^-0.5 and the score scale), and the rows'
        own LayerNormed key [T, index dim]; the first rope_dim of the queries and key turned (halves)."""
        c = self.config
        project_q, project_k, (norm_weight, norm_bias), head_weights = layer.indexer
        rows, heads, dim, r = x.shape[0], c.index_heads, c.index_head_dim, c.rope_dim
        keys = F.layer_norm(project_k(x), (dim,), norm_weight, norm_bias, 1e-6)
        both = torch.cat([project_q(bottleneck).view(rows, heads, dim), keys[:, None]], dim=1)  # [T, heads + 1, dim]
        both = torch.cat([_turn(both[..., :r], cos, sin), both[..., r:]], dim=-1)
        weights = head_weights(x).float() * (heads ** -0.5 * dim ** -0.5)
        return both[:, :heads], weights, both[:, heads]

    def _index_selection(self, sparse: list, keys: torch.Tensor, visible: torch.Tensor) -> torch.Tensor:
        """Sparse attention's choice for the queries of ``sparse`` (_index_queries' queries [Q, heads, dim] and weights
        [Q, heads]) among the keys [.., L, dim] they may see (``visible`` [Q, L] bool): each query's index_topk best
        keys by sum over heads of weight * relu(q . k), as a mask [Q, L] (True: attended); ``visible`` itself where no
        query sees more than index_topk. Keys [L, dim] are shared by every query; [Q, L, dim] are each query's own."""
        if keys.shape[-2] <= self.config.index_topk:
            return visible
        queries, weights = sparse[0].float(), sparse[1]
        chosen = torch.zeros_like(visible)
        step = max(1, (1 << 24) // max(1, queries.shape[1] * keys.shape[-2]))  # (rows of [Q, heads, L] a pass)
        for lo in range(0, queries.shape[0], step):
            hi = min(lo + step, queries.shape[0])
            own = keys[lo:hi] if keys.dim() == 3 else keys
            scores = torch.relu(torch.matmul(queries[lo:hi], own.float().transpose(-1, -2)))  # [q, heads, L]
            ranked = torch.matmul(weights[lo:hi, None], scores)[:, 0]  # [q, L]
            ranked = ranked.masked_fill(~visible[lo:hi], float("-inf"))
            chosen[lo:hi].scatter_(1, ranked.topk(self.config.index_topk, dim=-1).indices, True)
        return chosen & visible

    def _latent_attention(self, layer: _Layer, batch: ForwardBatch, kv: PagedKVCache, q: torch.Tensor,
                          k: torch.Tensor, q_heads: torch.Tensor, sparse: list | str | None = None) -> torch.Tensor:
        """The absorbed queries q [T, nh, rank + r] over the latent rows (k [T, 1, rank + r]: this forward's, already
        in the cache) -> each head's output [T, nh, v]: one key row a token for every head, its first rank its value,
        the outputs out of the latent through kv_b's value rows. A prefill chunk whose keys cost less expanded than
        its queries cost absorbed attends expanded instead: each key row through kv_b's key and value rows, the
        expanded queries ``q_heads`` [T, nh, d] (the rotated part first) over them, as the expanded layout does.
        ``sparse`` (DeepSeek V3.2: _index_queries' queries and weights for these rows; "shared": GLM-5's reuse of the
        last indexer's choice): each query attends only the keys the indexer picks (_index_selection), the rows' tails
        holding the indexer's keys.
        (The products take whole rows as values and keep what they need: torch's fused CPU attention wants values as
        wide as the keys, and its other path is 5-12x slower.)"""
        c = self.config
        rank, nh, d, v_dim = c.kv_lora_rank, c.num_heads, c.head_dim, c.v_head_dim
        width = rank + c.rope_dim  # (the latent and rotated part of a row; the indexer's key after them)
        key_rows, value_rows = layer.absorb
        cached = layer.kv_index
        out = q.new_empty(batch.num_tokens, nh, v_dim) if batch.prefill_groups else None

        def leave_latent(o: torch.Tensor) -> torch.Tensor:  # [n, nh, rank + r] -> [n, nh, v]
            return torch.bmm(o[..., :rank].transpose(0, 1), value_rows).transpose(0, 1)

        if batch.decode_row_ids is not None:
            num_decode, max_context = batch.decode_row_ids.shape[0], batch.decode_max_context
            rows = kv.gather(cached, batch.decode_gather_slot_ids)[0].view(num_decode, max_context, -1)
            keys = rows[..., :width]
            qd = q if out is None else q.index_select(0, batch.decode_row_ids)
            scores = torch.bmm(qd, keys.transpose(1, 2)).float() * self.scale  # [B, nh, L]
            visible = batch.decode_attn_mask.view(num_decode, max_context)
            if sparse == "shared":  # (GLM-5: the choice of the last layer with an indexer)
                visible = batch.window_masks[("index", "decode")]
            elif sparse is not None:
                own = sparse if out is None else [x.index_select(0, batch.decode_row_ids) for x in sparse]
                visible = batch.window_masks[("index", "decode")] = self._index_selection(own, rows[..., width:],
                                                                                          visible)
            scores.masked_fill_(~visible[:, None], float("-inf"))
            o = leave_latent(torch.bmm(torch.softmax(scores, dim=-1).to(q.dtype), keys))  # [B, nh, v]
            if out is None:
                return o  # decode rows are then exactly rows 0..B-1 in order
            out.index_copy_(0, batch.decode_row_ids, o)
        for gi, g in enumerate(batch.prefill_groups):
            q_len = g.row_end - g.row_start
            if g.attn_mask is None:  # no cached prefix: the chunk's own rows, as the cache holds them
                rows = kv.as_stored(k[g.row_start:g.row_end])[:, 0]  # [q_len, row]
            else:
                rows = kv.gather(cached, g.gather_slot_ids)[0][0]  # [L, row]
            keys, length = rows[:, :width], rows.shape[0]
            mask = g.attn_mask
            if sparse == "shared":
                mask = batch.window_masks[("index", gi)]
            elif sparse is not None:  # (the group's queries are the last q_len of its keys' positions)
                visible = mask if mask is not None else torch.ones(q_len, length, dtype=torch.bool,
                                                                     device=q.device).tril(length - q_len)
                mask = batch.window_masks[("index", gi)] = self._index_selection(
                    [x[g.row_start:g.row_end] for x in sparse], rows[:, width:], visible)
            pairs = q_len * (length - q_len / 2)  # (the causal (query, key) pairs)
            if length * rank * (d - c.rope_dim + v_dim) + pairs * 2 * d < pairs * 2 * (rank + c.rope_dim):
                latents = keys[:, :rank].expand(nh, length, rank)
                nope = torch.bmm(latents, key_rows.transpose(1, 2))  # [nh, L, d - r]
                k_heads = torch.cat([keys[None, :, rank:].expand(nh, length, c.rope_dim), nope], dim=-1)
                v_heads = torch.bmm(latents, value_rows)  # [nh, L, v], padded to d below (the fused path's)
                v_heads = torch.cat([v_heads, v_heads.new_zeros(nh, length, d - v_dim)], dim=-1)
                qg = q_heads[g.row_start:g.row_end].transpose(0, 1).unsqueeze(0)  # [1, nh, q_len, d]
                o = self._prefill_attention(qg, k_heads[None], v_heads[None], mask)  # [1, nh, q_len, d]
                out[g.row_start:g.row_end] = o[0, ..., :v_dim].transpose(0, 1)
            else:
                qg = q[g.row_start:g.row_end].transpose(0, 1).unsqueeze(0)  # [1, nh, q_len, rank + r]
                o = self._prefill_attention(qg, keys[None, None], keys[None, None], mask)  # [1, nh, q_len, rank + r]
                out[g.row_start:g.row_end] = leave_latent(o[0].transpose(0, 1))
        return out

    def _latent_qkv(self, layer: _Layer, x: torch.Tensor) -> torch.Tensor:
        """DeepSeek's latent attention as the fused layout's [T, q_size + 2 * kv_size] (a key/value head per query
        head): queries from x (through q_a's normed bottleneck); the latent (kv_a's first kv_lora_rank, normed) through
        kv_b to each head's unrotated key part and value; every head's key led by the one shared rotated part (kv_a's
        last rope_dim); values padded with zeros to head_dim."""
        c = self.config
        q_a, q_a_norm, q_b, kv_a, kv_a_norm, kv_b = layer.latent
        rows, nh, d, r = x.shape[0], c.num_heads, c.head_dim, c.rope_dim
        q = q_b(rms_norm(q_a(x), q_a_norm, c.rms_norm_eps)) if q_a is not None else q_b(x)
        compressed = kv_a(x)
        latent = rms_norm(compressed[:, :c.kv_lora_rank].contiguous(), kv_a_norm, c.rms_norm_eps)
        kv_b_out = kv_b(latent).view(rows, nh, d - r + c.v_head_dim)
        k = torch.cat([compressed[:, None, c.kv_lora_rank:].expand(rows, nh, r), kv_b_out[..., :d - r]], dim=-1)
        v = torch.cat([kv_b_out[..., d - r:], x.new_zeros(rows, nh, d - c.v_head_dim)], dim=-1)
        return torch.cat([q, k.reshape(rows, nh * d), v.reshape(rows, nh * d)], dim=1)

    def _norm(self, x: torch.Tensor, weight) -> torch.Tensor:
        """The family's norm of the rows of x: RMSNorm, or Cohere's LayerNorm (mean-centred, in float32 with float32
        weights, rounded once; ``weight`` a (weight, bias) pair where the norm has a bias: StarCoder2's)."""
        if self.config.layer_norm:
            weight, bias = weight if isinstance(weight, tuple) else (weight, None)
            return F.layer_norm(x.float(), (x.shape[-1],), weight.float(), None if bias is None else bias.float(),
                                self.config.rms_norm_eps).to(x.dtype)
        return rms_norm(x, weight, self.config.rms_norm_eps)

    def _activation(self, gate_up: torch.Tensor) -> torch.Tensor:
        """[T, 2 I] gate rows then up rows -> act(gate) * up [T, I]; an ungated MLP's [T, I] up rows -> act(up)
        (Nemotron-H's squared ReLU, StarCoder2's tanh-GELU)."""
        if not self.config.mlp_gated:
            if self.config.hidden_act in ("gelu_pytorch_tanh", "gelu"):  # (GPT-NeoX's exact one)
                return F.gelu(gate_up, approximate="tanh" if self.config.hidden_act == "gelu_pytorch_tanh" else "none")
            if self.config.hidden_act == "relu":  # (OPT's)
                return F.relu(gate_up)
            return torch.square(F.relu(gate_up))
        inter = gate_up.shape[1] // 2
        gate = gate_up[:, :inter]
        gate = F.silu(gate) if self.config.hidden_act == "silu" else F.gelu(gate, approximate="tanh")
        return gate * gate_up[:, inter:]

    def _expert_activation(self, gate_up: torch.Tensor) -> torch.Tensor:
        """An expert's [T, 2 I] gate rows then up rows -> [T, I]: the MLP's activation, or gpt-oss' clamped SwiGLU."""
        limit = self.config.swiglu_limit
        if limit is None:
            return self._activation(gate_up)
        inter = gate_up.shape[1] // 2
        gate = gate_up[:, :inter].clamp(max=limit)
        up = gate_up[:, inter:].clamp(-limit, limit)
        return (up + 1) * (gate * torch.sigmoid(gate * self.config.swiglu_alpha))

    def _routed_mlp(self, layer: _Layer, x: torch.Tensor) -> torch.Tensor:
        """A mixture-of-experts MLP over the normed rows x [T, H], as transformers computes it: the router's softmax
        (float32) over all experts, the top experts_per_token kept (renormalised when norm_topk_prob), each expert
        run once over the rows that chose it, its output scaled by their weights and summed into theirs; plus the
        shared expert scaled by sigmoid(its gate)."""
        c = self.config
        k = c.experts_per_token
        if c.router_sparsemixer:  # Phi-3.5-MoE
            weights, chosen = self._sparsemixer_route(layer, x)
        elif c.router_input_scale:  # Llama 4: sigmoid of each top logit scales its expert's input row
            top, chosen = layer.router(x).topk(k, dim=-1)
            weights = torch.sigmoid(top.float())
        elif c.router_sigmoid:
            weights, chosen = self._sigmoid_route(layer, x)
        elif c.router_topk_softmax:  # gpt-oss: the top logits, softmaxed among themselves
            top, chosen = layer.router(x).topk(k, dim=-1)
            weights = torch.softmax(top.float(), dim=-1)
        else:
            logits = layer.router(x.float() if c.router_float32 else x)
            probs = torch.softmax(logits.float(), dim=-1)
            if c.router_correction_bias:  # ERNIE 4.5: chosen by score plus the bias, weighed by the score
                chosen = (probs + layer.correction_bias).topk(k, dim=-1)[1]
                weights = probs.gather(1, chosen)
            else:
                weights, chosen = probs.topk(k, dim=-1)  # [T, k]
        if c.norm_topk_prob and not c.router_sigmoid:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        if c.routed_scaling is not None and not c.router_sigmoid:  # (DeepSeek-V2's: the chosen scores scaled)
            weights = weights * c.routed_scaling
        out = self._run_experts(layer, x, weights, chosen, scale_input=c.router_input_scale)
        if layer.shared is not None:
            gate_up, down, gate = layer.shared
            shared = down(self._activation(gate_up(x)))
            out = out + (shared if gate is None else torch.sigmoid(gate(x)) * shared)
        return out

    def _mlp_beside_experts(self, layer: _Layer, h: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """Gemma 4 26B-A4B's feed-forward over the residual h [T, H] (x: h through the pre-MLP norm): the dense MLP of x
        (normed by post_mlp_norm_1) plus the experts (normed by post_mlp_norm_2), those fed h through pre_mlp_norm_2 and
        routed from h RMS-normed without a weight, times router.scale and hidden^-0.5 (a softmax in float32, the top
        experts renormalised, each weight times its expert's router.expert_scale), as transformers computes them."""
        c = self.config
        scale, expert_scale, post_dense, pre_experts, post_experts = layer.beside
        dense = self._norm(layer.down(self._activation(layer.gate_up(x))), post_dense)
        routed_in = F.rms_norm(h.float(), (h.shape[-1],), None, c.rms_norm_eps).to(h.dtype)
        probs = torch.softmax(layer.router(routed_in * scale * c.hidden_size ** -0.5).float(), dim=-1)
        weights, chosen = probs.topk(c.experts_per_token, dim=-1)
        weights = weights / weights.sum(dim=-1, keepdim=True) * expert_scale[chosen]
        routed = self._run_experts(layer, self._norm(h, pre_experts), weights, chosen)
        return dense + self._norm(routed, post_experts)

    def _run_experts(self, layer: _Layer, x: torch.Tensor, weights: torch.Tensor, chosen: torch.Tensor, *,
                     scale_input: bool = False) -> torch.Tensor:
        """Each row of x [T, H] through its chosen experts [T, k], their outputs times the weights [T, k] summed
        (scale_input: the rows times the weights fed to the experts, their outputs summed as they are: Llama 4)."""
        c = self.config
        k = chosen.shape[1]
        weights = weights.to(x.dtype)
        flat = chosen.flatten()
        order = flat.argsort(stable=True)  # the (row, slot) pairs grouped by expert
        rows = order // k
        row_weights = weights.flatten().index_select(0, order)[:, None]
        out = torch.zeros_like(x)
        if self.grouped_experts and layer.expert_stacks is not None:
            # group g's rows end at offsets[g]: two grouped products over every chosen (row, expert) pair at once
            gate_up_t, down_t = layer.expert_stacks
            counts = torch.zeros(c.num_experts, dtype=torch.int32, device=x.device)
            counts.scatter_add_(0, flat, torch.ones_like(flat, dtype=torch.int32))
            offsets = counts.cumsum(0, dtype=torch.int32)
            routed_in = x.index_select(0, rows)
            gate_up = _grouped_mm(routed_in * row_weights if scale_input else routed_in, gate_up_t, offs=offsets)
            if layer.expert_biases is not None:  # each row its expert's biases
                experts = flat.index_select(0, order)
                gate_up = gate_up + layer.expert_biases[0].index_select(0, experts)
            y = _grouped_mm(self._expert_activation(gate_up), down_t, offs=offsets)
            if layer.expert_biases is not None:
                y = y + layer.expert_biases[1].index_select(0, experts)
            out.index_add_(0, rows, y if scale_input else y * row_weights)
        else:
            self._expert_loop(layer, x, flat, rows, row_weights, out, scale_input)
        return out

    def _sparsemixer_route(self, layer: _Layer, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Phi-3.5-MoE's sparsemixer as transformers runs it in inference: the best expert, weighed by its softmax
        among the logits s with (best - s) / max(|s|, best) <= 2 eps; then, the best masked out, the best of the others
        weighed the same way against the second best (the factor still the original logits'). -> (weights, chosen)
        [T, 2], in the logits' dtype."""
        eps = 2 * self.config.router_sparsemixer
        scores = layer.router(x)
        chosen, weights = [], []
        masked = scores
        for _ in range(2):
            best, index = masked.max(dim=-1, keepdim=True)
            far = (best - scores) / scores.abs().clamp(min=best) > eps
            gates = torch.softmax(masked.masked_fill(far, float("-inf")), dim=-1)
            chosen.append(index)
            weights.append(gates.gather(-1, index))
            masked = masked.scatter(-1, index, float("-inf"))
        return torch.cat(weights, dim=-1), torch.cat(chosen, dim=-1)

    def _sigmoid_route(self, layer: _Layer, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """DeepSeek-V3's routing, as transformers computes GLM-4.5's: float32 sigmoid scores; the choice by score plus
        the expert's correction bias, among the expert_groups_per_token groups whose two best sum highest; the
        chosen experts' scores (renormalised when norm_topk_prob) times routed_scaling. -> (weights, chosen) [T, k]."""
        c = self.config
        scores = layer.router(x.float()).sigmoid()  # [T, E]
        choice = scores + layer.correction_bias
        if c.expert_groups > 1:
            per_group = choice.view(-1, c.expert_groups, c.num_experts // c.expert_groups)
            best = per_group.topk(2, dim=-1)[0].sum(dim=-1)  # [T, groups]
            kept = torch.zeros_like(best, dtype=torch.bool).scatter_(
                1, best.topk(c.expert_groups_per_token, dim=-1, sorted=False)[1], True)
            choice = choice.masked_fill(~kept.repeat_interleave(c.num_experts // c.expert_groups, dim=1),
                                        float("-inf"))
        chosen = choice.topk(c.experts_per_token, dim=-1, sorted=False)[1]
        weights = scores.gather(1, chosen)
        if c.norm_topk_prob:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        return weights * (c.routed_scaling or 1.0), chosen

    def _expert_loop(self, layer: _Layer, x, flat, rows, row_weights, out, scale_input: bool = False) -> None:
        """Each expert hit runs once over its rows (one host sync for the counts)."""
        counts = torch.bincount(flat, minlength=self.config.num_experts).tolist()
        start = 0
        for expert, count in enumerate(counts):
            if not count:
                continue
            gate_up, down = layer.experts[expert]
            mine = rows[start:start + count]
            mine_weights = row_weights[start:start + count]
            routed_in = x.index_select(0, mine)
            y = down(self._expert_activation(gate_up(routed_in * mine_weights if scale_input else routed_in)))
            out.index_add_(0, mine, y if scale_input else y * mine_weights)
            start += count

    def _forward_fused_decode(self, batch: ForwardBatch, kv: PagedKVCache) -> torch.Tensor:
        """A decode-only batch (row i = decode row i) through flared/_fast/decode.pyx; same result as forward's
        per-op path up to silu's exp rounding (and, on per-request LoRA rows, the low-rank sums' order)."""
        c = self.config
        rows = batch.num_tokens
        threads = max(1, torch.get_num_threads())
        scratch = self._decode_scratch.get((rows, threads))
        if scratch is None:
            def buf(*shape: int) -> torch.Tensor:
                return torch.empty(shape, dtype=torch.bfloat16)

            scratch = (buf(threads, rows, c.hidden_size), buf(rows, c.q_size + 2 * c.kv_size), buf(rows, c.q_size),
                       buf(rows, c.q_size), buf(rows, c.intermediate_size))
            self._decode_scratch[(rows, threads)] = scratch
        x, qkv, q, attn, act = scratch
        lora = {}
        if batch.lora_groups:  # each adapter's table at a slot, each row its adapter's slot (-1: the base)
            slots = torch.full((rows,), -1, dtype=torch.int32)
            tables, rank = [], 1
            for slot, (adapter, members) in enumerate(batch.lora_groups):
                adapter_table, adapter_rank, _ = self.lora_modules[adapter - 1][FUSED_LORA]
                tables.append(adapter_table)
                rank = max(rank, adapter_rank)
                slots[members] = slot
            table = torch.stack(tables)
            low = torch.empty(rows, rank, dtype=torch.bfloat16)
            lora = dict(lora_rows=slots.data_ptr(), lora_table=table.data_ptr(), lora_low=low.data_ptr(),
                        lora_rank=rank)
        h = self.embed.index_select(0, batch.input_ids)  # [rows, H], updated in place by every layer
        _cpu_decode.decode_layers(
            rows=rows, hidden=c.hidden_size, num_heads=c.num_heads, num_kv_heads=c.num_kv_heads, head_dim=c.head_dim,
            intermediate=c.intermediate_size, num_layers=c.num_layers, eps=c.rms_norm_eps, scale=self.scale,
            window=c.sliding_window or 0, num_slots=kv.num_slots, stride_slots=batch.decode_max_context,
            layer_ptrs=self._layer_ptrs.data_ptr(), cos=self.rope_cos.data_ptr(), sin=self.rope_sin_signed.data_ptr(),
            positions=batch.positions.data_ptr(), write_slots=batch.write_slot_ids.data_ptr(),
            gather_slots=batch.decode_gather_slot_ids.data_ptr(), lens=batch.decode_context_lens.data_ptr(),
            k_cache=kv.keys.data_ptr(), v_cache=kv.values.data_ptr(), h=h.data_ptr(), x=x.data_ptr(),
            qkv=qkv.data_ptr(), q=q.data_ptr(), attn=attn.data_ptr(), act=act.data_ptr(), threads=threads,
            shared_sequences=batch.shared_sequences, kv_fp8=kv.storage_dtype == FP8_KV, **lora)
        last = self._norm(h.index_select(0, batch.logit_row_ids), self.final_norm)
        return self._logits(last)

    def _masks_of(self, layer: int):
        """``layer``'s own masks as a function of the batch (see _masks), or None where the batch's serve it."""
        c = self.config
        if layer in c.chunked_layers:
            return functools.partial(self._masks, kind="chunk", size=c.attention_chunk_size)
        if c.layer_windows is not None and c.window_of(layer):
            return functools.partial(self._masks, kind="window", size=c.window_of(layer))
        return None

    def _masks(self, batch: ForwardBatch, kind: str, size: int):
        """(decode rows' mask [1, B, 1, L] True = masked, each prefill group's [q_len, L] True = attend) for layers
        that see part of the context, made once a batch (the batch's own masks know only the whole-context layers):
        a query at position p sees the keys from p - size + 1 (kind "window", Gemma's) or from p - p % size (kind
        "chunk", Llama 4's) to p."""
        def first(pos: torch.Tensor) -> torch.Tensor:
            return pos - size + 1 if kind == "window" else torch.div(pos, size, rounding_mode="floor") * size

        cache = batch.window_masks
        if (kind, size) not in cache:
            decode = None
            if batch.decode_row_ids is not None:
                key = torch.arange(batch.decode_max_context, device=self.device)
                lens = batch.decode_context_lens[:, None]
                keep = (key[None, :] < lens) & (key[None, :] >= first(lens - 1))
                decode = ~keep.view(1, -1, 1, batch.decode_max_context)
            groups = []
            for g in batch.prefill_groups:
                length = g.gather_slot_ids.shape[0]
                q_pos = torch.arange(length - (g.row_end - g.row_start), length, device=self.device)[:, None]
                k_pos = torch.arange(length, device=self.device)[None, :]
                groups.append((k_pos <= q_pos) & (k_pos >= first(q_pos)))
            cache[(kind, size)] = (decode, groups)
        return cache[(kind, size)]

    def _prefill_attention(self, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
                           mask: torch.Tensor | None, sinks: torch.Tensor | None = None,
                           bias: torch.Tensor | None = None) -> torch.Tensor:
        """q [1, nh, q_len, d] over keys, values [1, nkv, L, d]; ``mask`` [q_len, L] True = attend (None: causal,
        the queries being the last q_len keys). Soft-capped scores (Gemma 2), sinks (gpt-oss: a logit per head [nh]
        in each softmax) and ALiBi's biases (BLOOM: ``bias`` [1, nh, q_len, L] float32, _alibi_bias) in plain ops,
        as SDPA has none of them."""
        group = q.shape[1] // keys.shape[1]
        cap = self.config.attn_logit_softcapping
        if cap is None and sinks is None and bias is None:
            if mask is None:
                return F.scaled_dot_product_attention(q, keys, values, is_causal=True, scale=self.scale,
                                                      enable_gqa=group > 1)
            return F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, scale=self.scale,
                                                  enable_gqa=group > 1)
        q_len, length = q.shape[2], keys.shape[2]
        if mask is None:
            mask = torch.ones(q_len, length, dtype=torch.bool, device=q.device).tril(length - q_len)
        keys, values = keys.repeat_interleave(group, dim=1), values.repeat_interleave(group, dim=1)
        scores = (q @ keys.transpose(-1, -2)) * self.scale
        if cap is not None:
            scores = _soft_cap(scores, cap)
        scores = scores.float()
        if bias is not None:
            scores = scores + bias
        scores = scores.masked_fill(~mask, float("-inf"))
        if sinks is None:
            return torch.softmax(scores, dim=-1).to(q.dtype) @ values
        return _softmax_with_sinks(scores, sinks.float().view(1, -1, 1, 1)).to(q.dtype) @ values

    def _alibi_bias(self, batch: ForwardBatch, key, q_positions: torch.Tensor, length: int) -> torch.Tensor:
        """ALiBi's score biases slope * (key position - query position), float32 [nh, Q, length], for the query
        positions [Q] over keys 0..length - 1: made once a batch (every layer shares them), kept in the batch's mask
        cache under ``key``. Falcon-RW's (alibi_bf16_positions): bf16(slope * sqrt(d) * key position) / sqrt(d), the
        same for every query (a row's constant shift leaves its softmax as it was), as transformers rounds them."""
        cache = batch.window_masks
        if ("alibi", key) not in cache:
            positions = torch.arange(length, device=self.device)
            if self.alibi_bf16 is not None:
                slopes, root = self.alibi_bf16
                bias = (slopes[:, None] * positions.to(torch.bfloat16)).float() / root  # [nh, length]
                cache[("alibi", key)] = bias[:, None, :].expand(-1, q_positions.shape[0], -1).contiguous()
            else:
                distance = positions[None, :] - q_positions.to(self.device)[:, None]
                cache[("alibi", key)] = self.alibi[:, None, None] * distance.float()  # [nh, Q, length]
        return cache[("alibi", key)]

    def _attention(self, layer: int, batch: ForwardBatch, kv: PagedKVCache, q: torch.Tensor, k: torch.Tensor,
                   v: torch.Tensor, decode_masked: torch.Tensor | None, native: bool) -> torch.Tensor:
        """q [T, nh, d]; k, v [T, nkv, d] (this forward's, already in the cache) -> [T, nh * d]. ``native``: decode
        rows through the Cython kernel (flared/_fast/attention.pyx), else the torch path."""
        c = self.config
        nh, (nkv, d) = c.num_heads, self.layers[layer].geometry  # (Gemma 4's global layers: their own)
        geometry = self.layers[layer].geometry
        group = nh // nkv
        sinks = self.layers[layer].sinks
        cached = self.layers[layer].kv_index  # (the KV cache's index of this layer)
        decode_only = not batch.prefill_groups
        out = None if decode_only else q.new_empty(batch.num_tokens, nh * d)
        masking = self._masks_of(layer)  # (a windowed or chunked layer's own masks, else None)
        if (batch.decode_row_ids is not None and native and d == c.head_dim and layer not in c.chunked_layers
                and self.alibi is None):  # (not Gemma 4's wider global heads, Llama 4's chunks nor ALiBi's biases)
            num_decode = batch.decode_row_ids.shape[0]
            qd = (q[:num_decode] if decode_only else q.index_select(0, batch.decode_row_ids)).contiguous()
            o = torch.empty(num_decode, nh * d, dtype=q.dtype)
            _cpu_attention.decode_attention(
                qd.data_ptr(), kv.keys[cached].data_ptr(), kv.values[cached].data_ptr(), o.data_ptr(),
                batch.decode_gather_slot_ids.data_ptr(), batch.decode_max_context,
                batch.decode_context_lens.data_ptr(), num_decode, nh, nkv, d, kv.num_slots, self.scale,
                c.window_of(layer), q.dtype == torch.bfloat16, torch.get_num_threads(),
                kv.storage_dtype == FP8_KV)
            if decode_only:
                return o
            out.index_copy_(0, batch.decode_row_ids, o)
        elif batch.decode_row_ids is not None:
            num_decode = batch.decode_row_ids.shape[0]
            max_context = batch.decode_max_context
            keys, values = kv.gather(cached, batch.decode_gather_slot_ids, geometry)  # [nkv, B * L, d]
            keys = keys.view(nkv * num_decode, max_context, d)
            values = values.view(nkv * num_decode, max_context, d)
            # Grouped query heads share their kv head: fold the group into the query axis ([nkv * B, group, d])
            # instead of repeating K/V.
            qd = q if decode_only else q.index_select(0, batch.decode_row_ids)
            qd = qd.view(num_decode, nkv, group, d).transpose(0, 1).reshape(nkv * num_decode, group, d)
            scores = torch.bmm(qd, keys.transpose(1, 2)).float() * self.scale  # [nkv * B, group, L]
            if c.attn_logit_softcapping is not None:
                scores = _soft_cap(scores, c.attn_logit_softcapping)
            if self.alibi is not None:  # (each row's position its context length - 1)
                bias = self._alibi_bias(batch, "decode", batch.decode_context_lens - 1, max_context)  # [nh, B, L]
                scores.view(nkv, num_decode, group, max_context).add_(
                    bias.view(nkv, group, num_decode, max_context).transpose(1, 2))
            if masking is not None:
                decode_masked = masking(batch)[0]
            scores.view(nkv, num_decode, group, max_context).masked_fill_(decode_masked, float("-inf"))
            if sinks is None:
                probs = torch.softmax(scores, dim=-1).to(q.dtype)
            else:  # each query head's sink: [nh] as [nkv, 1, group, 1] beside its rows' scores
                sink = sinks.float().view(nkv, 1, group, 1).expand(nkv, num_decode, group, 1)
                probs = _softmax_with_sinks(scores, sink.reshape(nkv * num_decode, group, 1)).to(q.dtype)
            o = torch.bmm(probs, values)  # [nkv * B, group, d]
            o = o.view(nkv, num_decode, group, d).transpose(0, 1).reshape(num_decode, nh * d)
            if decode_only:
                return o  # decode rows are then exactly rows 0..B-1 in order
            out.index_copy_(0, batch.decode_row_ids, o)
        window_masks = masking(batch)[1] if masking is not None else None
        blocks = (self._image_blocks(batch) if self.image_block_tokens
                  and not (self.image_blocks_windowed and not c.window_of(layer)) else None)
        for gi, g in enumerate(batch.prefill_groups):
            q_len = g.row_end - g.row_start
            qg = q[g.row_start:g.row_end].transpose(0, 1).unsqueeze(0)  # [1, nh, q_len, d]
            block = blocks[gi] if blocks is not None else None
            if window_masks is None and g.attn_mask is None and block is not None:  # (Gemma 3's images: the
                # chunk's own keys, causal or forward within an image)
                keys = kv.as_stored(k[g.row_start:g.row_end]).transpose(0, 1).unsqueeze(0)
                values = kv.as_stored(v[g.row_start:g.row_end]).transpose(0, 1).unsqueeze(0)
                mask = torch.ones(q_len, q_len, dtype=torch.bool, device=q.device).tril() | block
            elif window_masks is None and g.attn_mask is None:
                # No cached prefix: the chunk's own keys are the whole context, no gather needed (as the cache
                # holds them: a float8 pool's rounding included).
                keys = kv.as_stored(k[g.row_start:g.row_end]).transpose(0, 1).unsqueeze(0)  # [1, nkv, q_len, d]
                values = kv.as_stored(v[g.row_start:g.row_end]).transpose(0, 1).unsqueeze(0)
                mask = None
            else:  # (a windowed layer (Gemma 3), a chunked one (Llama 4): the keys it sees; else the group's mask)
                keys, values = (x.unsqueeze(0) for x in kv.gather(cached, g.gather_slot_ids, geometry))  # [1, nkv, L, d]
                mask = window_masks[gi] if window_masks is not None else g.attn_mask
                if block is not None:  # (the chunk's keys are the last q_len: its images' later tokens among them)
                    mask = mask.clone()
                    mask[:, mask.shape[1] - q_len:] |= block
            bias = None
            if self.alibi is not None:  # (the group's queries the last q_len of its keys' positions)
                length = keys.shape[2]
                bias = self._alibi_bias(batch, gi, torch.arange(length - q_len, length), length)[None]
            o = self._prefill_attention(qg, keys, values, mask, sinks, bias)
            out[g.row_start:g.row_end] = o[0].transpose(0, 1).reshape(q_len, nh * d)
        return out
