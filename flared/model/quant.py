"""Weights kept quantised in memory on the CPU: llama.cpp's Q8_0 and Q4_1 formats.

A weight row is cut into blocks of 32 inputs.
- Q8_0: each block keeps one float32 scale d = max|w| / 127 and its 32 values as int8 q = round(w / d). That is
  1.125 bytes a weight against bfloat16's 2, so a decode step, which streams every weight once, reads 44% fewer
  bytes. The weight the kernels use is bf16(d * q).
- Q4_1: each block keeps a float16 step d = (max w - min w) / 15 (or / 14 where that grid lies nearer: a Q4_K
  block's) and a float16 offset m = min w (both rounded first), and its 32 values as 4-bit q = round((w - m) / d)
  in 0..15, two to a byte: 20 bytes a block, 0.625 bytes a weight (5 bits, as llama.cpp's Q4_1). The weight the
  kernels use is bf16(fma(d, q, m)). A bf16 model exported from a Q4_1 GGUF (the embedded SmolLM2) holds exactly
  such blocks, so re-quantising it finds the GGUF's own steps.
The products (flared/_fast/qlinear_kernel.h) either widen each weight to that bf16 value on the fly and then sum
exactly as the bf16 kernels do, so that a quantised model's logits equal, bit for bit, those of the bf16 model whose
weights are the dequantised ones (the tests hold them to that); or take integer dot products with the rows
quantised per block of 32 (decode's few rows on VNNI CPUs): to int16 against Q8_0 weights, equal to rounding; to
int8 against Q4_1's, as llama.cpp's Q8_1 rows (twice the products an instruction, for a little more error).

``quantize_*`` / ``dequantize_*`` are the formats; ``pack_*`` lays them out for the kernels (groups of 64 output
features, as ``decoder.pack_bf16`` lays bf16 weights). ``DecoderModel(..., quantization=)`` quantises the products
of every layer (routed experts included) and the LM head at load (not the embedding rows or routers): all in one
format, or each layer matrix in its own (a ``QuantPlan``; ``gguf_plan``: as a GGUF file holds each, "gguf").
"""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import dataclass, field

import torch

QUANTIZATIONS = ("q8_0", "q4_1")
# What --quantization may also say: "gguf", each layer matrix at about the bits of the GGUF tensors it was exported
# from (gguf_plan; a core exported from a GGUF file records its tensors' types)
GGUF = "gguf"
# The LM head's format under each quantization: llama.cpp's 4-bit mixes keep the output matrix at more bits (Q6_K or
# Q8_0; the embedded SmolLM2's Q4_1 GGUF holds its tied head as Q8_0), as the logits feel its rounding most: at 4
# bits, SmolLM2's next-token KL divergence from float32 was 0.062 nats against 0.0014 with the head at Q8_0
# (tools/bench_quant.py --quality; bf16's own: 0.0013).
HEAD_QUANTIZATION = {"q8_0": "q8_0", "q4_1": "q8_0"}
Q8_BLOCK = 32  # (inputs a block, both formats)
GROUP_FEATURES = 64  # (linear_kernel.h's FL_GROUP)
# quantize_packed takes the C quantiser where it can (False: these torch ops always; tools/bench_quant.py --load's A/B).
C_QUANTISER = True


def check_quantization(name: str | None) -> str | None:
    """The quantization's canonical name, or a ValueError that lists the known ones; None stays None."""
    if name is None or name == "none":
        return None
    key = name.lower()
    if key not in QUANTIZATIONS:
        raise ValueError(f"unknown quantization {name!r}: flared keeps weights as {', '.join(QUANTIZATIONS)} (or none)")
    return key


# ggml tensor types by the format flared keeps such weights in on the CPU: none at fewer bits than the file holds
# them. 5 bits and more as Q8_0 (8.5 bits a weight), fewer as Q4_1 (5 bits; IQ types count as 4 bits); F16, BF16
# and F32 stay bf16.
_EIGHT_BITS = {"Q5_0", "Q5_1", "Q5_K", "Q6_K", "Q8_0", "Q8_1", "Q8_K"}
_FOUR_BITS = {"Q2_K", "Q3_K", "Q4_0", "Q4_1", "Q4_K", "TQ1_0", "TQ2_0", "MXFP4", "NVFP4"}
# A serving matrix of a layer and the GGUF tensors it is made of (llama.cpp's names, across its architectures): the
# attention's, the MLP's, a mixture's routed experts (one format for the layer's stack) and its shared expert
_GGUF_PARTS = {"qkv": ("attn_q", "attn_k", "attn_v", "attn_qkv"), "o": ("attn_output",),
               "gate_up": ("ffn_gate", "ffn_up"), "down": ("ffn_down",),
               "experts.gate_up": ("ffn_gate_exps", "ffn_up_exps", "ffn_gate_up_exps"),
               "experts.down": ("ffn_down_exps",),
               "shared.gate_up": ("ffn_gate_shexp", "ffn_up_shexp"), "shared.down": ("ffn_down_shexp",)}
_BITS = {"q4_1": 0, "q8_0": 1, None: 2}  # (a matrix made of several types takes the most bits among them)


def gguf_type_format(type_name: str) -> str | None:
    """The format a GGUF tensor of this ggml type is kept in ("q4_1", "q8_0"; None: bf16)."""
    if type_name in _EIGHT_BITS:
        return "q8_0"
    return "q4_1" if type_name in _FOUR_BITS or type_name.startswith("IQ") else None


@dataclass(frozen=True)
class QuantPlan:
    """Each layer matrix's format: ``matrices`` by serving tensor name ("layers.3.down.weight": "q8_0", or None:
    kept bf16), ``default`` for every product it does not name (experts, routers' neighbours, other families'
    matrices). The LM head takes HEAD_QUANTIZATION's format of the default, as with one format."""
    default: str
    matrices: dict[str, str | None] = field(default_factory=dict)
    grids: bool = False  # (the values lie on integer grids: Q4_1 blocks search them, quantize_q4_1's ``grids``)

    def format_of(self, name: str | None) -> str | None:
        return self.matrices.get(name, self.default) if name is not None else self.default

    def to_dict(self) -> dict:
        """As a core's manifest records it (``weights_quantization``)."""
        return {"default": self.default, "matrices": dict(sorted(self.matrices.items())), "grids": self.grids}

    @classmethod
    def from_dict(cls, d: dict) -> "QuantPlan":
        return cls(d["default"], dict(d.get("matrices", {})), bool(d.get("grids", False)))

    def digest(self) -> str:
        """What a cached prefix's keys and values depend on (they come from these weights)."""
        parts = [self.default, sorted(self.matrices.items(), key=lambda kv: kv[0])] + (["grids"] if self.grids else [])
        return hashlib.sha256(json.dumps(parts, default=str).encode()).hexdigest()[:16]


def gguf_plan(tensor_types: dict[str, list | str]) -> QuantPlan | None:
    """Each layer matrix at about the bits of the GGUF tensors it is made of (``tensor_types``: GGUF tensor name ->
    [ggml type name, its values], as a core exported from a GGUF file records them; a bare type name counts as one
    value): a Q4_K_M file's Q4_K matrices as q4_1 and its Q6_K ones (some layers' attn_v and ffn_down) as q8_0, as
    llama.cpp's server runs each tensor in its own type. A fused matrix (qkv, gate_up) takes the most bits among its
    parts; a layer's routed experts take their stack's (one for gate and up, one for down). The default, for the
    products the plan does not name, is the format that holds most of the file's layer weights. Its Q4_1 blocks search
    the integer grids (``grids``) that a GGUF's 4-bit values lie on: a Q4_0 block's values, a scale times -8..7, seldom
    span all 15 steps of their range (0.0065 nats of next-token KL from the file's values with the search, 0.17
    without; docs/benchmarks.md). None: the layers are mostly at 16 bits or more (nothing to keep quantised)."""
    weights: dict[str | None, int] = {"q4_1": 0, "q8_0": 0, None: 0}
    by_layer: dict[tuple[int, str], str | None] = {}
    pattern = re.compile(r"blk\.(\d+)\.([a-z_]+)\.weight$")
    role_of = {part: role for role, parts in _GGUF_PARTS.items() for part in parts}
    for name, entry in tensor_types.items():
        type_name, count = (entry, 1) if isinstance(entry, str) else entry
        fmt = gguf_type_format(type_name)
        if name.startswith("blk."):
            weights[fmt] += count
        m = pattern.match(name)
        if m is None or m.group(2) not in role_of:
            continue
        key = (int(m.group(1)), role_of[m.group(2)])
        by_layer[key] = max(by_layer.get(key, fmt), fmt, key=_BITS.__getitem__)
    default = max(weights, key=weights.__getitem__)
    if default is None:
        return None
    return QuantPlan(default, {f"layers.{i}.{role}.weight": fmt for (i, role), fmt in sorted(by_layer.items())
                               if fmt != default}, grids=True)


def _holds_four_bits(source: dict) -> bool:
    """Whether a core's manifest ``source`` is a GGUF file with layer matrices at 4 bits or fewer (their values on
    integer grids, which q4_1's blocks then search)."""
    types = source.get("tensor_types") if source.get("kind") == "gguf" else None
    if not isinstance(types, dict):
        return False
    return any(isinstance(entry, (list, str)) and gguf_type_format(entry if isinstance(entry, str) else entry[0])
               == "q4_1" for entry in types.values())


def resolve_quantization(name: str | None, source: dict, stored: dict | None = None) -> "str | QuantPlan | None":
    """--quantization as DecoderModel takes it: "gguf" becomes the core's plan (gguf_plan over the tensor types its
    manifest's ``source`` records; None where the file's layers are mostly 16-bit), a ValueError where the core
    records none; q4_1 or q8_0 of a core exported from a quantised checkpoint (manifest ``source.quantization``) a
    plan that keeps the checkpoint's wider modules at their bits (``matrix_bits``: 8 as q8_0, 16 as bf16) and, for
    q4_1 over integer grids (GPTQ, AWQ, AutoRound, compressed-tensors' integer schemes: ``integer_grid``; a GGUF's
    4-bit tensors), whose blocks search them (QuantPlan.grids); other names as check_quantization says. No name over
    a core that stores its matrices quantised (``stored``: its manifest's weights_quantization) is that core's plan."""
    if name is None and stored is not None:
        return QuantPlan.from_dict(stored)
    if name != GGUF:
        name = check_quantization(name)
        recorded = source.get("quantization") if isinstance(source.get("quantization"), dict) else {}
        bits = recorded.get("matrix_bits") if isinstance(recorded.get("matrix_bits"), dict) else {}
        grids = name == "q4_1" and (recorded.get("integer_grid") is True or _holds_four_bits(source))
        if name is None or not (grids or bits):
            return name
        def kept(width) -> str | None:  # (never fewer bits than the checkpoint's: 8-bit modules as q8_0, 16-bit bf16)
            if not isinstance(width, int) or width > 8:
                return None
            return "q4_1" if width <= 4 and name == "q4_1" else "q8_0"

        return QuantPlan(name, {m: kept(w) for m, w in sorted(bits.items()) if kept(w) != name}, grids=grids)
    types = source.get("tensor_types") if source.get("kind") == "gguf" else None
    if not types:
        raise ValueError("gguf keeps each layer matrix at about its bits in the GGUF file the core was exported "
                         "from, and this core " + ("was exported from a checkpoint directory" if source.get("kind")
                                                   != "gguf" else "does not record them (it was exported before "
                                                   "flared recorded them: export it again)") +
                         "; use q8_0 or q4_1")
    try:
        return gguf_plan(types)
    except (TypeError, ValueError, AttributeError) as exc:  # (a manifest edited by hand)
        raise ValueError(f"the core's manifest has a malformed source.tensor_types ({exc}): export it again") from None


def quantize_q8_0(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """weight [out, in] (in a multiple of 32) -> (q int8 [out, in], scales float32 [out, in / 32]): each block's
    scale is its largest magnitude / 127 and its values round to the nearest step (an all-zero block: scale 0)."""
    out_features, in_features = weight.shape
    if in_features % Q8_BLOCK:
        raise ValueError(f"Q8_0 needs a multiple of {Q8_BLOCK} inputs, got {in_features}")
    blocks = weight.detach().float().reshape(out_features, in_features // Q8_BLOCK, Q8_BLOCK)
    scales = blocks.abs().amax(dim=-1) / 127.0
    inverse = torch.where(scales > 0, 1.0 / scales, torch.zeros_like(scales))
    q = torch.round(blocks * inverse[..., None]).clamp_(-127, 127).to(torch.int8)
    return q.reshape(out_features, in_features), scales.contiguous()


def dequantize_q8_0(q: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """The weight the kernels compute with: each value times its block's scale in float32, then rounded to dtype."""
    out_features, in_features = q.shape
    blocks = q.float().reshape(out_features, in_features // Q8_BLOCK, Q8_BLOCK) * scales[..., None]
    return blocks.reshape(out_features, in_features).to(dtype)


def _padded_groups(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """Each [out, ...] tensor with zero rows up to a multiple of GROUP_FEATURES."""
    out_features = tensors[0].shape[0]
    extra = -(-out_features // GROUP_FEATURES) * GROUP_FEATURES - out_features
    return [torch.cat([t, t.new_zeros(extra, *t.shape[1:])]) if extra else t for t in tensors]


def _pack_block_params(params: torch.Tensor) -> torch.Tensor:
    """[padded out, in / 32] -> [groups, in / 32, 64]: each block's 64 features side by side."""
    return params.reshape(-1, GROUP_FEATURES, params.shape[1]).permute(0, 2, 1).contiguous()


def pack_q8_0(q: torch.Tensor, scales: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(q [out, in], scales [out, in / 32]) -> the kernels' layout: q as pack_bf16 lays a weight out, groups of 64
    output features each [in / 2, 64, 2]; scales [groups, in / 32, 64]. Rows past ``out`` are zero."""
    q, scales = _padded_groups([q, scales])
    in_features = q.shape[1]
    packed = q.reshape(-1, GROUP_FEATURES, in_features // 2, 2).permute(0, 2, 1, 3).contiguous()
    return packed, _pack_block_params(scales)


def q8_0_rows(packed: torch.Tensor, packed_scales: torch.Tensor, rows: list[int],
              dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """Rows ``rows`` of pack_q8_0's weight, dequantised as the kernels use them (dequantize_q8_0): [len(rows), in].
    (The whole weight goes back to bf16 through the C kernels: decoder.widen_quantised.)"""
    index = torch.tensor(rows, dtype=torch.long)
    groups, features = index // GROUP_FEATURES, index % GROUP_FEATURES
    q = packed[groups, :, features, :].reshape(len(rows), -1)  # [rows, in / 2, 2] -> [rows, in]
    return dequantize_q8_0(q, packed_scales[groups, :, features], dtype)



def quantize_q4_1(weight: torch.Tensor, grids: bool = False) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """weight [out, in] (in a multiple of 32) -> (q uint8 [out, in] in 0..15, steps float16 [out, in / 32], offsets
    float16 [out, in / 32]): each block's offset is its least value and its step its range / 15 or, where that grid
    lies nearer the block's values by more than 1/1024 of the squared distance, its range / 14 (both rounded to
    float16 before the values are placed to the nearest step from that offset; a constant block: step 0, values 0).

    The 14-step grid is a k-quant's: llama.cpp's Q4_K search often sets a block's step so that its values span 14
    of them, and a GGUF's Q4_K weights then come back on it as they were, where the 15-step grid moved a block's
    values by up to half a step (on Gaussian weights quantised by llama.cpp's Q4_K algorithm, 0.84e-3 RMS from
    themselves against 0.06e-3; docs/benchmarks.md). On other weights it lowers the error a few percent.

    With ``grids`` (values known to lie on integer grids, as a GPTQ, AWQ or compressed-tensors checkpoint's 4-bit
    values do: a scale times 0..15 less a zero point, in groups of 32 inputs or more), a block off the 15- and
    14-step grids tries the range in 13 steps down to 1, in turn, each taken where it lies nearer than the nearest
    before by more than 1/1024, until the block is on one: a block whose values span k steps of its group's scale
    then comes back as it was, where the 15-step grid moved its values by up to half a step."""
    out_features, in_features = weight.shape
    if in_features % Q8_BLOCK:
        raise ValueError(f"Q4_1 needs a multiple of {Q8_BLOCK} inputs, got {in_features}")
    blocks = weight.detach().float().reshape(out_features, in_features // Q8_BLOCK, Q8_BLOCK)
    low, high = blocks.amin(dim=-1), blocks.amax(dim=-1)
    steps, offsets = ((high - low) / 15.0).to(torch.float16), low.to(torch.float16)
    if not (torch.isfinite(steps).all() and torch.isfinite(offsets).all()):
        raise ValueError("Q4_1 keeps its steps and offsets in float16: this weight has values past 65504")
    q, best = _place_q4_1(blocks, steps, offsets)
    # (as fl_quantise_group chooses, in float32: a block on a grid but for bf16's rounding takes it)
    span = high - low
    on_grid = span * span * (1.0 / 4096)
    nearer_by = torch.tensor(1.0 - 1.0 / 1024, dtype=torch.float32)
    searching = best > on_grid
    for k in range(14, 0 if grids else 13, -1):
        if not searching.any():
            break
        steps_k = ((high - low) / float(k)).to(torch.float16)
        q_k, distance_k = _place_q4_1(blocks, steps_k, offsets)
        nearer = searching & torch.isfinite(steps_k) & (distance_k < best * nearer_by)
        q = torch.where(nearer[..., None], q_k, q)
        steps = torch.where(nearer, steps_k, steps)
        best = torch.where(nearer, distance_k, best)
        searching = searching & (best > on_grid)
    return q.reshape(out_features, in_features), steps.contiguous(), offsets.contiguous()


def _place_q4_1(blocks: torch.Tensor, steps: torch.Tensor, offsets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Each block's values [.., 32] placed on its grid (float16 step and offset): (q uint8, the squared distance of
    the values from the grid's: float32, each operation rounded on its own and summed in fl_q4_place's order, so
    that the C quantiser's choices are these, bit for bit)."""
    step, offset = steps.float(), offsets.float()
    inverse = torch.where(step > 0, 1.0 / step, torch.zeros_like(step))
    q = torch.round((blocks - offset[..., None]) * inverse[..., None]).clamp_(0, 15)
    gap = blocks - (step[..., None] * q + offset[..., None])
    lanes = (gap * gap).unflatten(-1, (4, 8))  # (value 8 i + j: lane j of the i-th vector)
    lane = ((lanes[..., 0, :] + lanes[..., 1, :]) + lanes[..., 2, :]) + lanes[..., 3, :]
    distance = ((lane[..., 0] + lane[..., 1]) + (lane[..., 2] + lane[..., 3])) + \
        ((lane[..., 4] + lane[..., 5]) + (lane[..., 6] + lane[..., 7]))
    return q.to(torch.uint8), distance


def dequantize_q4_1(q: torch.Tensor, steps: torch.Tensor, offsets: torch.Tensor,
                    dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """The weight the kernels compute with: fma(step, q, offset) rounded once to float32 (float64 holds the exact
    value: a float16 times 0..15 plus a float16), then to dtype."""
    out_features, in_features = q.shape
    blocks = q.double().reshape(out_features, in_features // Q8_BLOCK, Q8_BLOCK)
    exact = blocks * steps.double()[..., None] + offsets.double()[..., None]
    return exact.float().reshape(out_features, in_features).to(dtype)


def pack_q4_1(q: torch.Tensor, steps: torch.Tensor, offsets: torch.Tensor
              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(q [out, in], steps, offsets [out, in / 32]) -> the kernels' layout (qlinear_kernel.h): each group of 64
    output features' inputs in quads, 128 bytes a quad [groups, in / 4, 128]. Of the quad's 256 values in the order
    (feature, its 4 inputs), byte j holds value j in its low half and value 64 + j in its high half, byte 64 + j
    values 128 + j and 192 + j; steps and offsets [groups, in / 32, 64] float16. Rows past ``out`` are zero."""
    q, steps, offsets = _padded_groups([q, steps, offsets])
    in_features = q.shape[1]
    values = q.reshape(-1, GROUP_FEATURES, in_features // 4, 4).permute(0, 2, 1, 3).reshape(-1, in_features // 4, 256)
    low = torch.cat([values[..., 0:64], values[..., 128:192]], dim=-1)
    high = torch.cat([values[..., 64:128], values[..., 192:256]], dim=-1)
    packed = (low | (high << 4)).contiguous()
    return packed, _pack_block_params(steps), _pack_block_params(offsets)


def quantize_packed(quantization: str, weight: torch.Tensor, threads: int | None = None,
                    empty=None, grids: bool = False) -> tuple[torch.Tensor, ...]:
    """``weight`` quantised and laid out for the kernels: pack_q8_0's (values, scales) or pack_q4_1's (values, steps,
    offsets; ``grids``: quantize_q4_1's). A bf16 weight on a CPU with the C quantiser (linear.quantise_weight: the
    same values, bit for bit, in one pass, 3-8x faster than these torch ops) takes it, over ``threads`` (default:
    torch's), its tensors made by ``empty(shape, dtype)`` (zeroed; default torch.zeros: decoder._Arena's puts them
    in huge pages)."""
    if _c_quantiser_takes(weight):
        return _quantize_packed_c(quantization, weight.contiguous(), threads or torch.get_num_threads(),
                                  empty or (lambda shape, dtype: torch.zeros(shape, dtype=dtype)), grids)
    if quantization == "q4_1":
        return pack_q4_1(*quantize_q4_1(weight, grids))
    return pack_q8_0(*quantize_q8_0(weight))


def _c_quantiser_takes(weight: torch.Tensor) -> bool:
    if not C_QUANTISER or weight.dtype != torch.bfloat16 or weight.device.type != "cpu" or weight.dim() != 2 or \
            weight.shape[1] % Q8_BLOCK or not weight.numel():
        return False
    try:
        from flared._fast.linear import QUANTISER
    except ImportError:  # (a build from before it)
        return False
    return QUANTISER


def _quantize_packed_c(quantization: str, weight: torch.Tensor, threads: int, empty,
                       grids: bool = False) -> tuple[torch.Tensor, ...]:
    from flared._fast.linear import quantise_weight

    out_features, in_features = weight.shape
    shapes = packed_shapes(quantization, out_features, in_features)
    parts = tuple(empty(shape, dtype) for shape, dtype in shapes.values())  # (zeroed: Q4_1's halves are OR-ed in)
    pointers = [t.data_ptr() for t in parts] + [0] * (3 - len(parts))  # (values, scales or steps, offsets)
    if not quantise_weight(quantization, weight.data_ptr(), *pointers, out_features, in_features, threads, grids):
        raise ValueError("Q4_1 keeps its steps and offsets in float16: this weight has values past 65504")
    return parts


def unpack_q4_1_values(packed: torch.Tensor) -> torch.Tensor:
    """pack_q4_1's bytes [groups, in / 4, 128] -> the values [groups, in / 4, 64, 4] (feature, its quad of inputs)."""
    low, high = packed & 15, packed >> 4
    values = torch.cat([low[..., :64], high[..., :64], low[..., 64:], high[..., 64:]], dim=-1)
    return values.reshape(*packed.shape[:2], GROUP_FEATURES, 4)


def q4_1_rows(packed: torch.Tensor, packed_steps: torch.Tensor, packed_offsets: torch.Tensor, rows: list[int],
              dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """Rows ``rows`` of pack_q4_1's weight, dequantised as the kernels use them (dequantize_q4_1): [len(rows), in]."""
    index = torch.tensor(rows, dtype=torch.long)
    groups, features = index // GROUP_FEATURES, index % GROUP_FEATURES
    q = unpack_q4_1_values(packed[groups])  # [rows, in / 4, 64, 4]
    q = q[torch.arange(len(rows)), :, features, :].reshape(len(rows), -1)
    return dequantize_q4_1(q, packed_steps[groups, :, features], packed_offsets[groups, :, features], dtype)


# ---- a core's layer matrices stored quantised (flarectl export --quantization)
#
# A core exported with a quantization holds each layer matrix its plan keeps quantised in the kernels' layout
# (pack_q8_0's or pack_q4_1's tensors, a mixture's expert stacks one such set an expert, stacked) under the matrix's
# name and a suffix, in place of the bf16 matrix: "layers.3.qkv.weight.q4_1", ".q4_1_steps", ".q4_1_offsets". The
# manifest's weights_quantization records the plan. Loading then reads them as they are (a GPU that keeps them:
# stored_gpu_layout); a GPU that does not, or a float32 model, takes their values back (packed_values).

PACKED_SUFFIXES = {"q8_0": ("q8_0", "q8_0_scales"), "q4_1": ("q4_1", "q4_1_steps", "q4_1_offsets")}
# The serving layer matrices an export may store quantised: DecoderModel keeps these by a plan's format of them
PACKED_MATRIX = re.compile(r"^layers\.\d+\.(qkv|o|gate_up|down|shared\.gate_up|shared\.down|experts\.gate_up|"
                           r"experts\.down)\.weight$")


def packed_format(tensors: dict, name: str) -> str | None:
    """The format matrix ``name`` is stored in among ``tensors`` ("q8_0", "q4_1"), None where it is stored plain."""
    return next((fmt for fmt, suffixes in PACKED_SUFFIXES.items() if f"{name}.{suffixes[0]}" in tensors), None)


def packed_parts(tensors: dict, name: str, fmt: str) -> tuple[torch.Tensor, ...]:
    """Matrix ``name``'s stored tensors in ``fmt``: (values, scales) or (values, steps, offsets)."""
    return tuple(tensors[f"{name}.{suffix}"] for suffix in PACKED_SUFFIXES[fmt])


def packed_shapes(fmt: str, out_features: int, in_features: int) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """Each stored tensor's suffix -> (shape, dtype) for an [out, in] matrix in ``fmt`` (pack_q8_0's, pack_q4_1's)."""
    groups = -(-out_features // GROUP_FEATURES)
    params = (groups, in_features // Q8_BLOCK, GROUP_FEATURES)
    if fmt == "q8_0":
        return {"q8_0": ((groups, in_features // 2, GROUP_FEATURES, 2), torch.int8),
                "q8_0_scales": (params, torch.float32)}
    return {"q4_1": ((groups, in_features // 4, 128), torch.uint8), "q4_1_steps": (params, torch.float16),
            "q4_1_offsets": (params, torch.float16)}


def packed_values(parts: tuple[torch.Tensor, ...], fmt: str, out_features: int,
                  dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """A stored matrix's values as the kernels use them, [out, in] (an expert stack's parts: [E, out, in])."""
    if parts[0].dim() == (5 if fmt == "q8_0" else 4):  # (a stack: one set an expert)
        return torch.stack([packed_values(tuple(p[e] for p in parts), fmt, out_features, dtype)
                            for e in range(parts[0].shape[0])])
    rows = list(range(out_features))
    return q8_0_rows(*parts, rows, dtype) if fmt == "q8_0" else q4_1_rows(*parts, rows, dtype)


def pack_layer_matrices(tensors: dict, plan: "QuantPlan", threads: int | None = None) -> dict:
    """``tensors`` (a bf16 model's serving tensors) with each layer matrix that ``plan`` keeps quantised, and whose
    inputs are a multiple of 32, replaced by its stored tensors (the matrices the plan keeps bf16, and every other
    tensor, as they are)."""
    out = {}
    for name, value in tensors.items():
        fmt = plan.format_of(name) if PACKED_MATRIX.match(name) else None
        if fmt is None or value.dtype != torch.bfloat16 or value.shape[-1] % Q8_BLOCK:
            out[name] = value
            continue
        stack = value if value.dim() == 3 else value[None]
        sets = [quantize_packed(fmt, m.contiguous(), threads, grids=plan.grids) for m in stack]
        for i, suffix in enumerate(PACKED_SUFFIXES[fmt]):
            parts = [s[i] for s in sets]
            out[f"{name}.{suffix}"] = torch.stack(parts) if value.dim() == 3 else parts[0]
    return out


# ---- the GPU's layout (flared/model/kernels/wquant.py's products)
#
# The same blocks (32 inputs, the same quantisers, so the same values as the CPU's), laid out for a GPU tile that
# reads a run of inputs for a run of output features, the features contiguous: the values packed into int32 words
# down the inputs, a turn of a product's inputs (GPU_TURN) in GPU_WORD_ROWS rows of words, value j of word row r
# holding the turn's input 16 j + r, so that value j of every word is one 16-input step of the tensor cores as
# loaded; the inputs padded with zero blocks to whole turns; the scales (Q8_0 float32) or steps and offsets (Q4_1
# float16) [in / 32, out].
GPU_TURN = {"q4_1": 128, "q8_0": 64}
GPU_WORD_ROWS = 16


def _gpu_bits(fmt: str) -> tuple[int, int]:
    """(bits a value, values a word) of the GPU layout."""
    return (4, 8) if fmt == "q4_1" else (8, 4)


def gpu_layout(fmt: str, q: torch.Tensor, scales: torch.Tensor, offsets: torch.Tensor | None = None
               ) -> tuple[torch.Tensor, ...]:
    """(q [out, in], scales [out, in / 32][, offsets]) as quantize_q8_0 / quantize_q4_1 give them -> the GPU's
    tensors, on q's device: words int32 [in' / 8 (Q4_1) or in' / 4 (Q8_0), out] and scales[, offsets] [in' / 32, out],
    in' the inputs padded to whole turns (zero values, scales and offsets: zeros, widened)."""
    out_features, in_features = q.shape
    pad = -in_features % GPU_TURN[fmt]
    params = tuple(torch.nn.functional.pad(p, (0, pad // Q8_BLOCK)).t().contiguous()
                   for p in (scales, offsets) if p is not None)
    bits, per_word = _gpu_bits(fmt)
    values = torch.nn.functional.pad(q.to(torch.int64) & ((1 << bits) - 1), (0, pad))
    values = values.reshape(out_features, -1, per_word, GPU_WORD_ROWS)  # [out, turn, j, r]
    shifts = (bits * torch.arange(per_word, device=q.device, dtype=torch.int64)).view(1, 1, per_word, 1)
    words = (values << shifts).sum(dim=2)  # [out, turn, r]
    words = torch.where(words >= 1 << 31, words - (1 << 32), words)  # (the top value's bit as int32's sign)
    return (words.reshape(out_features, -1).t().contiguous().to(torch.int32), *params)


def gpu_quantize(fmt: str, weight: torch.Tensor, grids: bool = False) -> tuple[torch.Tensor, ...]:
    """``weight`` [out, in] quantised in ``fmt`` (quantize_q4_1's ``grids``) by the CPU's quantiser (on the host: the
    blocks a CPU or a stored core holds, bit for bit; a GPU's float division by a constant rounds otherwise than the
    CPU's), in the GPU's layout on the weight's device."""
    return stored_gpu_layout(quantize_packed(fmt, weight.detach().cpu(), grids=grids), fmt, weight.shape[0],
                             weight.device)


def stored_gpu_layout(parts: tuple[torch.Tensor, ...], fmt: str, out_features: int,
                      device: torch.device | str) -> tuple[torch.Tensor, ...]:
    """A stored matrix's tensors (pack_q8_0's or pack_q4_1's) in the GPU's layout on ``device`` (unpacked there)."""
    return gpu_layout(fmt, *unpack_stored(tuple(p.to(device) for p in parts), fmt, out_features))


def unpack_stored(parts: tuple[torch.Tensor, ...], fmt: str, out_features: int) -> tuple[torch.Tensor, ...]:
    """A stored matrix's tensors (pack_q8_0's or pack_q4_1's) back to the quantiser's: (q [out, in], scales [out,
    in / 32][, offsets])."""
    params = tuple(p.permute(0, 2, 1).reshape(-1, p.shape[1])[:out_features] for p in parts[1:])
    if fmt == "q8_0":
        q = parts[0].permute(0, 2, 1, 3).reshape(-1, 2 * parts[0].shape[1])
    else:
        q = unpack_q4_1_values(parts[0]).permute(0, 2, 1, 3).reshape(-1, 4 * parts[0].shape[1])
    return (q[:out_features], *params)


def gpu_values(parts: tuple[torch.Tensor, ...], fmt: str, dtype: torch.dtype = torch.bfloat16,
               in_features: int | None = None) -> torch.Tensor:
    """The GPU layout's weight as its products use it, [out, in] (dequantize_q8_0's and dequantize_q4_1's values;
    ``in_features``: without the padding)."""
    bits, per_word = _gpu_bits(fmt)
    words = parts[0].to(torch.int64) & 0xFFFFFFFF
    words = words.view(-1, 1, GPU_WORD_ROWS, words.shape[1])  # [turn, 1, r, out]
    shifts = (bits * torch.arange(per_word, device=words.device, dtype=torch.int64)).view(1, per_word, 1, 1)
    values = ((words >> shifts) & ((1 << bits) - 1)).reshape(-1, words.shape[-1]).t().to(torch.uint8)
    params = [p.t() for p in parts[1:]]
    out = (dequantize_q8_0(values.view(torch.int8), *params, dtype) if fmt == "q8_0"
           else dequantize_q4_1(values, *params, dtype))
    return out if in_features is None else out[:, :in_features]
