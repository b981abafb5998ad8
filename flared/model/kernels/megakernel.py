"""Every decoder layer of a few-row decode step as one persistent CUDA kernel (``decode_layers.cu``).

Inside a CUDA graph each kernel of a decode layer costs ~4.5 us on the H200 however little it reads, so
a small model's single-stream step is a chain of ~150 launch latencies, and a large one's pays ~0.4 ms
of small kernels and idle memory between its matrix-vector products. ``DecodeLayers`` runs all layers
and the final norm in one launch: one block per multiprocessor, phases separated by a grid-wide
barrier, each warp loading its next phase's first weight rows before it waits where they fit its
registers (the kernel source says how the work is split and rounded).

It is compiled with NVRTC through CuPy, once per (model shape, row count), with the shapes as
compile-time constants. It serves bfloat16 Llama-family decoders (the rotary tables already carry any
rope scaling) with head dims 64 or 128 and no q/k norm (``unsupported`` says why not otherwise). It has
no sliding window: a window model's steps run it only while every context is inside the window. It can
gather the rows' embeddings itself (``tokens``) and, compiled with ``head=True``, run the LM head and
greedy argmax too (``HEAD_INSIDE``: by default).
``PagedCudaDecoder.calibrate`` times it against the other decode paths and keeps it only where it is
faster.
"""

from __future__ import annotations

import ctypes
from pathlib import Path

import torch

SOURCE = Path(__file__).with_name("decode_layers.cu")
THREADS = 512  # 16 warps per block, one block per multiprocessor (models with long rows)
SHORT_ROW_THREADS = 256  # models whose every weight row fits a warp's registers (<= 2048 elements)
MAX_ROWS = 8  # rows it is compiled for at most (shared memory holds R rows of the widest input)
SPLITS = 16  # blocks one (row, head)'s attention is split over at most (short-row models; see splits_for)
SPLIT_KEYS = 128  # keys per attention piece at least (decode_layers.cu); LL_SPLIT_KEYS in the tagged-word build
LL_SPLIT_KEYS = 64
LONG_ROW_SPLITS = 2  # the same for long-row models at one row (see splits_for), pieces of LONG_ROW_SPLIT_KEYS
LONG_ROW_SPLIT_KEYS = 64
MAX_CONTEXT = 1024  # longest context a step may have to run it (see paged_decoder.mega_max_context)
RESIDENT_MAX_KEYS = 1024  # keys a resident-attention build holds at most (resident_cap)
# Shared memory a resident build may take a block (the device's opt-in maximum caps it too): 272 keys at 8B in
# 194,288 B, the most under the 196 KB carve-out, so one block a kv head holds up to 320 tokens (groups: below).
# With 227 KB (336 keys) the 8B launch ran 60-90 us slower at every context (H200). 272 against 256 keys, the whole
# 8B one-row step with a 4,096-page pool (nineteenth session, one run): 3,962 vs 4,006 us at 312 tokens, 3,901 vs
# 3,902 at 192.
RESIDENT_SHARED_BYTES = 190 * 1024
# Most rows calibration tries the tagged-word exchange at (low_latency): every block reads each phase's whole
# output as 8-byte words, four times the bytes of the bf16 rows. On the H200 at 135M and 256 tokens, us a
# launch against the barrier build: 1 row 470 vs 512, 2 rows 561 vs 541, 4 rows 781 vs 626.
LL_MAX_ROWS = 4
# 16-byte weight loads per lane a long (streamed) row issues together; decode_layers.cu's default is 8. At 8B, one
# row, 256 tokens (H200, two calls): 12 ran 24-36 us a launch faster than 8 (3,814, 3,833-3,845 against
# 3,848-3,868); end to end 244 tok/s against 240. 10 measured 3,822 once; 6 and 4 gained 22 and 10 us.
LONG_ROW_GEMV_BATCH = 12
# The barrier build's boundaries as tagged words (DecodeLayers, HX) up to this many rows. On the H200, us a launch
# against grid barriers in the same run: Llama-3.1-8B one row 3,611-3,615 vs 3,692-3,716 at 1 token, 3,668-3,676
# vs 3,772-3,774 at 256, 3,841-3,844 vs 3,873 at 384 (not resident); the whole one-row decode step at 256 tokens
# 3,918-3,919 vs 4,008-4,010. Two rows went both ways (8B launch 4,132-4,139 vs 4,152-4,165, but its whole step
# 4,415-4,418 vs 4,378-4,381 on another machine; 135M launch 508-509 vs 523); four rows lost (135M 651-652 vs
# 569: every block polls four rows' words). Bit 0 past the resident keys (the split path's blocks poll the words,
# seventeenth session), the whole one-row step: 4,009-4,014 vs 4,082-4,092 at 344 tokens, 4,010 vs 4,094-4,097 at
# 383; with a 4,096-page pool (bench_gpu's executor) 4,122-4,126 vs 4,170-4,176.
HX_MAX_ROWS = 1
# The shortest contexts whose one-row resident build gives each kv head a group of two blocks (RESIDENT_PAIR_FROM)
# or four (RESIDENT_QUAD_FROM), each part holding its share of the keys (decode_layers.cu, RES_SPLIT, RES_SPLIT4; at
# 8B a pair holds up to 544 keys, four up to 1,024). Llama-3.1-8B on the H200, the whole one-row step with a
# 4,096-page pool (tools/bench_decode_step.py, twenty-second session), us:
#   - pairs from 129 against one block a kv head (past 320 tokens the split path), one run: 3,928 vs 3,952 at 192
#     tokens, 3,946 vs 4,024 at 288, 3,947 vs 4,071 at 336, 3,955 vs 4,074 at 384;
#   - another machine, pairs from 129 | fours from 257 | fours from 129 | one block: 3,894 | 3,896 | 3,894 | 3,896
#     at 192, 3,898 | 3,900 | 3,897 | 3,911 at 256, 3,909 | 3,896 | 3,901 | 3,976 at 320, 3,915 | 3,898 | 3,904 |
#     4,020 at 384, 3,931 | 3,908 | 3,909 | 4,056 at 512.
RESIDENT_PAIR_FROM = 129
RESIDENT_QUAD_FROM = 257
RESIDENT_PARTS = 4  # blocks a kv head's resident group has at most (decode_layers.cu's RES_PARTS; the LL words)
PREFETCH_LINES = 0  # L2 prefetch of long next-phase rows, 128-byte lines per lane (measured slower: off)


def describe_decode_paths(*, skinny_max_rows: int, mega_max_rows: int, mega_max_context: int,
                          calibration: dict) -> str:
    """One line for the startup log: which kernels serve decode steps of how many rows (after
    ``PagedCudaDecoder.calibrate``), and why the megakernel is off when it failed to build."""
    parts = []
    if mega_max_rows:
        ll = calibration.get("mega_ll_rows")
        exchange = f" (tagged-word exchange at {', '.join(map(str, ll))} rows)" if ll else ""
        parts.append(f"megakernel up to {mega_max_rows} rows{exchange} while contexts are <= {mega_max_context} "
                     "tokens")
    if skinny_max_rows:
        parts.append(f"skinny kernels up to {skinny_max_rows} rows")
    parts.append("cuBLAS + fused kernels beyond" if parts else "cuBLAS + fused kernels")
    text = "decode: " + ", ".join(parts)
    if "megakernel_error" in calibration:
        text += f"; megakernel off: {calibration['megakernel_error']}"
    return text


def unsupported(model) -> str | None:
    """Why the megakernel cannot run ``model`` (a DecoderModel on a CUDA device), or None."""
    c = model.config
    if model.device.type != "cuda":
        return "not on a CUDA device"
    if model.dtype != torch.bfloat16:
        return f"dtype {model.dtype} (bfloat16 only)"
    if c.qk_norm:
        return "q/k norm"
    if c.head_dim not in (64, 128):
        return f"head_dim {c.head_dim} (64 or 128)"
    if c.num_heads % c.num_kv_heads:
        return "query heads not a multiple of kv heads"
    if c.hidden_size % 8 or c.intermediate_size % 8 or (c.num_heads * c.head_dim) % 8:
        return "widths not multiples of 8"
    if any(layer.gate_up.bias is not None or layer.down.bias is not None for layer in model.layers):
        return "MLP biases"
    return None


def _widest(config) -> int:
    """The longest input a product phase takes: the hidden size, the attention output or the MLP width."""
    return max(config.hidden_size, config.num_heads * config.head_dim, config.intermediate_size)


def threads_for(model) -> int:
    """Threads per block: 8 warps where every product row is short enough to be held in registers across
    a barrier (no register spills; SmolLM2-135M: 573 vs 750 us per launch at 512 threads), else 16 (more
    loads in flight for streamed rows; Llama-3.1-8B measured at 16)."""
    return SHORT_ROW_THREADS if _widest(model.config) <= 2048 else THREADS


def low_latency_rows(model) -> int:
    """The most rows calibration tries the tagged-word build at: LL_MAX_ROWS on short-row models, none on
    long-row ones (Llama-3.1-8B, one row at 256 tokens: 3,907-3,940 against 3,883-3,888 us with barriers;
    calibration times contexts of 0, where attention's share, and so the build's cost there, is missing)."""
    return LL_MAX_ROWS if threads_for(model) == SHORT_ROW_THREADS else 0


def splits_for(model, rows: int) -> int:
    """The most blocks one (row, head)'s attention may be split over. Short-row models split on long
    contexts (SmolLM2-135M, 512 tokens: 500 vs 578 us per launch). Long-row models split one row in at most
    LONG_ROW_SPLITS pieces and never more rows (Llama-3.1-8B, H200, us per launch against unsplit in the same
    run: one row in 2 pieces -31..-57 at 256 tokens, -34..-103 at 384; in 4 pieces +60 at 256, -5 at 384;
    two rows in 2 pieces +285 at 256). Retimed in the eighteenth session with the split path's boundaries as
    tagged words (one row past 304 keys, whole step, 4,096-page pool): 4 pieces won once at 344 tokens (3,992 vs
    4,024-4,025 us) and lost twice at 344 and 383 on another machine (4,062-4,067 vs 4,039-4,043), so 2 stay."""
    if threads_for(model) == SHORT_ROW_THREADS:
        return SPLITS
    return LONG_ROW_SPLITS if rows == 1 else 1


def split_keys_for(model, low_latency: bool) -> int:
    """The fewest keys of one attention piece (a head splits from 3x this many)."""
    if low_latency:
        return LL_SPLIT_KEYS
    return SPLIT_KEYS if threads_for(model) == SHORT_ROW_THREADS else LONG_ROW_SPLIT_KEYS


# The LM head, the logits writes and greedy argmax run inside the megakernel by default, on every model. A short-row
# model's step is latency-bound, so the kernels saved count (SmolLM2-135M, one row at 256 tokens: 617 vs 635 us per
# step); at 8B the head is a 1 GB product that the kernel's weight loads (L1::no_allocate) stream faster than cuBLAS
# (H200, one row at 256 tokens: 3,937-3,949 vs 3,956-3,958 us per step). FLARED_MEGAKERNEL_HEAD=0 pins it off.
HEAD_INSIDE = True


def _layout_bytes(model, rows: int, threads: int, resident: bool) -> int:
    """The ``Smem`` layout's bytes before a resident build's region (which then starts 16-byte aligned); a resident
    build stages its V tiles in that region, not in ``vec``."""
    c = model.config
    h, d = c.hidden_size, c.head_dim
    kmax = _widest(c)
    warps = threads // 32
    vec = rows * kmax if resident else max(rows * kmax, warps * 32 * d)  # product inputs, or the staged V tiles
    red = -(-(warps * rows + rows) // 4) * 4
    return (vec * 2 + rows * h * 2 + -(-h // 8) * 8 * 2 + red * 4 + warps * d * 4 + d * 4 + 2 * warps * 4
            + 2 * rows * d * 4 + 2 * rows * 8 + rows * 4)


def shared_bytes(model, rows: int, threads: int | None = None, res_cap: int | None = None) -> int:
    """The kernel's dynamic shared memory (its ``Smem`` layout). ``res_cap``: a resident-attention build
    holding that many keys (``resident_cap``)."""
    threads = threads or threads_for(model)
    if res_cap is None:
        return _layout_bytes(model, rows, threads, False)
    return -(-_layout_bytes(model, rows, threads, True) // 16) * 16 + _resident_region(model, threads, res_cap)


def _resident_region(model, threads: int, cap: int) -> int:
    """Bytes of a resident build's region: ``cap`` keys and values of head_dim elements, and at least the
    warps' staged V tiles (the unresident path) and their merge scratch."""
    c = model.config
    d, warps, group = c.head_dim, threads // 32, c.num_heads // c.num_kv_heads
    return max(4 * cap * d, warps * 32 * d * 2, (warps * group * d + warps * 32) * 4)


def resident_tail(model) -> int:
    """Keys past the resident ones a one-row launch copies into the product-input buffer during attention
    (free then): as many as it holds, a multiple of 16."""
    c = model.config
    return _widest(c) * 2 // (4 * c.head_dim) // 16 * 16


def resident_cap(model, threads: int, limit: int) -> int:
    """The most keys (a multiple of 16, at most RESIDENT_MAX_KEYS) one kv head's resident region holds in
    ``limit`` (at most RESIDENT_SHARED_BYTES) bytes of shared memory a block; 0 where fewer than 16 or the
    region does not fit."""
    c = model.config
    base = -(-_layout_bytes(model, 1, threads, True) // 16) * 16
    limit = min(limit, RESIDENT_SHARED_BYTES)
    cap = min(RESIDENT_MAX_KEYS, max(0, limit - base) // (4 * c.head_dim) // 16 * 16)
    return cap if cap >= 16 and shared_bytes(model, 1, threads, res_cap=cap) <= limit else 0


def resident(model, rows: int, low_latency: bool) -> bool:
    """Whether the build for ``rows`` takes one row's attention from resident keys (decode_layers.cu, RES):
    long-row models at one row with the barrier build, up to 16 query heads per kv head. Llama-3.1-8B on the
    H200, us a launch against the same build without it: 3,678-3,681 vs 3,765-3,770 at 128 tokens, 3,713-3,723
    vs 3,816 at 256, 3,756-3,760 vs 3,828-3,835 at 304."""
    c = model.config
    return (rows == 1 and not low_latency and threads_for(model) == THREADS
            and c.num_heads // c.num_kv_heads <= 16 and c.head_dim % 16 == 0)


def max_rows(model) -> int:
    """The most rows (a power of two <= MAX_ROWS) whose shared memory fits one block on this GPU."""
    limit = torch.cuda.get_device_properties(model.device).shared_memory_per_block_optin
    rows = MAX_ROWS
    while rows > 1 and shared_bytes(model, rows) > limit:
        rows //= 2
    return rows if shared_bytes(model, rows) <= limit else 0


class DecodeLayers:
    """One compiled megakernel for ``rows`` decode rows of ``model`` over the decoder's KV pools.

    ``__call__(h, out, positions, slots, block_tables, context_lens, head_args, tokens)``: ``h`` [rows, H]
    is the residual stream (updated in place; it holds the tokens' embeddings unless ``tokens`` has the
    kernel gather them), ``out`` [rows, H] receives the final-normed hidden states; the rest are the decode
    step's device inputs (``StaticInputs`` views). ``self.h`` and ``self.out`` are buffers for callers
    that pass ``tokens``.
    Capturable: one launch on the current torch stream (the barrier counter is never reset: each launch
    counts on from the epoch the previous one left).
    ``low_latency``: the phases exchange their outputs as tagged words instead of meeting at grid barriers
    (decode_layers.cu, LL): faster at one row on small models, slower with more rows (PagedDecoder calibrates).
    ``compile(page_tokens)`` must have run (outside any capture).
    """

    def __init__(self, model, k_pool: torch.Tensor, v_pool: torch.Tensor, rows: int, *, head: bool = False,
                 low_latency: bool = False, overrides: dict | None = None):
        from flared.execution.cuda import cupy

        why = unsupported(model)
        if why is not None:
            raise ValueError(f"the decode megakernel does not support this model: {why}")
        c = model.config
        dev = model.device
        self.rows = rows
        self.k_pool, self.v_pool = k_pool, v_pool
        defines = {
            "H": c.hidden_size, "NH": c.num_heads, "NKV": c.num_kv_heads, "D": c.head_dim,
            "I": c.intermediate_size, "L": c.num_layers, "R": rows, "KMAX": _widest(c), "THREADS": threads_for(model),
            "PF_LINES": PREFETCH_LINES, "SPLITS": splits_for(model, rows), "HEAD": int(head),
            # The tagged-word build splits attention from 192 keys in pieces of 64 (split_keys_for), whose short
            # V tiles stop after their keys' group of 8.
            "SPLIT_KEYS": split_keys_for(model, low_latency), "TILE_STEP": 8 if low_latency else 32,
            "LL": int(low_latency),
            # Weight loads with the L1::no_allocate hint (H200, us a launch against plain __ldg, same run): 8B one row
            # 3,632 vs 3,741 at 1 token, 3,748 vs 3,869 at 256; two rows 4,132 vs 4,615; SmolLM2-135M one row with
            # its head 495.5 vs 511.1. The tagged-word build lost with it (482.2 vs 474.5) and keeps plain loads.
            "LDW_NOALLOC": int(not low_latency),
            **({"GEMV_BATCH": LONG_ROW_GEMV_BATCH} if threads_for(model) == THREADS else {}),
            "HAS_QKV_BIAS": int(any(layer.qkv.bias is not None for layer in model.layers)),
            "HAS_O_BIAS": int(any(layer.o.bias is not None for layer in model.layers)),
        }
        defines["RES"] = int(resident(model, rows, low_latency))
        # Up to HX_MAX_ROWS rows the barrier build exchanges P3 -> P4 and P5 -> the next P1 as tagged words too
        # (bits 1 and 2), and in a resident build P1 -> P2 -> P3 (bit 0, around resident attention and past the
        # resident keys around the split path): three or five of a layer's five grid barriers become polls of the
        # words the next phase reads (decode_layers.cu, HX; the bits a build cannot take are cleared below).
        defines["HX"] = 7 if rows <= HX_MAX_ROWS else 0
        # Compile-time constants replaced for experiments (tools/profile_megakernel.py: SKIP, PF_LINES, ...).
        self.overrides = dict(overrides or {})
        defines.update(self.overrides)
        self.threads = int(defines["THREADS"])
        if int(defines["RES"]) and not int(defines.get("RES_CAP", 0)):  # as many keys as shared memory holds
            limit = torch.cuda.get_device_properties(dev).shared_memory_per_block_optin
            defines["RES_CAP"] = resident_cap(model, self.threads, limit)
            defines["RES"] = int(defines["RES_CAP"] > 0)
        if int(defines["LL"]) or int(defines.get("SKIP", 0)):
            defines["HX"] = 0  # LL exchanges words at every boundary already; SKIP leaves words unwritten
        elif not int(defines["RES"]):
            defines["HX"] = int(defines["HX"]) & 6  # bit 0 needs resident attention
        if int(defines["RES"]):
            defines.setdefault("RES_TAIL", resident_tail(model))
            defines.setdefault("RES_SPLIT", RESIDENT_PAIR_FROM)
            defines.setdefault("RES_SPLIT4", RESIDENT_QUAD_FROM)
            defines.setdefault("RES_PARTS", RESIDENT_PARTS)
        # keys of one kv head held in shared memory (0: not a resident build)
        self.resident_keys = int(defines["RES_CAP"]) if int(defines["RES"]) else 0
        self._defines = defines
        self._floats = {"EPS": float(c.rms_norm_eps), "SCALE_LOG2": float(model.scale) * 1.4426950408889634}
        self._model = model
        self.kernel = None
        self.page_tokens = None
        self.shared_mem = shared_bytes(model, rows, self.threads, res_cap=self.resident_keys or None)
        self.shared_mem += int(defines.get("SMEM_PAD", 0))  # unused bytes (diagnosis: the L1 the carve-out leaves)
        self.grid = torch.cuda.get_device_properties(dev).multi_processor_count
        if not (model.rope_cos.is_contiguous() and model.rope_sin_signed.is_contiguous()):
            raise ValueError("the decode megakernel needs contiguous rotary tables")
        table = []
        for layer in model.layers:
            for w in (layer.qkv.weight, layer.o.weight, layer.gate_up.weight, layer.down.weight):
                if not w.is_contiguous() or w.data_ptr() % 16:
                    raise ValueError("the decode megakernel needs contiguous, 16-byte aligned weights")
            # the kernel's per-layer pointers (decode_layers.cu, LP): a missing bias is 0
            table.append([0 if t is None else t.data_ptr() for t in (
                layer.attn_norm, layer.qkv.weight, layer.qkv.bias, layer.o.weight, layer.o.bias, layer.mlp_norm,
                layer.gate_up.weight, layer.down.weight)])
        self.layer_table = torch.tensor(table, dtype=torch.int64, device=dev)
        bf = torch.bfloat16
        self.qkv = torch.zeros(rows, (c.num_heads + 2 * c.num_kv_heads) * c.head_dim, dtype=bf, device=dev)
        self.attn = torch.zeros(rows, c.num_heads * c.head_dim, dtype=bf, device=dev)
        self.act = torch.zeros(rows, c.intermediate_size, dtype=bf, device=dev)
        self.h = torch.zeros(rows, c.hidden_size, dtype=bf, device=dev)  # the residual (with ``tokens``)
        self.out = torch.zeros(rows, c.hidden_size, dtype=bf, device=dev)  # final-normed hidden states
        # attention partials of split heads: [rows * NH * SPLITS][D] outputs, then [rows * NH * SPLITS][2] (max, sum)
        self.part = torch.zeros(rows * c.num_heads * defines["SPLITS"] * (c.head_dim + 2), dtype=torch.float32,
                                device=dev)
        # the grid barrier's arrivals (every launch's, never reset), the launch epoch, then each (row, head)'s
        # split-attention arrivals (reset by the last)
        self.sync = torch.zeros(2 + rows * c.num_heads, dtype=torch.int32, device=dev)
        self.low_latency = bool(int(defines["LL"]))
        # the LL words: two residuals, attention outputs, activations, split partials with their (max, sum), q, k, v
        ll_words = rows * (2 * c.hidden_size + c.num_heads * c.head_dim + c.intermediate_size
                           + c.num_heads * int(defines["SPLITS"]) * (c.head_dim + 2)
                           + (c.num_heads + 2 * c.num_kv_heads) * c.head_dim)
        ll_words += (RESIDENT_PARTS - 1) * c.num_heads * (c.head_dim + 2)  # resident groups' partials (one row)
        exchange = self.low_latency or int(defines["HX"])  # HX: some boundaries by the same words
        self.llbuf = torch.zeros(ll_words if exchange else 1, dtype=torch.int64, device=dev)
        self.head = head
        self.cand_val = torch.zeros(self.grid * rows, dtype=torch.float32, device=dev)  # per-block argmax candidates
        self.cand_idx = torch.zeros(self.grid * rows, dtype=torch.int32, device=dev)
        self._cupy = cupy

    def compile(self, page_tokens: int) -> None:
        """Build the kernel (NVRTC, cached by CuPy) for this page size; outside any graph capture."""
        if self.kernel is not None and self.page_tokens == page_tokens:
            return
        cupy = self._cupy
        options = [f"-D{k}={v}" for k, v in self._defines.items()]
        options += [f"-DPAGE={int(page_tokens)}"]
        options += [f"-D{k}={v!r}f" for k, v in self._floats.items()]
        module = cupy.RawModule(code=SOURCE.read_text(), options=tuple(options))
        kernel = module.get_function("flared_decode_layers")
        kernel.max_dynamic_shared_size_bytes = self.shared_mem
        if kernel.max_threads_per_block < self.threads:
            raise RuntimeError(f"the decode megakernel needs {self.threads} threads per block; this build allows "
                               f"{kernel.max_threads_per_block} (registers)")
        self.kernel = kernel
        self._function = kernel.kernel.ptr  # the loaded CUfunction
        self.page_tokens = page_tokens
        self._module = module

    def __call__(self, h: torch.Tensor, out: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor,
                 block_tables: torch.Tensor, context_lens: torch.Tensor, head_args: tuple | None = None,
                 tokens: tuple | None = None) -> None:
        """``tokens``: (token_ids [rows] i64, state_rows [rows] i64, last_token [S] i64): the kernel gathers the
        embedding rows itself (a token of -1 is its state row's last sampled token) and ``h`` is only its
        residual buffer; without it ``h`` holds the embedded rows.
        ``head_args`` (with ``head=True``): (logits [>= rows, V] f32, state_logits [S, V] f32, state_rows
        [rows] i64, sampled [>= rows] i64, last_token [S] i64, greedy): the kernel writes the step's logits
        and the state rows' logits and, when greedy, the argmax into sampled and last_token."""
        rows = self.rows
        assert h.shape[0] == rows and out.shape[0] == rows and h.is_contiguous() and out.is_contiguous()
        assert block_tables.stride(1) == 1 and positions.dtype == torch.int64 and slots.dtype == torch.int64
        if self.kernel is None:
            raise RuntimeError("DecodeLayers.compile(page_tokens) first")
        u64, i64, i32 = ctypes.c_uint64, ctypes.c_int64, ctypes.c_int32
        m = self._model
        values = [u64(self.layer_table.data_ptr()), u64(self.k_pool.data_ptr()), u64(self.v_pool.data_ptr()),
                  i64(self.k_pool.stride(0)), u64(h.data_ptr()), u64(out.data_ptr()), u64(m.final_norm.data_ptr()),
                  u64(self.qkv.data_ptr()), u64(self.attn.data_ptr()), u64(self.act.data_ptr()),
                  u64(self.part.data_ptr()), u64(self.sync.data_ptr()), u64(m.rope_cos.data_ptr()),
                  u64(m.rope_sin_signed.data_ptr()), u64(positions.data_ptr()), u64(slots.data_ptr()),
                  u64(block_tables.data_ptr()), i32(block_tables.stride(0)), u64(context_lens.data_ptr())]
        if self.head:
            logits, state_logits, state_rows, sampled, last_token, greedy = head_args
            vocab = self._model.config.vocab_size
            assert logits.shape[-1] == vocab and state_logits.shape[-1] == vocab and logits.is_contiguous()
            values += [u64(m.lm_head.data_ptr()), i32(vocab), u64(logits.data_ptr()), u64(state_logits.data_ptr()),
                       u64(state_rows.data_ptr()), u64(sampled.data_ptr()), u64(last_token.data_ptr()),
                       u64(self.cand_val.data_ptr()), u64(self.cand_idx.data_ptr()), i32(int(greedy))]
        else:
            values += [u64(0), i32(0), u64(0), u64(0), u64(0), u64(0), u64(0), u64(0), u64(0), i32(0)]
        if tokens is not None:
            token_ids, state_rows, last_token = tokens
            assert m.embed.is_contiguous() and m.embed.data_ptr() % 16 == 0
            assert token_ids.dtype == torch.int64 and state_rows.dtype == torch.int64 and token_ids.shape[0] >= rows
            values += [u64(m.embed.data_ptr()), u64(token_ids.data_ptr()), u64(state_rows.data_ptr()),
                       u64(last_token.data_ptr())]
        else:
            values += [u64(0), u64(0), u64(0), u64(0)]
        values.append(u64(self.llbuf.data_ptr()))
        from flared.execution.cuda import launch_kernel

        # on torch's current stream: a launch inside a torch graph capture must be on the capturing stream
        launch_kernel(self._function, self.grid, self.threads, self.shared_mem,
                      torch.cuda.current_stream(h.device).cuda_stream, [ctypes.addressof(v) for v in values])
